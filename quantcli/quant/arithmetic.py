"""The one arithmetic: ONNX ``QuantizeLinear`` / ``DequantizeLinear``, as small pure functions.

    q = saturate(round_half_to_even(x / scale) + zero_point)
    x' = (q - zero_point) * scale

``scale`` is float32 and ``x`` is divided by it (never multiplied by a reciprocal: ``x * (1/s)`` and
``x / s`` round differently at ties). Every quantize path in quantcli (fake quant, affine, calibrator
search, export-time weight folding) goes through these functions, so the PyTorch model and the ONNX graph
produce the same integer codes.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
"""Largest finite float8 e4m3fn value; FP8 quantization saturates to ±448."""


def check_num_bits(num_bits: int) -> int:
    """Validate an integer bit width (2..16) and return it."""
    if isinstance(num_bits, bool) or not isinstance(num_bits, int):
        raise TypeError(f"num_bits must be an int, got {num_bits!r}")
    if not 2 <= num_bits <= 16:
        raise ValueError(f"num_bits must be between 2 and 16, got {num_bits}")
    return num_bits


def symmetric_bound(num_bits: int, unsigned: bool = False) -> int:
    """The integer that amax maps to: ``2**(num_bits-1) - 1`` signed, ``2**num_bits - 1`` unsigned."""
    check_num_bits(num_bits)
    return (1 << num_bits) - 1 if unsigned else (1 << (num_bits - 1)) - 1


def integer_range(num_bits: int, unsigned: bool = False, narrow_range: bool = False) -> tuple[int, int]:
    """``(qmin, qmax)`` of the integer grid.

    Signed: ``[-bound-1, bound]``, or ``[-bound, bound]`` with ``narrow_range``. Unsigned: ``[0,
        2**num_bits-1]``.
    """
    bound = symmetric_bound(num_bits, unsigned)
    if unsigned:
        return 0, bound
    return (-bound if narrow_range else -bound - 1), bound


def check_amax(amax: torch.Tensor) -> None:
    """Raise on a negative or non-finite amax (a dead channel, amax == 0, is allowed)."""
    if amax.numel() == 0:
        raise ValueError("amax is empty")
    a = amax.detach()
    if not torch.isfinite(a).all():
        raise ValueError(f"amax must be finite, got {a.flatten()[~torch.isfinite(a.flatten())][:4].tolist()}")
    if (a < 0).any():
        raise ValueError(f"amax must be >= 0, got {a.min().item():g}")


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float32 for float32/16/bf16 and integer tensors (ONNX's arithmetic); float64 stays float64
    (gradchecks)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def symmetric_scale(amax: torch.Tensor, bound: int | float) -> torch.Tensor:
    """float32 scale ``amax / bound``; a dead channel (amax == 0) gets the placeholder scale 1.0.

    The placeholder keeps the scale finite and positive (ONNX needs that); dead channels are clipped to
    zero before quantization (see :func:`dead_mask`), so their code is 0 whatever the scale.
    """
    a = amax.detach().to(compute_dtype(amax))
    scale = a / torch.tensor(float(bound), dtype=a.dtype, device=a.device)
    return torch.where(a > 0, scale, torch.ones_like(scale))


def quantize_linear(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | int | float = 0,
    qmin: torch.Tensor | int | float = -128,
    qmax: torch.Tensor | int | float = 127,
) -> torch.Tensor:
    """ONNX QuantizeLinear on float32: ``clamp(round_half_even(x / scale) + zero_point, qmin, qmax)``.

    Returns float32 codes (integer-valued). ``scale``, ``zero_point``, ``qmin``, ``qmax`` broadcast against
    ``x``; per-element bounds let dead channels clamp to ``[zp, zp]``.
    """
    ct = compute_dtype(x)
    q = torch.round(x.to(ct) / scale.to(ct))
    if not (isinstance(zero_point, (int, float)) and zero_point == 0):
        q = q + zero_point
    if isinstance(qmin, torch.Tensor) or isinstance(qmax, torch.Tensor):
        lo = qmin if isinstance(qmin, torch.Tensor) else torch.tensor(float(qmin), device=q.device)
        hi = qmax if isinstance(qmax, torch.Tensor) else torch.tensor(float(qmax), device=q.device)
        return torch.clamp(q, lo.to(q), hi.to(q))
    return torch.clamp(q, float(qmin), float(qmax))


def dequantize_linear(
    q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | int | float = 0
) -> torch.Tensor:
    """ONNX DequantizeLinear: ``(q - zero_point) * scale`` in float32."""
    ct = compute_dtype(scale)
    q32 = q.to(ct)
    if not (isinstance(zero_point, (int, float)) and zero_point == 0):
        q32 = q32 - zero_point
    return q32 * scale.to(ct)


DYNAMIC_QMAX = 255
"""ONNX ``DynamicQuantizeLinear`` quantizes to uint8 only: the grid ``[0, 255]``."""


def affine_qparams(min_range, max_range, num_bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """gemmlowp parameters for an unsigned grid ``[0, 2**num_bits-1]`` covering ``[min, max]`` (0 included).

    Returns ``(scale float32, zero_point float32 integer-valued)``; the zero point is the code of 0.0.
    """
    check_num_bits(num_bits)
    lo = torch.as_tensor(min_range, dtype=torch.float32).clamp(max=0.0)
    hi = torch.as_tensor(max_range, dtype=torch.float32).clamp(min=0.0)
    if (lo > hi).any():
        raise ValueError(f"min_range {min_range} > max_range {max_range}")
    return affine_qparams_of(lo, hi, float((1 << num_bits) - 1))


def affine_qparams_of(lo: torch.Tensor, hi: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`affine_qparams`' arithmetic alone, for float32 ``lo <= 0 <= hi`` the caller guarantees (a range
    search evaluating thousands of candidate pairs skips the checks)."""
    scale = (hi - lo) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero_point = torch.clamp(torch.round(-lo / scale), 0.0, qmax)
    return scale, zero_point


