"""``analyze``: per-quantizer sensitivity ranking and statistics of a calibrated checkpoint.

Two kinds of work, priced differently:

* **statistics** — one float pass over all the data: per activation quantizer a histogram of ``|x|``
  (:class:`calibrators.HistogramCalibrator`, per tensor), the signed range, the outlier ratio ``max|x| /
  p99.99(|x|)`` and the amax each method would choose (``max``; ``percentile``, ``mse``, ``entropy`` from the
  histogram with :mod:`calibrators.histogram`'s pure functions); per weight quantizer the same from the weight
  itself. The checkpoint stores amax, not histograms, so they are collected here.
* **sensitivity** — per quantizer, the model's output quality (cosine, SNR vs float) with only that
  quantizer on, and with only it off: two passes per quantizer, so they run on a bounded sample of the data
  (the first ``sample_samples`` samples), the float outputs of that sample computed once and reused. Ranked
  worst first by the only-on SNR (the error energy; cosine, scale-invariant, saturates near 1).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from calibrators import HistogramCalibrator
from calibrators.histogram import METHODS, compute_amax_percentile
from calibrators.methods import HISTOGRAM_METHODS, defined_for
from calibrators.shared import shared_observations
from quantcli import defaults
from quantcli.analysis.sensitivity import measure, quantizing, rank, reference_outputs
from quantcli.errors import CalibrationError
from quantcli.inputs.checkpoint import Calibrated
from quantcli.inputs.data import Batch, cap_samples, num_samples, run_model
from quantcli.nn.tensor_quantizer import owner, quantizers
from quantcli.quant.descriptor import format_name

SAMPLE_SAMPLES = defaults.SENSITIVITY_SAMPLES
NUM_BINS = defaults.NUM_BINS
PLOT_BINS = 128  # histogram bins kept for the report's plots (groups of NUM_BINS / PLOT_BINS summed)
OUTLIER_PERCENTILE = 99.99


@dataclass
class AnalysisReport:
    checkpoint: str
    num_samples: int
    sensitivity_samples: int
    overall: dict
    quantizers: list[dict] = field(default_factory=list)  # ranked worst first
    seconds: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "checkpoint": self.checkpoint,
            "num_samples": self.num_samples,
            "sensitivity_samples": self.sensitivity_samples,
            "overall": self.overall,
            "quantizers": self.quantizers,
            "seconds": self.seconds,
        }


class _Observer:
    """Statistics of one tensor over batches: a per-tensor histogram of |x| and the signed range."""

    def __init__(self, name: str):
        self.hist = HistogramCalibrator(num_bins=NUM_BINS, name=name)
        self.lo = float("inf")
        self.hi = float("-inf")

    def __call__(self, _module, args) -> None:
        x = args[0].detach()
        if x.numel() == 0:
            return
        lo, hi = torch.aminmax(x.to(torch.float32))
        self.lo, self.hi = min(self.lo, float(lo)), max(self.hi, float(hi))
        self.hist.collect(x)


def _method_amax(hist: torch.Tensor, edges: torch.Tensor, absmax: float, desc, percentile: float) -> dict:
    """The amax each method would choose from this histogram (per tensor); ``None`` where undefined."""
    h, e = hist[0].to(torch.float64), edges[0]
    bits = tuple(desc.num_bits) if desc.is_fp8 else desc.num_bits
    unsigned = bool(desc.unsigned)
    out = {"max": absmax}
    for m in HISTOGRAM_METHODS:
        kw = {"percentile": percentile} if m == "percentile" else {"num_bits": bits, "unsigned": unsigned}
        out[m] = float(METHODS[m](h, e, **kw)) if defined_for(m, desc.is_fp8) else None
    return out


def _stats(
    name: str,
    q,
    hist: torch.Tensor,
    edges: torch.Tensor,
    lo: float,
    hi: float,
    percentile: float,
    methods: bool,
) -> dict:
    absmax = max(-lo, hi)
    # the bin's right edge can pass the largest value when it falls in the same bin
    p = min(absmax, float(compute_amax_percentile(hist[0].to(torch.float64), edges[0], OUTLIER_PERCENTILE)))
    group = NUM_BINS // PLOT_BINS
    plot = hist[0].reshape(PLOT_BINS, group).sum(1)
    amax = q.amax.detach().to(torch.float32) if q.amax is not None else None
    d = q.desc
    fmt = format_name(d.num_bits, d.unsigned or d.asymmetric)  # the grid's name: no " asymmetric" here
    amin = q.amin.detach().to(torch.float32) if d.asymmetric and q.amin is not None else None
    return {
        "min": lo,
        "max": hi,
        "absmax": absmax,
        "p99_99": p,
        "outlier_ratio": absmax / p if p > 0 else None,
        "amax": None if amax is None else float(amax.max()),
        "amax_min": None if amax is None else float(amax.min()),
        # an asymmetric quantizer's range is [amin, amax] on the uint8 grid with a zero point; the methods'
        # amax below are symmetric thresholds, what it would be with a symmetric grid
        "asymmetric": bool(d.asymmetric),
        "amin": None if amin is None else float(amin.min()),
        "per_channel": amax is not None and amax.numel() > 1,
        "format": fmt,
        "method_amax": _method_amax(hist, edges, absmax, d, percentile) if methods else None,
        "histogram": {"counts": [int(c) for c in plot], "top": float(edges[0, -1])},
    }


def analyze(
    ckpt: Calibrated,
    batches: list[Batch],
    *,
    sample_samples: int = SAMPLE_SAMPLES,
    only_disabled: bool = True,
    progress: Callable[[str, int, int], None] | None = None,
) -> AnalysisReport:
    """Statistics over ``batches`` and sensitivity on their first ``sample_samples`` samples.

    ``progress(stage, done, total)`` is called as passes complete. Raises :class:`CalibrationError` if the
    checkpoint has no enabled quantizer."""
    if not batches:
        raise CalibrationError("no data to analyze")
    if sample_samples <= 0:
        raise CalibrationError(f"--num-samples must be positive, got {sample_samples}")
    model = ckpt.model.eval()
    qs = {n: q for n, q in quantizers(model).items() if q.enabled}
    if not qs:
        raise CalibrationError(f"{ckpt.path} has no enabled quantizers to analyze")
    percentile = float(ckpt.data.get("calibration", {}).get("settings", {}).get("percentile", 99.99))
    t0 = time.perf_counter()
    stats = _statistics(model, qs, batches, percentile, progress)
    t_stats = time.perf_counter() - t0
    # sensitivity on the bounded sample
    t1 = time.perf_counter()
    sample = cap_samples(batches, sample_samples)
    refs = reference_outputs(model, sample)
    overall = measure(model, sample, refs)
    names = [n for n in qs if n in stats]
    total = len(names) * (2 if only_disabled else 1)
    rows = _ranked_rows(
        model,
        sample,
        refs,
        names,
        stats,
        only_disabled,
        None if progress is None else (lambda k: progress("sensitivity", k, total)),
    )
    t_sens = time.perf_counter() - t1
    return AnalysisReport(
        ckpt.path,
        num_samples(batches),
        num_samples(sample),
        overall.to_dict(),
        rows,
        {
            "statistics": round(t_stats, 3),
            "sensitivity": round(t_sens, 3),
            "passes": 1 + total + 2,
            "total": round(time.perf_counter() - t0, 3),
        },
    )


def _statistics(
    model: nn.Module,
    qs: dict,
    batches: list[Batch],
    percentile: float,
    progress: Callable[[str, int, int], None] | None,
) -> dict[str, dict]:
    """Per quantizer: activations from one float pass over every batch (observers on the activation
    quantizers; a layer the data never reaches has none), weights from the weights themselves."""
    acts = {n: q for n, q in qs.items() if not n.endswith("weight_quantizer")}
    observers = {n: _Observer(n) for n in acts}
    hooks = [acts[n].register_forward_pre_hook(o) for n, o in observers.items()]
    try:
        with quantizing(model, active=()), torch.inference_mode():
            for i, b in enumerate(batches):
                with shared_observations():  # q/k/v observers of one tensor histogram it once
                    run_model(model, b, f"batch {i}")
                if progress is not None:
                    progress("statistics", i + 1, len(batches))
    finally:
        for h in hooks:
            h.remove()
    stats: dict[str, dict] = {}
    for n, o in observers.items():
        if o.hist.num_batches == 0:
            continue  # a layer the data never reaches
        stats[n] = _stats(n, acts[n], o.hist.hist, o.hist.bin_edges, o.lo, o.hi, percentile, methods=True)
    for n, q in qs.items():
        if n in acts:
            continue
        layer = model.get_submodule(owner(n))
        w = layer.weight.detach()
        h = HistogramCalibrator(num_bins=NUM_BINS, name=n)
        h.collect(w)
        lo, hi = torch.aminmax(w.to(torch.float32))
        stats[n] = _stats(n, q, h.hist, h.bin_edges, float(lo), float(hi), percentile, methods=False)
    return stats


def _ranked_rows(
    model: nn.Module,
    sample: list[Batch],
    refs,
    names: list[str],
    stats: dict[str, dict],
    only_disabled: bool,
    progress: Callable[[int], None] | None,
) -> list[dict]:
    """Sensitivity of each quantizer on the bounded sample, worst first, each row with its statistics."""
    ranked = rank(
        model, sample, {n: [n] for n in names}, refs, only_disabled=only_disabled, by="snr", progress=progress
    )
    rows = []
    for i, r in enumerate(ranked, 1):
        row = {
            "rank": i,
            "quantizer": r.unit,
            "kind": "weight" if r.unit.endswith("weight_quantizer") else "input",
            "only_enabled": r.only_enabled.to_dict(),
            "only_disabled": None if r.only_disabled is None else r.only_disabled.to_dict(),
        }
        row.update(stats[r.unit])
        rows.append(row)
    return rows
