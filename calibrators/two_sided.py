"""``[min, max]`` ranges for asymmetric quantizers (an unsigned grid with a zero point) as pure functions of
two histograms, one of ``max(x, 0)`` and one of ``max(-x, 0)``, each over ``[0, 2**e)`` (both sides of
:class:`calibrators.signed_histogram.SignedHistogramCalibrator`, which collects them in one pass, exactly
order-invariant and merged across ranks bin for bin), and the data's own ``min`` and ``max``.

A negative value is counted as a zero in the positive histogram and the other way round: a zero lies in bin 0
and quantizes to the zero point's code, exactly, whatever the range, so it changes neither search.

- percentile: each tail clipped at ``percentile`` % of all values. ``max`` is the right edge of the first bin
  of ``max(x, 0)`` where the cumulative count reaches ``percentile`` % of the total, which is the value
  above which ``100 - percentile`` % of ``x`` lie; ``min`` likewise from ``max(-x, 0)``.
- mse: the ``(min, max)`` minimising ``sum_j hist[j] * (c_j - fq(c_j; min, max))**2`` over the bin centres
  of both sides, with ``fq`` the deployed arithmetic (``affine_qparams`` and ONNX Quantize/DequantizeLinear
  in float32). The two ends share one scale and zero point, so the error is not a sum of two one-sided
  searches: the search alternates, the best ``max`` for the current ``min`` over every candidate edge, then
  the best ``min`` for that ``max``, until neither moves. It starts from the data's range, which is a
  candidate on both sides, so the result's error is never above that of ``min``/``max``.

Both return ``(min, max)`` as float32 0-d tensors with ``min <= 0 <= max``, inside the data's range.
"""

from __future__ import annotations

import math

import torch

from calibrators.histogram import compute_amax_percentile
from quantcli import defaults
from quantcli.quant import arithmetic


