"""GPTQ (Frantar et al., 2023): round a Linear layer's weights column by column, each column's rounding error
compensated in the columns not yet rounded, weighted by the inverse Hessian of the layer's calibration inputs.

For a layer ``y = x @ W.T`` with ``W`` of shape ``(out, in)``, the layer-output error of rounded weights ``Q``
over the calibration inputs ``X`` (``(n, in)``) is ``tr((W - Q) H (W - Q).T) / 2`` with ``H = 2 X.T X``. GPTQ
quantizes column ``j`` (one input channel), then moves the others by ``-(w_j - q_j) / [H^-1]_jj *
[H^-1]_j,j+1:``, which minimises that error for the remaining columns; ``H^-1`` is used through the upper
Cholesky factor of ``H^-1`` (numerically stable), with ``damp * mean(diag H)`` added to the diagonal. The
updates are applied lazily per block of ``lazy`` columns (one matrix product per block instead of one per
column).

The grid is the weight quantizer's own: the scale of every element comes from the quantizer's calibrated amax
(per output channel or per block of the input dimension, :mod:`quantcli.quant.granularity`), which GPTQ does
not change, and each column is rounded with quantcli's arithmetic on float32 values
(:mod:`quantcli.quant.arithmetic`). What :func:`gptq_weights` returns is the matrix of values each column had
when it was rounded: the quantizer maps it to exactly GPTQ's codes, and the exported graph stores those codes.

:class:`HessianAccumulator` collects ``2 X.T X`` streaming over batches (memory: one ``in x in`` matrix per
layer, whatever the number of samples), in float64 on the layer's device.
"""

from __future__ import annotations

import torch

from quantcli.errors import CalibrationError
from quantcli.quant import arithmetic
from quantcli.quant.granularity import expand_amax

DEFAULT_DAMP = 0.01  # fraction of the mean diagonal of H added to it (the GPTQ paper's default)
DEFAULT_LAZY = 128  # columns per lazy-update block


class HessianAccumulator:
    """``H = 2 sum_n x_n x_n.T`` over every row of every batch a layer reads (``x``: ``(..., in)``)."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu"):
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float64, device=device)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        """Add a batch of inputs; products of float32 values are exact in float64."""
        x = x.detach().reshape(-1, x.shape[-1]).to(device=self.hessian.device, dtype=torch.float64)
        self.hessian.addmm_(x.T, x, alpha=2.0)
        self.rows += x.shape[0]


def _grid(amax: torch.Tensor, shape: tuple[int, int], num_bits: int, unsigned: bool, narrow_range: bool):
    """Per-element float32 scale and code bounds of the quantizer's grid on an ``(out, in)`` weight."""
    a = expand_amax(amax.detach().to(torch.float32), shape).expand(shape)
    scale = arithmetic.symmetric_scale(a, arithmetic.symmetric_bound(num_bits, unsigned))
    lo, hi = arithmetic.symmetric_code_bounds(a, num_bits, unsigned, narrow_range)
    lo = torch.as_tensor(lo, dtype=torch.float32, device=a.device).expand(shape)
    hi = torch.as_tensor(hi, dtype=torch.float32, device=a.device).expand(shape)
    return scale, lo, hi


def inverse_hessian_factor(
    hessian: torch.Tensor, damp: float = DEFAULT_DAMP
) -> tuple[torch.Tensor, torch.Tensor]:
    """(upper Cholesky factor of ``(H + damp * mean(diag H) I)^-1``, dead input channels).

    A channel that never saw a non-zero input (``H_jj == 0``) gets ``H_jj = 1``: its weights cannot matter."""
    h = hessian.clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    diag = torch.arange(h.shape[0], device=h.device)
    h[diag, diag] += damp * torch.mean(torch.diagonal(h))
    try:
        low = torch.linalg.cholesky(h)
        inv = torch.cholesky_inverse(low)
        return torch.linalg.cholesky(inv, upper=True), dead
    except RuntimeError as e:  # torch.linalg.LinAlgError: not positive definite even with damping
        raise CalibrationError(
            f"GPTQ: the damped Hessian is not positive definite ({e}); raise the damping"
        ) from None


def gptq_weights(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    amax: torch.Tensor,
    num_bits: int,
    *,
    unsigned: bool = False,
    narrow_range: bool = False,
    damp: float = DEFAULT_DAMP,
    lazy: int = DEFAULT_LAZY,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """GPTQ on one ``(out, in)`` weight. Returns float32 ``(out, in)``: each column as it was when rounded.

    Args:
        hessian: ``(in, in)``, ``2 X.T X`` of the layer's calibration inputs (:class:`HessianAccumulator`).
        amax: the weight quantizer's calibrated amax (its granularity gives each element's scale).
        dtype: the working precision of the error updates (float32 as in the paper; float64 for references).
    The fake-quant of the result with ``amax`` gives GPTQ's codes times their scales.
    """
    shape = tuple(weight.shape)
    scale, lo, hi = _grid(amax.to(weight.device), shape, num_bits, unsigned, narrow_range)
    factor, dead = inverse_hessian_factor(hessian.to(device=weight.device, dtype=torch.float64), damp)
    factor = factor.to(dtype)
    w = weight.detach().to(dtype).clone()
    w[:, dead] = 0
    before = torch.empty(shape, dtype=torch.float32, device=weight.device)
    for i1 in range(0, shape[1], lazy):
        i2 = min(i1 + lazy, shape[1])
        block = w[:, i1:i2].clone()
        err = torch.zeros_like(block)
        f = factor[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = block[:, i].to(torch.float32)  # rounded as the float32 weight the model will hold
            j = i1 + i
            before[:, j] = col
            q = arithmetic.dequantize_linear(
                arithmetic.quantize_linear(col, scale[:, j], 0, lo[:, j], hi[:, j]), scale[:, j]
            )
            e = (block[:, i] - q.to(dtype)) / f[i, i]
            block[:, i:] -= e[:, None] * f[i, i:][None, :]
            err[:, i] = e
        w[:, i2:] -= err @ factor[i1:i2, i2:]
    return before
