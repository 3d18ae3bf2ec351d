"""Latency-aware placement for onnxruntime: keep in float the layers that would not run faster quantized.

A quantized layer is worth its Q/DQ only where onnxruntime runs it as an integer kernel that beats the float
one. A layer onnxruntime does not fuse runs in float between its Q/DQ (its weight dequantized at every run,
its input quantized and dequantized again): slower than float. A fused layer can still be slower than float on
a given CPU (small shapes, no VNNI). Both are measured on the machine that runs calibrate, with the
calibration example batch:

1. export the calibrated model (int8) and the same model with every quantizer off (float), default
   exporter/opset;
2. per quantized layer of the int8 graph, what onnxruntime runs it as
   (:func:`exporters.onnxruntime.fusion.inspect_fusion`) and, from onnxruntime's profiler
   (:func:`exporters.onnxruntime.profile.node_times`), its cost: the kernel node plus the
   QuantizeLinear/DequantizeLinear/DynamicQuantizeLinear nodes that feed it (:func:`int8_cost`); the float
   cost is the time of the same layer's node (same module scope) in onnxruntime's graph of the float export;
3. :func:`decide` (pure): not fused -> float; int8 cost > float cost x (1 + ``margin``) -> float; else
   quantized;
4. the whole graph decides between per-layer choices: a layer kept float between quantized ones brings Q/DQ
   and layout changes that no single node's time shows, so when the measured choice keeps float more than the
   layers onnxruntime does not fuse, both graphs (and the float one) are exported and timed whole, interleaved
   (:func:`exporters.onnxruntime.profile.graph_times`, :data:`GRAPH_TIMER`), and the measured choice stands
   only if its graph is faster (:func:`prefer_faster_graph`, pure); and when the int8 graph is still slower
   than the float one by more than the timing's noise, every layer is kept float (:func:`float_if_slower`): no
   gain to deploy on this CPU, said so in the report (``--placement all`` quantizes anyway). The noise is
   measured in the same timing: the float graph runs in two sessions, and their difference (the A/A spread),
   at least :data:`GRAPH_NOISE_FLOOR`, is the band (:func:`noise_band`).

Timing runs on one onnxruntime thread (:data:`exporters.onnxruntime.profile.THREADS`) on the example batch
repeated to :data:`TIMING_SAMPLES` samples (the deployment batch, not the 8 samples a checkpoint stores), the
whole graphs in interleaved bursts (:func:`exporters.onnxruntime.profile.time_interleaved`).

:func:`measure_and_decide` returns a :class:`LatencyPlacement` and changes nothing; :func:`apply` switches the
chosen layers' quantizers off for good (:func:`quantcli.nn.modes.keep_float`), as mixed precision does, so
that the checkpoint, export and verify follow the choice.

The timing sources are :data:`TIMER` and :data:`GRAPH_TIMER` (module attributes, or arguments): tests replace
them with stubs, so that nothing they assert depends on wall-clock time.
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from torch import nn

from exporters.graph import consumer_map, producer_map, read_onnx
from exporters.onnx_export import export_onnx
from exporters.onnxruntime.fusion import find_float, inspect_fusion, optimized_graph
from exporters.onnxruntime.profile import graph_times, node_times
from quantcli.errors import first_line
from quantcli.inputs.data import Batch
from quantcli.nn.modes import keep_float
from quantcli.nn.tensor_quantizer import quantizers

#: An int8 layer must be more than 20% slower than float to be kept in float. Node times of small layers on a
# shared : CPU vary by 10-20% between medians of 20 runs; a smaller margin would flip layers whose two kernels
# are about as : fast from one calibration to the next, and such a layer loses nothing by staying quantized.
MARGIN = 0.2
#: ... and by more than this many microseconds: onnxruntime's profiler reports whole microseconds, so on a
# layer of : a few microseconds a difference of one or two is its resolution, not the kernels'
MIN_DIFF_US = 2.0
#: the smallest noise band of the whole-graph rule: the int8 graph must be slower than the float graph by
# more than : this fraction (or than the A/A spread measured beside it, if wider) before every layer is kept
# float. From : bench_zoo's A/A measurements over the zoo (every float graph timed against a second session of
# itself, 32 per : run): the widest of two runs was 2.9% and 4.7%, the median 0.7% and 0.8% (docs/zoo.md). A
# model as fast either : way should not turn float by chance.
GRAPH_NOISE_FLOOR = 0.05
ROUNDS = 20  # timed runs per graph, at least (after one warm-up run); the median of each node is used
#: the example batch is repeated along its first dimension to this many samples for timing: with 8 samples
# (what a : checkpoint stores) a small CNN's fixed per-run costs weigh more than they do at a deployment batch
TIMING_SAMPLES = 32

#: ``(onnx path, feeds, rounds) -> {node name: microseconds}``; tests install a stub here
#: ``(paths, feeds, rounds) -> [{node: microseconds}, ...]``, one dict per path (timed interleaved)
TIMER: Callable[[list[str | Path], dict[str, np.ndarray], int], list[dict[str, float]]] = node_times

#: ``(paths, feeds, rounds) -> [milliseconds, ...]``: whole-graph times, one per path (timed interleaved)
GRAPH_TIMER: Callable[[list[str | Path], dict[str, np.ndarray], int], list[float]] = graph_times

QUANTIZED, FLOAT = "quantized", "float"
_QDQ = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear")


@dataclass
class LayerCost:
    """What measurement found for one quantized layer (input of :func:`decide`)."""

    layer: str
    kernel: str | None  # the op type onnxruntime runs the quantized layer as
    fused: bool | None  # an integer kernel (None: not found in onnxruntime's graph)
    int8_us: float | None  # kernel + the Q/DQ feeding it, median microseconds (None: not timed)
    float_us: float | None  # the float export's node for the same layer
    quantizers: list[str] = field(default_factory=list)  # the layer's quantizers (input, weight, output)
    not_applicable: str | None = None  # why the layer is left as configured, whatever it costs


@dataclass
class LayerDecision:
    layer: str
    kernel: str | None
    int8_us: float | None
    float_us: float | None
    decision: str  # "quantized" or "float"
    reason: str
    quantizers: list[str] = field(default_factory=list)
    # what onnxruntime made of the quantized layer (a float decision of a fused one: time)
    fused: bool | None = None
    applicable: bool = True  # False: float8, weight-only, not 8-bit: left as configured whatever it costs

    def to_dict(self) -> dict:
        return {
            "layer": self.layer,
            "kernel": self.kernel,
            "int8_us": None if self.int8_us is None else round(self.int8_us, 2),
            "float_us": None if self.float_us is None else round(self.float_us, 2),
            "decision": self.decision,
            "reason": self.reason,
        }


@dataclass
class LatencyPlacement:
    """The placement's outcome: per layer, quantized or float and why; or why it was not measured."""

    mode: str  # "auto" or "all"
    measured: bool
    note: str = ""  # why not measured, or how
    layers: list[LayerDecision] = field(default_factory=list)
    margin: float = MARGIN
    seconds: float = 0.0  # exporting and timing
    quantizers_disabled: list[str] = field(default_factory=list)  # filled by apply()
    # whole-graph milliseconds: "float", "chosen" and, when the two choices were compared, "other"; "int8":
    # the int8 graph's when it was slower than float and every layer was kept float; "float A/A": the float
    # graph's second session (its difference from "float" is the timing's noise)
    graph_ms: dict[str, float] = field(default_factory=dict)
    noise: float | None = None  # the whole-graph rule's band (a fraction), when measured

    @property
    def kept_float(self) -> list[str]:
        return [d.layer for d in self.layers if d.decision == FLOAT]

    @property
    def text(self) -> str:
        if not self.measured:
            return self.note
        kept = self.kept_float
        noise = "" if self.noise is None else f", noise band {self.noise:.1%}"
        text = f"{len(kept)} of {len(self.layers)} layers kept float ({self.seconds:.1f} s to measure{noise})"
        every = bool(kept) and len(kept) == len(self.layers)
        if self.graph_ms.get("float") and every and self.graph_ms.get("int8"):
            ratio = self.graph_ms["int8"] / self.graph_ms["float"]
            text += f"; the int8 graph took {ratio:.2f}x the float graph's time on this CPU: float stays"
        elif self.graph_ms.get("float"):
            ratio = self.graph_ms["chosen"] / self.graph_ms["float"]
            text += f"; the int8 graph takes {ratio:.2f}x the float graph's time on this CPU" + (
                " (slower than float)" if ratio > 1 + (self.noise or 0) else ""
            )
        if kept:
            shown = "; ".join(f"{d.layer} ({d.reason})" for d in self.layers if d.decision == FLOAT)
            text += f": {shown}"
        return text

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "measured": self.measured,
            "note": self.note,
            "margin": self.margin,
            "seconds": round(self.seconds, 3),
            "graph_ms": {k: round(v, 4) for k, v in self.graph_ms.items()},
            "noise": None if self.noise is None else round(self.noise, 4),
            "kept_float": self.kept_float,
            "quantizers_disabled": list(self.quantizers_disabled),
            "layers": [d.to_dict() for d in self.layers],
            "text": self.text,
        }