def _side(hist: torch.Tensor, edges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One side's non-empty bins: ``(counts float64, centres float64)``, flat."""
    h = torch.as_tensor(hist).to(torch.float64).reshape(-1)
    e = torch.as_tensor(edges).to(torch.float64).reshape(-1)
    if e.numel() != h.numel() + 1:
        raise ValueError(f"hist of {h.numel()} bins and {e.numel()} edges do not fit: need edges = bins + 1")
    centres = (e[:-1] + e[1:]) / 2
    keep = h > 0
    return h[keep], centres[keep]


def _limits(lo_data, hi_data) -> tuple[torch.Tensor, torch.Tensor]:
    lo = torch.as_tensor(lo_data, dtype=torch.float32).reshape(()).clamp(max=0.0)
    hi = torch.as_tensor(hi_data, dtype=torch.float32).reshape(()).clamp(min=0.0)
    return lo, hi


def range_percentile(
    pos_hist, pos_edges, neg_hist, neg_edges, lo_data, hi_data, percentile: float = defaults.PERCENTILE
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` clipping ``100 - percentile`` % of the values at each end (see the module)."""
    lo, hi = _limits(lo_data, hi_data)
    top = torch.as_tensor(compute_amax_percentile(pos_hist, pos_edges, percentile), dtype=torch.float32)
    bottom = torch.as_tensor(compute_amax_percentile(neg_hist, neg_edges, percentile), dtype=torch.float32)
    return torch.maximum(-bottom.reshape(()), lo), torch.minimum(top.reshape(()), hi)


def _candidates(edges, limit: torch.Tensor, start_bin: int, stride: int) -> torch.Tensor:
    """One side's candidate ends (``>= 0``, float32): the edges below the data's extreme ``limit``, from
    ``start_bin / bins`` of the side's own power-of-two range (``[0, 2**e)``, ``limit < 2**e``) on, every
    ``stride``-th, and ``limit`` itself. With a histogram over the side's own range, that is the edges
    ``start_bin, start_bin + stride, ...``; one over a wider range (both sides of a
    :class:`calibrators.signed_histogram.SignedHistogramCalibrator` share one) starts as far into this
    side."""
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    e = torch.as_tensor(edges).to(torch.float64).reshape(-1)
    n = e.numel() - 1
    wider = max(0, math.frexp(float(e[-1]))[1] - 1 - math.frexp(float(limit))[1])  # doublings beyond it
    idx = torch.arange(max(1, min(start_bin, n) >> wider), n + 1, stride)
    vals = e[idx].to(torch.float32)
    return torch.cat([vals[vals < limit], limit.reshape(1)])


def _points(sides) -> tuple[torch.Tensor, torch.Tensor]:
    """Both sides' bin centres as one signed row, ``(1, bins)`` float32 (as they would be quantized), and
    their counts, float64 ``(bins,)``."""
    values = torch.cat([c if sign > 0 else -c for sign, (_, c) in zip((1, -1), sides)])
    return values.to(torch.float32).view(1, -1), torch.cat([h for h, _ in sides])


def _errors(lo: torch.Tensor, hi: torch.Tensor, points, num_bits: int) -> torch.Tensor:
    """Squared error of every ``(lo[k], hi[k])`` pair over the bins (:func:`_points`), float64 ``(K,)``: each
    bin centre quantized and dequantized in float32 as deployed (``affine_qparams``, then ONNX
    QuantizeLinear's round-half-even and clamp to the unsigned grid, DequantizeLinear), in place on one ``(K,
    bins)`` buffer; the squared differences summed in float64."""
    x, counts = points
    qmax = float((1 << num_bits) - 1)
    scale, zp = arithmetic.affine_qparams_of(lo, hi, qmax)  # (K,) float32, as deployed; lo <= 0 <= hi
    s, z = scale.view(-1, 1), zp.view(-1, 1)
    e = torch.div(x, s)  # then code, clamped, dequantized, less x: all in place
    e.round_().add_(z).clamp_(0.0, qmax).sub_(z).mul_(s).sub_(x)
    return torch.mv(e.square_().to(torch.float64), counts)


def _best(lo: torch.Tensor, hi: torch.Tensor, points, num_bits: int, chunk: int) -> int:
    """Index of the pair with the least error (the first among equals), in chunks of ``chunk`` pairs."""
    errs = torch.cat(
        [_errors(lo[a : a + chunk], hi[a : a + chunk], points, num_bits) for a in range(0, len(lo), chunk)]
    )
    return int(torch.argmin(errs))


#: the search's strides: every 128th candidate first, then every 8th near that result, then each near that
STRIDES = (128, 8, 1)


def _near(cands: torch.Tensor, v: torch.Tensor, radius: int, stride: int) -> torch.Tensor:
    """Every ``stride``-th candidate within ``radius`` places of the one nearest ``v``, that one included."""
    i = int(torch.argmin((cands - v).abs()))
    return cands[i % stride + max(0, i - radius) // stride * stride : i + radius + 1 : stride]


def _descend(los, his, lo, hi, points, num_bits: int, chunk: int, max_rounds: int):
    """Alternate from ``(lo, hi)``: the best of ``his`` for the current ``lo``, then the best of ``los`` for
    that, until neither moves; the current pair competes as a candidate, so the error never rises."""
    for r in range(max_rounds):
        hs = torch.cat([his, hi.reshape(1)])
        new_hi = hs[_best(lo.expand(hs.shape), hs, points, num_bits, chunk)]
        if r and bool(new_hi == hi):
            break  # lo is the best for this hi already: the last round chose it
        ls = torch.cat([los, lo.reshape(1)])
        new_lo = ls[_best(ls, new_hi.expand(ls.shape), points, num_bits, chunk)]
        if bool(new_hi == hi) and bool(new_lo == lo):
            break
        lo, hi = new_lo, new_hi
    return lo, hi


def range_mse(
    pos_hist,
    pos_edges,
    neg_hist,
    neg_edges,
    lo_data,
    hi_data,
    num_bits: int = 8,
    start_bin: int = 128,
    stride: int = 1,
    max_rounds: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of least squared error on the affine grid (see the module). Candidates per side: the
    edges from ``start_bin`` on, every ``stride``, below the data's extreme, and the extreme itself."""
    if not isinstance(num_bits, int):
        raise ValueError(f"asymmetric ranges are for integer grids, got num_bits={num_bits!r}")
    arithmetic.check_num_bits(num_bits)
    lo, hi = _limits(lo_data, hi_data)
    points = _points((_side(pos_hist, pos_edges), _side(neg_hist, neg_edges)))
    if float(points[1].sum()) <= 0:
        raise ValueError("the histograms are empty (no values collected)")
    chunk = max(1, (1 << 22) // max(1, points[1].numel()))  # pairs x bins per evaluation: 48 MiB at most
    his = _candidates(pos_edges, hi, start_bin, stride)
    los = -_candidates(neg_edges, -lo, start_bin, stride)
    # coarse to fine (STRIDES): about 30x fewer evaluations than the full alternation, the error being smooth
    # at the scale of a stride (a test holds the result to a brute-force grid's error on the raw data)
    lo, hi = _descend(los[:: STRIDES[0]], his[:: STRIDES[0]], lo, hi, points, num_bits, chunk, max_rounds)
    for radius, step in zip(STRIDES, STRIDES[1:]):
        lo_c, hi_c = _near(los, lo, radius, step), _near(his, hi, radius, step)
        lo, hi = _descend(lo_c, hi_c, lo, hi, points, num_bits, chunk, max_rounds)
    return lo.clone(), hi.clone()


#: the range search behind each histogram method for asymmetric quantizers; ``entropy`` (TensorRT's search of
#: a symmetric threshold by KL divergence) has none: those quantizers keep the data's min and max
METHODS = {"percentile": range_percentile, "mse": range_mse}