def dynamic_qparams(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero_point)`` of ONNX ``DynamicQuantizeLinear`` for the whole tensor ``x``, as 0-d float32.

    ``x_min = min(0, min(x))``, ``x_max = max(0, max(x))`` (the range always holds 0),
    ``scale = (x_max - x_min) / 255`` in float32, or 1 when ``x_max == x_min`` (an all-zero tensor: the ONNX
    reference and onnxruntime define it so, where the formula would give 0);
    ``zero_point = round_half_to_even(clamp(0 - x_min / scale, 0, 255))`` (float32 division, as onnxruntime's
    ``GetQuantizationParameter``). The zero point is integer-valued.
    """
    xf = x.detach().to(torch.float32)
    zero = torch.zeros((), dtype=torch.float32, device=x.device)
    if xf.numel() == 0:
        return torch.ones((), dtype=torch.float32, device=x.device), zero
    lo = torch.minimum(xf.min(), zero)
    hi = torch.maximum(xf.max(), zero)
    span = hi - lo
    scale = torch.where(
        span > 0, span / torch.tensor(float(DYNAMIC_QMAX), device=x.device), torch.ones_like(span)
    )
    zp = torch.round(torch.clamp(zero - lo / scale, 0.0, float(DYNAMIC_QMAX)))
    return scale, zp


def fake_quant_dynamic(x: torch.Tensor) -> torch.Tensor:
    """ONNX ``DynamicQuantizeLinear`` followed by ``DequantizeLinear``: uint8, per tensor, in ``x``'s
    dtype."""
    scale, zp = dynamic_qparams(x)
    return dequantize_linear(quantize_linear(x, scale, zp, 0, DYNAMIC_QMAX), scale, zp).to(x.dtype)


def dead_mask(amax: torch.Tensor) -> torch.Tensor:
    """True where amax == 0: those elements quantize to 0."""
    return amax.detach() == 0


def symmetric_code_bounds(
    amax: torch.Tensor, num_bits: int, unsigned: bool, narrow_range: bool
) -> tuple[torch.Tensor | int, torch.Tensor | int]:
    """Per-element ``(qmin, qmax)``: the integer range, collapsed to ``[0, 0]`` for dead channels."""
    qmin, qmax = integer_range(num_bits, unsigned, narrow_range)
    dead = dead_mask(amax)
    if not dead.any():
        return qmin, qmax
    zero = torch.zeros((), dtype=torch.float32, device=amax.device)
    lo = torch.where(dead, zero, torch.tensor(float(qmin), device=amax.device))
    hi = torch.where(dead, zero, torch.tensor(float(qmax), device=amax.device))
    return lo, hi


def fake_quant_symmetric(
    x: torch.Tensor, amax: torch.Tensor, num_bits: int = 8, unsigned: bool = False, narrow_range: bool = False
) -> torch.Tensor:
    """Quantize-dequantize with a symmetric grid; result in ``x``'s dtype."""
    scale = symmetric_scale(amax, symmetric_bound(num_bits, unsigned))
    lo, hi = symmetric_code_bounds(amax, num_bits, unsigned, narrow_range)
    return dequantize_linear(quantize_linear(x, scale, 0, lo, hi), scale).to(x.dtype)


def quantize_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """ONNX QuantizeLinear to float8e4m3fn (saturate=1): ``x / scale`` rounded to nearest-even, clamped to
    ±448.

    NaN stays NaN, as in ONNX.
    """
    v = x.to(torch.float32) / scale.to(torch.float32)
    return torch.clamp(v, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def fake_quant_e4m3(x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
    """FP8 E4M3 quantize-dequantize with ``scale = amax / 448`` (scale 1 when amax is None)."""
    if amax is None:
        scale = torch.ones((), dtype=torch.float32, device=x.device)
        return dequantize_linear(quantize_e4m3(x, scale), scale).to(x.dtype)
    scale = symmetric_scale(amax, FP8_E4M3_MAX)
    xin = x.to(torch.float32)
    dead = dead_mask(amax)
    if dead.any():
        xin = torch.where(dead, torch.zeros((), device=x.device), xin)
    return dequantize_linear(quantize_e4m3(xin, scale), scale).to(x.dtype)


INT32_MIN = -(1 << 31)
# the largest float32 below 2**31: codes stay exact in float32 and int32
INT32_MAX_F32 = float((1 << 31) - 128)


def bias_scale(input_scale: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """float32 scale of an int32 bias: ``input_scale * weight_scale`` (one per output channel).

    The integer kernels (QLinearConv, QGemm) add the bias codes to the int32 accumulator of
    ``x_code * w_code`` products, whose unit is exactly this scale.
    """
    return (input_scale.to(torch.float32) * weight_scale.to(torch.float32)).reshape(-1)


def int32_bias_codes(bias: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``saturate_int32(round_half_even(bias / scale))`` as float32 (integer-valued, exact in int32)."""
    q = torch.round(bias.detach().to(torch.float32) / scale.to(torch.float32))
    return torch.clamp(q, float(INT32_MIN), INT32_MAX_F32)