# ------------------------------------------------------------------------------------------- the decision


def decide(
    costs: list[LayerCost], margin: float = MARGIN, min_diff_us: float = MIN_DIFF_US
) -> list[LayerDecision]:
    """Per layer: float when onnxruntime does not fuse it or its int8 cost exceeds the float cost by more than
    ``margin`` (a fraction) and more than ``min_diff_us``; quantized otherwise, also when a figure is missing
    (nothing measured against it)."""
    out = []
    for c in costs:
        decision, reason = QUANTIZED, ""
        if c.not_applicable:
            reason = c.not_applicable
        elif c.fused is False:
            decision, reason = (
                FLOAT,
                f"onnxruntime runs it in float between Q/DQ ({c.kernel or 'not loaded'})",
            )
        elif c.fused is None:
            reason = "not found in onnxruntime's optimized graph: left quantized"
        elif c.int8_us is None or c.float_us is None:
            reason = "not timed: left quantized"
        elif c.int8_us > c.float_us * (1 + margin) and c.int8_us - c.float_us > min_diff_us:
            decision = FLOAT
            reason = (
                f"{c.kernel} {c.int8_us:.1f} us (with its Q/DQ) vs float {c.float_us:.1f} us: "
                f"more than {margin:.0%} slower"
            )
        else:
            reason = f"{c.kernel} {c.int8_us:.1f} us (with its Q/DQ) vs float {c.float_us:.1f} us"
        out.append(
            LayerDecision(
                c.layer,
                c.kernel,
                c.int8_us,
                c.float_us,
                decision,
                reason,
                list(c.quantizers),
                c.fused,
                c.not_applicable is None,
            )
        )
    return out


