"""Linear layers with dynamic int8 activations (the ``int8-dynamic`` preset).

The input quantizer is ONNX ``DynamicQuantizeLinear`` (uint8, per tensor, scale and zero point from each
tensor's own min and max, :func:`quantcli.quant.arithmetic.dynamic_qparams`); the weight quantizer is
calibrated as usual (8-bit symmetric, per output channel or per tensor). In PyTorch the layer computes
``linear(dequantize(x codes), dequantize(w codes), bias)``; exported, it becomes the pattern onnxruntime runs
through its dynamic integer kernels (its ``quantize_dynamic`` writes the same)::

    DynamicQuantizeLinear(x) -> MatMulInteger(x codes, W codes (K, N), x zero point, 0)
        -> Cast(float) -> Mul(x scale * w scale) -> Add(bias)

which onnxruntime's ``MatMulIntegerToFloatFusion`` and ``DynamicQuantizeMatMulFusion`` turn into one
``DynamicQuantizeMatMul``. The integer codes are the fake-quant model's; the outputs differ only by float
accumulation order (the graph sums the integer products exactly and scales once).

:class:`DynamicLinearFunction` builds that pattern in its ``symbolic`` (TorchScript exporter); the dynamo
exporter sets the layer's export hook instead (:mod:`quantcli.nn.export_hooks`).
:mod:`exporters.dynamic_linear` reads the pattern back from a graph.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from quantcli.errors import ExportError
from quantcli.quant.one_node import traced_as_one_node


class DynamicLinearFunction(torch.autograd.Function):
    """``linear(fake_quant_dynamic(x), fake-quantized weight, bias)`` with an ONNX ``symbolic``.

    ``weight_amax`` is the weight quantizer's calibrated amax, ``(N, 1)`` per output channel or a scalar.
    """

    @staticmethod
    @traced_as_one_node
    def forward(ctx, x, weight, weight_amax, bias, num_bits: int = 8, narrow_range: bool = False):
        from quantcli.quant.tensor_quant import FakeDynamicQuantFunction, FakeTensorQuantFunction

        w = FakeTensorQuantFunction.apply(weight, weight_amax, num_bits, False, narrow_range)
        return F.linear(FakeDynamicQuantFunction.apply(x), w, bias)

    @staticmethod
    def symbolic(g, x, weight, weight_amax, bias, num_bits=8, narrow_range=False):
        return dynamic_linear_symbolic(g, x, weight, weight_amax, bias, num_bits, narrow_range)


def weight_spec(amax: torch.Tensor, weight_shape: tuple[int, int], num_bits: int, narrow_range: bool):
    """The Q spec of the transposed weight ``(K, N)``: per output channel is ONNX axis 1 there."""
    from quantcli.quant.qdq import symmetric_spec  # (loads onnx: only when exporting)

    n, k = weight_shape
    a = amax.detach().cpu().to(torch.float32)
    a_t = a.reshape(1, n) if a.numel() > 1 else a.reshape(())
    return symmetric_spec(a_t, (k, n), num_bits, False, narrow_range)


def dynamic_linear_symbolic(g, x, weight, weight_amax, bias, num_bits=8, narrow_range=False):
    """``DynamicLinearFunction.symbolic`` (TorchScript exporter): the pattern of the module docstring. The
    weight codes are ``QuantizeLinear(Transpose(W))``; the exporter folds the Transpose and
    :mod:`exporters.fold` stores the codes as an int8 initializer, computed with quantcli's arithmetic."""
    import onnx

    from quantcli.quant.qdq import constant_value, emit

    amax = constant_value(weight_amax, "weight amax")
    sizes = weight.type().sizes()
    spec = weight_spec(amax, (sizes[0], sizes[1]), num_bits, narrow_range)
    xq, xs, xzp = g.op("DynamicQuantizeLinear", x, outputs=3)
    w_t = g.op("Transpose", weight, perm_i=[1, 0])
    w_codes = emit(g, w_t, spec, dequantize=False)
    w_zp = g.op("Constant", value_t=spec.zero_point.to(torch.int8))
    acc = g.op("MatMulInteger", xq, w_codes, xzp, w_zp)
    w_scale = g.op("Constant", value_t=spec.scale.to(torch.float32))
    y = g.op("Mul", g.op("Cast", acc, to_i=onnx.TensorProto.FLOAT), g.op("Mul", xs, w_scale))
    if bias is not None and not (hasattr(bias, "node") and bias.node().mustBeNone()):
        y = g.op("Add", y, bias)
    return y


def linear_weight(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's weight in ``F.linear``'s ``(out, in)`` layout and its amax per output channel ``(out, 1)``
    (or per tensor): the weight itself for a Linear, its transpose for an ``x @ W + b`` layer
    (``weight_axis = 1``, transformers' ``Conv1D``; its amax is ``(1, out)``)."""
    w, amax = layer.weight, layer.weight_quantizer.amax
    if getattr(layer, "weight_axis", 0) == 1:
        w = w.t()
        if amax is not None and amax.numel() > 1:
            amax = amax.reshape(-1, 1)
    return w, amax


def exportable(layer: nn.Module) -> str | None:
    """Why ``layer`` (a QuantLinear with a dynamic input quantizer) cannot export, or None when it can."""
    wq = layer.weight_quantizer
    d = wq.desc
    if not wq.enabled:
        return "its weight quantizer is disabled (MatMulInteger needs integer weights)"
    if d.is_fp8 or d.unsigned or d.asymmetric or d.dynamic or d.num_bits > 8 or wq._block is not None:
        return "its weights are not 8-bit symmetric integers per tensor or per output channel"
    if wq.amax is None:
        return "its weight quantizer is not calibrated"
    w = layer.weight
    per_channel = (w.shape[0], 1) if getattr(layer, "weight_axis", 0) == 0 else (1, w.shape[1])
    if wq.amax.numel() > 1 and tuple(wq.amax.shape) != per_channel:
        return f"its weight amax has shape {tuple(wq.amax.shape)}, not per output channel"
    return None


def dynamic_linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The TorchScript export path of a QuantLinear whose input quantizer is dynamic (eager mode gives the
    same values); ``bias``: the one its ``F.linear`` adds."""
    why = exportable(layer)
    if why is not None:
        raise ExportError(
            f"{layer.input_quantizer.name}: a dynamic activation quantizer exports as "
            f"DynamicQuantizeLinear -> MatMulInteger, but {why}"
        )
    from quantcli.quant.qdq import export_amax

    d = layer.weight_quantizer.desc
    weight, amax = linear_weight(layer)
    return DynamicLinearFunction.apply(
        x, weight, export_amax(amax.detach()), bias, d.num_bits, d.narrow_range
    )


@contextmanager
def count_calls(quantizers: dict[str, nn.Module]) -> Iterator[dict[str, int]]:
    """Count the calls of each quantizer while the block runs (calibration: dynamic quantizers need no
    statistics, but a layer that never runs must still be found and left out, as for static quantizers)."""
    counts = dict.fromkeys(quantizers, 0)
    hooks = [
        q.register_forward_pre_hook(lambda m, a, n=n: counts.__setitem__(n, counts[n] + 1))
        for n, q in quantizers.items()
    ]
    try:
        yield counts
    finally:
        for h in hooks:
            h.remove()
