"""Latency-aware placement for onnxruntime: keep in float the layers that would not run faster quantized on
the CPU that deploys, decided from what onnxruntime fuses and a measured table of its kernels, not from a
stopwatch.

A quantized layer is worth its Q/DQ only where onnxruntime runs it as an integer kernel that beats the float
one. Three steps, none of them timed, so the same model gets the same decisions on every call:

1. what onnxruntime fuses: the calibrated model is exported (int8, default exporter and opset) and loaded the
   way a user loads it (:func:`exporters.onnxruntime.fusion.inspect_fusion`); a layer it runs in float between
   its Q/DQ is slower than float, whatever the CPU;
2. how fast the fused kernel is on the deployment CPU (``--cpu``, :mod:`quantcli.quant.cpu`): the int8/float
   ratio of the nearest row of that CPU kind's measured table (:mod:`exporters.onnxruntime.kernel_costs`,
   ``python -m benchmarks.bench_kernel_costs``) for the layer's shape (:func:`layer_shapes`, one forward
   pass on the example batch); a layer more than :data:`MARGIN` slower quantized stays float
(:func:`decide`, pure); 3. neighbours: a float layer must not cost the layers around it their integer
   kernels (a Conv whose output Q is gone when the layer it feeds turns float). The graph with the float
   choices is exported and inspected again; where a layer fused before is not any more, the float choices
   made for speed go back to quantized, and if that is not enough, every choice does
   (:func:`keep_neighbours`). A layer beside a sigmoid/multiplication chain run on codes is not kept float
   for speed at all (:func:`keep_chains`): the chain would go float with it. Where every layer kept float is
   a stem (it reads a graph input, and its input and weight quantizers feed it alone: :func:`is_stem`), those
   two go, its output's stay, no neighbour can lose anything, and the graph is not exported again. The
   chosen graph is then never slower than ``--placement all``'s by more than the table's error.

Layers placement has nothing to decide for (weight-only INT4, float8, other widths) are left as configured
with no export at all, so an INT4 weight-only calibration of an LLM spends nothing here.

:func:`measure_and_decide` returns a :class:`LatencyPlacement` and changes nothing; :func:`apply` switches the
chosen layers' quantizers off for good (:func:`quantcli.nn.modes.keep_float`), as mixed precision does, so
that the checkpoint, export and verify follow the choice.
"""

from __future__ import annotations

import copy
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import onnx
import torch
from torch import nn

from exporters.graph import consumer_map, quantizer_map
from exporters.onnx_export import export_onnx
from exporters.onnxruntime import kernel_costs
from exporters.onnxruntime.fusion import FusionReport, inspect_fusion
from exporters.onnxruntime.kernel_costs import (
    CONV,
    DEPTHWISE,
    GEMM,
    STEM,
    STEM_CHANNELS,
    LayerShape,
    Prediction,
)
from exporters.onnxruntime.placement import COMMUTING_OPS
from quantcli.errors import ConfigError, ExportError, first_line
from quantcli.inputs.data import Batch, run_model
from quantcli.nn.modes import keep_float
from quantcli.nn.tensor_quantizer import owner, quantizers, role
from quantcli.quant import u8s8

#: a fused layer stays float when the table predicts its int8 kernel more than this fraction slower than
#: float: the table's rows are medians of interleaved runs on a loaded 2-core machine, whose ratios moved by
#: up to 0.2 between runs; a layer within that band loses little by staying quantized, and a float layer
#: between quantized ones brings Q/DQ of its own
MARGIN = 0.25

QUANTIZED, FLOAT = "quantized", "float"


@dataclass
class LayerCost:
    """What placement found for one quantized layer (input of :func:`decide`)."""

    layer: str
    kernel: str | None  # the op type onnxruntime runs the quantized layer as
    fused: bool | None  # an integer kernel (None: not found in onnxruntime's graph)
    prediction: Prediction | None  # the table's int8/float ratio for its shape on the deployment CPU
    quantizers: list[str] = field(default_factory=list)  # the layer's quantizers (input, weight, output)
    not_applicable: str | None = None  # why the layer is left as configured, whatever it costs
    calls: str = ""  # a module called several times: how many of its calls onnxruntime runs in float


@dataclass
class LayerDecision:
    layer: str
    kernel: str | None
    ratio: float | None  # the predicted int8/float time, where the table has one
    decision: str  # "quantized" or "float"
    reason: str
    quantizers: list[str] = field(default_factory=list)
    fused: bool | None = None  # what onnxruntime made of the quantized layer
    applicable: bool = True  # False: float8, weight-only, not 8-bit: left as configured whatever it costs

    def to_dict(self) -> dict:
        return {
            "layer": self.layer,
            "kernel": self.kernel,
            "ratio": None if self.ratio is None else round(self.ratio, 3),
            "decision": self.decision,
            "reason": self.reason,
        }


