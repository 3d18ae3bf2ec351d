"""amax methods as pure functions of a histogram of ``|x|``: entropy, mse, percentile.

Each takes ``hist`` of shape ``(bins,)`` or ``(channels, bins)`` and ``bin_edges`` of shape ``(bins + 1,)``
(shared) or ``(channels, bins + 1)``, as numpy arrays or tensors (on any device), and returns amax as a
tensor of shape ``()`` or ``(channels,)`` (a numpy array when given numpy). All candidates are evaluated
at once with tensor ops; only channels are processed in chunks to bound memory.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from calibrators.methods import HISTOGRAM_METHODS
from quantcli import defaults
from quantcli.errors import CalibrationError
from quantcli.quant import arithmetic


def _chunk_elements(device: torch.device) -> int:
    """candidates x bins x channels evaluated at once. On the CPU about one 2048-bin channel (a couple of
    MiB per temporary, cache-resident: larger chunks measured 2-3x slower per element); on a GPU as many as
    its free memory holds with room to spare (the searches' temporaries take 16-32 bytes per element: 1/32 of
    the free bytes, between 2**24 and 2**27), so the searches of a whole model (calibrators.batched) run in a
    few chunks, each with its few reads back to the host."""
    if device.type != "cuda":
        return 1 << 18
    free, _ = torch.cuda.mem_get_info(device)
    return int(min(1 << 27, max(1 << 24, free // 32)))


def _prepare(hist, bin_edges):
    was_numpy = isinstance(hist, np.ndarray)
    h = torch.as_tensor(hist).to(torch.float64)
    e = torch.as_tensor(bin_edges, device=h.device).to(torch.float64)
    squeeze = h.dim() == 1
    if squeeze:
        h = h.unsqueeze(0)
    if e.dim() == 1:
        e = e.unsqueeze(0).expand(h.shape[0], -1)
    if h.dim() != 2 or e.shape != (h.shape[0], h.shape[1] + 1):
        raise ValueError(
            f"hist {tuple(h.shape)} and bin_edges {tuple(e.shape)} do not fit: need edges = bins + 1"
        )
    if (h.sum(dim=1) <= 0).any():
        raise CalibrationError("the histogram is empty (no values collected)")
    return h, e, squeeze, was_numpy


def _finish(amax: torch.Tensor, squeeze: bool, was_numpy: bool):
    amax = amax.to(torch.float32)
    if squeeze:
        amax = amax.reshape(())
    return amax.cpu().numpy() if was_numpy else amax


def _candidate_start(num_bins: int, start_bin: int, stride: int) -> int:
    """The first candidate edge of ``range(start, num_bins + 1, stride)``, after checking ``stride``."""
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    return max(1, min(start_bin, num_bins))


def _candidates(num_bins: int, start_bin: int, stride: int, device) -> torch.Tensor:
    return torch.arange(_candidate_start(num_bins, start_bin, stride), num_bins + 1, stride, device=device)


def _data_end(h: torch.Tensor) -> torch.Tensor:
    """Per row, one past the last non-empty bin: candidates beyond it clip nothing and only coarsen the
    grid."""
    nz = (h > 0).to(torch.long)
    pos = torch.arange(1, h.shape[1] + 1, device=h.device).unsqueeze(0)
    return (nz * pos).amax(dim=1)  # (C,)


def _pick(
    cand: torch.Tensor, score: torch.Tensor, stop: torch.Tensor, last: bool, valid=None
) -> torch.Tensor:
    """Best candidate per row among those <= stop (the row's data end); stop itself if none is. ``valid``:
    that mask, if the caller has it; ``None`` where every candidate is valid (a single row)."""
    if valid is None and score.shape[0] > 1:
        valid = cand.view(1, -1) <= stop.view(-1, 1)
    if valid is None:
        j = _last_argmin(score) if last else torch.argmin(score, dim=-1)
        return cand[j]
    score = torch.where(valid, score, torch.full_like(score, float("inf")))
    j = _last_argmin(score) if last else torch.argmin(score, dim=-1)
    return torch.where(valid.any(1), cand[j], stop)


def _last_argmin(values: torch.Tensor) -> torch.Tensor:
    """Index of the minimum along the last dim, the last one among equal minima."""
    n = values.shape[-1]
    return n - 1 - torch.argmin(values.flip(-1), dim=-1)


def _bounds(cand: torch.Tensor, nq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For candidates ``i``: the ``nq + 1`` boundaries ``ceil(k * i / nq)`` between quantization bins (bin k
    holds source bins ``[b_k, b_{k+1})``), flattened, and the quantization bin of source bin ``i - 1``."""
    i = cand.view(-1, 1)
    k = torch.arange(nq + 1, device=cand.device).view(1, -1)
    return ((k * i + nq - 1) // nq).reshape(-1), ((cand - 1) * nq) // cand


@functools.lru_cache(maxsize=32)
def _range_bounds(
    start: int, stop: int, step: int, nq: int, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``range(start, stop, step)`` as a tensor and its :func:`_bounds`: data-independent, so cached. The
    bounds of the first ``K`` candidates are the first ``K * (nq + 1)`` entries."""
    cand = torch.arange(start, stop, step, device=device)
    return (cand, *_bounds(cand, nq))


def _entropy_tables(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact prefix sums the divergences are built from, shared by the float32 screening and the float64
    re-scoring: mass and non-empty count below each bin edge (stacked, int64, ``(2, C, B + 1)``), the totals
    ``(C, 1)`` and ``sum p log p`` below each edge (float64, ``(C, B + 1)``)."""
    counts = h.round().to(torch.long)
    pre = F.pad(torch.stack([counts.cumsum(1), (counts > 0).to(torch.long).cumsum(1)]), (1, 0))
    total = pre[0, :, -1:].to(torch.float64)
    p = h / total
    return pre, total, F.pad(torch.xlogy(p, p).cumsum(1), (1, 0))


def _bin_terms(tables, bounds: torch.Tensor, k_last: torch.Tensor, nq: int, dtype: torch.dtype):
    """Per candidate (columns): ``sum_k s_k log(s_k / n_k)`` over its ``nq`` quantization bins, and the mass
    and non-empty count of the bin holding source bin ``i - 1``; float64 ``(C, K)`` each.

    ``s_k``, ``n_k`` are exact: differences of float32 prefix sums while every total is below 2**24, of
    integer ones beyond. Only the ``(K, nq)`` logarithms and their sum are evaluated in ``dtype``."""
    pre, total = tables[0], tables[1]
    c_rows = pre.shape[1]
    flat = pre.view(2 * c_rows, -1)
    most = float(total.max())
    if dtype == torch.float64 or most < 2**24:
        per_bin = torch.diff(flat.to(dtype).index_select(1, bounds).view(2 * c_rows, -1, nq + 1), dim=-1)
    else:  # large totals: float32 prefix sums would round, their differences are computed as integers
        narrow = flat.to(torch.int32) if most < 2**31 else flat
        per_bin = torch.diff(narrow.index_select(1, bounds).view(2 * c_rows, -1, nq + 1), dim=-1).to(dtype)
    s_k, n_k = per_bin[:c_rows], per_bin[c_rows:]  # (C, K, nq) each
    idx_last = k_last.view(1, -1, 1).expand(c_rows, -1, 1)
    s_last = s_k.gather(2, idx_last).view(c_rows, -1).to(torch.float64)
    n_last = n_k.gather(2, idx_last).view(c_rows, -1).to(torch.float64)
    # 0 log 0 = 0: n_k = 0 only where s_k = 0, and where s_k > 0 the ratio is at least 1 (each non-empty bin
    # holds a sample), far above the floor that keeps log finite at s_k = 0 (log is vectorised; xlogy is not)
    ratio = n_k.clamp_(min=1)  # in place: n_last is taken
    torch.div(s_k, ratio, out=ratio)
    inner = ratio.clamp_(min=1e-30).log_().mul_(s_k).sum(-1).to(torch.float64)
    return inner, s_last, n_last


def _entropy_divergences(
    h: torch.Tensor,
    tables,
    cand: torch.Tensor,
    inner: torch.Tensor,
    s_last: torch.Tensor,
    n_last: torch.Tensor,
) -> torch.Tensor:
    """KL(P_i || Q_i) for every candidate i (columns), as TensorRT's calibrator defines them.

    P_i: the first i bins, with the mass beyond bin i added to bin i-1. Q_i: the first i bins merged into
    ``nq`` quantization bins (bin j goes to ``floor(j * nq / i)``), each bin's mass spread evenly over its
    non-empty source bins. From the exact prefix sums of :func:`_entropy_tables` and the per-bin terms of
    :func:`_bin_terms`, so no loop over candidates or bins:

        T sum_j p_j log q_j = sum_k s_k log(s_k / n_k) - S_i log S_i + out_i log q_last

    with ``s_k``, ``n_k`` the mass and non-empty count of quantization bin k, ``S_i`` the mass below i,
    ``out_i`` the mass beyond it and ``q_last = s_last / (n_last S_i)`` the value Q gives bin ``i - 1``.
    """
    pre, total, plogp = tables
    iv = cand.view(1, -1).expand(h.shape[0], -1)
    sum_i = pre[0].gather(1, iv).to(torch.float64)  # an integer: (C, K)
    out_i = total - sum_i
    b_last = h.gather(1, iv - 1)
    q_last = s_last / (n_last.clamp(min=1) * sum_i.clamp(min=1))
    # 0 log 0 = 0 throughout; a zero q_last where out_i > 0 is the impossible case below
    cross = (inner - torch.xlogy(sum_i, sum_i) + torch.xlogy(out_i, q_last)) / total
    u = (b_last + out_i) / total
    kl = plogp.gather(1, iv - 1) + torch.xlogy(u, u) - cross
    impossible = ((out_i > 0) & (b_last == 0)) | (sum_i <= 0)  # Q is zero where P is not
    return kl.masked_fill_(impossible | kl.isnan(), float("inf"))


def compute_amax_entropy(
    hist, bin_edges, num_bits: int = 8, unsigned: bool = False, stride: int = 1, start_bin: int = 128
):
    """amax minimising the KL divergence between the histogram and its quantized version (TensorRT).

    ``2**(num_bits - 1 + unsigned)`` quantization bins; candidates are bin edges ``start_bin, start_bin +
    stride, ...`` up to the last non-empty bin (larger ones clip nothing). As in TensorRT, the first bin's
    count is replaced by the second's, so a spike of exact zeros (ReLU) does not dominate. Ties go to the
    largest candidate. Candidates are screened with the ``(candidates, nq)`` logarithms in float32 (from exact
    bin masses: the error is below 1e-5 for any sample count), and those within 1e-4 of the best are scored
    again in float64, so the choice is the float64 evaluation's.

    Also as in TensorRT, a candidate whose last bin is empty while mass lies beyond it has infinite
    divergence (Q is zero where P is not). An isolated outlier beyond an empty gap is therefore clipped only
    when the bulk of the data reaches past ``start_bin``; lower ``start_bin`` for such data.
    """
    if isinstance(num_bits, (tuple, list)):
        raise ValueError("entropy calibration is defined for integer formats; use mse or percentile for FP8")
    h, e, squeeze, was_numpy = _prepare(hist, bin_edges)
    h = h.clone()
    num_bins = h.shape[1]
    if num_bins > 1:
        h[:, 0] = h[:, 1]
    nq = 1 << (num_bits - 1 + int(unsigned))
    start = _candidate_start(num_bins, start_bin, stride)
    all_cand, all_bounds, all_last = _range_bounds(start, num_bins + 1, stride, nq, str(h.device))
    stop = _data_end(h)
    per_row = max(1, _chunk_elements(h.device) // (all_cand.numel() * nq))
    best = [
        _entropy_best(
            h[r : r + per_row], stop[r : r + per_row], start, stride, nq, all_cand, all_bounds, all_last
        )
        for r in range(0, h.shape[0], per_row)
    ]
    idx = torch.cat(best) if len(best) > 1 else best[0]
    amax = e.gather(1, idx.view(-1, 1)).squeeze(1)
    return _finish(amax, squeeze, was_numpy)


def _entropy_best(
    hr: torch.Tensor,
    st: torch.Tensor,
    start: int,
    stride: int,
    nq: int,
    all_cand: torch.Tensor,
    all_bounds: torch.Tensor,
    all_last: torch.Tensor,
) -> torch.Tensor:
    """The entropy search for one chunk of histogram rows ``hr`` ``(rows, bins)`` whose data ends at bins
    ``st``: per row, the index of the bin edge with the smallest KL divergence (see
    :func:`compute_amax_entropy`). ``all_cand``, ``all_bounds``, ``all_last``: every candidate of the range
    and its quantization bins (:func:`_range_bounds`)."""
    # candidates past the data clip nothing: the first n of the range are those up to the chunk's data end
    n = max(0, (int(st.max()) - start) // stride + 1)
    if n == 0:
        return st
    cr, bounds, k_last = all_cand[:n], all_bounds[: n * (nq + 1)], all_last[:n]
    # a candidate whose last bin is empty while mass lies beyond it has infinite divergence: skip it
    # (the data end itself clips nothing and always stays)
    alive = (hr.index_select(1, cr - 1) > 0).any(0) | (cr.view(1, -1) == st.view(-1, 1)).any(0)
    if int(alive.sum()) < 0.75 * n:  # worth an indexing pass
        cr, k_last = cr[alive], k_last[alive]
        bounds = bounds.view(n, nq + 1)[alive].reshape(-1)
        if cr.numel() == 0:
            return st
    tables = _entropy_tables(hr)
    kl = _entropy_divergences(hr, tables, cr, *_bin_terms(tables, bounds, k_last, nq, torch.float32))
    valid = cr.view(1, -1) <= st.view(-1, 1) if hr.shape[0] > 1 else None  # one row: every candidate is
    if valid is not None:
        kl = torch.where(valid, kl, float("inf"))
    low = kl.amin(dim=1, keepdim=True)
    near = torch.isfinite(kl) & (kl <= low + 1e-4 * (1 + low.abs()))
    # rescore the near-best exactly, unless each row has a single one (the float32 choice is then certain)
    if bool((near.sum(1) > 1).any()):
        cols = near.any(0)
        terms = _bin_terms(tables, bounds.view(-1, nq + 1)[cols].reshape(-1), k_last[cols], nq, torch.float64)
        exact = _entropy_divergences(hr, tables, cr[cols], *terms)
        kl = torch.full_like(kl, float("inf"))
        kl[:, cols] = torch.where(near[:, cols], exact, float("inf"))
    return _pick(cr, kl, st, last=True, valid=valid)


def _fake_quant_positive(centers: torch.Tensor, amax: torch.Tensor, num_bits, unsigned: bool) -> torch.Tensor:
    """Quantize-dequantize non-negative values with quantcli's arithmetic (float64 for the search)."""
    if isinstance(num_bits, (tuple, list)):
        scale = arithmetic.symmetric_scale(amax, arithmetic.FP8_E4M3_MAX)
        v = torch.clamp(
            centers.to(torch.float32) / scale.to(torch.float32),
            -arithmetic.FP8_E4M3_MAX,
            arithmetic.FP8_E4M3_MAX,
        )
        return v.to(torch.float8_e4m3fn).to(torch.float64) * scale.to(torch.float64)
    bound = arithmetic.symmetric_bound(num_bits, unsigned)
    scale = arithmetic.symmetric_scale(amax.to(torch.float32), bound)  # float32 scale, as deployed
    codes = arithmetic.quantize_linear(centers.to(torch.float32), scale, 0, 0, bound)
    return codes.to(torch.float64) * scale.to(torch.float64)


def _mse_errors_fast(hr: torch.Tensor, cr: torch.Tensor, amax_c: torch.Tensor, bound: int) -> torch.Tensor:
    """Integer-grid errors for every candidate in float32: ``s**2 * sum_j h_j (t_j - q(t_j))**2`` with ``t = c
    / s``, in blocks of candidates small enough to stay in cache, two reused buffers and a matrix-vector
    product for the weighted sum (one pass over a many-MiB grid per op cost more than the arithmetic)."""
    s = arithmetic.symmetric_scale(amax_c.to(torch.float32), bound)  # (c, K) float32, as deployed
    c32, h32 = cr.to(torch.float32).unsqueeze(1), hr.to(torch.float32).unsqueeze(-1)  # (c, 1, B'), (c, B', 1)
    rows, k_all, width = s.shape[0], s.shape[1], cr.shape[1]
    # blocks of about _chunk_elements grid cells: on the CPU two reused 1 MiB buffers, 1.1-4x faster on the
    # sample models' histograms than one pass per op over a grid of up to 16 MiB (allocated afresh per call)
    step = min(k_all, max(1, _chunk_elements(cr.device) // max(1, rows * width)))
    t_buf = torch.empty(rows, step, width, device=cr.device)
    q_buf = torch.empty_like(t_buf)
    err = torch.empty_like(s)
    for a in range(0, k_all, step):
        k = min(step, k_all - a)
        t, q = t_buf[:, :k], q_buf[:, :k]
        torch.div(c32, s[:, a : a + k].unsqueeze(-1), out=t)
        torch.round(t, out=q).clamp_(0, bound)
        t.sub_(q).square_()
        err[:, a : a + k] = torch.matmul(t, h32).squeeze(-1)
    return err * (s * s)


def compute_amax_mse(
    hist, bin_edges, num_bits=8, unsigned: bool = False, stride: int = 1, start_bin: int = 128
):
    """amax minimising ``sum_j hist[j] * (c_j - fq(c_j; amax))**2`` over bin centres ``c_j``.

    ``fq`` is quantcli's own fake quantization (float32 scale ``amax / bound``) for integer ``num_bits``, or
    FP8 E4M3 for ``num_bits=(4, 3)``. Candidates: bin edges ``start_bin, start_bin + stride, ...`` up to the
    end of the data. Integer grids are scored in float32 first; the candidates within 1e-3 of the best are
    then scored again in float64, so the chosen bin is the one an exact evaluation picks.
    """
    h, e, squeeze, was_numpy = _prepare(hist, bin_edges)
    cand = _candidates(h.shape[1], start_bin, stride, h.device)
    centers = (e[:, :-1] + e[:, 1:]) / 2  # (C, B)
    stop = _data_end(h)
    per_row = max(1, _chunk_elements(h.device) // (cand.numel() * h.shape[1]))
    fp8 = isinstance(num_bits, (tuple, list))
    out = []
    for r in range(0, h.shape[0], per_row):
        hr, cr, er, st = (
            h[r : r + per_row],
            centers[r : r + per_row],
            e[r : r + per_row],
            stop[r : r + per_row],
        )
        ck = cand[cand <= st.max()]
        if ck.numel() == 0:
            out.append(er.gather(1, st.view(-1, 1)).squeeze(1))
            continue
        amax_c = er[:, ck]  # (c, K)
        # only non-empty bins contribute; drop columns empty in every row of the chunk
        keep = (hr > 0).any(0)
        hr, cr = hr[:, keep], cr[:, keep]
        if fp8:
            err = _mse_exact(hr, cr, amax_c, num_bits, unsigned)
        else:
            err = _mse_errors_fast(hr, cr, amax_c, arithmetic.symmetric_bound(num_bits, unsigned)).to(
                torch.float64
            )
            valid = ck.view(1, -1) <= st.view(-1, 1)
            best = torch.where(valid, err, torch.full_like(err, float("inf"))).amin(dim=1, keepdim=True)
            close = valid & (err <= best * (1 + 1e-3) + 1e-30)
            if bool((close.sum(1) > 1).any()):  # rescore near-ties exactly; a lone near-best is certain
                rows, cols = close.nonzero(as_tuple=True)
                exact = _mse_exact_pairs(hr[rows], cr[rows], amax_c[rows, cols], num_bits, unsigned)
                err = torch.full_like(err, float("inf"))
                err[rows, cols] = exact
        best = _pick(ck, err, st, last=False)
        out.append(er.gather(1, best.view(-1, 1)).squeeze(1))
    return _finish(torch.cat(out), squeeze, was_numpy)


def _mse_exact(hr, cr, amax_c, num_bits, unsigned) -> torch.Tensor:
    fq = _fake_quant_positive(cr.unsqueeze(1), amax_c.unsqueeze(-1), num_bits, unsigned)  # (c, K, B')
    return ((cr.unsqueeze(1) - fq) ** 2 * hr.unsqueeze(1)).sum(-1)


def _mse_exact_pairs(h_rows, c_rows, amax, num_bits, unsigned) -> torch.Tensor:
    """Exact float64 errors for (row, candidate) pairs: ``h_rows``/``c_rows`` (P, B'), ``amax`` (P,)."""
    fq = _fake_quant_positive(c_rows, amax.unsqueeze(-1), num_bits, unsigned)
    return ((c_rows - fq) ** 2 * h_rows).sum(-1)


def compute_amax_percentile(hist, bin_edges, percentile: float = defaults.PERCENTILE):
    """The right edge of the first bin where the cumulative count reaches ``percentile`` % of the total."""
    if not 0 < percentile <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {percentile}")
    h, e, squeeze, was_numpy = _prepare(hist, bin_edges)
    cdf = h.cumsum(1)
    target = cdf[:, -1:] * (percentile / 100.0)
    idx = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=False).clamp(max=h.shape[1] - 1)
    amax = e.gather(1, idx + 1).squeeze(1)
    return _finish(amax, squeeze, was_numpy)


#: the search behind each name of :data:`calibrators.methods.HISTOGRAM_METHODS` (``compute_amax_<method>``, a
#: name the registry has and this module lacks fails at import), in the registry's order
METHODS = {m: globals()[f"compute_amax_{m}"] for m in HISTOGRAM_METHODS}
