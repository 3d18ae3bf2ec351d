"""Every histogram search of one model at once: one call per kind of search, not one per quantizer.

``calibrate()`` ends with an amax search per activation quantizer (:mod:`calibrators.histogram`) or, for an
asymmetric one, a range search (:mod:`calibrators.two_sided`). The searches are pure functions of a histogram
and take many rows at once (a per-channel histogram is rows), so the histograms of all quantizers with the
same settings on one device are stacked into rows and searched together: one call, chunked by the device's
memory, instead of one per quantizer with its own small kernels and, on a GPU, its own reads back to the host.
A row's result depends on that row alone (its own candidates, its own float64 re-scoring of near ties), so
each quantizer gets what its own search gives; the results are kept with the calibrators
(:meth:`calibrators.base.Calibrator.keep_result`), which return them from ``compute_amax`` /
``compute_range`` until their statistics change.

Batched: ``entropy``, ``mse`` and ``percentile`` of :class:`calibrators.HistogramCalibrator`, ``percentile``
of :class:`calibrators.two_sided_calibrator.TwoSidedHistogramCalibrator`, and its ``mse`` on a device
(:func:`calibrators.two_sided.ranges_mse`: the alternating descent of every quantizer in step, over every
bin; on the CPU each quantizer's own search, over its non-empty bins only, costs several times less and is
kept).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from calibrators.counting import sides_of_signed
from calibrators.histogram import METHODS, compute_amax_percentile
from calibrators.histogram_calibrator import HistogramCalibrator, edges_of
from calibrators.two_sided import ranges_mse
from calibrators.two_sided_calibrator import TwoSidedHistogramCalibrator
from quantcli import defaults
from quantcli.errors import CalibrationError


def search_histograms(calibrators: Iterable, method: str, kwargs: dict | None = None) -> int:
    """Search ``method``'s amax for every :class:`HistogramCalibrator` among ``calibrators`` that has data,
    one call per group of equal settings; returns the number searched. Calibrators whose search would raise
    (no data, only zeros with ``skip_zeros``, entropy on an FP8 grid) are left out: their own ``compute_amax``
    raises as before, with their name."""
    kwargs = dict(kwargs or {})
    groups: dict[tuple, list] = {}
    for c in calibrators:
        if not isinstance(c, HistogramCalibrator) or c.num_batches == 0:
            continue
        kw = c.search_kwargs(method, kwargs)
        if method == "entropy" and isinstance(kw.get("num_bits"), (tuple, list)):
            continue
        if c.kept_result(c.result_key(method, kwargs)) is not None:
            continue
        try:
            hist, exp = c.search_counts()
        except (CalibrationError, ValueError):
            continue
        key = (tuple(sorted(kw.items())), c.num_bins, hist.device)
        groups.setdefault(key, []).append((c, hist, exp))
    searched = 0
    for (kw, nb, _), items in groups.items():
        # the rows of every calibrator at once: one concatenation, one set of edges
        hist = torch.cat([h for _, h, _ in items]).to(torch.float64)
        edges = edges_of(torch.cat([e for _, _, e in items]), nb)
        amax = METHODS[method](hist, edges, **dict(kw))
        rows = [h.shape[0] for _, h, _ in items]
        parts = amax.unbind(0) if set(rows) == {1} else amax.split(rows)  # (one operation for all)
        for (c, _, _), part in zip(items, parts):
            c.keep_result(c.result_key(method, kwargs), c.shaped(part))
            searched += 1
    return searched


def mse_together(device: torch.device) -> bool:
    """Whether the asymmetric ``mse`` searches on ``device`` run together (see the module)."""
    return device.type != "cpu"


def search_ranges(calibrators: Iterable, method: str, kwargs: dict | None = None) -> int:
    """The asymmetric ``percentile`` range of every :class:`TwoSidedHistogramCalibrator` among ``calibrators``
    with data, and the ``mse`` one of those on a device (:func:`mse_together`), one call per group of equal
    settings on one device; returns the number searched."""
    if method not in ("percentile", "mse"):
        return 0
    kwargs = dict(kwargs or {})
    percentile = kwargs.get("percentile", defaults.PERCENTILE)
    groups: dict[tuple, list] = {}
    for c in calibrators:
        if not isinstance(c, TwoSidedHistogramCalibrator) or c.num_batches == 0:
            continue
        if c.kept_result(c.result_key(method, kwargs)) is not None:
            continue
        try:
            lo, hi = c.extremes.compute_range()
            hist, exp = c.histogram.search_counts()
        except (CalibrationError, ValueError):
            continue
        if method == "mse" and not mse_together(hist.device):
            continue
        groups.setdefault((c.num_bins, hist.device, c.num_bits), []).append((c, hist, exp, lo, hi))
    searched = 0
    for (nb, device, num_bits), items in groups.items():
        hist = torch.cat([h for _, h, _, _, _ in items]).to(torch.float64)
        exp = torch.cat([e.to(device) for _, _, e, _, _ in items])
        edges = edges_of(exp, nb)
        pos, neg = sides_of_signed(hist, nb)
        # the data's (min, max) of every row, already widened to include 0 (0-d each)
        lo_all = torch.stack([lo.to(device) for _, _, _, lo, _ in items])
        hi_all = torch.stack([hi.to(device) for _, _, _, _, hi in items])
        if method == "mse":
            kw = {k: v for k, v in kwargs.items() if k != "num_bits"}
            lows, highs = ranges_mse(pos, neg, edges, lo_all, hi_all, num_bits=num_bits, **kw)
        else:  # within the data's range
            highs = compute_amax_percentile(pos, edges, percentile).to(torch.float32)
            lows = compute_amax_percentile(neg, edges, percentile).to(torch.float32)
            lows, highs = torch.maximum(lows.neg_(), lo_all), torch.minimum(highs, hi_all)
        for (c, *_), found in zip(items, zip(lows.unbind(0), highs.unbind(0))):  # (one operation for all)
            c.keep_result(c.result_key(method, kwargs), found)
            searched += 1
    return searched
