"""In-place module replacement: ``quantize_model(model, config)``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from quantcli.errors import ConfigError, TransformationError
from quantcli.nn import computed
from quantcli.nn.computed import Census, census
from quantcli.nn.config import QuantConfig, load_config
from quantcli.nn.fold_bn import FoldReport, fold_batchnorm, unfold
from quantcli.nn.linear_like import (
    NORMS,
    float_reason,
    overrides_forward,
    pads_itself,
    quant_class,
    resolve_parametrizations,
    torch_base,
)
from quantcli.nn.module_outputs import (
    Fingerprint,
    capture,
    describe_change,
    differences,
    fold_changes,
    observer,
    unstable,
)
from quantcli.nn.modules import (
    QUANT_POOL_CLASSES,
    apply_input_quantizer_before,
    apply_output_quantizer_after,
)
from quantcli.nn.placement import (
    Placement,
    analyse,
    insert_activation_quantizers,
    insert_residual_quantizers,
    nonnegative,
)
from quantcli.nn.recurrent import WeightView
from quantcli.nn.recurrent import convert as convert_lstm
from quantcli.nn.recurrent import float_reason as recurrent_float_reason
from quantcli.nn.recurrent import weight_format_reason as lstm_weight_format_reason
from quantcli.nn.tensor_quantizer import TensorQuantizer, owner
from quantcli.quant.descriptor import QuantDescriptor

#: what to write instead of a product quantcli does not quantize (:data:`quantcli.nn.computed.OTHER_PRODUCTS`)
OTHER_PRODUCT_REMEDY = (
    "compute the product with F.linear or torch.matmul (or @), a 2-D weight as the second operand "
    "contracting the activation's last axis (reshape a weight of more axes, move the contracted axis last), "
    "to quantize it"
)
# rule fields that choose an activation grid themselves: placement leaves such quantizers as the rules say
_GRID_FIELDS = ("unsigned", "asymmetric", "num_bits", "axis", "block_sizes", "dynamic")


def _grid_chosen(cfg: QuantConfig, matched: list[int]) -> bool:
    """Whether one of the ``matched`` rules sets a grid field (then placement leaves the quantizer's grid)."""
    return any(f in cfg.rules[i] for i in matched for f in _GRID_FIELDS)


@dataclass
class QuantizeReport:
    layers: list[str] = field(default_factory=list)
    unmatched_patterns: list[str] = field(default_factory=list)
    batchnorm: FoldReport = field(default_factory=FoldReport)  # the BatchNorms folded, and those left alone
    placement: Placement | None = None
    # modules that own a 2+-D floating weight and stay float: {"name", "type", "reason"}
    # (quantcli.nn.linear_like)
    float_layers: list[dict[str, str]] = field(default_factory=list)
    # parameters of quantized layers that a product quantcli does not quantize took as a weight (the layer's
    # quantized operation computes with another): {"name" (module.param), "layer", "reason"}
    float_weights: list[dict[str, str]] = field(default_factory=list)
    # torch layers whose parametrized weight (weight_norm, ...) was stored as the value it computes
    resolved_parametrizations: list[str] = field(default_factory=list)
    # layers quantized where their operations run (quantcli.nn.computed), and the torch modules whose fused
    # fast path is off so that their layers run
    computed: list[str] = field(default_factory=list)
    fast_paths_off: list[str] = field(default_factory=list)
    # the float check: every transformation compared, module by module and quantizers off, with the model as
    # loaded on the example batch (quantcli.nn.module_outputs): {"checked", "modules", "reverted": [{"kind":
    # "fold" or "layer", "layer", "cause"}]}
    float_check: dict = field(default_factory=lambda: {"checked": False})
    # the model as loaded, module by module (a later transformation, SmoothQuant, is checked against it)
    float_reference: dict[str, Fingerprint] = field(default_factory=dict, repr=False)


def quantize_model(
    model: nn.Module,
    config=None,
    *,
    example: Mapping[str, torch.Tensor] | None = None,
    fold: bool | None = None,
    keep_float: list[str] | tuple[str, ...] = (),
    check_float: bool = True,
) -> nn.Module:
    """Insert quantizers in place into every ``nn.Linear``, ``nn.ConvNd`` and ``nn.ConvTransposeNd``, every
    module that computes what one does (:mod:`quantcli.nn.linear_like`: transformers' ``Conv1D``,
    weight-normed convolutions), and every module whose weight a convolution, linear or matmul the model
    computes takes (:mod:`quantcli.nn.computed`: subclasses with a ``forward`` of their own, such as
    "same"-padding convolutions, ``nn.MultiheadAttention``, a weight a plain function passes to ``F.linear``);
    the report lists the weighted modules left float and why.

    First, when the config's ``fold_batchnorm`` is on (the default), every BatchNorm that only its preceding
    Conv/ConvTranspose/Linear feeds is folded into that layer (:func:`quantcli.nn.fold_bn.fold_batchnorm`), so
    weights are calibrated as they will run; the BatchNorm becomes ``nn.Identity``. Otherwise module names,
    parameters, hooks and ``state_dict`` keys are kept (quantizer ``amax`` buffers are added).
    ``config`` is anything :func:`quantcli.nn.config.load_config` takes (default: the ``int8`` preset). The
    report (layers converted, rule patterns that matched nothing, BatchNorms folded and not) is at
    ``model.quantcli_report``.

    Args:
        example: one keyword batch for ``model(**example)``. The operations the model computes are read from
            one forward on it (:func:`quantcli.nn.computed.census`), and its structure (BatchNorm folding,
            placement) from another, as the exporter reads it (:mod:`quantcli.nn.recorded_graph`); without
            it, torch layers are found by class and the structure from ``torch.fx`` symbolic tracing, which
            fails on Python control flow and leaves a BatchNorm after a Linear unfolded.
        fold: overrides the config's ``fold_batchnorm`` (``load_calibrated`` restores stored folds instead).
        keep_float: layers to leave float (a calibrated checkpoint's layers the float check left as loaded).
        check_float: with ``example``, check every transformation against the model as loaded, module by
            module, quantizers off (:mod:`quantcli.nn.module_outputs`): a BatchNorm fold or a layer
            conversion that changes a module's float output is undone (reported in ``float_check`` and
            ``float_layers``); a placement rewrite that does raises
            :class:`quantcli.errors.TransformationError` naming the module.

    The config's ``target`` then decides the placement (:mod:`quantcli.nn.placement`): for ``onnxruntime``,
    inputs that are non-negative by construction use the unsigned grid, Convs whose output no quantized layer
    reads directly get an ``output_quantizer``, and Conv/2-D Linear biases are rounded to int32 codes; for
    ``tensorrt``, the skip inputs of residual Adds get a ``residual_quantizer``.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"quantize_model takes a torch nn.Module, got {type(model).__name__}")
    if example is not None and not isinstance(example, Mapping):
        raise ConfigError(
            f"example is one keyword batch, a dict of input name -> tensor for model(**example), got "
            f"{type(example).__name__}"
        )
    scripted = [n or "the model" for n, m in model.named_modules() if isinstance(m, torch.jit.ScriptModule)]
    if scripted:
        # quantizers go in with Python forward hooks and wrappers, which a ScriptModule does not take
        raise ConfigError(
            f"{scripted[0]} is a TorchScript module (torch.jit.script / torch.jit.trace): quantcli inserts "
            "quantizers into Python modules; build the model without torch.jit.script (a scripted function "
            "it calls is fine)"
        )
    already = [n for n, m in model.named_modules() if isinstance(m, TensorQuantizer)]
    if already:
        # a second call would keep the first config's quantizers under the second's model.quantcli_config
        raise ConfigError(
            f"the model is already quantized ({len(already)} quantizers, {already[0]} first); quantize_model "
            "inserts quantizers into a float model: load the float model again to quantize it with another "
            "config"
        )
    cfg: QuantConfig = load_config(config)
    report = QuantizeReport()
    # first: a folded BatchNorm scales the weight a parametrization would otherwise recompute
    report.resolved_parametrizations = resolve_parametrizations(model)
    reference: dict[str, Fingerprint] = {}
    found: Census | None = None
    check = check_float and example is not None
    if example is not None:
        found = census(model, example, observer(reference) if check else None)
    if cfg.fold_batchnorm if fold is None else fold:
        report.batchnorm = fold_batchnorm(model, example, found)
    used: set[int] = set()
    layers: dict[str, nn.Module] = {}
    originals: dict[str, type] = {}
    own_grid: set[str] = set()  # input quantizers whose grid a rule chose
    uses = found.by_layer() if found is not None else {}
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.RNNBase):  # LSTM as onnxruntime's DynamicQuantizeLSTM; GRU, RNN: float
            if _recurrent(name, module, cfg, report, used):
                report.layers.append(name)
            continue
        plan = _plan(name, module, uses.get(name, []), found)
        if name in keep_float and plan[0] != "float":
            plan = (
                "float",
                "the float check found that quantizing it changed its float output (calibration)",
            )
        if plan[0] == "float":
            if plan[1] is not None:
                report.float_layers.append({"name": name, "type": type(module).__name__, "reason": plan[1]})
            continue
        originals[name] = type(module)
        if found is not None:
            own = {p for u in uses.get(name, []) for p in u.params}
            own.add("weight" if plan[0] == "class" else plan[2])  # the weight its quantizer quantizes
            report.float_weights += _weights_left_float(name, module, own, found)
        if plan[0] == "class":
            module.__class__ = plan[1]
        else:
            _, kind, weight_name, derived, axis, callers = plan
            computed.convert(model, name, kind, weight_name, derived, axis, callers)
            report.computed.append(name)
        for kind in ("input", "weight"):
            qname = _qname(name, kind)
            enabled, desc, matched = cfg.resolve(qname, kind, module)
            used.update(matched)
            if kind == "input" and _grid_chosen(cfg, matched):
                own_grid.add(name)
            module.add_module(f"{kind}_quantizer", TensorQuantizer(desc, name=qname, enabled=enabled))
        report.layers.append(name)
        layers[name] = module
    report.fast_paths_off = computed.disable_fast_paths(model, list(layers.values()))
    if check:
        report.float_reference = reference
        _check_conversions(model, example, reference, report, layers, originals)
    if cfg.target == "onnxruntime" and not getattr(cfg, "legacy_placement", False):
        used.update(_place_for_onnxruntime(model, cfg, layers, own_grid, report, example))
    elif cfg.target == "tensorrt":
        used.update(_place_for_tensorrt(model, cfg, layers, report, example))
    if check:
        _check_placement(model, example, reference, report)
    report.unmatched_patterns = [r["pattern"] for i, r in enumerate(cfg.rules) if i not in used]
    model.quantcli_config = cfg
    model.quantcli_report = report
    return model


def _plan(name: str, module: nn.Module, uses: list, found: Census | None) -> tuple:
    """How ``module`` is quantized: ``("class", quantized class)``, ``("computed", kind, weight parameter,
    derived, weight axis, callers)`` (:mod:`quantcli.nn.computed`), or ``("float", reason or None)``."""
    cls = type(module)
    if cls.__module__.startswith("quantcli."):
        return ("float", None)  # already converted, or a quantcli module
    if isinstance(module, NORMS):
        return ("float", None)  # a normalization's gain, whatever its shape or where its output goes
    qcls = quant_class(module)
    callers = sorted({u.caller for u in uses if u.caller != name})
    shared = found.combined.get(name) if found is not None else None
    if qcls is not None and not callers:
        return ("class", qcls)
    base = torch_base(cls)
    static = (
        base is not None
        and (
            overrides_forward(cls) or cls.__name__ == "NonDynamicallyQuantizableLinear" or pads_itself(module)
        )
    ) or isinstance(module, nn.MultiheadAttention)
    if found is None:
        if not static:
            reason = float_reason(module)
            return ("float", reason)
        return _static_plan(module, base)
    if not uses:
        buffers = found.buffer_weights.get(name)
        if buffers:
            held = ", ".join(sorted(buffers))
            return (
                "float",
                f"its weight {held} is a buffer (register_buffer), and quantcli quantizes parameters: "
                "register it as nn.Parameter(..., requires_grad=False) to quantize it",
            )
        reason = float_reason(module)
        # a product that took the module's parameter and an activation says it is a weight, whatever its name
        others = {op for ops in found.other_products.get(name, {}).values() for op in ops}
        if reason is None and not static and not others:
            return ("float", None)
        if shared:
            return ("float", f"its weight is combined with parameters of {', '.join(sorted(shared))}")
        if isinstance(module, nn.Embedding):
            return ("float", reason)
        if others:
            return (
                "float",
                f"its weight goes to {', '.join(sorted(others))}, which quantcli does not quantize: "
                f"{OTHER_PRODUCT_REMEDY}",
            )
        return (
            "float",
            "no convolution, linear or matmul took its weight (or a tensor computed from its parameters "
            "alone) on the example batch",
        )
    sources = {u.params for u in uses}
    kinds = {(u.kind, u.weight_axis) for u in uses}
    if len(sources) > 1:
        names = ", ".join("+".join(p) for p in sorted(sources))
        return (
            "float",
            f"it computes with {len(sources)} weights in separate operations ({names}); one weighted "
            "operation per module is quantized: give each weight a module of its own (nn.Linear, nn.Conv2d, "
            "or a module whose forward calls F.linear or F.conv2d)",
        )
    if len(kinds) > 1:
        return (
            "float",
            f"its weight is used by operations of different kinds ({', '.join(sorted(k for k, _ in kinds))})",
        )
    aliases = found.aliased.get(name, ())
    # (looked up only for a module that shares its weight: not a pass over every use per module)
    quantized_there = sorted(m for m in aliases if any(u.layer == m for u in found.uses))
    if quantized_there:
        # the same parameter is another module's weight, computed with there too: its quantized weight would
        # be taken for this module's operand (one weight quantizer per parameter)
        where = ", ".join(m or "the root module" for m in quantized_there)
        return (
            "float",
            f"its weight is also the weight of {where}, which computes with it too; one weight quantizer "
            "serves one module: give this use a weight of its own to quantize both",
        )
    layouts = sorted({u.weight_shape for u in uses})
    if len(layouts) > 1:
        # a tied weight used as it is and transposed (an autoencoder's decoder): one weight quantizer has one
        # channel axis and one shape
        return (
            "float",
            f"its weight is used in {len(layouts)} layouts ({' and '.join(str(tuple(s)) for s in layouts)}: "
            "slices of it, as cross-attention splits nn.MultiheadAttention's in_proj into q and k/v, or "
            "tied and transposed); one weight quantizer serves one: give each use a weight of its own to "
            "quantize them",
        )
    (params,) = sources
    ((kind, axis),) = kinds
    weight = "weight" if "weight" in params else max(params, key=lambda p: module._parameters[p].numel())
    derived = any(u.derived for u in uses)
    return ("computed", kind, weight, derived, axis, callers)


def _weights_left_float(
    name: str, module: nn.Module, quantized: set[str], found: Census
) -> list[dict[str, str]]:
    """The parameters of the quantized layer ``name`` that products quantcli does not quantize took as a
    weight, each with its reason (the layer's quantized operation is another)."""
    out = []
    for param, ops in sorted(found.other_products.get(name, {}).items()):
        # the quantized operation's own weight (its output, computed from parameters alone, may reach such a
        # product: a Perceiver's latent queries), and biases and gains (1-D), are not weights left float
        p = module._parameters.get(param)
        if param in quantized or (isinstance(p, torch.Tensor) and p.dim() < 2):
            continue
        out.append(
            {
                "name": f"{name}.{param}" if name else param,
                "layer": name,
                "reason": f"it goes to {', '.join(sorted(ops))}, which quantcli does not quantize: "
                f"{OTHER_PRODUCT_REMEDY}",
            }
        )
    return out


def _static_plan(module: nn.Module, base: type | None) -> tuple:
    """Without an example batch: a torch layer's subclass with a ``forward`` of its own is computed as its
    base computes (its weight, derived or not, is attributed at run time), ``nn.MultiheadAttention`` through
    its packed input projection."""
    if isinstance(module, nn.MultiheadAttention):
        if getattr(module, "in_proj_weight", None) is None:
            return ("float", "its query, key and value projections are three separate weights")
        return ("computed", "linear", "in_proj_weight", False, 0, [])
    if base in (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d):
        return ("computed", "conv_transpose", "weight", True, 1, [])
    return ("computed", "linear" if base is nn.Linear else "conv", "weight", True, 0, [])


def _qname(layer: str, kind: str) -> str:
    return f"{layer}.{kind}_quantizer" if layer else f"{kind}_quantizer"


def _remove_quantizers(module: nn.Module) -> None:
    for kind in ("input", "weight", "output"):
        if f"{kind}_quantizer" in module._modules:
            delattr(module, f"{kind}_quantizer")


def _check_conversions(
    model: nn.Module,
    example: Mapping[str, torch.Tensor],
    reference: dict[str, Fingerprint],
    report: QuantizeReport,
    layers: dict[str, nn.Module],
    originals: dict[str, type],
) -> None:
    """BatchNorm folds and layer conversions, compared with the model as loaded: the first module whose float
    output moved is put back as it was (its fold undone, or its conversion), until none moves."""
    folded = {f.batchnorm: f.layer for f in report.batchnorm.folded}
    reverted = []
    report.float_check = {"checked": True, "modules": len(reference), "reverted": reverted}
    unsteady: set[str] | None = None
    for _ in range(len(layers) + len(folded) + 2):
        # a folded layer computes its BatchNorm's output: that one is compared (as is what returned the
        # layer's output before the BatchNorm, a container ending in it)
        skip = fold_changes(reference, ((layer, bn) for bn, layer in folded.items())) | (unsteady or set())
        diffs = differences(reference, capture(model, example, reference), skip)
        if not diffs:
            return
        module, rel = diffs[0]
        culprit = _culprit(module, folded, layers, report)
        if culprit is None and unsteady is None:
            # a forward whose outputs change from one call to the next: those modules are not compared
            unsteady = unstable(model, example, reference)
            report.float_check["unstable"] = sorted(unsteady)
            continue
        if culprit is None:
            raise TransformationError(
                f"quantcli changed what the float model computes: {module} ({describe_change(rel)} on the "
                "example batch) and no fold or layer conversion explains it; please report this"
            )
        kind, what = culprit
        if kind == "fold":
            bn = what
            cause = (
                f"folding BatchNorm {bn} into {folded[bn]} changed {module} ({describe_change(rel)}); left "
                "unfolded"
            )
            unfold(model, report.batchnorm, bn, "folding it changed the float output (float check)")
            del folded[bn]
            reverted.append({"kind": "fold", "layer": bn, "cause": cause})
        else:
            layer = layers.pop(what)
            cause = f"quantizing {what} changed {module} ({describe_change(rel)}); left float"
            if computed.is_computed(layer):
                computed.unconvert(model, layer)
                report.computed.remove(what)
            else:
                layer.__class__ = originals[what]
            _remove_quantizers(layer)
            report.layers.remove(what)
            report.float_layers.append(
                {"name": what, "type": type(layer).__name__, "reason": f"float check: {cause}"}
            )
            reverted.append({"kind": "layer", "layer": what, "cause": cause})


def _culprit(module: str, folded: dict[str, str], layers: dict[str, nn.Module], report) -> tuple | None:
    """The transformation to undo for a change first seen at ``module``: the fold whose BatchNorm (now an
    identity computing the folded layer's output) or layer it is, or the converted layer it is. A change first
    seen at a module that holds them (its children's outputs unchanged) is none of theirs."""
    for bn, layer in folded.items():
        if module in (bn, layer):
            return ("fold", bn)
    return ("layer", module) if module in layers else None


def _check_placement(
    model: nn.Module, example: Mapping[str, torch.Tensor], reference: dict[str, Fingerprint], report
) -> None:
    """The placement's rewrites (residual quantizers in a block's ``forward``, quantizers moved before a
    padding or after a ReLU) compute, quantizers off, what the model as loaded computes."""
    folds = ((f.layer, f.batchnorm) for f in report.batchnorm.folded)
    skip = fold_changes(reference, folds) | set(report.float_check.get("unstable", ()))
    diffs = differences(reference, capture(model, example, reference), skip)
    if diffs:
        module, rel = diffs[0]
        raise TransformationError(
            f"quantcli's placement changed what the float model computes: {module} ({describe_change(rel)} "
            "on the example batch); calibrate with --target tensorrt or a config that leaves its layers "
            "float, and please report this"
        )


def _recurrent(
    name: str, module: nn.Module, cfg: QuantConfig, report: QuantizeReport, used: set[int]
) -> bool:
    """Convert an LSTM into a :class:`~quantcli.nn.recurrent.QuantLSTM` (True), or report why a recurrent
    module stays float (False)."""
    why = recurrent_float_reason(module, cfg.target)
    if why is None:
        _, desc, _ = cfg.resolve(
            _qname(f"{name}.l0" if name else "l0", "weight"), "weight", WeightView(module)
        )
        why = lstm_weight_format_reason(desc)
    if why is not None:
        report.float_layers.append({"name": name, "type": type(module).__name__, "reason": why})
        return False

    def resolve(path: str):
        qname = f"{name}.{path}" if name else path
        enabled, desc, matched = cfg.resolve(qname, "weight", WeightView(module))
        used.update(matched)
        return enabled, desc, qname

    convert_lstm(module, resolve)
    return True


def _qname(layer: str, kind: str) -> str:
    return f"{layer}.{kind}_quantizer" if layer else f"{kind}_quantizer"


def _integer8_desc(d: QuantDescriptor) -> bool:
    return not d.is_fp8 and not d.dynamic and not d.block_sizes and d.num_bits <= 8


def _unsigned_when(nonnegative: bool, desc: QuantDescriptor) -> QuantDescriptor:
    """``desc`` on the uint8 grid when its tensor is >= 0 by construction and ``desc`` is a symmetric
    per-tensor 8-bit integer format (a rule that asks for something else keeps it)."""
    if (
        nonnegative
        and _integer8_desc(desc)
        and not desc.unsigned
        and not desc.asymmetric
        and desc.axis is None
    ):
        return QuantDescriptor(**{**desc.dict(), "unsigned": True})
    return desc


def _integer8(q: TensorQuantizer) -> bool:
    d = q.desc
    return q.enabled and not d.is_fp8 and not d.dynamic and q._block is None and d.num_bits <= 8


def _place_for_onnxruntime(
    model: nn.Module,
    cfg: QuantConfig,
    layers: dict[str, nn.Module],
    own_grid: set[str],
    report: QuantizeReport,
    example: Mapping[str, torch.Tensor] | None,
) -> set[int]:
    """Unsigned post-ReLU inputs, output quantizers, int32 biases; returns the indices of rules that
    matched."""
    used: set[int] = set()
    placement, graph = analyse(
        model,
        layers,
        cfg.target,
        {n: m.input_quantizer.enabled and not m.input_quantizer.desc.dynamic for n, m in layers.items()},
        {n: _integer8(m.weight_quantizer) for n, m in layers.items()},
        example,
        activations=not getattr(cfg, "legacy_activations", False),
        functional_pools=not getattr(cfg, "legacy_functional_pools", False),
    )
    for name in list(placement.unsigned_inputs):
        q = layers[name].input_quantizer
        d = q.desc
        if name in own_grid or not _integer8(q) or d.unsigned or d.asymmetric or d.axis is not None:
            placement.unsigned_inputs.remove(name)
            continue
        q.desc = QuantDescriptor(**{**d.dict(), "unsigned": True})
    modules = dict(model.named_modules())
    # the exported node of a hook-run quantizer is named after the hook module's parent: one per parent
    parents = [a.rsplit(".", 1)[0] if "." in a else "" for a, _ in placement.output_after.values()]
    placement.output_after = {
        k: v
        for k, v in placement.output_after.items()
        if parents.count(v[0].rsplit(".", 1)[0] if "." in v[0] else "") == 1
    }
    for name in placement.output_quantized:
        module = layers[name]
        qname = _qname(name, "output")
        enabled, desc, matched = cfg.resolve(qname, "input", module)
        used.update(matched)
        after = placement.output_after.get(name)
        if after is not None and not _grid_chosen(cfg, matched):
            desc = _unsigned_when(after[1], desc)  # after a ReLU: >= 0
        module.add_module("output_quantizer", TensorQuantizer(desc, name=qname, enabled=enabled))
        if after is not None:
            apply_output_quantizer_after(modules[after[0]], module)
    for name, pad in placement.input_before.items():
        apply_input_quantizer_before(modules[pad], layers[name])

    def activation_quantizer(qname: str, module: nn.Module, unsigned: bool) -> TensorQuantizer:
        """A quantizer the placement adds beside the layers' own: the config's input settings for ``qname``,
        on the uint8 grid where its tensor is >= 0."""
        enabled, desc, matched = cfg.resolve(qname, "input", module)
        used.update(matched)
        return TensorQuantizer(_unsigned_when(unsigned, desc), name=qname, enabled=enabled)

    for name, unsigned in list(placement.pool_inputs.items()):
        pool = modules[name]
        if type(pool) not in QUANT_POOL_CLASSES:  # a subclass with its own forward: left in float
            del placement.pool_inputs[name]
            continue
        quantizer = activation_quantizer(_qname(name, "input"), pool, unsigned)
        pool.__class__ = QUANT_POOL_CLASSES[type(pool)]
        pool.add_module("input_quantizer", quantizer)
    if placement.qlinear_adds:

        def make(qname: str, conv: nn.Module, skip) -> TensorQuantizer:
            return activation_quantizer(qname, conv, nonnegative(skip, modules))

        placement.residual_quantized, placement.residual_untraced = insert_residual_quantizers(
            model, layers, graph, make, only=placement.qlinear_adds
        )
    by_node: dict = {}
    if placement.qlinear_activations:

        def make_activation(qname: str, unsigned: bool) -> TensorQuantizer:
            return activation_quantizer(qname, modules.get(owner(qname), model), unsigned)

        by_node = insert_activation_quantizers(model, graph, placement.qlinear_activations, make_activation)
        placement.activation_quantized = [q for qs in by_node.values() for q in qs]
    for nodes, around in placement.activation_chains:
        qs = [q for n in nodes for q in by_node.get(n, [])]
        qs += [
            _qname(n.target, "input")
            for n in nodes
            if n.op == "call_module" and n.target in placement.pool_inputs
        ]
        if qs:
            placement.activation_groups.append({"quantizers": qs, "layers": around})
    # graph nodes, linked to the whole recorded graph: not kept in the report the model carries (a deep copy
    # of the model would follow every link)
    placement.qlinear_adds = {}
    placement.qlinear_activations = {}
    placement.activation_chains = []
    for module in layers.values():
        # QLinearConv and QGemm take an int32 bias; onnxruntime has no CPU QDQ rule for ConvTranspose
        if not isinstance(module, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)) and getattr(
            module, "takes_int32_bias", True
        ):
            module.int32_bias = True
    report.placement = placement
    if cfg.activations_asymmetric:
        placement.asymmetric = _asymmetric_activations(model, cfg, used)
    return used


def _asymmetric_activations(model: nn.Module, cfg: QuantConfig, used: set[int]) -> list[str]:
    """Put every signed 8-bit per-tensor activation quantizer whose grid no rule chose on uint8 with a zero
    point (the config's ``asymmetric_activations``); returns their names. Runs after the placement, so the
    quantizers it added are included and those it put on the unsigned grid (>= 0 by construction) keep it."""
    done = []
    for name, q in model.named_modules():
        if not isinstance(q, TensorQuantizer) or name.endswith("weight_quantizer"):
            continue
        d = q.desc
        if not _integer8_desc(d) or d.num_bits != 8 or d.unsigned or d.asymmetric or d.axis is not None:
            continue
        rules = cfg.matching_rules(q.name or name)
        if _grid_chosen(cfg, rules):
            continue
        used.update(rules)
        q.desc = QuantDescriptor(**{**d.dict(), "asymmetric": True})
        done.append(q.name or name)
    return done


def _place_for_tensorrt(
    model: nn.Module,
    cfg: QuantConfig,
    layers: dict[str, nn.Module],
    report: QuantizeReport,
    example: Mapping[str, torch.Tensor] | None,
) -> set[int]:
    """NVIDIA's placement: the per-layer quantizers plus the skip inputs of residual Adds."""
    used: set[int] = set()
    placement, graph = analyse(model, layers, cfg.target, {}, {}, example)
    if placement.analysed:

        def make(qname: str, conv: nn.Module, skip=None) -> TensorQuantizer:
            enabled, desc, matched = cfg.resolve(qname, "input", conv)
            used.update(matched)
            return TensorQuantizer(desc, name=qname, enabled=enabled)

        placement.residual_quantized, placement.residual_untraced = insert_residual_quantizers(
            model, layers, graph, make
        )
    report.placement = placement
    return used
