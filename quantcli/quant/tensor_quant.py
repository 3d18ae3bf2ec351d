"""The quantize ops, as ``torch.autograd.Function``s with ``forward``, ``backward`` and ONNX ``symbolic``.

Semantics follow NVIDIA's ``tensor_quant`` (pytorch-quantization's ``TensorQuantFunction``,
``FakeTensorQuantFunction``, ``FakeAffineTensorQuantFunction``; TensorRT Model Optimizer's
``ScaledE4M3Function``): ``amax`` is given instead of a scale, its shape decides the granularity (per-tensor,
per-axis with the rank kept, or blocked), and ``num_bits``/``unsigned``/``narrow_range`` decide the integer
grid. The arithmetic is ONNX's, from :mod:`quantcli.quant.arithmetic`: the fake-quant output and onnxruntime's
``QuantizeLinear`` give the same codes.

Where the reference differs from ONNX (it multiplies by ``bound / amax``), quantcli divides by the float32
scale ``amax / bound`` as ``QuantizeLinear`` does.

Each op's ``symbolic`` builds its ONNX nodes with :mod:`quantcli.quant.qdq`, imported only when exporting (it
loads onnx).
"""

from __future__ import annotations

import torch

from quantcli.quant import arithmetic
from quantcli.quant.descriptor import QuantDescriptor, ScaledQuantDescriptor
from quantcli.quant.granularity import expand_amax
from quantcli.quant.one_node import traced_as_one_node

__all__ = [
    "TensorQuantFunction",
    "FakeTensorQuantFunction",
    "LegacyFakeTensorQuantFunction",
    "FakeAffineTensorQuantFunction",
    "ScaledE4M3Function",
    "FakeDynamicQuantFunction",
    "QuantDescriptor",
    "ScaledQuantDescriptor",
    "tensor_quant",
    "fake_tensor_quant",
    "legacy_fake_tensor_quant",
    "fake_affine_tensor_quant",
    "scaled_e4m3",
]


def _as_amax(amax, like: torch.Tensor) -> torch.Tensor:
    if amax is None:
        raise ValueError("amax is None: calibrate the quantizer or give amax")
    if not isinstance(amax, torch.Tensor):
        amax = torch.tensor(amax, dtype=torch.float32, device=like.device)
    arithmetic.check_amax(amax)
    return amax


def _check_float_input(inputs: torch.Tensor) -> None:
    """The ops quantize real values: an integer tensor would be rounded and returned in its own dtype,
    the dequantized values truncated (``[1, 2, 300]`` at amax 100 came back ``[0, 2, 100]``)."""
    if not inputs.is_floating_point():
        raise TypeError(
            f"quantization takes a floating-point tensor, got {inputs.dtype}; convert it first "
            "(inputs.float())"
        )


def _check_unsigned_input(inputs: torch.Tensor, unsigned: bool) -> None:
    if unsigned and inputs.numel() and inputs.detach().min() < 0:
        raise TypeError(
            f"negative input (min {inputs.detach().min().item():g}) to an unsigned quantizer; "
            "use unsigned=False or quantize a non-negative tensor"
        )


def _symmetric_codes(inputs, amax, num_bits, unsigned, narrow_range):
    """(codes float32, onnx scale float32 broadcastable, amax broadcastable)."""
    _check_float_input(inputs)
    arithmetic.check_num_bits(num_bits)
    amax = _as_amax(amax, inputs)
    _check_unsigned_input(inputs, unsigned)
    amax_e = expand_amax(amax, tuple(inputs.shape))
    scale = arithmetic.symmetric_scale(amax_e, arithmetic.symmetric_bound(num_bits, unsigned))
    lo, hi = arithmetic.symmetric_code_bounds(amax_e, num_bits, unsigned, narrow_range)
    return arithmetic.quantize_linear(inputs, scale, 0, lo, hi), scale, amax_e


def _ste_clip_mask(inputs: torch.Tensor, amax_e: torch.Tensor) -> torch.Tensor:
    return inputs.abs() <= amax_e.to(inputs.dtype)


def _amax_grad(grad_outputs, codes, amax, bound):
    # d(scale * code)/d amax = code / bound almost everywhere (the code is locally constant);
    # autograd on this surrogate sums it back over broadcast and blocked dimensions.
    with torch.enable_grad():
        a = amax.detach().to(torch.float64).requires_grad_(True)
        surrogate = expand_amax(a, tuple(codes.shape)) / bound * codes.to(torch.float64)
        (g,) = torch.autograd.grad(surrogate, a, grad_outputs.to(torch.float64))
    return g.to(amax.dtype)