def prefer_faster_graph(
    decisions: list[LayerDecision], measured_ms: float, fused_only_ms: float
) -> list[LayerDecision]:
    """The decisions to keep, given the whole-graph times of the measured choice and of the choice that keeps
    float only the layers onnxruntime does not fuse: the measured one when its graph is at least as fast, else
    the layers it kept float for their kernels' times go back to quantized, with both graph times in the
    reason."""
    if measured_ms <= fused_only_ms:
        return decisions
    out = []
    for d in decisions:
        if d.decision == FLOAT and d.fused:
            d = LayerDecision(
                d.layer,
                d.kernel,
                d.int8_us,
                d.float_us,
                QUANTIZED,
                f"{d.reason}; quantized all the same: the whole graph ran {measured_ms:.3g} ms with such "
                f"layers in float vs {fused_only_ms:.3g} ms quantized",
                list(d.quantizers),
                d.fused,
            )
        out.append(d)
    return out


def noise_band(float_ms: float, float_again_ms: float, floor: float = GRAPH_NOISE_FLOOR) -> float:
    """The fraction by which two whole-graph times must differ to count as different: the A/A spread (the
    float graph timed in two sessions, interleaved with the others), at least ``floor``."""
    spread = abs(float_again_ms / float_ms - 1) if float_ms > 0 else float("inf")
    return max(floor, spread)


def float_if_slower(
    decisions: list[LayerDecision], int8_ms: float, float_ms: float, margin: float = GRAPH_NOISE_FLOOR
) -> list[LayerDecision]:
    """The decisions to keep when the chosen int8 graph takes ``int8_ms`` and the float graph ``float_ms``: an
    int8 graph more than ``margin`` (the timing's noise band, :func:`noise_band`) slower than float on this
    CPU is no gain to deploy, so then every layer placement weighs is kept float (``--placement all``
    quantizes them anyway), with both times in the reason; otherwise the decisions as they are."""
    if int8_ms <= float_ms * (1 + margin):
        return decisions
    why = (
        f"the whole int8 graph ran {int8_ms:.3g} ms vs {float_ms:.3g} ms in float on this CPU, more than the "
        f"{margin:.1%} noise band: every layer kept float (--placement all quantizes anyway)"
    )
    return [
        LayerDecision(
            d.layer,
            d.kernel,
            d.int8_us,
            d.float_us,
            FLOAT,
            why if d.decision != FLOAT else d.reason,
            list(d.quantizers),
            d.fused,
            d.applicable,
        )
        if d.applicable
        else d
        for d in decisions
    ]


def _kernel_choices(decisions: list[LayerDecision]) -> list[str]:
    """The layers the measured choice keeps float for their kernels' times (not for being unfused)."""
    return [d.layer for d in decisions if d.decision == FLOAT and d.fused]


