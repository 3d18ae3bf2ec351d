"""Slow, obviously correct amax searches: one Python loop per candidate (and, in ``ref_entropy``, per bin).

The specification the vectorized methods in ``calibrators.histogram`` are tested against, and the references
the calibrator benchmark times them against: ``ref_entropy`` loops over bins in pure Python inside each
candidate (TensorRT's description, step by step); ``ref_entropy_vectorized`` is the fair reference, the same
per-candidate loop with each candidate's work vectorised over bins in numpy, as ``ref_mse`` is.
"""

import math

import numpy as np


def _entropy_search(hist, edges, num_bits, unsigned, stride, start_bin, divergence):
    """The candidate loop both entropy references share (TensorRT's description): for each candidate ``i``
    (the first ``i`` bins kept, the outliers folded into the last), the reference distribution ``p``, and
    ``divergence(bins, i, nq, p)``, the KL divergence of the ``nq``-level quantized ``q`` from it. Ties: the
    last (largest) candidate."""
    bins = np.array(hist, dtype=np.float64)
    bins[0] = bins[1]
    total = bins.sum()
    nq = 1 << (num_bits - 1 + int(unsigned))
    best_i, best_kl = None, math.inf
    stop = int(np.nonzero(np.asarray(hist))[0].max()) + 1  # candidates end where the data ends
    for i in range(start_bin, stop + 1, stride):
        p = bins[:i].copy()
        p[-1] += bins[i:].sum()
        p /= total
        kl = divergence(bins, i, nq, p)
        if kl <= best_kl:
            best_i, best_kl = i, kl
    return edges[best_i]


def _kl_loops(bins, i, nq, p) -> float:
    """KL(p || q), every step a Python loop over the ``i`` bins."""
    quant = [(j * nq) // i for j in range(i)]
    sums = np.zeros(nq)
    nnz = np.zeros(nq)
    for j in range(i):
        if bins[j] > 0:
            sums[quant[j]] += bins[j]
            nnz[quant[j]] += 1
    q = np.zeros(i)
    for j in range(i):
        if bins[j] > 0:
            q[j] = sums[quant[j]] / nnz[quant[j]]
    q /= q.sum()
    kl = 0.0
    for j in range(i):
        if p[j] > 0:
            kl = math.inf if q[j] == 0 else kl + p[j] * math.log(p[j] / q[j])
    return kl


def _kl_vectorized(bins, i, nq, p) -> float:
    """KL(p || q) as :func:`_kl_loops`, the loops over bins done by numpy (bincount, masks, one sum)."""
    quant = (np.arange(i) * nq) // i
    nz = bins[:i] > 0
    sums = np.bincount(quant, weights=np.where(nz, bins[:i], 0.0), minlength=nq)
    nnz = np.bincount(quant, weights=nz.astype(np.float64), minlength=nq)
    q = np.where(nz, sums[quant] / np.maximum(nnz[quant], 1.0), 0.0)
    q /= q.sum()
    m = p > 0
    return math.inf if np.any(q[m] == 0) else float(np.sum(p[m] * np.log(p[m] / q[m])))


def ref_entropy(hist, edges, num_bits=8, unsigned=False, stride=1, start_bin=128):
    return _entropy_search(hist, edges, num_bits, unsigned, stride, start_bin, _kl_loops)


def ref_entropy_vectorized(hist, edges, num_bits=8, unsigned=False, stride=1, start_bin=128):
    """``ref_entropy`` with each candidate's loops over bins done by numpy (bincount, masks, one sum)."""
    return _entropy_search(hist, edges, num_bits, unsigned, stride, start_bin, _kl_vectorized)


def ref_mse(hist, edges, num_bits=8, unsigned=False, stride=1, start_bin=128):
    bound = 2**num_bits - 1 if unsigned else 2 ** (num_bits - 1) - 1
    centers = (edges[:-1] + edges[1:]) / 2
    best, best_err = None, math.inf
    stop = int(np.nonzero(hist)[0].max()) + 1
    for i in range(start_bin, stop + 1, stride):
        a = np.float32(edges[i])
        s = np.float32(a / np.float32(bound))
        fq = np.clip(np.round(centers.astype(np.float32) / s), 0, bound).astype(np.float64) * np.float64(s)
        err = float(np.sum(hist * (centers - fq) ** 2))
        if err < best_err:
            best, best_err = edges[i], err
    return best
