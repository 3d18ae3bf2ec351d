"""What onnxruntime's uint8 x int8 kernels compute on an x86 CPU without VNNI, as small pure functions.

The AVX2 (and AVX-512 without VNNI) GEMM and convolution kernels multiply with ``VPMADDUBSW``: each pair of
adjacent uint8 x int8 products along the reduction axis K is added into a *saturating* signed 16-bit lane, and
only then widened to int32 (``VPMADDWD``). 255 * 127 * 2 = 64770 does not fit in 16 bits, so a pair of large
products clips at 32767. VNNI (``VPDPBUSD``) adds in 32 bits and never clips. x86 runs int8 activations as
uint8 (code + 128), so even small activations make large products.

Checked on an AVX2-only CPU against onnxruntime 1.31's fused kernels (``MatMulIntegerToFloat``,
``QLinearConv`` with groups 1 and 2): :func:`saturated_sums` reproduces the deployed int32 sums exactly; the
pairing follows K in the kernels' order, ``(k_spatial..., cin)`` per group for a convolution (onnxruntime's
NHWC im2col), the input dimension for a GEMM; padding is the activation's zero point. Depthwise convolutions
(one input channel per group, as many groups as inputs and outputs) run a kernel that does not saturate.

A weight grid cannot saturate when no same-sign pair of its codes can exceed 32767 with the largest activation
code: ``(|w_k| + |w_k+1|) * a_max <= 32767`` for every adjacent pair (:func:`can_saturate`); 7-bit weights
(``|w| <= 63``) never can (255 * 126 = 32130).
"""

from __future__ import annotations

import torch

I16_MIN, I16_MAX = -32768, 32767
#: the largest uint8 activation code
A_MAX = 255


def _pairs(w: torch.Tensor) -> torch.Tensor:
    """``(K, N)`` -> ``(ceil(K/2), 2, N)`` int64, a zero row appended to an odd K (the kernels pad K)."""
    w = w.to(torch.int64)
    if w.shape[0] % 2:
        w = torch.cat([w, w.new_zeros(1, w.shape[1])])
    return w.view(-1, 2, w.shape[1])


def candidate_pairs(w: torch.Tensor, a_max: int = A_MAX) -> torch.Tensor:
    """``(P, N)`` bool: the weight pairs ``(w[2p, n], w[2p+1, n])`` that can saturate with activation codes
    up to ``a_max``: both the same sign and ``(|w0| + |w1|) * a_max > 32767``. (Opposite signs cannot: then
    ``|pair| <= a_max * max|w| <= 255 * 128``.)

    Args:
        w: ``(K, N)`` integer weight codes in the kernel's K order.
    """
    p = _pairs(w)
    w0, w1 = p[:, 0], p[:, 1]
    same = (w0 * w1) > 0
    return same & ((w0.abs() + w1.abs()) * a_max > I16_MAX)


def can_saturate(w: torch.Tensor, a_max: int = A_MAX) -> bool:
    """Whether any activation codes in ``[0, a_max]`` can make these ``(K, N)`` weight codes saturate."""
    return bool(candidate_pairs(w, a_max).any())


def saturated_sums(
    a: torch.Tensor, w: torch.Tensor, chunk_elements: int = 1 << 22
) -> tuple[torch.Tensor, int, int]:
    """``(error, saturated pairs, pairs)``: ``error`` is ``(M, N)`` int64, the kernel's int32 sums minus the
    exact ``a @ w``; only the pairs :func:`candidate_pairs` allows are evaluated, in chunks of at most
    ``chunk_elements`` pair values.

    Args:
        a: ``(M, K)`` uint8 activation codes (any integer dtype), 0..255.
        w: ``(K, N)`` int8 weight codes (any integer dtype), in the kernel's K order.
    """
    m, k = a.shape
    n = w.shape[1]
    err = torch.zeros(m, n, dtype=torch.int64)
    pairs = m * n * ((k + 1) // 2)
    a_max = int(a.max()) if a.numel() else 0
    cand = candidate_pairs(w, a_max).nonzero()
    if not len(cand):
        return err, 0, pairs
    a64 = a.to(torch.int64)
    if k % 2:
        a64 = torch.cat([a64, a64.new_zeros(m, 1)], dim=1)
    wp = _pairs(w)
    saturated = 0
    step = max(1, chunk_elements // max(1, m))
    for s in range(0, len(cand), step):
        p, col = cand[s : s + step, 0], cand[s : s + step, 1]
        pair = a64[:, 2 * p] * wp[p, 0, col] + a64[:, 2 * p + 1] * wp[p, 1, col]
        delta = pair.clamp(I16_MIN, I16_MAX) - pair
        saturated += int((delta != 0).sum())
        err.index_add_(1, col, delta)
    return err, saturated, pairs


def conv_rows(
    a: torch.Tensor,
    kernel: tuple[int, ...],
    stride: tuple[int, ...],
    pads: tuple[tuple[int, int], ...],
    dilation: tuple[int, ...],
    groups: int,
    pad_code: int,
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The im2col rows of a convolution's input codes, in the kernel's K order.

    Args:
        a: ``(B, C, *spatial)`` integer activation codes.
        pads: ``(before, after)`` per spatial dimension.
        pad_code: the code padding takes (the activation's zero point).

    Returns:
        ``(rows, out_spatial)``: rows ``(groups, B * prod(out_spatial), prod(kernel) * C // groups)``, K
        ordered ``(k_spatial..., cin)``.
    """
    b, c = a.shape[:2]
    nd = len(kernel)
    flat = [x for p in reversed(pads) for x in p]
    x = torch.nn.functional.pad(a.to(torch.int64) - pad_code, flat) + pad_code
    for d in range(nd):  # (B, C, o1..on, k1..kn) after the loop
        span = dilation[d] * (kernel[d] - 1) + 1
        x = x.unfold(2 + d, span, stride[d])[..., :: dilation[d]]
    out = tuple(x.shape[2 : 2 + nd])
    cg = c // groups
    k = 1
    for n in kernel:
        k *= n
    x = x.reshape(b, groups, cg, *out, *kernel)
    # (groups, B, o..., k..., cin_g)
    perm = [1, 0, *range(3, 3 + nd), *range(3 + nd, 3 + 2 * nd), 2]
    return x.permute(perm).reshape(groups, -1, k * cg), out


def conv_weight_columns(w: torch.Tensor, groups: int) -> torch.Tensor:
    """``(Cout, Cin/groups, *kernel)`` weight codes -> ``(groups, K, Cout/groups)`` in the kernel's K order
    ``(k_spatial..., cin)``."""
    cout, cg = w.shape[:2]
    nd = w.dim() - 2
    cols = w.permute(0, *range(2, 2 + nd), 1).reshape(groups, cout // groups, -1)
    return cols.transpose(1, 2)


def is_depthwise(in_channels: int, out_channels: int, groups: int) -> bool:
    """A convolution onnxruntime runs with its depthwise kernel (which does not saturate)."""
    return groups > 1 and groups == in_channels == out_channels