def _float_layers_copy(
    model: nn.Module, decisions: list[LayerDecision], layers: set[str] | None
) -> nn.Module:
    """A copy of ``model`` with the quantizers of the ``decisions``' float layers off (``layers``: only those
    among them; None: every quantizer off, the float model)."""
    plain = copy.deepcopy(model)
    qs = quantizers(plain)
    for d in decisions:
        if layers is not None and (d.decision != FLOAT or d.layer not in layers):
            continue
        for name in d.quantizers:
            if name in qs:
                keep_float(qs[name])
    if layers is None:
        for q in qs.values():
            keep_float(q)
    return plain


def timing_feeds(example: Batch, names: set[str], samples: int = TIMING_SAMPLES) -> dict[str, np.ndarray]:
    """The graph inputs ``names`` of ``example`` as numpy arrays, each repeated along its first (batch)
    dimension to ``samples`` rows (the exports' batch dimension is dynamic); an input with fewer dimensions is
    left as it is."""
    out = {}
    for k, v in example.items():
        if k not in names:
            continue
        a = v.detach().cpu().numpy()
        if a.ndim and 0 < a.shape[0] < samples:
            a = np.concatenate([a] * -(-samples // a.shape[0]))[:samples]
        out[k] = a
    return out


def whole_graph_check(
    model: nn.Module,
    example: Batch,
    decisions: list[LayerDecision],
    graph_timer: Callable | None = None,
    rounds: int = ROUNDS,
) -> tuple[list[LayerDecision], dict[str, float], float]:
    """Step 4: export the float graph and the chosen graph (and, when kernel times kept layers float, the
    graph keeping float only the unfused layers), time them whole with the float graph twice (A/A: the noise
    band) and keep the faster choice. Returns the decisions, the graph times and the noise band."""
    graph_timer = graph_timer or GRAPH_TIMER
    kernel_float = set(_kernel_choices(decisions))
    unfused = {d.layer for d in decisions if d.decision == FLOAT} - kernel_float
    with tempfile.TemporaryDirectory(prefix="quantcli-placement-") as d:
        paths = {"float": Path(d) / "float.onnx", "chosen": Path(d) / "chosen.onnx"}
        export_onnx(_float_layers_copy(model, decisions, None), example, paths["float"])
        export_onnx(_float_layers_copy(model, decisions, kernel_float | unfused), example, paths["chosen"])
        if kernel_float:
            paths["other"] = Path(d) / "other.onnx"
            export_onnx(_float_layers_copy(model, decisions, unfused), example, paths["other"])
        paths["float A/A"] = paths["float"]  # a second session of the float graph: the timing's own spread
        names = {i.name for i in read_onnx(paths["float"]).graph.input}
        ms = dict(zip(paths, graph_timer(list(paths.values()), timing_feeds(example, names), rounds)))
    band = noise_band(ms["float"], ms["float A/A"])
    if kernel_float:
        kept = prefer_faster_graph(decisions, ms["chosen"], ms["other"])
        if kept is not decisions:  # the other choice won: it is the graph the checkpoint will hold
            decisions, ms = kept, {**ms, "chosen": ms["other"], "other": ms["chosen"]}
    slower = float_if_slower(decisions, ms["chosen"], ms["float"], band)
    if slower is not decisions:
        decisions, ms = slower, {**ms, "int8": ms["chosen"], "chosen": ms["float"]}
    return decisions, ms, band


def int8_cost(optimized: onnx.ModelProto, kernel: str, times: dict[str, float]) -> float | None:
    """The time of node ``kernel`` of onnxruntime's ``optimized`` graph plus the Q/DQ nodes that feed it: a
    QuantizeLinear/DequantizeLinear/DynamicQuantizeLinear producing one of its inputs, and the Q before such a
    DQ. A Q/DQ read by ``k`` nodes counts ``1/k`` (its time is shared by its readers). ``None``: the kernel
    was not timed.
    """
    if kernel not in times:
        return None
    producers, consumers = producer_map(optimized.graph), consumer_map(optimized)
    node = next((n for n in optimized.graph.node if n.name == kernel), None)
    if node is None:
        return None
    total = times[kernel]

    def share(n: onnx.NodeProto) -> float:
        readers = {id(r) for o in n.output for r in consumers.get(o, [])}
        return times.get(n.name, 0.0) / max(1, len(readers))

    for i in node.input:
        p = producers.get(i)
        if p is None or p.op_type not in _QDQ:
            continue
        total += share(p)
        q = producers.get(p.input[0]) if p.op_type == "DequantizeLinear" else None
        if q is not None and q.op_type == "QuantizeLinear":
            total += share(q)
    return total


# ------------------------------------------------------------------------------------------- measuring


def _not_applicable(modules: dict[str, nn.Module], layer: str) -> str | None:
    """Why a layer is left as configured: placement weighs 8-bit integer layers (input and weight
    quantized)."""
    m = modules.get(layer)
    if m is None:
        return "not mapped to a module of the model: left quantized"
    qi, qw = getattr(m, "input_quantizer", None), getattr(m, "weight_quantizer", None)
    on = [q for q in (qi, qw) if q is not None and q.enabled]
    if any(q.desc.is_fp8 for q in on):
        return "float8: onnxruntime has no float8 kernel; left as configured"
    if qi is None or not qi.enabled:
        return "weight-only: quantized for size, not speed; left as configured"
    if any(q.desc.num_bits != 8 for q in on):
        return "not an 8-bit layer; left as configured"
    return None


def _layer_quantizers(model: nn.Module, layer: str) -> list[str]:
    """The enabled quantizers of module ``layer`` (input, weight, output), by their model-wide names."""
    return [n for n, q in quantizers(model).items() if n.rsplit(".", 1)[0] == layer and q.enabled]


def measure(
    model: nn.Module, example: Batch, timer: Callable | None = None, rounds: int = ROUNDS
) -> list[LayerCost]:
    """Export ``model`` (calibrated) and its float version to a temporary folder, time both in onnxruntime on
    ``example`` and return each quantized layer's costs. Raises what export or onnxruntime raise."""
    timer = timer or TIMER
    with tempfile.TemporaryDirectory(prefix="quantcli-placement-") as d:
        int8_path, float_path = Path(d) / "int8.onnx", Path(d) / "float.onnx"
        export_onnx(model, example, int8_path)
        plain = copy.deepcopy(model)  # the float export: the same module scopes, so the same node names
        for q in quantizers(plain).values():
            keep_float(q)
        export_onnx(plain, example, float_path)
        del plain
        report = inspect_fusion(int8_path)
        if report.load_error:
            raise RuntimeError(f"onnxruntime does not load the int8 graph: {report.load_error}")
        float_model = read_onnx(float_path)
        feeds = timing_feeds(example, {i.name for i in float_model.graph.input})
        opt8, optf = optimized_graph(int8_path), optimized_graph(float_path)
        t8, tf = timer([int8_path, float_path], feeds, rounds)
    modules = dict(model.named_modules())
    costs = []
    for lf in report.layers:
        f = find_float(float_model, optf, lf.node)
        costs.append(
            LayerCost(
                lf.layer,
                lf.kernel,
                lf.fused,
                int8_cost(opt8, lf.optimized_node, t8) if lf.optimized_node else None,
                tf.get(f.name) if f is not None else None,
                _layer_quantizers(model, lf.layer),
                _not_applicable(modules, lf.layer),
            )
        )
    return costs


def measure_and_decide(
    model: nn.Module,
    example: Batch,
    timer: Callable | None = None,
    margin: float = MARGIN,
    graph_timer: Callable | None = None,
) -> LatencyPlacement:
    """:func:`measure` then :func:`decide`; a model that does not export or load is not measured (``measured``
    False, the reason in ``note``), never an error. The model is not changed (see :func:`apply`)."""
    t0 = time.perf_counter()
    try:
        costs = measure(model, example, timer)
        decisions, ms, band = whole_graph_check(model, example, decide(costs, margin), graph_timer)
    except Exception as e:  # export or onnxruntime: calibration still succeeds, the report says why
        return LatencyPlacement(
            "auto",
            False,
            f"not measured: {type(e).__name__}: {first_line(e, 200)}",
            margin=margin,
            seconds=time.perf_counter() - t0,
        )
    return LatencyPlacement(
        "auto",
        True,
        "measured with onnxruntime's profiler (CPU provider, default options, 1 "
        f"thread) on the example batch repeated to {TIMING_SAMPLES} samples, then the whole graphs",
        decisions,
        margin,
        time.perf_counter() - t0,
        graph_ms=ms,
        noise=band,
    )


def apply(model: nn.Module, placement: LatencyPlacement) -> list[str]:
    """Switch off, for good, every quantizer of the layers ``placement`` keeps float; returns their names.
    When it keeps every layer float, the quantizers of no layer (residual skips, pooling inputs) go too: they
    serve integer kernels around them, and the graph is the float one."""
    qs = quantizers(model)
    every = bool(placement.layers) and all(d.decision == FLOAT for d in placement.layers)
    names = list(qs) if every else [n for d in placement.layers if d.decision == FLOAT for n in d.quantizers]
    for name in names:
        if name in qs and qs[name].enabled:
            keep_float(qs[name])
            placement.quantizers_disabled.append(name)
    return placement.quantizers_disabled