@dataclass
class LatencyPlacement:
    """The placement's outcome: per layer, quantized or float and why; or why nothing was decided."""

    mode: str  # "auto" or "all"
    measured: bool
    note: str = ""  # why not decided, or from what
    layers: list[LayerDecision] = field(default_factory=list)
    margin: float = MARGIN
    seconds: float = 0.0  # exporting and inspecting
    cpu: str | None = None  # the deployment CPU the table was read for
    quantizers_disabled: list[str] = field(default_factory=list)  # filled by apply()

    @property
    def kept_float(self) -> list[str]:
        return [d.layer for d in self.layers if d.decision == FLOAT]

    @property
    def text(self) -> str:
        if not self.measured:
            return self.note
        kept = self.kept_float
        text = f"{len(kept)} of {len(self.layers)} layers kept float ({self.seconds:.1f} s, {self.note})"
        if kept:
            groups: dict[str, list[str]] = {}
            for d in self.layers:
                if d.decision == FLOAT:
                    groups.setdefault(_reason_kind(d.reason), []).append(d.layer)
            text += ": " + "; ".join(f"{_shown(names)} ({why})" for why, names in groups.items())
        return text

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "measured": self.measured,
            "note": self.note,
            "margin": self.margin,
            "seconds": round(self.seconds, 3),
            "cpu": self.cpu,
            "kept_float": self.kept_float,
            "quantizers_disabled": list(self.quantizers_disabled),
            "layers": [d.to_dict() for d in self.layers],
            "text": self.text,
        }


def _reason_kind(reason: str) -> str:
    """A float decision's reason without its per-layer figures (the summary says each kind once)."""
    return reason.split(":", 1)[0]


