"""AWQ-style activation-aware scale search (Lin et al., 2024) for weight-only Linear layers.

The layers reading one tensor ``X`` (q, k and v read one) get one per-input-channel scale ``s``: ``W' = W *
s`` is quantized, ``X' = X / s`` is what they read, so ``X' @ Q(W').T = X @ (Q(W * s) / s).T``. Channels whose
inputs are large on average get ``s > 1`` and so a finer relative grid. The search tries ``s = mean|x| **
alpha`` (normalised so that ``sqrt(max s * min s) = 1``) for ``alpha`` on a grid in ``[0, 1]``
and keeps the one with the smallest layer-output error over the calibration inputs::

    error(s) = sum over the layers of  tr(D H D.T),   D = W - Q(W * s) / s,   H = 2 X.T X

which needs only ``H`` and ``mean|x|`` (streamed, :mod:`quantcli.calibration.weight_rounding`), not the
inputs. ``alpha = 0`` is round-to-nearest (``s = 1``), so the chosen scale never has a larger error than
rounding. ``Q`` is the layer's own weight quantizer grid (blocks along the input dimension, or per output
channel) with amax = max ``|W * s|`` per block, the amax calibration then computes.
"""

from __future__ import annotations

import torch

from quantcli.quant import arithmetic
from quantcli.quant.granularity import expand_amax

ALPHAS = tuple(i / 20 for i in range(21))


def max_amax(w: torch.Tensor, block: int | None) -> torch.Tensor:
    """max |w| per block of ``block`` input channels (the last partial block padded with zeros) of an
    ``(out, in)`` weight, shaped ``(out, ceil(in / block))``; per output channel ``(out, 1)`` when
    ``block`` is None."""
    a = w.detach().abs()
    if block is None or block >= w.shape[1]:
        return a.amax(1, keepdim=True)
    blocks = -(-w.shape[1] // block)
    a = torch.nn.functional.pad(a, (0, blocks * block - w.shape[1]))
    return a.reshape(w.shape[0], blocks, block).amax(-1)


def fake_quant(
    w: torch.Tensor, block: int | None, num_bits: int, unsigned: bool = False, narrow_range: bool = False
) -> torch.Tensor:
    """``w`` through a symmetric grid whose amax is its own max per block (what max calibration gives)."""
    amax = expand_amax(max_amax(w, block), tuple(w.shape))
    return arithmetic.fake_quant_symmetric(w, amax, num_bits, unsigned, narrow_range)


def output_error(delta: torch.Tensor, hessian: torch.Tensor) -> float:
    """``tr(D H D.T)`` in float64: the summed squared layer-output error of a weight error ``D`` over the
    inputs whose ``H = 2 X.T X`` (up to the factor 2)."""
    d = delta.to(torch.float64)
    return float(((d @ hessian.to(d)) * d).sum())


def candidate_scale(mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """``mean|x| ** alpha``, normalised; 1 on channels that never saw a non-zero input. float32 ``(in,)``."""
    m = mean_abs.to(torch.float64)
    live = m > 0
    s = torch.where(live, m.clamp(min=1e-12).pow(alpha), torch.ones_like(m))
    if live.any():
        s = s / torch.sqrt(s[live].max() * s[live].min())
    return torch.where(live, s, torch.ones_like(s)).to(torch.float32)


def search_scale(
    weights: list[torch.Tensor],
    mean_abs: torch.Tensor,
    hessian: torch.Tensor,
    num_bits: int,
    block: int | None,
    *,
    unsigned: bool = False,
    narrow_range: bool = False,
    alphas: tuple[float, ...] = ALPHAS,
) -> tuple[torch.Tensor, float, dict[float, float]]:
    """(the best ``s``, its alpha, error per alpha) for the layers ``weights`` (each ``(out, in)``) reading
    one tensor with statistics ``mean_abs`` (``(in,)``) and ``hessian`` (``(in, in)``)."""
    errors: dict[float, float] = {}
    best = (float("inf"), None, 0.0)
    for alpha in alphas:
        s = candidate_scale(mean_abs, alpha).to(weights[0].device)
        err = 0.0
        for w in weights:
            w32 = w.detach().to(torch.float32)
            q = fake_quant(w32 * s, block, num_bits, unsigned, narrow_range) / s
            err += output_error(w32 - q, hessian)
        errors[alpha] = err
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2], errors
