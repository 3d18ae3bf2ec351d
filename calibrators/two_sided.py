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

from calibrators.histogram import compute_amax_entropy, compute_amax_percentile
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


def ranges_mse(
    pos_hist: torch.Tensor,
    neg_hist: torch.Tensor,
    edges: torch.Tensor,
    lo_data: torch.Tensor,
    hi_data: torch.Tensor,
    num_bits: int = 8,
    start_bin: int = 128,
    stride: int = 1,
    max_rounds: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`range_mse` of ``Q`` histograms at once, every step of the search for all of them together (on a
    GPU: a few dozen launches and host reads for a model instead of a few hundred per quantizer):
    ``pos_hist``, ``neg_hist`` ``(Q, bins)`` over the edges ``(Q, bins + 1)`` they share row by row,
    ``lo_data``, ``hi_data`` ``(Q,)``. Returns ``(min, max)`` as float32 ``(Q,)``.

    The same search as :func:`range_mse`, step for step: the candidates of each side, coarse to fine, the
    alternation and where each row stops. Two differences, neither in what is searched: every bin takes part
    (empty ones add exactly 0 to an error), and each error is summed in another order than ``torch.mv``'s, so
    where two candidates' errors are equal to float64 rounding the other may be kept (the errors agree to
    rounding; a test holds them to ``1e-9``)."""
    if not isinstance(num_bits, int):
        raise ValueError(f"asymmetric ranges are for integer grids, got num_bits={num_bits!r}")
    arithmetic.check_num_bits(num_bits)
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    dev = pos_hist.device
    lo = torch.as_tensor(lo_data, dtype=torch.float32, device=dev).reshape(-1).clamp(max=0.0)
    hi = torch.as_tensor(hi_data, dtype=torch.float32, device=dev).reshape(-1).clamp(min=0.0)
    e = edges.to(device=dev, dtype=torch.float64)
    centres = (e[:, :-1] + e[:, 1:]) / 2
    x = torch.cat([centres, -centres], 1).to(torch.float32)  # (Q, 2 bins): both sides' bin centres, signed
    counts = torch.cat([pos_hist, neg_hist], 1).to(device=dev, dtype=torch.float64)
    if bool((counts.sum(1) <= 0).any()):
        raise ValueError("the histograms are empty (no values collected)")
    sides = (_Side(e, hi, start_bin, stride), _Side(e, -lo, start_bin, stride))  # max's side, min's side
    points = (x, counts)
    # coarse to fine, as range_mse: every STRIDES[0]-th candidate, then near the result, then each near that
    his, los = (s.every(STRIDES[0]) for s in sides)
    lo, hi = _descend_all(los, his, lo, hi, points, num_bits, max_rounds)
    for radius, step in zip(STRIDES, STRIDES[1:]):
        los, his = sides[1].near(-lo, radius, step), sides[0].near(hi, radius, step)
        lo, hi = _descend_all(los, his, lo, hi, points, num_bits, max_rounds)
    return lo, hi


class _Side:
    """One side's candidates for every row, as :func:`_candidates` lists them: the edges from the row's first
    candidate on, every ``stride``-th, below the row's ``limit``, then ``limit`` itself (position ``m``), held
    as arithmetic (first edge, stride, count) instead of a list per row."""

    def __init__(self, e: torch.Tensor, limit: torch.Tensor, start_bin: int, stride: int):
        n = e.shape[1] - 1
        self.e32, self.limit, self.stride, self.sign = e.to(torch.float32), limit, stride, 1.0
        wider = (_exponent(e[:, -1]) - 1 - _exponent(limit)).clamp(min=0)  # doublings beyond the side's range
        self.first = torch.bitwise_right_shift(torch.full_like(wider, min(start_bin, n)), wider).clamp(min=1)
        self.width = n // stride + 1  # candidates a row can have below its limit, at most
        k = torch.arange(self.width, device=e.device)
        idx = self.first.unsqueeze(1) + k * stride
        below = (idx <= n) & (self.e32.gather(1, idx.clamp(max=n)) < limit.unsqueeze(1))
        self.m = below.sum(1)  # the limit's position: every edge before it is below the limit

    def values(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(candidate k of each row, valid)`` for ``k`` ``(Q, K)``: the edge, or the limit at ``k == m``."""
        n = self.e32.shape[1] - 1
        idx = (self.first.unsqueeze(1) + k * self.stride).clamp(max=n)
        edge = self.e32.gather(1, idx)
        m = self.m.unsqueeze(1)
        v = torch.where(k < m, edge, self.limit.unsqueeze(1).expand_as(edge))
        return v, (k >= 0) & (k <= m)

    def every(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every ``step``-th candidate from the first (``cands[::step]``)."""
        count = int(self.m.max()) // step + 1
        return self.values(torch.arange(count, device=self.m.device).unsqueeze(0) * step)

    def near(self, v: torch.Tensor, radius: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`_near` per row: every ``step``-th candidate within ``radius`` places of the one nearest
        ``v``."""
        k = torch.arange(self.width + 1, device=v.device).unsqueeze(0)
        cands, valid = self.values(k)
        dist = torch.where(valid, (cands - v.unsqueeze(1)).abs(), torch.full_like(cands, float("inf")))
        i = torch.argmin(dist, dim=1, keepdim=True)  # the first nearest, as argmin of the list
        start = i % step + (i - radius).clamp(min=0) // step * step
        ks = start + step * torch.arange(2 * radius // step + 1, device=v.device).unsqueeze(0)
        vals, ok = self.values(ks)
        return vals, ok & (ks <= i + radius)


def _exponent(v: torch.Tensor) -> torch.Tensor:
    """``math.frexp``'s exponent of each value (0 for 0), int64."""
    return torch.frexp(v)[1].to(torch.long)


def _errors_all(lo: torch.Tensor, hi: torch.Tensor, points, num_bits: int) -> torch.Tensor:
    """:func:`_errors` of pairs ``(Q, K)`` against each row's points: float64 ``(Q, K)``, in chunks of rows
    that keep the ``(rows, K, bins)`` temporaries near 64 MiB."""
    x, counts = points
    qmax = float((1 << num_bits) - 1)
    rows = max(1, (1 << 24) // max(1, lo.shape[1] * x.shape[1]))
    out = []
    for a in range(0, lo.shape[0], rows):
        scale, zp = arithmetic.affine_qparams_of(lo[a : a + rows], hi[a : a + rows], qmax)
        s, z = scale.unsqueeze(2), zp.unsqueeze(2)
        xr = x[a : a + rows].unsqueeze(1)
        err = torch.div(xr, s)
        err.round_().add_(z).clamp_(0.0, qmax).sub_(z).mul_(s).sub_(xr)
        out.append((err.square_().to(torch.float64) * counts[a : a + rows].unsqueeze(1)).sum(-1))
    return torch.cat(out)


def _best_all(lo, hi, valid, points, num_bits: int) -> torch.Tensor:
    """Per row, the index of the valid pair of least error (the first among equals)."""
    err = _errors_all(lo, hi, points, num_bits).masked_fill_(~valid, float("inf"))
    return torch.argmin(err, dim=1, keepdim=True)


def _descend_all(los, his, lo, hi, points, num_bits: int, max_rounds: int):
    """:func:`_descend` for every row in step: each row stops where its own alternation would, the others go
    on; candidates ``(values (Q, K), valid (Q, K))`` per side, ``lo``, ``hi`` ``(Q,)``."""
    (lv, lok), (hv, hok) = los, his
    lv, hv = -lv, hv  # the min side's candidates are the negated edges
    true = torch.ones_like(lo, dtype=torch.bool).unsqueeze(1)
    active = torch.ones_like(lo, dtype=torch.bool)
    for r in range(max_rounds):
        hs, hs_ok = torch.cat([hv, hi.unsqueeze(1)], 1), torch.cat([hok, true], 1)
        new_hi = hs.gather(1, _best_all(lo.unsqueeze(1).expand_as(hs), hs, hs_ok, points, num_bits)).squeeze(
            1
        )
        stop = (new_hi == hi) if r else torch.zeros_like(active)
        ls, ls_ok = torch.cat([lv, lo.unsqueeze(1)], 1), torch.cat([lok, true], 1)
        new_lo = ls.gather(
            1, _best_all(ls, new_hi.unsqueeze(1).expand_as(ls), ls_ok, points, num_bits)
        ).squeeze(1)
        stop = stop | ((new_hi == hi) & (new_lo == lo))
        move = active & ~stop
        lo, hi = torch.where(move, new_lo, lo), torch.where(move, new_hi, hi)
        active = move
        if not bool(active.any()):
            break
    return lo, hi


def range_entropy(
    pos_hist, pos_edges, neg_hist, neg_edges, lo_data, hi_data, num_bits: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)``: the data's range clipped at ``±T``, ``T`` the entropy (KL divergence, TensorRT's)
    threshold of ``|x|``'s histogram for a signed ``num_bits`` grid. ``|x|``'s histogram is the two sides'
    counts added bin for bin (one set of edges), less the other sign's values each side counts in its bin 0.
    A candidate of ``--method auto`` for asymmetric quantizers, which compares it on the layer's output; not
    ``--method entropy``'s (those quantizers keep the data's min and max: :data:`METHODS`)."""
    if not torch.equal(torch.as_tensor(pos_edges), torch.as_tensor(neg_edges)):
        raise ValueError("range_entropy needs both sides over one set of edges")
    pos = torch.as_tensor(pos_hist).to(torch.float64).reshape(-1)
    neg = torch.as_tensor(neg_hist).to(torch.float64).reshape(-1)
    absolute = pos + neg
    absolute[0] -= pos.sum()  # each side counts every value of the other sign (and each zero) in its bin 0
    lo, hi = _limits(lo_data, hi_data)
    t = torch.as_tensor(compute_amax_entropy(absolute.clamp(min=0), pos_edges, num_bits), dtype=torch.float32)
    t = t.reshape(())
    return torch.maximum(-t, lo), torch.minimum(t, hi)


#: the range search behind each histogram method for asymmetric quantizers; ``entropy`` (TensorRT's search of
#: a symmetric threshold by KL divergence) has none: those quantizers keep the data's min and max
#: (:func:`range_entropy` is ``--method auto``'s candidate only)
METHODS = {"percentile": range_percentile, "mse": range_mse}