def _shown(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


# ------------------------------------------------------------------------------------------- the decision

UNFUSED = "onnxruntime runs it in float between Q/DQ"
SLOWER = "its integer kernel is slower on this CPU kind"


def decide(costs: list[LayerCost], margin: float = MARGIN) -> list[LayerDecision]:
    """Per layer: float when onnxruntime does not fuse it, or when the table predicts its int8 kernel more
    than ``margin`` (a fraction) slower than float; quantized otherwise, also when nothing predicts it."""
    out = []
    for c in costs:
        ratio = c.prediction.ratio if c.prediction is not None else None
        decision, reason = QUANTIZED, ""
        if c.not_applicable:
            reason = c.not_applicable
        elif c.fused is False:
            calls = f" ({c.calls})" if c.calls else ""
            decision, reason = FLOAT, f"{UNFUSED}: {c.kernel or 'not loaded'}{calls}"
        elif c.fused is None:
            reason = "not found in onnxruntime's optimized graph: left quantized"
        elif c.prediction is None:
            reason = f"{c.kernel}; no kernel-cost table row for it on this CPU kind: left quantized"
        elif ratio > 1 + margin:
            decision, reason = FLOAT, f"{SLOWER}: {c.kernel} {c.prediction.describe()}"
        else:
            reason = f"{c.kernel} {c.prediction.describe()}"
        out.append(
            LayerDecision(
                c.layer,
                c.kernel,
                ratio,
                decision,
                reason,
                list(c.quantizers),
                c.fused,
                c.not_applicable is None,
            )
        )
    return out


def _requantized(d: LayerDecision, why: str) -> LayerDecision:
    return LayerDecision(
        d.layer,
        d.kernel,
        d.ratio,
        QUANTIZED,
        f"{d.reason}; quantized all the same: {why}",
        d.quantizers,
        d.fused,
    )


#: a float layer whose input quantizer stays on (the layer before it needs that Q for its integer kernel)
INPUT_KEPT = "its input stays quantized: the layer before it needs that Q for its integer kernel"


def keep_neighbours(
    decisions: list[LayerDecision], fused_after: Callable[[set[str], bool], dict[str, bool | None]]
) -> list[LayerDecision]:
    """Step 3: the decisions with no float layer costing another its integer kernel.

    ``fused_after(floats, keep_inputs) -> {layer: fused}`` is what onnxruntime fuses with the layers
    ``floats`` kept float (``keep_inputs``: their input quantizers left on, so that the layer before each
    keeps the Q on its output that its integer kernel needs); a float layer it maps to True is one onnxruntime
    quantizes itself (between a DQ and a Q: :func:`exporters.onnxruntime.fusion.runtime_quantized_layers`),
    so that choice is not float. Tried in order: every float choice, then the same with their inputs kept,
    then only the layers onnxruntime does not fuse (both ways), then none."""
    fused_before = {d.layer for d in decisions if d.fused}
    floats = [d for d in decisions if d.decision == FLOAT]
    every = frozenset(d.layer for d in floats)
    unfused = frozenset(d.layer for d in floats if not d.fused)
    tries = [(every, False), (every, True), (unfused, False), (unfused, True)]
    # (each choice is tried as a group: what the group costs is not what each layer alone would)
    group = f"keeping {_shown(sorted(every))} float together" if len(every) > 1 else "keeping it float"
    first_lost: list[str] = []
    first_requantized: list[str] = []
    for chosen, keep_inputs in dict.fromkeys(t for t in tries if t[0]):
        now = fused_after(set(chosen), keep_inputs)
        lost = sorted(layer for layer in fused_before - chosen if now.get(layer) is False)
        # a float layer between a DQ and a Q gets onnxruntime's own per-tensor int8 weights: not float at all
        requantized = sorted(layer for layer in chosen if now.get(layer) is True)
        if not lost and not requantized:
            # the loss was the first try's, of the whole group: a layer the group needed does not cause it
            # alone (a stem was said to cost a U-Net's decoder convs their kernels, which its transposed
            # convolutions' inputs did)
            why = f"{group} would cost {_shown(first_lost)} their integer kernel(s)"
            if first_requantized and not first_lost:
                why = RUNTIME_QUANTIZES
            return [_chosen(d, chosen, keep_inputs, why) for d in decisions]
        first_lost = first_lost or lost
        first_requantized = first_requantized or requantized
    if not first_lost and not first_requantized:
        return decisions
    why = RUNTIME_QUANTIZES
    if first_lost:
        why = f"{group} would cost {_shown(first_lost)} their integer kernel(s)"
    return [_requantized(d, why) if d.decision == FLOAT else d for d in decisions]


#: why a float choice went back to quantized: onnxruntime would quantize the float layer itself
RUNTIME_QUANTIZES = (
    "kept float between its neighbours' Q/DQ, onnxruntime would quantize it itself with coarser per-tensor "
    "int8 weights (WeightBiasQuantization)"
)


def _chosen(d: LayerDecision, chosen: frozenset[str], keep_inputs: bool, why: str) -> LayerDecision:
    """``d`` as the choice ``chosen`` (``keep_inputs``: float layers keep their input quantizer) has it."""
    if d.decision != FLOAT:
        return d
    if d.layer not in chosen:
        return _requantized(d, why)
    if not keep_inputs:
        return d
    kept = [q for q in d.quantizers if role(q) != "input_quantizer"]
    return LayerDecision(
        d.layer, d.kernel, d.ratio, FLOAT, f"{d.reason}; {INPUT_KEPT}", kept, d.fused, d.applicable
    )


def keep_chains(decisions: list[LayerDecision], groups: list[dict]) -> list[LayerDecision]:
    """Step 3 for the operations between layers: a layer kept float for speed goes back to quantized where it
    borders a chain of sigmoids, multiplications or global poolings run on codes (``groups``: the structural
    placement's ``activation_groups``, each ``{"quantizers", "layers"}``). Kept float, it would break the
    chain, whose ``QLinearSigmoid``/``QLinearMul``/``QLinearGlobalAveragePool`` kernels then run in float
    between new Q/DQ pairs (:func:`apply`): the table's ratio is of the layer alone, and on MobileViT's SiLU
    blocks the graph with three such layers float ran 1.08x ``--placement all``'s. A layer onnxruntime does
    not fuse stays float: its chain is in float whatever is decided."""
    bordering = {layer for g in groups for layer in g.get("layers", ())}
    why = "keeping it float would cost the sigmoid/multiplication chain beside it its integer kernels"
    return [
        _requantized(d, why) if d.decision == FLOAT and d.fused and d.layer in bordering else d
        for d in decisions
    ]


#: ops a layer's output passes through, one reader each, before the MaxPool :func:`keep_pools` looks for
_TO_POOL = ("Relu", "Clip", "QuantizeLinear", "DequantizeLinear")
#: and after it, to the quantizers of the layers that read it
_AFTER_POOL = ("QuantizeLinear", "DequantizeLinear", *COMMUTING_OPS)


def maxpool_readers(graph: onnx.ModelProto, node: str) -> set[str]:
    """The layers whose quantizers read, through a QuantizeLinear, the MaxPool that node ``node``'s output of
    the int8 ``graph`` reaches through Relu/Clip and Q/DQ read by one node each; empty where it reaches
    none."""
    by_name = {n.name: n for n in graph.graph.node}
    consumers = consumer_map(graph)
    named = quantizer_map(graph)
    n = by_name.get(node)
    while n is not None and n.output:
        readers = consumers.get(n.output[0], [])
        if len(readers) != 1:
            return set()
        n = readers[0]
        if n.op_type == "MaxPool":  # its readers' quantizers, through Q/DQ copies and reshapes
            found, stack, quantized = set(), list(consumers.get(n.output[0], [])), False
            while stack:
                r = stack.pop()
                if r.op_type not in _AFTER_POOL or not r.output:
                    continue
                quantized = quantized or r.op_type == "QuantizeLinear"
                if r.op_type == "DequantizeLinear" and r.output[0] in named:
                    found.add(owner(named[r.output[0]]))
                else:
                    stack.extend(consumers.get(r.output[0], []))
            return found if quantized else set()
        if n.op_type not in _TO_POOL:
            return set()
    return set()


def keep_pools(decisions: list[LayerDecision], report: FusionReport) -> list[LayerDecision]:
    """``decisions`` with a layer kept float for speed quantized again where its output goes to a MaxPool
    before the Q of a layer that stays quantized (:func:`maxpool_readers`): onnxruntime moves that Q above the
    MaxPool (its QDQ propagation), which then runs on uint8 in NCHW layout instead of its NHWC kernel after
    a ``QLinearConv``. A stem kept float before a MaxPool made the graph 5.3x float at batch 32 on an AVX-512
    VNNI CPU (the MaxPool 380 us against 14 us quantized and 6 us in float), against 2.2x with the stem
    quantized."""
    floats = {d.layer for d in decisions if d.decision == FLOAT}
    fused = [d.layer for d in decisions if d.decision == FLOAT and d.fused]  # kept float for speed
    if not fused:
        return decisions
    graph = report.graph()
    nodes = {lf.layer: lf.node for lf in report.layers}
    pooled = {layer for layer in fused if layer in nodes and maxpool_readers(graph, nodes[layer]) - floats}
    why = "keeping it float would run the MaxPool after it on uint8 codes in NCHW layout"
    return [_requantized(d, why) if d.layer in pooled else d for d in decisions]


_OWN = ("input_quantizer", "weight_quantizer")

#: a stem kept float (:func:`as_stems`): its other quantizers (the Q on its output) stay on
OUTPUT_KEPT = "its output stays quantized, as the graph after it reads it"


def is_stem(graph: onnx.ModelProto, node: str, quantizers: list[str]) -> bool:
    """Whether the layer run by ``node`` of the exported int8 ``graph`` reads a graph input through its input
    quantizer and its input and weight quantizers (among ``quantizers``) feed that node alone. Kept float with
    those two off and the others (its output's) on, it takes no Q or DQ from any other node: no neighbour
    can lose its integer kernel, and placement need not export the graph again to find out
    (:func:`keep_neighbours`). A DQ that feeds another node too (a shared input or weight), or an input Q that
    reads anything but a graph input: not a stem."""
    own = {q for q in quantizers if role(q) in _OWN}
    producers = {o: n for n in graph.graph.node for o in n.output}
    consumers: dict[str, set[str]] = {}
    for n in graph.graph.node:
        for i in n.input:
            consumers.setdefault(i, set()).add(n.name)
    inputs = {i.name for i in graph.graph.input}
    reads_input = False
    for dq_out, q in quantizer_map(graph).items():
        if q not in own:
            continue
        if consumers.get(dq_out, set()) - {node}:
            return False  # the DQ serves another node too
        if role(q) == "input_quantizer":
            dq = producers.get(dq_out)
            quantize = producers.get(dq.input[0]) if dq is not None else None
            if quantize is None or quantize.op_type != "QuantizeLinear" or quantize.input[0] not in inputs:
                return False
            reads_input = True
    return reads_input


def stem_layers(decisions: list[LayerDecision], report: FusionReport) -> set[str]:
    """The layers ``decisions`` keep float that are stems (:func:`is_stem` in the graph ``report``
    inspected)."""
    floats = [d for d in decisions if d.decision == FLOAT]
    if not floats:
        return set()
    graph = report.graph()
    nodes = {lf.layer: lf.node for lf in report.layers}
    return {d.layer for d in floats if d.layer in nodes and is_stem(graph, nodes[d.layer], d.quantizers)}


def _outputs_kept(decisions: list[LayerDecision]) -> list[LayerDecision]:
    """``decisions`` with each float layer's quantizers cut to its input and weight ones
    (:data:`OUTPUT_KEPT`)."""
    out = []
    for d in decisions:
        if d.decision == FLOAT and any(role(q) not in _OWN for q in d.quantizers):
            own = [q for q in d.quantizers if role(q) in _OWN]
            d = replace(d, reason=f"{d.reason}; {OUTPUT_KEPT}", quantizers=own)
        out.append(d)
    return out


def as_stems(decisions: list[LayerDecision], report: FusionReport) -> list[LayerDecision] | None:
    """``decisions`` with every layer kept float a stem (:func:`stem_layers`): only its input and weight
    quantizers go, the others stay on (:data:`OUTPUT_KEPT`). None where some layer kept float is not a stem,
    or none is kept float."""
    floats = {d.layer for d in decisions if d.decision == FLOAT}
    if not floats or stem_layers(decisions, report) != floats:
        return None
    return _outputs_kept(decisions)


def stems_alone(
    after: list[LayerDecision], before: list[LayerDecision], report: FusionReport
) -> list[LayerDecision]:
    """Where the neighbours' check (:func:`keep_neighbours`, ``before`` -> ``after``) quantized every layer
    again, the stems among ``before``'s float choices kept float on their own (as :func:`as_stems` keeps
    them: they cost no neighbour anything), the others as ``after`` has them. On MobileNetV2 a float
    depthwise conv beside the float stem cost the 1x1 convs their kernels, and the stem went back with it."""
    if any(d.decision == FLOAT for d in after):
        return _stem_inputs_off(after, before, report)
    stems = stem_layers(before, report)
    if not stems:
        return after
    chosen = {d.layer: d for d in before if d.layer in stems}
    return _outputs_kept([chosen.get(d.layer, d) for d in after])


def _stem_inputs_off(
    after: list[LayerDecision], before: list[LayerDecision], report: FusionReport
) -> list[LayerDecision]:
    """``after`` with the stems whose input quantizer the neighbours' check kept (:data:`INPUT_KEPT`, for the
    layers before the others it keeps float) given it back: a stem's input is a graph input, no layer before
    it needs that Q, and its DQ feeds the stem alone (:func:`is_stem`)."""
    kept = [d for d in after if d.decision == FLOAT and d.reason.endswith(INPUT_KEPT)]
    stems = stem_layers(before, report) & {d.layer for d in kept} if kept else set()
    if not stems:
        return after
    inputs = {d.layer: [q for q in d.quantizers if role(q) == "input_quantizer"] for d in before}
    return [
        replace(
            d, reason=d.reason.removesuffix(f"; {INPUT_KEPT}"), quantizers=[*inputs[d.layer], *d.quantizers]
        )
        if d.layer in stems
        else d
        for d in after
    ]


# ------------------------------------------------------------------------------------------- measuring


RECURRENT = (
    "a dynamic int8 LSTM (DynamicQuantizeLSTM: its activations quantized at run time, at every step); "
    "left as configured"
)


def _not_applicable(modules: dict[str, nn.Module], layer: str) -> str | None:
    """Why a layer is left as configured: placement weighs 8-bit integer layers (input and weight
    quantized)."""
    m = modules.get(layer)
    # an LSTM's layers are lstm.l0, lstm.l1 (one DynamicQuantizeLSTM each, holding its weight quantizers)
    if isinstance(m, nn.RNNBase) or isinstance(modules.get(owner(layer)), nn.RNNBase):
        return RECURRENT
    if m is None:
        return "not mapped to a module of the model: left quantized"
    qi, qw = getattr(m, "input_quantizer", None), getattr(m, "weight_quantizer", None)
    on = [q for q in (qi, qw) if q is not None and q.enabled]
    if any(q.desc.is_fp8 for q in on):
        return "float8: onnxruntime has no float8 kernel; left as configured"
    if qi is None or not qi.enabled:
        return "weight-only: quantized for size, not speed; left as configured"
    if any(q.desc.num_bits not in (7, 8) for q in on):
        return "not an 8-bit layer; left as configured"
    return None


def placed_layers(model: nn.Module) -> list[str]:
    """The layers placement (and the target search's fusion check) decides for: quantized modules it finds
    applicable."""
    modules = dict(model.named_modules())
    return [
        n
        for n, m in modules.items()
        if getattr(m, "input_quantizer", None) is not None
        and getattr(m, "weight_quantizer", None) is not None
        and (m.input_quantizer.enabled or m.weight_quantizer.enabled)
        and _not_applicable(modules, n) is None
    ]


def _layer_quantizers(model: nn.Module, layer: str) -> list[str]:
    """The enabled quantizers of module ``layer`` (input, weight, output), by their model-wide names."""
    return [n for n, q in quantizers(model).items() if owner(n) == layer and q.enabled]


def layer_shape(module: nn.Module, output: torch.Tensor) -> LayerShape:
    """A quantized layer's kernel shape (:class:`exporters.onnxruntime.kernel_costs.LayerShape`) from the
    module and one output of it."""
    w = module.weight
    if w.dim() > 2:  # a convolution: (Cout, Cin/groups, *k), or transposed (Cin, Cout/groups, *k)
        groups = getattr(module, "groups", 1)
        cin = getattr(module, "in_channels", w.shape[1] * groups)
        cout = getattr(module, "out_channels", w.shape[0])
        return _conv_shape(w, groups, cin, cout, output)
    out_features = output.shape[-1]
    in_features = w.shape[1] if w.shape[0] == out_features else w.shape[0]
    return _gemm_shape(in_features, out_features, output)


def op_shape(kind: str, args: tuple, kwargs: dict, output: torch.Tensor) -> LayerShape | None:
    """The kernel shape of one weighted operation a computed layer ran (:mod:`quantcli.nn.computed`: its
    ``kind``, call arguments and output): of the operand it took, which may be a slice of the layer's
    weight, in whichever module's ``forward`` it ran."""
    from quantcli.nn.computed import operands

    _, w, _ = operands(kind, args, kwargs)
    if not isinstance(w, torch.Tensor) or not isinstance(output, torch.Tensor):
        return None
    if kind in ("conv", "conv_transpose"):
        groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
        if kind == "conv_transpose":  # (Cin, Cout/groups, *k)
            return _conv_shape(w, groups, w.shape[0], w.shape[1] * groups, output)
        return _conv_shape(w, groups, w.shape[1] * groups, w.shape[0], output)
    if kind == "linear":  # (out, in)
        return _gemm_shape(w.shape[-1], w.shape[0], output)
    return _gemm_shape(w.shape[0], w.shape[-1], output)  # x @ W: (in, out)


def _conv_shape(w: torch.Tensor, groups: int, cin: int, cout: int, output: torch.Tensor) -> LayerShape:
    kernel = math.prod(w.shape[2:])
    positions = math.prod(output.shape[2:]) if output.dim() > 2 else 1
    if u8s8.is_depthwise(cin, cout, groups):
        return LayerShape(DEPTHWISE, kernel, cout, positions)
    if groups == 1 and cin <= STEM_CHANNELS and w.shape[0] == cout:  # not transposed
        return LayerShape(STEM, cin * kernel, cout, positions)
    return LayerShape(CONV, cin // groups * kernel, cout, positions)


def _gemm_shape(in_features: int, out_features: int, output: torch.Tensor) -> LayerShape:
    positions = math.prod(output.shape[1:-1]) if output.dim() > 2 else 1
    return LayerShape(GEMM, in_features, out_features, positions)


def layer_shapes(model: nn.Module, example: Batch, layers: list[str]) -> dict[str, LayerShape]:
    """Each layer's kernel shape, from one forward pass on ``example`` (a layer that does not run has
    none). A computed layer whose own ``forward`` never runs (a parent's ``forward`` convolving with a slice
    of its weight) has that of the first operation it ran, of the operand it took."""
    from quantcli.nn.computed import OP_OBSERVERS, ComputedLayer, weighted_kind

    modules = dict(model.named_modules())
    shapes: dict[str, LayerShape] = {}
    ran: dict[str, LayerShape] = {}  # computed layers, by the operations they ran
    wanted = {id(modules[n]): n for n in layers if n in modules and isinstance(modules[n], ComputedLayer)}

    def observe(layer, func, args, kwargs, out):
        name = wanted.get(id(layer))
        found = weighted_kind(func)
        if name is not None and name not in ran and found is not None:
            shape = op_shape(found[0], args, kwargs, out)
            if shape is not None:
                ran[name] = shape
        return out

    def hook(name):
        def record(module, args, kwargs, output):
            if name in shapes:
                return
            if isinstance(module, nn.MultiheadAttention):  # its in-projection: (tuple output, no .weight)
                query = args[0] if args else kwargs.get("query")
                if isinstance(query, torch.Tensor) and query.dim() == 3:
                    positions = query.shape[1 if module.batch_first else 0]
                    e = module.embed_dim
                    shapes[name] = LayerShape(GEMM, e, 3 * e, positions)
                    # its out_proj's weight is read by the functional attention, never called as a module
                    shapes.setdefault(
                        f"{name}.out_proj" if name else "out_proj", LayerShape(GEMM, e, e, positions)
                    )
            elif isinstance(output, torch.Tensor) and hasattr(module, "weight"):
                shapes[name] = layer_shape(module, output)

        return record

    handles = [modules[n].register_forward_hook(hook(n), with_kwargs=True) for n in layers if n in modules]
    OP_OBSERVERS.append(observe)
    try:
        with torch.inference_mode():
            run_model(model, example, "the example batch")
    finally:
        OP_OBSERVERS.remove(observe)
        for h in handles:
            h.remove()
    for name, shape in ran.items():
        shapes.setdefault(name, shape)
    return shapes


def fusion_probe(
    model: nn.Module, example: Batch, workdir: Path, exporters: list[str] | None = None
) -> Callable[[set[str]], dict[str, bool | None]]:
    """``probe(off) -> {layer: fused}``: what onnxruntime fuses, per module, in the int8 export of a copy of
    ``model`` with the quantizers ``off`` switched off (the model itself is not changed); a float layer
    onnxruntime quantizes itself (between a DQ and a Q: its own per-tensor int8 weights,
    :func:`exporters.onnxruntime.fusion.runtime_quantized_layers`) maps to True. The graphs go to
    ``workdir``; ``exporters``: see :func:`_fusion`."""
    modules = dict(model.named_modules())
    exporters = list(EXPORTERS) if exporters is None else exporters
    count = iter(range(1, 1 << 30))

    def probe(off: set[str]) -> dict[str, bool | None]:
        plain = copy.deepcopy(model)
        qs = quantizers(plain)
        for name in off:
            if name in qs:
                keep_float(qs[name])
        rep = _fusion(plain, example, workdir, f"float{next(count)}", exporters)
        now = {m.layer: m.fused for m in module_calls(rep.layers, modules)}
        now.update({m.layer: m.fused for m in module_calls(rep.runtime_quantized, modules)})
        return now

    return probe


#: the exporters placement writes its graphs with, in order: TorchScript (``export``'s default), then dynamo
#: for a model TorchScript cannot export (an operator torch has no TorchScript translation for: nn.RMSNorm,
#: nn.Bilinear), which the user exports with ``--exporter dynamo`` and whose placement is decided all the same
EXPORTERS = ("torchscript", "dynamo")


def _fusion(model: nn.Module, example: Batch, workdir: Path, name: str, exporters: list[str]) -> FusionReport:
    """What onnxruntime fuses in ``model``'s int8 export. ``exporters``: the ones to try, in order; the list
    keeps the first that exports (later graphs of the same model are written with it); where none does, the
    first one's error is raised."""
    path = workdir / f"{name}.onnx"
    first: ExportError | None = None
    for i, exporter in enumerate(exporters):
        try:
            report = export_onnx(model, example, path, exporter=exporter).fusion  # inspected (onnxruntime)
        except ExportError as e:
            first = first or e
            if i == len(exporters) - 1:
                raise first from None
            continue
        del exporters[:i]
        break
    if report is None:
        report = inspect_fusion(path)
    if report.load_error:
        raise RuntimeError(f"onnxruntime does not load the int8 graph: {report.load_error}")
    return report


@dataclass
class ModuleCalls:
    """The graph nodes of one module (several where forward calls it several times: a loop over one block,
    shared layers), as onnxruntime runs them. Its quantizers serve every call, so placement decides for the
    module."""

    layer: str  # the module's name, or the node's where its quantizers name no module
    calls: list  # exporters.onnxruntime.fusion.LayerFusion, one per node

    @property
    def kernel(self) -> str | None:
        kinds = list(dict.fromkeys(c.kernel for c in self.calls if c.kernel is not None))
        return ", ".join(kinds) if kinds else None

    @property
    def fused(self) -> bool | None:
        """False when at least half the calls run in float between their Q/DQ (the shared quantizers cannot
        be switched off for some calls only), None where a call was not found, else True."""
        unfused = sum(c.fused is False for c in self.calls)
        if unfused and 2 * unfused >= len(self.calls):
            return False
        return None if any(c.fused is None for c in self.calls) else True

    @property
    def unfused_calls(self) -> str:
        n = sum(c.fused is False for c in self.calls)
        return f"{n} of {len(self.calls)} calls" if len(self.calls) > 1 else ""


def module_calls(layers: list, modules: dict[str, nn.Module]) -> list[ModuleCalls]:
    """A fusion report's layers grouped by module, in graph order: a layer named after its node (a module
    called several times is named by node, :func:`exporters.onnxruntime.fusion.quantized_layers`) goes to the
    module its input and weight quantizers belong to."""
    grouped: dict[str, ModuleCalls] = {}
    for lf in layers:
        name = lf.layer
        if name not in modules:
            owners = {owner(q) for q in lf.quantizers if role(q) in _OWN}
            if len(owners) == 1 and next(iter(owners)) in modules:
                name = next(iter(owners))
        grouped.setdefault(name, ModuleCalls(name, [])).calls.append(lf)
    return list(grouped.values())


def measure(
    model: nn.Module, example: Batch, cpu: str, workdir: Path, exporters: list[str] | None = None
) -> tuple[list[LayerCost], FusionReport]:
    """Step 1 and 2: what onnxruntime fuses in ``model``'s export, and each layer's predicted kernel ratio on
    ``cpu``. ``exporters``: see :func:`_fusion` (default: :data:`EXPORTERS`). Raises what export or
    onnxruntime raise."""
    report = _fusion(model, example, workdir, "int8", list(EXPORTERS) if exporters is None else exporters)
    modules = dict(model.named_modules())
    layers = module_calls(report.layers, modules)
    shapes = layer_shapes(model, example, [m.layer for m in layers])
    costs = []
    for m in layers:
        shape = shapes.get(m.layer)
        costs.append(
            LayerCost(
                m.layer,
                m.kernel,
                m.fused,
                kernel_costs.predict(cpu, shape) if shape is not None else None,
                _layer_quantizers(model, m.layer),
                _not_applicable(modules, m.layer),
                m.unfused_calls,
            )
        )
    return costs, report


def measure_and_decide(
    model: nn.Module, example: Batch, cpu: str, margin: float = MARGIN
) -> LatencyPlacement:
    """Steps 1-3 for deployment CPU kind ``cpu``; a model with no layer to decide for is not exported, and one
    that does not export or load is not decided (``measured`` False, the reason in ``note``), never an error.
    The model is not changed (see :func:`apply`)."""
    t0 = time.perf_counter()
    if not placed_layers(model):
        return LatencyPlacement(
            "auto",
            False,
            "nothing to decide: no 8-bit integer layer (weight-only, float8 and other widths are left as "
            "configured)",
            margin=margin,
            cpu=cpu,
        )
    table = kernel_costs.table(cpu) if cpu != "any" else None
    source = (
        f"onnxruntime's fusions and the {cpu} kernel table"
        if table
        else f"onnxruntime's fusions and the kernel tables of every CPU kind measured ({cpu})"
        if cpu == "any"
        else f"onnxruntime's fusions only: no kernel table for {cpu}"
    )
    try:
        with tempfile.TemporaryDirectory(prefix="quantcli-placement-") as d:
            work, exporters = Path(d), list(EXPORTERS)
            costs, report = measure(model, example, cpu, work, exporters)
            decisions = keep_pools(keep_chains(decide(costs, margin), _activation_groups(model)), report)
            probe = fusion_probe(model, example, work, exporters)

            def fused_after(floats: set[str], keep_inputs: bool) -> dict[str, bool | None]:
                return probe(
                    {
                        name
                        for d in decisions
                        if d.layer in floats
                        for name in d.quantizers
                        if not (keep_inputs and role(name) == "input_quantizer")
                    }
                )

            stems = as_stems(decisions, report)  # stems kept float cost no neighbour anything
            if stems is None:
                stems = stems_alone(keep_neighbours(decisions, fused_after), decisions, report)
            decisions = stems
            if exporters[0] != EXPORTERS[0]:
                source += f"; its graphs exported with {exporters[0]}: {EXPORTERS[0]} cannot export the model"
    except ConfigError:  # a config the model cannot be quantized with (export would refuse it too)
        raise
    except Exception as e:  # export or onnxruntime: calibration still succeeds, the report says why
        return LatencyPlacement(
            "auto",
            False,
            f"not decided: {type(e).__name__}: {first_line(e, 600)}",
            margin=margin,
            seconds=time.perf_counter() - t0,
            cpu=cpu,
        )
    return LatencyPlacement("auto", True, source, decisions, margin, time.perf_counter() - t0, cpu)


def _activation_groups(model: nn.Module) -> list[dict]:
    """The chains of operations on codes of the model's structural placement (``activation_groups``; none for
    a model quantized without one)."""
    structure = getattr(getattr(model, "quantcli_report", None), "placement", None)
    return getattr(structure, "activation_groups", None) or []


def apply(model: nn.Module, placement: LatencyPlacement) -> list[str]:
    """Switch off, for good, every quantizer of the layers ``placement`` keeps float; returns their names.
    When it keeps every layer float, the quantizers of no layer (residual skips, pooling inputs) go too: they
    serve integer kernels around them, and the graph is the float one. The quantizers of a chain of
    sigmoids, multiplications and global poolings run on codes (``activation_groups`` of the model's
    structural placement) go with any layer around the chain that is kept float: the chain's operations no
    longer all read DQs and write Qs, so they run in float again, without a Q/DQ pair that serves nothing."""
    qs = quantizers(model)
    every = bool(placement.layers) and all(d.decision == FLOAT for d in placement.layers)
    names = list(qs) if every else [n for d in placement.layers if d.decision == FLOAT for n in d.quantizers]
    floats = {d.layer for d in placement.layers if d.decision == FLOAT}
    for group in _activation_groups(model):
        # a chain of sigmoids/multiplications/poolings on codes needs every layer around it quantized
        if floats & set(group["layers"]):
            names += [n for n in group["quantizers"] if n not in names]
    for name in names:
        if name in qs and qs[name].enabled:
            keep_float(qs[name])
            placement.quantizers_disabled.append(name)
    return placement.quantizers_disabled
