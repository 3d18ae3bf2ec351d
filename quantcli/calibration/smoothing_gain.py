"""Whether SmoothQuant's ``s`` lowers a group of Linear layers' quantization error: the check that keeps
``--smoothquant`` from smoothing layers it makes worse.

Smoothing divides input channel ``j`` of ``X`` by ``s[j]`` and multiplies the weight columns by it: exact in
float, it only moves quantization error between the activation and the weights. Where ``X`` has no outlier
channels there is nothing to move, and the weights' per-row ranges widen instead: on the digits sample CNN
(no outliers) smoothing cost 1.5 dB of SNR. The criterion is the one a user cares about, each layer's output:
the relative error ``|Qx(X / s) @ Qw(W * s).T - X @ W.T|^2 / |X @ W.T|^2`` summed over the layers reading
``X`` must be :data:`MIN_GAIN` times lower smoothed than as it is (``s = 1``), with the layers' own grids
(the input quantizer's per-tensor range, symmetric or ``[min, max]``; the weight quantizer's symmetric max
per output channel, at its ``num_bits``), on a sample of ``X`` from the calibration data. Pure functions of
tensors: no model is run.
"""

from __future__ import annotations

import torch

from quantcli.quant.tensor_quant import fake_affine_tensor_quant, fake_tensor_quant

#: rows of X the comparison takes (spread evenly over the first calibration batch)
SAMPLE_ROWS = 4096

#: smoothing is applied where it divides the error by at least this much. Measured over 65 groups of 8
#: models (the digits and text samples, ``pretrained_like``, ``structured.deep_encoder``, an MLP, a small
#: transformer and two MLPs with an outlier channel): layers whose input has outlier channels gained
#: 3x-1300x (deep_encoder's mild LayerNorm gains of 3-5: 3x-33x), every other layer 0.4x-1.9x, and on the
#: digits CNN a 1.26x gain still cost 1 dB of SNR end to end (and, through the explicit Mul, its conv2's
#: integer kernel). An error halved (3 dB) lies between the two kinds.
MIN_GAIN = 2.0


def sample_rows(x: torch.Tensor, rows: int = SAMPLE_ROWS) -> torch.Tensor:
    """``x`` as ``(rows, channels)`` float32, at most ``rows`` of them, evenly spaced."""
    flat = x.detach().reshape(-1, x.shape[-1])
    if flat.shape[0] > rows:
        idx = torch.linspace(0, flat.shape[0] - 1, rows, device=flat.device).round().long()
        flat = flat.index_select(0, idx)
    return flat.to(torch.float32)


def checkable(input_desc, weight_desc) -> bool:
    """Whether the grids are ones :func:`relative_error` computes: integer, a per-tensor input, weights per
    output channel (or per tensor), no blocks."""
    return (
        isinstance(input_desc.num_bits, int)
        and isinstance(weight_desc.num_bits, int)
        and input_desc.axis is None
        and not input_desc.block_sizes
        and not weight_desc.block_sizes
        and not input_desc.dynamic
    )


def quantize_input(x: torch.Tensor, desc) -> torch.Tensor:
    """``x`` on the input quantizer's grid calibrated by max: ``[min, max]`` (asymmetric) or ``max |x|``."""
    if desc.asymmetric:
        lo, hi = torch.clamp(x.min(), max=0.0), torch.clamp(x.max(), min=0.0)
        if float(hi - lo) == 0.0:
            return x
        return fake_affine_tensor_quant(x, lo, hi, desc.num_bits)
    amax = x.abs().max()
    if float(amax) == 0.0:
        return x
    unsigned = bool(desc.unsigned) and float(x.min()) >= 0
    return fake_tensor_quant(x, amax, desc.num_bits, unsigned, bool(desc.narrow_range))


def quantize_weight(w: torch.Tensor, desc) -> torch.Tensor:
    """``w`` ``(out, in)`` on the weight quantizer's symmetric grid: per output row, or per tensor."""
    amax = w.abs().amax(dim=1, keepdim=True) if desc.axis is not None else w.abs().max()
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    return fake_tensor_quant(w, amax, desc.num_bits, False, bool(desc.narrow_range))


def relative_error(
    x: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor, input_desc, weight_descs: list
) -> float:
    """The summed relative output error of the layers ``weights`` (each ``(out, in)``) reading ``x`` ``(rows,
    in)`` smoothed by ``s`` (``(in,)``; ones: unsmoothed), every operand quantized on its grid."""
    x = x.to(torch.float64)
    xs = quantize_input((x / s.to(x)).to(torch.float32), input_desc).to(torch.float64)
    total = 0.0
    for w, desc in zip(weights, weight_descs):
        w = w.detach().to(torch.float64)
        ref = x @ w.T
        power = float((ref**2).sum())
        if power == 0.0:
            continue
        ws = quantize_weight((w * s.to(w)).to(torch.float32), desc).to(torch.float64)
        total += float(((xs @ ws.T - ref) ** 2).sum()) / power
    return total
