"""The export driver: a quantized model -> a checked, standard Q/DQ ONNX file, written atomically.

Both torch exporters are supported. ``torchscript`` (``torch.onnx.export(..., dynamo=False)``) calls the
quantize ops' ``symbolic`` functions; ``dynamo`` (torch.export) sees the same ops as ``torch.library`` custom
ops whose ONNX translations emit the same nodes (:mod:`exporters.dynamo`). Then :mod:`exporters.fold` stores
weights quantized, :mod:`exporters.onnxruntime.compat` guards float8 pairs against onnxruntime's optimizer
(onnxruntime target), the model is checked with ``onnx.checker`` and shape inference, and the quant config and
the quantizer of every DequantizeLinear go into ``metadata_props``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch
from torch import nn

from exporters import aten_symbolics
from exporters.causal_lm import ops as decode_ops
from exporters.dynamic_linear import dynamic_layers, dynamic_quantizer_map
from exporters.fold import drop_unused_initializers, narrow_types, prepare, share_identical_initializers
from exporters.forward_inputs import forward_by_name
from exporters.graph import (
    BRANCHES_KEY,
    CPU_KEY,
    PRUNED_KEY,
    QUANTIZERS_KEY,
    UNREAD_INPUTS_KEY,
    consumer_map,
    name_scopes,
    producer_map,
    qdq_pairs,
    scope_module_path,
)
from exporters.matmul_nbits import KN_WEIGHTS_KEY, to_matmul_nbits
from exporters.onnxruntime.compat import guard_fp8, session_needs
from exporters.onnxruntime.cpu_fusions import keep_cpu_kernels
from exporters.onnxruntime.fusion import FusionReport, inspect_fusion
from exporters.onnxruntime.placement import place_for_onnxruntime
from exporters.onnxruntime.recurrent import RECURRENT_KEY, to_dynamic_quantize_lstm
from exporters.opset import LAYER_NORM_OPSET, NO_QUANTIZER, OpProbe, format_opset, ops_opset
from quantcli import __version__
from quantcli.errors import ExportError, few, whole_line
from quantcli.files import commit, no_space, staging_directory, writable_directory
from quantcli.inputs.data import check_names, checked_batch
from quantcli.nn.derived_weights import constant_operands
from quantcli.nn.forward_call import call_forward
from quantcli.nn.fresh_inputs import fresh
from quantcli.nn.modules import input_quantized_before
from quantcli.nn.recurrent import exported_weights, onnx_layers, recurrent_quantizers
from quantcli.nn.tensor_quantizer import owner, quantizer_name, quantizers, uncalibrated
from quantcli.nn.usage import unused_quantizers
from quantcli.quant import formats

EXPORTERS = ("torchscript", "dynamo")
PROVIDERS = ("cpu", "cuda")  # onnxruntime execution providers an onnxruntime-target graph is shaped for
EXTERNAL_DATA_BYTES = 1_800_000_000  # protobuf's 2 GB limit, with margin
DYNAMO_MIN_OPSET = 18  # torch's torch.export-based exporter builds opset 18 and newer


@dataclass
class ExportResult:
    path: str
    opset: int
    exporter: str
    pairs_by_format: dict[str, int] = field(default_factory=dict)
    weights_stored_quantized: int = 0
    file_bytes: int = 0
    seconds: float = 0.0
    input_names: list[str] = field(default_factory=list)  # the graph's (the example's, less unread_inputs)
    # the example's inputs that forward never reads: the exporter leaves them out of the graph
    unread_inputs: list[str] = field(default_factory=list)
    output_names: list[str] = field(default_factory=list)
    external_data: bool = False
    dynamic_layers: int = 0  # DynamicQuantizeLinear -> MatMulInteger layers (exporters.dynamic_linear)
    # Max(x, -inf) nodes that keep onnxruntime's float8 fusion bugs away (exporters.onnxruntime.compat)
    fp8_guards: int = 0
    # onnxruntime target: layers with Q/DQ, and how many it leaves in float
    quantized_layers: int | None = None
    unfused_layers: int | None = None
    # onnxruntime target: weight-only blocked layers written in the MatMulNBits form (exporters.matmul_nbits)
    matmul_nbits_layers: int = 0
    # their DequantizeLinear outputs (metadata)
    kn_weights: list[str] = field(default_factory=list, repr=False)
    # bytes of equal initializers stored once (a module called several times: one copy per call)
    shared_initializer_bytes: int = 0
    # the weight quantizers among them with 8-bit codes: onnxruntime's default accuracy level 4 quantizes
    # those layers' activations to int8 as well, an error of the size of the 8-bit weights' own
    matmul_nbits_8bit: list[str] = field(default_factory=list)
    fusion_error: str | None = None  # onnxruntime could not load the graph with default options
    # float layers onnxruntime quantizes itself on per-tensor weights (exporters.onnxruntime.fusion)
    runtime_quantized_layers: list[str] = field(default_factory=list)
    # other targets: what onnxruntime needs
    onnxruntime_disabled_optimizers: list[str] = field(default_factory=list)
    target: str = "onnxruntime"
    # onnxruntime target: the CPU kind the grids were chosen for (quantcli.quant.cpu), from the config
    cpu: str | None = None
    # onnxruntime target: the execution provider the graph is shaped for (cpu, cuda)
    provider: str | None = None
    # onnxruntime target: what exporters.onnxruntime.placement did, and for the CPU provider
    # exporters.onnxruntime.cpu_fusions
    placement: dict[str, int] = field(default_factory=dict)
    # enabled quantizers the exporter removed as dead code: they run in forward, but no output uses their
    # result
    pruned_quantizers: list[str] = field(default_factory=list)
    # torchscript: where the model's own code branched on a tensor's value while traced (file:line), so the
    # graph holds only the path the example batch took
    traced_branches: list[str] = field(default_factory=list)
    opset_reason: str = ""  # why this opset: the format's minimum, the model's ops, or --opset
    # an explicit opset below what the model's ops are best expressed in: what that costs
    opset_note: str = ""
    # a causal LM's decode graph: its layout, inputs, outputs and contrib ops (exporters.causal_lm.export)
    decode: dict | None = None
    decode_note: str = ""  # why a model with an lm_head got no decode graph
    genai_config: str | None = None  # the genai_config.json written beside a decode graph (--genai-config)
    # DynamicQuantizeLSTM node -> {"layer", "quantizers"} (exporters.onnxruntime.recurrent)
    recurrent: dict[str, dict] = field(default_factory=dict)
    # input name -> its axes exported with a symbolic size (the batch axis, --dynamic-dim's)
    dynamic_dims: dict[str, list[int]] = field(default_factory=dict)
    # the exact session on the example batch against the fake-quant model, in verify's unit
    # (quantcli.verify.export_check; set by the CLI, None where not measured)
    graph_agreement: dict | None = None
    # onnxruntime target: what onnxruntime fuses in the saved graph (counted above; latency placement reads
    # the layers, so that it does not load the graph a second time)
    fusion: FusionReport | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("kn_weights", "fusion")}


def required_opset(model: nn.Module) -> tuple[int, str]:
    """(lowest opset the model's quantizers need, the format that needs it)."""
    return format_opset(model)


def check_exportable(model: nn.Module) -> None:
    from quantcli.nn.config import computes_plain_linear
    from quantcli.nn.dynamic import exportable

    recurrent = recurrent_quantizers(model)  # dynamic by construction: exported as DynamicQuantizeLSTM
    missing = uncalibrated(model)
    if missing:
        raise ExportError(
            f"uncalibrated quantizer(s), amax missing: {few(missing)}; run `quantcli calibrate` first"
        )
    dynamic = [
        n
        for n, q in quantizers(model).items()
        if q.enabled and q.desc.dynamic and not q.dynamic_uint8 and n not in recurrent
    ]
    for module in model.modules():  # dynamic uint8 inputs export with their Linear (MatMulInteger)
        q = getattr(module, "input_quantizer", None)
        if q is not None and q.enabled and q.dynamic_uint8:
            why = (
                exportable(module)
                if computes_plain_linear(module)
                else f"it quantizes a {type(module).__name__}"
            )
            if why is not None:
                raise ExportError(
                    f"{q.name}: a dynamic activation quantizer exports as "
                    f"DynamicQuantizeLinear -> "
                    f"MatMulInteger in a Linear layer with 8-bit integer weights, but {why}"
                )
    if dynamic:
        raise ExportError(f"dynamic quantizers cannot be exported as static Q/DQ: {', '.join(dynamic[:5])}")


@contextlib.contextmanager
def _plain_outputs(model: nn.Module, outputs):
    """While exporting, a model whose output holds a dataclass (its own output class), a value that is no
    tensor (an int, a string) or a dict key that is no string returns what the exporters can trace instead
    (:func:`quantcli.inputs.data.plain_outputs`: the dataclass's fields, None, the key's str), and one that
    returns a tensor twice returns a copy the second time (:func:`quantcli.inputs.data.distinct_outputs`: one
    graph value cannot be two outputs)."""
    from quantcli.inputs.data import distinct_outputs, needs_plain, plain_outputs, repeats_a_tensor

    if not needs_plain(outputs) and not repeats_a_tensor(outputs):
        yield
        return
    handle = model.register_forward_hook(lambda _m, _args, out: distinct_outputs(plain_outputs(out)))
    try:
        yield
    finally:
        handle.remove()


def _output_names(outputs) -> list[str]:
    """The graph's output names (:func:`quantcli.inputs.data.named_outputs`); refuses a model that returns no
    tensor at all."""
    from quantcli.inputs.data import named_outputs

    named = named_outputs(outputs)
    if not named:
        raise ExportError("the model's forward returns no tensor; return the outputs to export as tensors")
    return [name for name, _ in named]


def _dynamic_axes(
    example: dict[str, torch.Tensor],
    output_names: list[str],
    outputs,
    dims: dict[str, list[int]] | None = None,
) -> dict[str, dict[int, str]]:
    """The graph's symbolic dimensions: each input's batch axis (:mod:`quantcli.inputs.batch_axes`: axis 0
    unless the example says otherwise), axis 1 of batch-first integer inputs of rank 2 and more (token ids'
    sequence; not uint8, an image's pixels), every axis of an input that has no batch axis (its size follows
    what the batch holds, as EmbeddingBag indices do), ``dims``' axes (``--dynamic-dim``), and axis 0 of the
    outputs."""
    from quantcli.inputs.batch_axes import batch_axes

    batch = batch_axes(example)
    axes: dict[str, dict[int, str]] = {}
    for name, t in example.items():
        if t.dim() == 0:
            continue
        a = {} if batch[name] is None else {batch[name]: "batch"}
        if batch[name] is None:
            a.update({i: f"{name}_{i}" for i in range(t.dim())})
        elif batch[name] == 0 and not t.dtype.is_floating_point and t.dim() >= 2 and t.dtype != torch.uint8:
            a[1] = "sequence"  # (not a uint8 image's channels)
        for i in (dims or {}).get(name, ()):
            a.setdefault(i, f"{name}_{i}")
        axes[name] = a
    from quantcli.inputs.data import flat_outputs

    for name, o in zip(output_names, flat_outputs(outputs)):
        if isinstance(o, torch.Tensor) and o.dim() > 0:
            axes[name] = {0: "batch"}
    return axes


def check_dynamic_dims(
    dims: dict[str, list[int]] | None, example: dict[str, torch.Tensor], dynamic_axes: bool
) -> dict[str, list[int]]:
    """``dims`` (input name -> axes to export with a symbolic size, ``--dynamic-dim``) checked against the
    inputs, with negative axes counted from the end; an empty name means the only input."""
    if not dims:
        return {}
    if not dynamic_axes:
        raise ExportError(
            "--dynamic-dim makes axes dynamic, --static-shapes fixes them all: pass one of them"
        )
    out: dict[str, list[int]] = {}
    for name, wanted in dims.items():
        if not name:
            if len(example) != 1:
                raise ExportError(
                    f"--dynamic-dim without an input name applies to a model with one input; this one has "
                    f"{', '.join(example)}: write NAME=AXES (e.g. {next(iter(example))}=2,3)"
                )
            name = next(iter(example))
        if name not in example:
            raise ExportError(
                f"--dynamic-dim {name}: the model has no input {name!r} (its inputs: {', '.join(example)})"
            )
        rank = example[name].dim()
        bad = [a for a in wanted if not -rank <= a < rank]
        if bad:
            raise ExportError(
                f"--dynamic-dim {name}={','.join(map(str, wanted))}: input {name!r} has {rank} axes "
                f"(shape {list(example[name].shape)}), so axis {bad[0]} does not exist; use 0..{rank - 1}"
            )
        out[name] = sorted({a % rank for a in [*out.get(name, []), *wanted]})
    return out


def _ir_version(opset: int) -> int:
    return 10 if opset >= 21 else 9 if opset >= 19 else 8


def _namequantizers(model: onnx.ModelProto, module: nn.Module) -> dict[str, str]:
    """DequantizeLinear output -> quantizer name.

    The TorchScript exporter names nodes by module scope (``/fc1/input_quantizer/DequantizeLinear``); the
    dynamo path names its nodes after the quantizer (:mod:`exporters.dynamo`). Either way the quantizer's
    module path is in the node name.
    """
    known = set(quantizers(module))
    aliases = _hook_scopes(module)
    before = _padding_inputs(module)
    readers = consumer_map(model) if before else {}
    mapping = {}
    for n in model.graph.node:
        if n.op_type != "DequantizeLinear":
            continue
        hits = [s for s in name_scopes(n) if s in known]  # dynamo
        if hits:
            mapping[n.output[0]] = hits[-1]
            continue
        parts = n.name.strip("/").split("/")
        scoped = ".".join(parts[:-1])
        if scoped in known:
            mapping[n.output[0]] = scoped
            continue
        scoped = scope_module_path(parts[:-1])
        if scoped in known:
            mapping[n.output[0]] = scoped
            continue
        if scoped in aliases:
            mapping[n.output[0]] = aliases[scoped]
            continue
        padded = {scope_module_path(r.name.strip("/").split("/")[:-1]) for r in readers.get(n.output[0], [])}
        hits = [before[p] for p in padded if p in before]
        if len(hits) == 1:
            mapping[n.output[0]] = hits[0]
            continue
        # a module reached through a parent that is never called itself (``self.inner.fc(x)``, a loop
        # over ``self.model.layers``): TorchScript's scopes leave the parent out, so the path is a known
        # name's tail
        tails = [q for q in known if scoped and q.endswith("." + scoped)]
        if len(tails) == 1:
            mapping[n.output[0]] = tails[0]
            continue
        flat = n.name.replace("/", ".")
        hits = [q for q in known if q in flat]
        if hits:
            mapping[n.output[0]] = max(hits, key=len)
    return _unscoped(model, known, mapping)


def _unscoped(model: onnx.ModelProto, known: set[str], mapping: dict[str, str]) -> dict[str, str]:
    """A quantizer's DQ that TorchScript named by the quantizer's role alone (``/output_quantizer/...``: its
    module reached through a container called as ``down.forward(y)``, timm's HRNet head, which records no
    scope) goes to the one quantizer of that role no other DQ was mapped to; verify failed such a graph
    ("Q/DQ pair missing") with the pair in it."""
    taken = set(mapping.values())
    for n in model.graph.node:
        if n.op_type != "DequantizeLinear" or n.output[0] in mapping:
            continue
        parts = n.name.strip("/").split("/")
        if len(parts) != 2 or not parts[0].endswith("_quantizer"):
            continue
        left = [q for q in known if q.endswith("." + parts[0]) and q not in taken]
        if len(left) == 1:
            mapping[n.output[0]] = left[0]
            taken.add(left[0])
    return mapping


def _padding_inputs(module: nn.Module) -> dict[str, str]:
    """Padding module path -> the input quantizer its pre-hook runs
    (:func:`quantcli.nn.modules.apply_input_quantizer_before`): TorchScript names that quantizer's nodes
    ``<parent>/input_quantizer/...``, which several paddings under one parent share; the Pad node reading its
    DequantizeLinear is named after the padding module."""
    names = {id(m): n for n, m in module.named_modules()}
    return {
        names[id(input_quantized_before(m))]: quantizer_name(name, "input_quantizer")
        for name, m in module.named_modules()
        if id(input_quantized_before(m)) in names
    }


def _hook_scopes(module: nn.Module) -> dict[str, str]:
    """TorchScript scope -> quantizer name for output quantizers run by a forward hook of a later module
    (:func:`quantcli.nn.modules.apply_output_quantizer_after`): the hook runs in the scope of that module's
    parent, so the node is named ``<parent>/output_quantizer/...``. quantize_model puts at most one such
    quantizer under a parent, so the scope names one quantizer."""
    names = {id(m): n for n, m in module.named_modules()}
    out: dict[str, str] = {}
    for name, layer in module.named_modules():
        after = layer.__dict__.get("_output_quantized_after")
        if after is None or id(after) not in names:
            continue
        parent = owner(names[id(after)])
        out[quantizer_name(parent, "output_quantizer")] = quantizer_name(name, "output_quantizer")
    return out


def export_onnx(
    model: nn.Module,
    example_inputs: dict[str, torch.Tensor],
    path: str | Path,
    opset: int | None = None,
    exporter: str = "torchscript",
    *,
    dynamic_axes: bool | dict[str, dict[int, str]] = True,
    weights_qdq: bool = False,
    metadata: dict[str, str] | None = None,
    provider: str | None = None,
    graph_input_names: dict[str, str] | None = None,
    edit_graph: Callable[[onnx.ModelProto], None] | None = None,
    dynamic_dims: dict[str, list[int]] | None = None,
    finish_graph: Callable[[onnx.ModelProto, dict[str, str], ExportResult], None] | None = None,
) -> ExportResult:
    """Export a calibrated, quantized ``model`` to a standard Q/DQ ONNX file.

    Args:
        example_inputs: keyword inputs for ``model(**example_inputs)``; their names become the graph's inputs.
        opset: default: the lowest that the formats need (13 int8, 19 fp8, 21 int4/blocked; 18 with dynamo)
            and the model's ops are best expressed in (17 with a LayerNorm: :mod:`exporters.opset`). Lower
            than the formats need is an error; lower than the ops prefer is allowed
            (``ExportResult.opset_note``).
        exporter: ``torchscript`` or ``dynamo``.
        dynamic_axes: batch (and sequence, for integer token inputs) dimensions are dynamic; or the dynamic
            dimensions of each input (by ``example_inputs`` key) and output, ``{name: {dim: label}}``.
        dynamic_dims: more dynamic axes, input name -> axes (``{"image": [2, 3]}``: any image size; ``""``
            names the only input). Needs ``dynamic_axes`` (not a dict). Each input's batch axis is found from
            the example (:mod:`quantcli.inputs.batch_axes`).
        weights_qdq: keep float weights with Q/DQ instead of storing them quantized.
        provider: onnxruntime target only: the execution provider the graph is for, ``cpu`` (default) or
            ``cuda``. For ``cpu`` the residual and GELU-bias Adds are written as ``Sum``
            (:mod:`exporters.onnxruntime.cpu_fusions`), so onnxruntime's CPU provider forms no
            ``SkipLayerNormalization`` or ``BiasGelu`` (slower there than what they replace); ``cuda`` leaves
            them to onnxruntime's fusions. Naming it for another target is an error.
        graph_input_names: ``example_inputs`` key -> the graph input's name, where they differ (forward
            parameters must be Python names: ``past_key_values_0_key`` -> ``past_key_values.0.key``).
        edit_graph: called on the graph as the exporter wrote it (inputs renamed), before the graph passes:
            the caller declares what the exporter could not know (a custom op's output shapes).
        finish_graph: called after the graph passes with the graph, its quantizer map and the result, before
            the metadata is written: a caller's pass over the final form (both may be edited in place).

    For the onnxruntime target (the config's ``target``, default) float8 pairs get the guards of
    :mod:`exporters.onnxruntime.compat`, so the graph loads with default session options, and the result
    counts the quantized layers onnxruntime leaves in float
    (:func:`exporters.onnxruntime.fusion.inspect_fusion`).
    """
    t0 = time.perf_counter()
    need, what = _required_opset(model, exporter, opset)
    target = getattr(getattr(model, "quantcli_config", None), "target", "onnxruntime")
    provider = _check_provider(provider, target)
    path = Path(path)
    parent = _check_destination(path)
    model = model.eval().cpu()
    example_inputs = checked_batch(example_inputs, "export's example_inputs")
    check_names(example_inputs, model, "export's example_inputs")
    example = _in_forward_order(model, {k: v.cpu() for k, v in example_inputs.items()})
    dynamic_dims = check_dynamic_dims(dynamic_dims, example, dynamic_axes)
    probe = OpProbe()
    inputs = fresh(example)  # (not an op of the model's)
    with torch.no_grad(), probe:
        outputs = call_forward(model, inputs)
    opset, reason, note = _resolve_opset(model, probe, opset, need, what)
    output_names = _output_names(outputs)
    renamed = graph_input_names or {}
    res = ExportResult(
        str(path),
        opset,
        exporter,
        input_names=[renamed.get(k, k) for k in example],
        output_names=output_names,
        opset_reason=reason,
        opset_note=note,
        target=target,
        provider=provider,
        cpu=_config_cpu(model) if target == "onnxruntime" else None,
    )
    if isinstance(dynamic_axes, dict):
        axes = dynamic_axes
    else:
        axes = _dynamic_axes(example, output_names, outputs, dynamic_dims) if dynamic_axes else None
    res.dynamic_dims = {k: sorted(v) for k, v in (axes or {}).items() if k in example}
    with staging_directory(parent, prefix=".quantcli-export-") as workdir:
        with exported_weights(model), constant_operands(model, example), _plain_outputs(model, outputs):
            # quantized LSTM layers: their dequantized weights, for the LSTM node; derived weight operands as
            # constants; dataclass outputs as dicts
            onnx_model = _export_graph(model, example, workdir / "raw.onnx", res, axes)
        _inputs_kept_apart_from_outputs(onnx_model, list(example))
        rename_inputs(onnx_model, renamed)
        present = {i.name for i in onnx_model.graph.input}
        res.unread_inputs = [n for n in res.input_names if n not in present]
        res.input_names = [n for n in res.input_names if n in present]
        if edit_graph is not None:
            edit_graph(onnx_model)
        mapping = _post_process(onnx_model, model, example, res, weights_qdq)
        if finish_graph is not None:
            finish_graph(onnx_model, mapping, res)
        _stamp_metadata(onnx_model, mapping, res, metadata)
        onnx_model = _checked(onnx_model, res.exporter)
        res.external_data = _save(onnx_model, path, parent, workdir)
    _describe_saved(onnx_model, path, res)
    res.seconds = time.perf_counter() - t0
    return res


def _config_cpu(model: nn.Module) -> str | None:
    """The deployment CPU the calibrated model's grids were chosen for (None: a model quantized without a
    config, or one from before the CPU was recorded)."""
    cfg = getattr(model, "quantcli_config", None)
    return None if cfg is None else cfg.deploy_cpu


def _required_opset(model: nn.Module, exporter: str, opset: int | None) -> tuple[int, str]:
    """Check the exporter, the model and an explicit ``opset`` before any work is done.

    Returns (the lowest opset the formats and the exporter need, what needs it, worded for messages)."""
    if exporter not in EXPORTERS:
        raise ExportError(f"unknown exporter {exporter!r}; choose torchscript or dynamo")
    check_exportable(model)
    need, why = required_opset(model)
    if exporter == "dynamo" and need < DYNAMO_MIN_OPSET:
        need, why = DYNAMO_MIN_OPSET, "the dynamo exporter"
    what = why if why in ("the dynamo exporter", NO_QUANTIZER) else f"{why} quantization"
    if opset is not None and opset < need:
        raise ExportError(
            f"{what} needs ONNX opset >= {need}, got --opset {opset}; pass --opset {need} or leave it out"
        )
    if opset is not None and opset > 21:
        raise ExportError(f"opset {opset} is not supported; use 13..21")
    return need, what


def _check_provider(provider: str | None, target: str) -> str | None:
    """The onnxruntime execution provider to shape the graph for: ``cpu`` by default for the onnxruntime
    target (its integer kernels are CPU kernels: the CUDA provider runs Q/DQ int8 graphs in float, GPU int8
    goes through TensorRT), none for other targets."""
    if provider is not None and provider not in PROVIDERS:
        raise ExportError(f"unknown provider {provider!r}; choose cpu or cuda")
    if target != "onnxruntime":
        if provider is not None:
            raise ExportError(
                f"--provider applies to the onnxruntime target; this model is calibrated for "
                f"{target} "
                f"(leave --provider out, or calibrate with --target onnxruntime)"
            )
        return None
    return provider or "cpu"


def _check_destination(path: Path) -> Path:
    """The directory the ``.onnx`` file goes to, checked writable before the export runs."""
    if path.suffix.lower() != ".onnx":
        raise ExportError(f"output {path} must end in .onnx")
    return writable_directory(path, ExportError)


def _resolve_opset(
    model: nn.Module, probe: OpProbe, opset: int | None, need: int, what: str
) -> tuple[int, str, str]:
    """(the opset to export, why that one, what an explicit opset below the ops' best costs) from the formats'
    minimum ``need`` and the ops ``probe`` saw in a forward pass (:func:`exporters.opset.ops_opset`)."""
    best, best_why = ops_opset(model, probe)
    if opset is None:
        first = (
            f"the graph is float ({what}): the project's minimum, {need}"
            if what == NO_QUANTIZER
            else f"{what} needs {need}"
        )
        return max(need, best), first + (f"; {best_why} needs {best}" if best > need else ""), ""
    note = ""
    if opset < best and best == LAYER_NORM_OPSET:
        note = (
            f"{best_why.split(' (')[0]} is exported decomposed (ReduceMean, Sub, Pow, ...) below opset "
            f"{best}: "
            f"onnxruntime fuses it back into LayerNormalization (forming no SkipLayerNormalization), "
            f"other "
            f"runtimes may not; leave --opset out for {best}"
        )
    return opset, "--opset", note


def _export_graph(
    model: nn.Module,
    example: dict[str, torch.Tensor],
    raw: Path,
    res: ExportResult,
    axes: dict[str, dict[int, str]] | None,
) -> onnx.ModelProto:
    """Run the chosen torch exporter into ``raw`` and load what it wrote (inputs named after ``example``'s
    keys)."""
    if res.exporter == "torchscript":
        res.traced_branches = _export_torchscript(
            model, example, raw, res.opset, list(example), res.output_names, axes
        )
    else:
        from exporters.dynamo import export_dynamo, name_dims

        export_dynamo(model, example, raw, res.opset, list(example), res.output_names, axes)
        onnx_model = onnx.load(str(raw))
        name_dims(onnx_model, axes)
        return onnx_model
    return onnx.load(str(raw))


def _weight_codes_shapes(model: nn.Module, qs: dict) -> dict[str, tuple[int, ...]]:
    """Module -> the ``(K, N)`` shape of its weight codes in a MatMulInteger, for every module with a dynamic
    input quantizer (:func:`exporters.dynamic_linear.dynamic_quantizer_map`)."""
    from quantcli.nn.dynamic import linear_weight
    from quantcli.nn.tensor_quantizer import owner

    shapes = {}
    for name, q in qs.items():
        if q.enabled and q.dynamic_uint8 and name.rsplit(".", 1)[-1] == "input_quantizer":
            module = model.get_submodule(owner(name))
            if isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() == 2:
                shapes[owner(name)] = tuple(linear_weight(module)[0].shape[::-1])  # (out, in) transposed
    return shapes


def _inputs_kept_apart_from_outputs(onnx_model: onnx.ModelProto, inputs: list[str]) -> None:
    """An input the model also returns: the dynamo exporter names the graph input after the output. It gets
    its own name back, and the output reads it through an ``Identity``, in place."""
    outputs = {o.name for o in onnx_model.graph.output}
    producers = producer_map(onnx_model.graph)
    for graph_input, want in zip(onnx_model.graph.input, inputs):
        if graph_input.name == want:
            continue
        if graph_input.name in outputs:
            returned = graph_input.name
            rename_inputs(onnx_model, {returned: want})
            onnx_model.graph.node.insert(0, onnx.helper.make_node("Identity", [want], [returned]))
        elif want in outputs:
            # TorchScript: an output took the input's name (a dict key), the input became "mask.1"
            p = producers.get(want)
            if p is None or p.op_type != "Identity" or p.input[0] != graph_input.name:
                raise ExportError(
                    f"the model returns an output named {want!r}, the name of one of its inputs, holding "
                    "another value; one graph cannot name two values alike: rename that output (its dict key)"
                )
            onnx_model.graph.node.remove(p)  # the output is the input itself, returned under its own name
            rename_inputs(onnx_model, {graph_input.name: want})


def rename_inputs(onnx_model: onnx.ModelProto, names: dict[str, str]) -> None:
    """Rename graph inputs (and every node input reading them), in place; ``names``: old -> new."""
    if not names:
        return
    for i in onnx_model.graph.input:
        i.name = names.get(i.name, i.name)
    for node in onnx_model.graph.node:
        for k, name in enumerate(node.input):
            if name in names:
                node.input[k] = names[name]


def _post_process(
    onnx_model: onnx.ModelProto,
    model: nn.Module,
    example: dict[str, torch.Tensor],
    res: ExportResult,
    weights_qdq: bool,
) -> dict[str, str]:
    """The graph passes, in place: fold weights, name each DequantizeLinear's quantizer, narrow 4-bit types,
    place Q/DQ for onnxruntime, drop dead initializers and node stack traces, guard float8 pairs. Records what
    each did in ``res``; returns DequantizeLinear output -> quantizer name."""
    res.weights_stored_quantized = prepare(onnx_model, fold_weights=not weights_qdq)
    _set_opset(onnx_model, res.opset)
    qs = quantizers(model)
    mapping = _namequantizers(onnx_model, model)
    mapping.update(dynamic_quantizer_map(onnx_model, qs, _weight_codes_shapes(model, qs)))
    narrow = {}
    for out_name, qname in mapping.items():
        d = qs[qname].desc
        if not d.is_fp8 and d.num_bits <= 4:
            narrow[out_name] = formats.integer_type(d.num_bits, d.unsigned or d.asymmetric).elem_type
    narrow_types(onnx_model, narrow)
    res.placement = place_for_onnxruntime(onnx_model) if res.target == "onnxruntime" else {}
    res.recurrent = to_dynamic_quantize_lstm(onnx_model, onnx_layers(model))
    if res.target == "onnxruntime" and not weights_qdq:
        res.kn_weights = to_matmul_nbits(onnx_model)
        res.matmul_nbits_layers = len(res.kn_weights)
        res.matmul_nbits_8bit = sorted(
            mapping[w] for w in res.kn_weights if w in mapping and qs[mapping[w]].desc.num_bits == 8
        )
    if res.provider == "cpu":
        res.placement.update(keep_cpu_kernels(onnx_model))
    res.shared_initializer_bytes = share_identical_initializers(onnx_model)  # a module called several times
    drop_unused_initializers(onnx_model)
    for node in onnx_model.graph.node:  # per-node stack traces: local paths and most of the file's size
        del node.metadata_props[:]
    res.fp8_guards = guard_fp8(onnx_model) if res.target == "onnxruntime" else 0
    res.onnxruntime_disabled_optimizers = list(session_needs(onnx_model).disabled_optimizers)
    recurrent = {q for entry in res.recurrent.values() for q in entry["quantizers"]}
    res.pruned_quantizers = _pruned(model, example, mapping, recurrent)
    return mapping


def _stamp_metadata(
    onnx_model: onnx.ModelProto, mapping: dict[str, str], res: ExportResult, metadata: dict[str, str] | None
) -> None:
    """The model's ``metadata_props`` (quantcli version, exporter, quantizer map, target, pruned quantizers
    and the caller's ``metadata``) and producer."""
    meta = {
        "quantcli.version": __version__,
        "quantcli.exporter": res.exporter,
        QUANTIZERS_KEY: json.dumps(mapping),
        "quantcli.target": res.target,
        **({"quantcli.provider": res.provider} if res.provider else {}),
        **({CPU_KEY: res.cpu} if res.cpu else {}),
        PRUNED_KEY: json.dumps(res.pruned_quantizers),
        **({UNREAD_INPUTS_KEY: json.dumps(res.unread_inputs)} if res.unread_inputs else {}),
        **({BRANCHES_KEY: json.dumps(res.traced_branches)} if res.traced_branches else {}),
        **({KN_WEIGHTS_KEY: json.dumps(res.kn_weights)} if res.kn_weights else {}),
        **({RECURRENT_KEY: json.dumps(res.recurrent)} if res.recurrent else {}),
        **(metadata or {}),
    }
    del onnx_model.metadata_props[:]
    for k, v in meta.items():
        onnx_model.metadata_props.add(key=k, value=v)
    onnx_model.producer_name = "quantcli"
    onnx_model.producer_version = __version__


def other_exporter(exporter: str) -> str:
    """What to try when ``exporter`` fails on a model: the other torch exporter."""
    return "try --exporter dynamo" if exporter == "torchscript" else "try --exporter torchscript"


def _checked(onnx_model: onnx.ModelProto, exporter: str) -> onnx.ModelProto:
    """The model with inferred shapes, after ``onnx.checker``; a failure is an :class:`ExportError` quoting
    the checker whole (the node it names is on its second line) and naming the other exporter."""
    try:
        onnx_model = onnx.shape_inference.infer_shapes(onnx_model, check_type=True)
        onnx.checker.check_model(onnx_model)
    except Exception as e:
        raise ExportError(
            f"the exported graph failed the ONNX checker: {whole_line(e)} ({other_exporter(exporter)})"
        ) from None
    return onnx_model


def _save(onnx_model: onnx.ModelProto, path: Path, parent: Path, workdir: Path) -> bool:
    """Write the model in ``workdir`` and rename it (and its external data, past protobuf's limit) into place.
    Returns whether the weights went to an external ``<name>.data`` file."""
    external = onnx_model.ByteSize() > EXTERNAL_DATA_BYTES if _small_enough_to_size(onnx_model) else True
    final = workdir / path.name
    if external:
        onnx.save_model(
            onnx_model,
            str(final),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=path.name + ".data",
        )
        commit(workdir / (path.name + ".data"), parent / (path.name + ".data"))
        os.replace(final, path)  # (the pair is committed: no stop between the two renames)
    else:
        onnx.save_model(onnx_model, str(final))
        commit(final, path)
    return external


def _describe_saved(onnx_model: onnx.ModelProto, path: Path, res: ExportResult) -> None:
    """Fill ``res`` with what the saved graph holds: Q/DQ pairs by format, file size, dynamic layers and, for
    the onnxruntime target, the quantized layers onnxruntime fuses (loading the file)."""
    counts: dict[str, int] = {}
    for p in qdq_pairs(onnx_model):
        key = p.format + (" blocked" if p.block_size else "")
        counts[key] = counts.get(key, 0) + 1
    res.pairs_by_format = counts
    res.file_bytes = path.stat().st_size
    dyn = dynamic_layers(onnx_model)
    res.dynamic_layers = len(dyn)
    # the dynamo path writes dynamic layers' weight codes itself (nothing to fold)
    if res.exporter == "dynamo":
        inits = {t.name for t in onnx_model.graph.initializer}
        res.weights_stored_quantized += sum(1 for d in dyn if d.weight in inits)
    if res.target == "onnxruntime":
        res.fusion = fusion = inspect_fusion(path)
        res.quantized_layers, res.unfused_layers = len(fusion.layers), len(fusion.unfused)
        res.runtime_quantized_layers = [r.layer for r in fusion.runtime_quantized]
        res.fusion_error = fusion.load_error
        if fusion.load_error and not fusion.needs:
            _refuse_unloadable(path, res, fusion.load_error)


def _refuse_unloadable(path: Path, res: ExportResult, error: str) -> None:
    """A graph for onnxruntime that it loads neither with default options nor with every optimization off
    (and for which no session option is known to help: float8 graphs have theirs) is no export: it is removed
    and :class:`ExportError` says why (Falcon's ALiBi through the dynamo exporter: a complex128 Cast the graph
    cannot type). One that loads with optimizations off keeps its summary row (an onnxruntime optimizer's
    failure, which verify reports)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    try:
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        return
    except Exception:  # noqa: BLE001 - any load failure: the graph is not one onnxruntime can run
        pass
    path.unlink(missing_ok=True)
    if res.external_data:
        path.with_name(path.name + ".data").unlink(missing_ok=True)
    raise ExportError(
        f"onnxruntime cannot load the exported graph, with or without its optimizations: {error} "
        f"({other_exporter(res.exporter)})"
    )


def _pruned(
    model: nn.Module, example: dict[str, torch.Tensor], mapping: dict[str, str], elsewhere: set[str]
) -> list[str]:
    """Enabled quantizers without a DequantizeLinear (nor a node of their own: ``elsewhere``, the weights of
    DynamicQuantizeLSTM nodes) whose output reaches no model output (traced by autograd).

    A quantizer that is absent and *is* used stays out of this list: verify reports it as missing.
    """
    absent = {n for n, q in quantizers(model).items() if q.enabled} - set(mapping.values()) - elsewhere
    if not absent:
        return []
    unused = unused_quantizers(model, example) or set()
    return sorted(absent & unused)


def _small_enough_to_size(model: onnx.ModelProto) -> bool:
    total = sum(len(t.raw_data) for t in model.graph.initializer)
    return total < EXTERNAL_DATA_BYTES


def _set_opset(model: onnx.ModelProto, opset: int) -> None:
    """Check the exporter wrote the asked-for opset, and use the IR version onnxruntime reads for it."""
    got = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), opset)
    if got != opset:
        raise ExportError(f"the exporter wrote opset {got} instead of {opset}")
    model.ir_version = _ir_version(opset)


def _in_forward_order(model: nn.Module, example: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The example keyed in forward's parameter order: the exporters name graph inputs in that order, so a
    batch whose keys come in another order (a tokenizer's ``token_type_ids`` before ``attention_mask``) must
    not name the wrong input."""
    from quantcli.inputs.data import forward_parameters

    names, _, _ = forward_parameters(model)
    return {
        **{k: example[k] for k in names if k in example},
        **{k: v for k, v in example.items() if k not in names},
    }


def _export_torchscript(model, example, path, opset, input_names, output_names, axes) -> list[str]:
    """Export with torchscript; returns where the model's own code branched on a tensor's value while traced
    (:func:`_branches`)."""
    from torch.onnx import symbolic_helper  # noqa: F401  (registers helpers used by symbolic functions)

    aten_symbolics.register()
    decode_ops.register_torchscript()
    args = tuple(fresh(example).values())  # in forward's order (_in_forward_order)
    with (
        warnings.catch_warnings(record=True) as caught,
        contextlib.redirect_stderr(io.StringIO()),
        native_output_silenced(),
        forward_by_name(model, list(example)),
    ):
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", torch.jit.TracerWarning)
        try:
            torch.onnx.export(
                model,
                args,
                str(path),
                dynamo=False,
                opset_version=opset,
                input_names=input_names,
                output_names=output_names,
                dynamic_axes=axes,
                do_constant_folding=True,
            )
        except ExportError:
            raise
        except Exception as e:
            if no_space(e):  # the disk, not the model: the usual one-line full-disk error, not "try dynamo"
                raise
            cause = e
            while cause.__cause__ is not None or cause.__context__ is not None:
                nxt = cause.__cause__ or cause.__context__
                if isinstance(nxt, ExportError):
                    raise nxt from None
                cause = nxt
            raise aten_symbolics.unsupported_operator(e, "torchscript", opset) or ExportError(
                f"torch.onnx.export failed: {whole_line(e, 400)} ({other_exporter('torchscript')})"
            ) from None
    return _branches(caught)


#: code whose tensor-to-bool conversions are not the model's own branches: quantcli's, and every installed
# library's (torch's, transformers' shape checks while tracing: ``if attention_mask.shape[-1] ...``)
_NOT_THE_MODELS = (
    *(str(Path(sys.modules[m].__file__).resolve().parent) + os.sep for m in ("quantcli", "exporters")),
    f"{os.sep}site-packages{os.sep}",
    f"{os.sep}dist-packages{os.sep}",
)


def _branches(caught: list) -> list[str]:
    """``file:line`` of each place the model's own code (not an installed library's) turned a traced tensor
    into a Python bool (an ``if`` on a value: torchscript records the path the example batch took, the graph
    cannot hold the other), as torch's tracer warns of them."""
    seen: dict[str, None] = {}
    for w in caught:
        where = str(Path(w.filename).resolve())
        if (
            issubclass(w.category, torch.jit.TracerWarning)
            and "Python boolean" in str(w.message)
            and not any(part in where for part in _NOT_THE_MODELS)
        ):
            seen[f"{Path(w.filename).name}:{w.lineno}"] = None
    return list(seen)


@contextlib.contextmanager
def native_output_silenced():
    """Send what native code writes to stdout/stderr (torch prints its whole IR graph on an export error,
    whatever ``verbose`` says) to nowhere, so ``--json`` output stays JSON; Python-level output is
    untouched."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved = []
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    try:
        for fd in (1, 2):
            with contextlib.suppress(OSError):
                saved.append((fd, os.dup(fd)))
                os.dup2(devnull, fd)
        yield
    finally:
        for fd, copy in saved:
            os.dup2(copy, fd)
            os.close(copy)
        os.close(devnull)
