"""Mixed precision to a quality target: keep the fewest layers in float needed to reach ``min_cosine`` /
``min_snr`` against the float model on held-out data.

The unit is a layer (its input and weight quantizers together): onnxruntime and TensorRT run a layer in
integer arithmetic only when both its input and its weight are quantized, so keeping one of the two in float
costs the layer's speed-up anyway and buys less accuracy than keeping both.

Search (every quality below is measured on the whole held-out set, in PyTorch with quantcli's fake
quantization, which gives the same integer codes as the exported graph in onnxruntime):

1. the calibrated model as it is; done if it meets the target;
2. rank the layers by sensitivity (:mod:`quantcli.analysis.sensitivity`, only that layer quantized) on a
   bounded sample of the held-out data (``sample_samples``), worst first;
3. bisect the smallest ``k`` such that keeping the ``k`` worst layers in float meets the target (all layers
   in float is the float model and always meets it; quality is assumed to grow with ``k`` along the ranking,
   and every accepted step is measured, never assumed);
4. prune: try to re-quantize each kept layer, least sensitive first, and keep it quantized if the target is
   still met;
5. dynamic int8 before float: each layer still kept, least sensitive first, is tried with dynamic int8
   activations (ONNX ``DynamicQuantizeLinear -> MatMulInteger``, the ``int8-dynamic`` preset's layer: uint8
   codes from each tensor's own range, its int8 weights unchanged) and stays so if the target is still met. A
   Linear layer only, with 8-bit symmetric weights and no output quantizer. onnxruntime runs that layer as
   ``DynamicQuantizeMatMul``, an integer kernel: on a pretrained-like BERT (``benchmarks/bench_bert.py``) the
   float ``MatMul`` a kept layer runs cost more than the rest of the quantized graph saved against
   ``quantize_dynamic``. The layer's weight codes are the static layer's; its input quantizer's descriptor
   becomes dynamic (saved in the checkpoint, re-applied by ``load_calibrated``).

6. inputs kept for the layer before (onnxruntime): a float layer whose input quantizer is the Q on a quantized
   layer's output takes, when switched off, that layer's integer kernel with it (onnxruntime fuses a Conv or
   Gemm only up to a QuantizeLinear on its output): a kept MLP layer made the layer before it run float
   between its Q/DQ, 1.9x slower than onnxruntime's own ``quantize_static`` graph. With a ``fusion`` probe
   (what onnxruntime fuses with given quantizers off, :func:`quantcli.calibration.latency_placement.
   fusion_probe`), each kept layer, least sensitive first, keeps its input quantizer (its weights float) where
   that restores a lost integer kernel and the target stays met (``inputs_kept``); a layer that loses its
   kernel all the same runs float too (``float_too``) where the quality stays as good; what neither way can
   keep is reported (``unfused``).

``max_float_layers`` caps the layers kept in float (default: a quarter of the quantized layers, at least one),
not those step 5 moves to dynamic int8: where the target needs more float layers than the cap but step 5
leaves no more float than the cap, it is met that way. Otherwise the result keeps the cap's worth of the worst
layers in float, reports
``met=False`` with the quality reached and how many layers the target would need (the command exits 1).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch import nn

from quantcli.analysis.quality import Quality
from quantcli.analysis.sensitivity import layer_units, measure, quantizing, rank, reference_outputs
from quantcli.errors import CalibrationError
from quantcli.inputs.data import Batch, cap_samples, num_samples
from quantcli.nn.dynamic import exportable
from quantcli.nn.modes import keep_float
from quantcli.nn.modules import QuantLinear
from quantcli.nn.tensor_quantizer import quantizers, role
from quantcli.quant.descriptor import QuantDescriptor

SENSITIVITY_SAMPLES = 64  # held-out samples the ranking passes use (one pass per layer)
#: a layer's input quantizer when the target moves it to dynamic int8 (the int8-dynamic preset's input)
DYNAMIC_INPUT = QuantDescriptor(num_bits=8, asymmetric=True, dynamic=True)


def default_cap(num_layers: int) -> int:
    """A quarter of the quantized layers (rounded up), at least one."""
    return max(1, math.ceil(num_layers / 4))


@dataclass
class MixedPrecisionResult:
    min_cosine: float | None
    min_snr: float | None
    before: Quality
    after: Quality
    met: bool
    kept_float: list[str] = field(default_factory=list)  # layers, most sensitive first
    # layers moved to dynamic int8 activations instead of float
    dynamic: list[str] = field(default_factory=list)
    quantizers_disabled: list[str] = field(default_factory=list)
    # float layers whose input quantizer stays on: the layer before needs that Q for its integer kernel
    inputs_kept: list[str] = field(default_factory=list)
    # layers kept float with them: a layer kept float took the Q their integer kernel needs (step 6)
    float_too: list[str] = field(default_factory=list)
    # quantized layers that run float in onnxruntime because a layer kept float took their output's Q
    unfused: list[str] = field(default_factory=list)
    layers_total: int = 0
    cap: int = 0
    needed: int | None = None  # layers the target needs along the ranking, when the cap was hit
    holdout: str = ""
    holdout_samples: int = 0
    ranking: list[dict] = field(default_factory=list)
    evaluations: int = 0  # full held-out passes
    sensitivity_passes: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {
            "min_cosine": self.min_cosine,
            "min_snr": self.min_snr,
            "met": self.met,
            "before": self.before.to_dict(),
            "after": self.after.to_dict(),
            "kept_float": self.kept_float,
            "layers_kept_float": len(self.kept_float),
            "dynamic": self.dynamic,
            "quantizers_disabled": self.quantizers_disabled,
            "inputs_kept": self.inputs_kept,
            "float_too": self.float_too,
            "unfused": self.unfused,
            "layers_total": self.layers_total,
            "cap": self.cap,
            "needed": self.needed,
            "holdout": self.holdout,
            "holdout_samples": self.holdout_samples,
            "ranking": self.ranking,
            "evaluations": self.evaluations,
            "sensitivity_passes": self.sensitivity_passes,
            "seconds": round(self.seconds, 3),
        }


def split_holdout(batches: list[Batch]) -> tuple[list[Batch], list[Batch]]:
    """``(calibration, held-out)``: the last quarter of the batches (at least one) is held out."""
    if len(batches) < 2:
        raise CalibrationError(
            "--min-cosine/--min-snr need held-out data: pass --holdout FILE, or --data with at least 2 "
            "batches (the last quarter of them is held out)"
        )
    k = max(1, len(batches) // 4)
    return batches[:-k], batches[-k:]


def check_target(min_cosine: float | None, min_snr: float | None) -> None:
    if min_cosine is None and min_snr is None:
        raise CalibrationError("give a target: --min-cosine C and/or --min-snr DB")
    if min_cosine is not None and not (-1.0 <= min_cosine <= 1.0):
        raise CalibrationError(f"--min-cosine must be in [-1, 1], got {min_cosine}")
    if min_snr is not None and not math.isfinite(min_snr):
        raise CalibrationError(f"--min-snr must be a finite number of dB, got {min_snr}")


def meet_target(
    model: nn.Module,
    holdout: list[Batch],
    *,
    min_cosine: float | None = None,
    min_snr: float | None = None,
    max_float_layers: int | None = None,
    sample_samples: int = SENSITIVITY_SAMPLES,
    holdout_name: str = "",
    progress: Callable[[str], None] | None = None,
    prefer_dynamic: bool = True,
    fusion: Callable[[set[str]], dict[str, bool | None]] | None = None,
) -> MixedPrecisionResult:
    """Disable (keep in float) the fewest layers of a calibrated ``model`` needed to meet the target on
    ``holdout``; the model is changed in place (``enabled = False`` on those layers' quantizers).
    ``prefer_dynamic``: step 5, kept layers that meet the target with dynamic int8 activations run so.
    ``fusion``: step 6's probe, ``fusion(quantizers off) -> {layer: fused}`` (onnxruntime target only)."""
    check_target(min_cosine, min_snr)
    if not holdout:
        raise CalibrationError("no held-out batches to measure the target on")
    t0 = time.perf_counter()
    units = layer_units(model)  # none (every layer already float, e.g. by latency placement): met as it is
    cap = default_cap(len(units)) if max_float_layers is None else max_float_layers
    if cap < 0:
        raise CalibrationError(f"--max-float-layers must be >= 0, got {cap}")
    refs = reference_outputs(model, holdout)
    res = MixedPrecisionResult(
        min_cosine,
        min_snr,
        Quality(None, None),
        Quality(None, None),
        False,
        layers_total=len(units),
        cap=cap,
        holdout=holdout_name,
        holdout_samples=num_samples(holdout),
    )
    search = _Search(model, holdout, refs, units, res)
    res.before = search.quality_without([])
    if search.meets(res.before):
        res.after, res.met = res.before, True
    else:
        order = _rank_layers(model, holdout, units, sample_samples, res, progress)
        if progress is not None:
            progress("searching the fewest layers to keep in float")
        res.kept_float = _fewest_float_layers(search, order, cap)
        if res.met and prefer_dynamic:
            _prefer_dynamic(search, res)
        elif prefer_dynamic:
            _dynamic_within_cap(search, order, res, cap)
        if fusion is not None:
            _keep_fusion(search, res, fusion)
        _keep_in_float(model, units, res)
    res.seconds = time.perf_counter() - t0
    return res


@dataclass
class _Search:
    """The quality of ``model`` with some layers kept in float, on the whole held-out set (each measurement
    counted in ``res.evaluations``), and whether it meets the target."""

    model: nn.Module
    holdout: list[Batch]
    refs: list
    units: dict[str, list[str]]
    res: MixedPrecisionResult

    def quality_without(
        self, layers: list[str], dynamic: list[str] = (), inputs_kept: Iterable[str] = ()
    ) -> Quality:
        """Quality with ``layers`` in float (but the input quantizers of those in ``inputs_kept``) and the
        ``dynamic`` layers' inputs quantized at run time."""
        self.res.evaluations += 1
        off = self.off(layers, inputs_kept)
        with quantizing(self.model, inactive=off), dynamic_inputs(self.model, dynamic):
            return measure(self.model, self.holdout, self.refs)

    def off(self, layers: Iterable[str], inputs_kept: Iterable[str] = ()) -> set[str]:
        """The quantizers switched off to keep ``layers`` in float, the inputs of ``inputs_kept`` staying."""
        kept = set(inputs_kept)
        return {q for u in layers for q in self.units[u] if not (u in kept and role(q) == "input_quantizer")}

    def has_input(self, layer: str) -> bool:
        """Whether ``layer``'s unit has an input quantizer (one step 6 may keep)."""
        return any(role(q) == "input_quantizer" for q in self.units[layer])

    def meets(self, q: Quality) -> bool:
        return q.meets(self.res.min_cosine, self.res.min_snr)


def _rank_layers(
    model: nn.Module,
    holdout: list[Batch],
    units: dict[str, list[str]],
    sample_samples: int,
    res: MixedPrecisionResult,
    progress: Callable[[str], None] | None,
) -> list[str]:
    """Step 2: the layers by sensitivity on a bounded sample of the held-out data, worst first."""
    if progress is not None:
        progress(f"ranking {len(units)} layers by sensitivity")
    sample = cap_samples(holdout, sample_samples)
    by = "snr" if res.min_cosine is None else "cosine"
    ranked = rank(model, sample, units, by=by)
    res.sensitivity_passes = len(units)
    res.ranking = [r.to_dict() for r in ranked]
    return [r.unit for r in ranked]


def _fewest_float_layers(search: _Search, order: list[str], cap: int) -> list[str]:
    """Steps 3 and 4: bisect the fewest of the worst layers to keep in float, then prune; within ``cap``.
    Sets ``after``, ``met`` and (the cap hit) ``needed`` of the result; returns the layers kept in float."""
    res = search.res
    hi, known = _bisect(search, order)
    limit = min(cap, len(order))
    if hi > limit:  # the cap is hit: the best within it, and what the target would need
        res.needed = hi
        kept = order[:limit]
        res.after = known.get(limit) or search.quality_without(kept)
        res.met = False
        return kept
    kept, res.after = _pruned(search, order[:hi], known.get(hi) or search.quality_without(order[:hi]))
    res.met = True
    return kept


def _pruned(search: _Search, kept: list[str], after: Quality) -> tuple[list[str], Quality]:
    """Step 4: re-quantize kept layers the target does not need, least sensitive first (``kept`` meets it
    with quality ``after``)."""
    for u in reversed(list(kept)):
        trial = [k for k in kept if k != u]
        q = search.quality_without(trial)
        if search.meets(q):
            kept, after = trial, q
    return kept, after


def _bisect(search: _Search, order: list[str]) -> tuple[int, dict[int, Quality]]:
    """The smallest ``k`` such that keeping the ``k`` worst layers in float meets the target (``k =
    len(order)`` is the float model), and every quality measured on the way, by ``k``."""
    known: dict[int, Quality] = {0: search.res.before}
    lo, hi = 0, len(order)  # lo fails, hi meets
    while hi - lo > 1:
        mid = (lo + hi) // 2
        known[mid] = search.quality_without(order[:mid])
        if search.meets(known[mid]):
            hi = mid
        else:
            lo = mid
    return hi, known


def can_be_dynamic(model: nn.Module, layer: str) -> bool:
    """``layer`` can run with dynamic int8 activations: a Linear whose input quantizer is enabled and static,
    with 8-bit symmetric calibrated weights (what ``DynamicQuantizeLinear -> MatMulInteger`` exports) and no
    output quantizer (the dynamic export computes the float output itself)."""
    m = model.get_submodule(layer)
    if not isinstance(m, QuantLinear) or not m.input_quantizer.enabled or m.input_quantizer.desc.dynamic:
        return False
    out = getattr(m, "output_quantizer", None)
    return (out is None or not out.enabled) and exportable(m) is None


@contextmanager
def dynamic_inputs(model: nn.Module, layers: Iterable[str]) -> Iterator[None]:
    """Within the block, the input quantizers of ``layers`` quantize dynamically (uint8, per tensor, as ONNX
    ``DynamicQuantizeLinear``); their descriptors come back after."""
    saved = []
    try:
        for u in layers:
            q = model.get_submodule(u).input_quantizer
            saved.append((q, q.desc))
            q.desc = DYNAMIC_INPUT
        yield
    finally:
        for q, desc in saved:
            q.desc = desc


def make_dynamic(model: nn.Module, layer: str) -> None:
    """For good: ``layer``'s input quantizer is dynamic (its calibrated range is dropped)."""
    q = model.get_submodule(layer).input_quantizer
    q.desc = DYNAMIC_INPUT
    q.amax = None
    q.amin = None


def _dynamic_choice(search: _Search, kept_float: list[str], after: Quality) -> tuple[list, list, Quality]:
    """Step 5's choice: the kept layers moved, least sensitive first, from float to dynamic int8 where the
    target stays met: ``(still float, dynamic, quality)``. Measures only; the model is not changed."""
    kept, dynamic = list(kept_float), []
    for u in reversed(kept_float):
        if not can_be_dynamic(search.model, u):
            continue
        trial_float = [k for k in kept if k != u]
        q = search.quality_without(trial_float, dynamic + [u])
        if search.meets(q):
            kept, dynamic, after = trial_float, dynamic + [u], q
    return kept, dynamic, after


def _prefer_dynamic(search: _Search, res: MixedPrecisionResult) -> None:
    """Step 5: move kept layers, least sensitive first, from float to dynamic int8 where the target stays
    met."""
    res.kept_float, res.dynamic, res.after = _dynamic_choice(search, res.kept_float, res.after)
    for u in res.dynamic:
        make_dynamic(search.model, u)


def _dynamic_within_cap(search: _Search, order: list[str], res: MixedPrecisionResult, cap: int) -> None:
    """The cap hit: the ``res.needed`` worst layers the bisection found the target needs, pruned as within a
    cap, with step 5 applied; where the layers that then stay float fit the cap, the target is met that way
    (a cap of 0 with one layer that meets it as dynamic int8: no layer in float). Otherwise ``res`` stays as
    the cap left it."""
    needed = order[: res.needed]
    kept, after = _pruned(search, needed, search.quality_without(needed))
    still_float, dynamic, after = _dynamic_choice(search, kept, after)
    if len(still_float) <= cap and search.meets(after):
        res.kept_float, res.dynamic, res.after, res.met, res.needed = still_float, dynamic, after, True, None
        for u in dynamic:
            make_dynamic(search.model, u)


def _keep_fusion(
    search: _Search, res: MixedPrecisionResult, fusion: Callable[[set[str]], dict[str, bool | None]]
) -> None:
    """Step 6: where the layers kept float cost quantized layers their integer kernels (``fusion`` says what
    onnxruntime fuses with the given quantizers off), kept layers, least sensitive first, keep their input
    quantizer if the target stays met. A layer that loses its kernel all the same runs float (``float_too``):
    quantized it would run float between its Q/DQ, its weights dequantized on every run, slower than float
    and less accurate; its input quantizer stays where another layer's kernel needs it. Layers that would
    still lose theirs go to ``res.unfused``."""
    kept = list(res.kept_float)
    if not any(search.has_input(u) for u in kept):
        return
    fused_before = {layer for layer, f in fusion(set()).items() if f and layer not in kept}

    def lost(floats: list[str], inputs_kept: list[str]) -> list[str] | None:
        """The quantized layers no longer fused with those layers float; ``None`` where onnxruntime would
        quantize one of the float layers itself (a float layer between a DQ and a Q: not float at all)."""
        now = fusion(search.off(floats, inputs_kept))
        if any(now.get(u) is True for u in floats):
            return None
        return sorted(layer for layer in fused_before - set(floats) if now.get(layer) is False)

    gone = lost(kept, [])
    if not gone:
        return
    inputs: list[str] = []
    if res.met:
        after = res.after
        for u in reversed(kept):
            if not search.has_input(u):
                continue
            q = search.quality_without(kept, res.dynamic, inputs + [u])
            if search.meets(q):
                inputs, after = inputs + [u], q
        now = lost(kept, inputs) if inputs else None
        if now is not None and len(now) < len(gone):
            res.inputs_kept, res.after, gone = inputs, after, now
        else:
            inputs = []
    if gone:
        _float_too(search, res, lost, kept, inputs, gone)


def _float_too(search: _Search, res: MixedPrecisionResult, lost, kept, inputs, gone) -> None:
    """Step 6, continued: the layers ``gone`` (they lose their integer kernel to the layers kept float) run
    float, their input quantizers kept where dropping them would cost another layer its kernel, if the
    quality stays as good (the target met, or no worse where it was missed)."""
    floats = kept + gone
    best = None
    for keep in (inputs, inputs + gone):  # their inputs off first: a Q/DQ that serves no kernel costs time
        q = search.quality_without(floats, res.dynamic, keep)
        if (search.meets(q) or not res.met and _no_worse(q, res.after)) and lost(floats, keep) == []:
            best = keep, q
            break
    if best is None:
        res.unfused = gone
        return
    res.float_too, (res.inputs_kept, res.after) = gone, best


def _no_worse(q: Quality, than: Quality) -> bool:
    return all(
        b is None or (a is not None and a >= b) for a, b in ((q.cosine, than.cosine), (q.snr_db, than.snr_db))
    )


def _keep_in_float(model: nn.Module, units: dict[str, list[str]], res: MixedPrecisionResult) -> None:
    """Switch off, for good, the quantizers of the layers the search keeps in float (but the inputs of
    ``res.inputs_kept``)."""
    qs = quantizers(model)
    kept = set(res.inputs_kept)
    for u in res.kept_float + res.float_too:
        for name in units[u]:
            if u in kept and role(name) == "input_quantizer":
                continue
            keep_float(qs[name])
            res.quantizers_disabled.append(name)