class TensorQuantFunction(torch.autograd.Function):
    """Quantize to integer codes; returns ``(outputs, scale)``.

    ``outputs`` are integer-valued in the input's float dtype, ``scale = bound / amax`` as in the reference
    API, so ``outputs / scale`` dequantizes (for a dead channel, amax 0, the scale is 1 and the code 0). The
    ONNX scale is ``amax / bound``, and it is what the codes are computed with.
    """

    @staticmethod
    @traced_as_one_node
    def forward(ctx, inputs, amax, num_bits=8, unsigned=False, narrow_range=True):
        codes, onnx_scale, amax_e = _symmetric_codes(inputs, amax, num_bits, unsigned, narrow_range)
        ctx.save_for_backward(inputs, amax_e)
        a = amax_e.to(onnx_scale.dtype)
        bound = arithmetic.symmetric_bound(num_bits, unsigned)
        quant_scale = torch.where(a > 0, bound / torch.where(a > 0, a, 1.0), 1.0)
        ctx.mark_non_differentiable(quant_scale)
        return codes.to(inputs.dtype), quant_scale.to(torch.float32)

    @staticmethod
    def backward(ctx, grad_outputs, grad_scale):
        inputs, amax_e = ctx.saved_tensors
        zero = grad_outputs.new_zeros(())
        return torch.where(_ste_clip_mask(inputs, amax_e), grad_outputs, zero), None, None, None, None

    @staticmethod
    def symbolic(g, inputs, amax, num_bits=8, unsigned=False, narrow_range=True):
        from quantcli.quant.qdq import symmetric_quantize

        return symmetric_quantize(g, inputs, amax, num_bits, unsigned, narrow_range)


class FakeTensorQuantFunction(torch.autograd.Function):
    """Quantize then dequantize; output in the input's dtype.

    ``backward``: straight-through estimator with clipping (gradient zero outside ``[-amax, amax]``); if amax
    requires grad (``learn_amax``), its gradient is ``sum(grad * code / bound)`` over the elements it scales.
    """

    @staticmethod
    @traced_as_one_node
    def forward(ctx, inputs, amax, num_bits=8, unsigned=False, narrow_range=True):
        codes, scale, amax_e = _symmetric_codes(inputs, amax, num_bits, unsigned, narrow_range)
        amax_t = amax if isinstance(amax, torch.Tensor) else None
        ctx.save_for_backward(inputs, amax_e, codes, amax_t)
        ctx.bound = arithmetic.symmetric_bound(num_bits, unsigned)
        return arithmetic.dequantize_linear(codes, scale).to(inputs.dtype)

    @staticmethod
    def backward(ctx, grad_outputs):
        inputs, amax_e, codes, amax = ctx.saved_tensors
        zero = grad_outputs.new_zeros(())
        grad_inputs = torch.where(_ste_clip_mask(inputs, amax_e), grad_outputs, zero)
        grad_amax = None
        if amax is not None and ctx.needs_input_grad[1]:
            grad_amax = _amax_grad(grad_outputs, codes, amax, ctx.bound)
        return grad_inputs, grad_amax, None, None, None

    @staticmethod
    def symbolic(g, inputs, amax, num_bits=8, unsigned=False, narrow_range=True):
        from quantcli.quant.qdq import symmetric_qdq

        return symmetric_qdq(g, inputs, amax, num_bits, unsigned, narrow_range)


class LegacyFakeTensorQuantFunction(torch.autograd.Function):
    """Same forward as :class:`FakeTensorQuantFunction`; backward is the plain straight-through estimator."""

    @staticmethod
    @traced_as_one_node
    def forward(ctx, inputs, amax, num_bits=8, unsigned=False, narrow_range=True):
        codes, scale, _ = _symmetric_codes(inputs, amax, num_bits, unsigned, narrow_range)
        return arithmetic.dequantize_linear(codes, scale).to(inputs.dtype)

    @staticmethod
    def backward(ctx, grad_outputs):
        return grad_outputs, None, None, None, None

    @staticmethod
    def symbolic(g, inputs, amax, num_bits=8, unsigned=False, narrow_range=True):
        from quantcli.quant.qdq import symmetric_qdq

        return symmetric_qdq(g, inputs, amax, num_bits, unsigned, narrow_range)


class FakeAffineTensorQuantFunction(torch.autograd.Function):
    """Fake affine (asymmetric) quantization on an unsigned grid with a zero point (gemmlowp style).

    ``backward``: straight-through estimator with clipping to ``[min_range, max_range]``.
    """

    @staticmethod
    @traced_as_one_node
    def forward(ctx, inputs, min_range, max_range, num_bits=8):
        _check_float_input(inputs)
        scale, zp = arithmetic.affine_qparams(min_range, max_range, num_bits)
        scale, zp = scale.to(inputs.device), zp.to(inputs.device)
        codes = arithmetic.quantize_linear(inputs, scale, zp, 0, (1 << num_bits) - 1)
        lo = torch.as_tensor(min_range, dtype=inputs.dtype, device=inputs.device)
        hi = torch.as_tensor(max_range, dtype=inputs.dtype, device=inputs.device)
        ctx.save_for_backward(inputs, lo, hi)
        return arithmetic.dequantize_linear(codes, scale, zp).to(inputs.dtype)

    @staticmethod
    def backward(ctx, grad_outputs):
        inputs, lo, hi = ctx.saved_tensors
        mask = (inputs >= lo) & (inputs <= hi)
        return torch.where(mask, grad_outputs, grad_outputs.new_zeros(())), None, None, None

    @staticmethod
    def symbolic(g, inputs, min_range, max_range, num_bits=8):
        from quantcli.quant.qdq import affine_qdq

        return affine_qdq(g, inputs, min_range, max_range, num_bits)


class FakeDynamicQuantFunction(torch.autograd.Function):
    """ONNX ``DynamicQuantizeLinear`` -> ``DequantizeLinear``: uint8 asymmetric, per tensor, scale and zero
    point computed from this very tensor (:func:`quantcli.quant.arithmetic.dynamic_qparams`).

    ``backward``: straight-through (the range always covers the tensor, so nothing is clipped). Exported only
    as part of a Linear (``DynamicQuantizeLinear -> MatMulInteger``, :mod:`quantcli.nn.dynamic`).
    """

    @staticmethod
    @traced_as_one_node
    def forward(ctx, inputs):
        _check_float_input(inputs)
        return arithmetic.fake_quant_dynamic(inputs)

    @staticmethod
    def backward(ctx, grad_outputs):
        return grad_outputs


class ScaledE4M3Function(torch.autograd.Function):
    """FP8 E4M3 fake quantization: ``scale = amax / 448``, saturating at ±448, round to nearest even.

    Only ``(E, M) == (4, 3)`` exists in ONNX; other formats raise.
    """

    @staticmethod
    @traced_as_one_node
    def forward(ctx, inputs, amax=None, E=4, M=3):
        if (E, M) != (4, 3):
            raise ValueError(f"only FP8 E4M3 (E=4, M=3) is supported, got E={E}, M={M}")
        _check_float_input(inputs)
        amax_e = None
        if amax is not None:
            amax = _as_amax(amax, inputs)
            amax_e = expand_amax(amax, tuple(inputs.shape))
        ctx.save_for_backward(inputs, amax_e)
        return arithmetic.fake_quant_e4m3(inputs, amax_e)

    @staticmethod
    def backward(ctx, grad_outputs):
        inputs, amax_e = ctx.saved_tensors
        if amax_e is None:
            mask = inputs.abs() <= arithmetic.FP8_E4M3_MAX
        else:
            mask = _ste_clip_mask(inputs, amax_e)
        return torch.where(mask, grad_outputs, grad_outputs.new_zeros(())), None, None, None

    @staticmethod
    def symbolic(g, inputs, amax=None, E=4, M=3):
        from quantcli.quant.qdq import e4m3_qdq

        return e4m3_qdq(g, inputs, amax, E, M)


class Int32BiasFunction(torch.autograd.Function):
    """Dequantize int32 bias codes: ``codes * scale`` (float32), ONNX ``DequantizeLinear`` of int32 codes.

    ``codes`` come from :func:`quantcli.quant.arithmetic.int32_bias_codes`, ``scale`` from
    :func:`quantcli.quant.arithmetic.bias_scale` (per output channel, axis 0). ``backward``: straight-through
    to nothing (the codes are constants).
    """

    @staticmethod
    @traced_as_one_node
    def forward(ctx, codes, scale):
        return arithmetic.dequantize_linear(codes, scale)

    @staticmethod
    def backward(ctx, grad_outputs):
        return None, None

    @staticmethod
    def symbolic(g, codes, scale):
        from quantcli.quant.qdq import int32_bias_dq

        return int32_bias_dq(g, codes, scale)


tensor_quant = TensorQuantFunction.apply
fake_tensor_quant = FakeTensorQuantFunction.apply
legacy_fake_tensor_quant = LegacyFakeTensorQuantFunction.apply
fake_affine_tensor_quant = FakeAffineTensorQuantFunction.apply
scaled_e4m3 = ScaledE4M3Function.apply


class _CallableModule(type(__import__("sys"))):
    """``from quantcli import tensor_quant`` gives this module; calling it is ``TensorQuantFunction.apply``,
    so both the module style (``tensor_quant.fake_tensor_quant``) and the function style work."""

    def __call__(self, *args, **kwargs):
        return TensorQuantFunction.apply(*args, **kwargs)


__import__("sys").modules[__name__].__class__ = _CallableModule
