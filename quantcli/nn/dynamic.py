"""Linear layers with dynamic int8 activations (the ``int8-dynamic`` preset).

The input quantizer is ONNX ``DynamicQuantizeLinear`` (uint8, per tensor, scale and zero point from each
tensor's own min and max, :func:`quantcli.arithmetic.dynamic_qparams`); the weight quantizer is calibrated as
usual (8-bit symmetric, per output channel or per tensor). In PyTorch the layer computes
``linear(dequantize(x codes), dequantize(w codes), bias)``; exported, it becomes the pattern onnxruntime runs
through its dynamic integer kernels (its ``quantize_dynamic`` writes the same)::

    DynamicQuantizeLinear(x) -> MatMulInteger(x codes, W codes (K, N), x zero point, 0)
        -> Cast(float) -> Mul(x scale * w scale) -> Add(bias)

which onnxruntime's ``MatMulIntegerToFloatFusion`` and ``DynamicQuantizeMatMulFusion`` turn into one
``DynamicQuantizeMatMul``. The integer codes are the fake-quant model's; the outputs differ only by float
accumulation order (the graph sums the integer products exactly and scales once).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from quantcli.errors import ExportError


class DynamicLinearFunction(torch.autograd.Function):
    """``linear(fake_quant_dynamic(x), fake-quantized weight, bias)`` with an ONNX ``symbolic``.

    ``weight_amax`` is the weight quantizer's calibrated amax, ``(N, 1)`` per output channel or a scalar.
    """

    @staticmethod
    def forward(ctx, x, weight, weight_amax, bias, num_bits: int = 8, narrow_range: bool = False):
        from quantcli.tensor_quant import FakeDynamicQuantFunction, FakeTensorQuantFunction

        w = FakeTensorQuantFunction.apply(weight, weight_amax, num_bits, False, narrow_range)
        return F.linear(FakeDynamicQuantFunction.apply(x), w, bias)

    @staticmethod
    def symbolic(g, x, weight, weight_amax, bias, num_bits=8, narrow_range=False):
        from exporters.dynamic_linear import dynamic_linear_symbolic

        return dynamic_linear_symbolic(g, x, weight, weight_amax, bias, num_bits, narrow_range)


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
    if wq.amax.numel() > 1 and tuple(wq.amax.shape) != (layer.weight.shape[0], 1):
        return f"its weight amax has shape {tuple(wq.amax.shape)}, not per output channel"
    return None


def exporting() -> bool:
    """True while either torch exporter traces the model."""
    from exporters import dynamo

    return torch.onnx.is_in_onnx_export() or dynamo.active()


def dynamic_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The export path of a QuantLinear whose input quantizer is dynamic (eager mode gives the same values)."""
    why = exportable(layer)
    if why is not None:
        raise ExportError(f"{layer.input_quantizer.name}: a dynamic activation quantizer exports as "
                          f"DynamicQuantizeLinear -> MatMulInteger, but {why}")
    from exporters import dynamo

    if dynamo.active():
        return dynamo.dynamic_linear(layer, x)
    d = layer.weight_quantizer.desc
    amax = layer.weight_quantizer.amax.detach()
    from exporters.custom_ops import export_amax

    return DynamicLinearFunction.apply(x, layer.weight, export_amax(amax), layer.bias, d.num_bits, d.narrow_range)


@contextmanager
def count_calls(quantizers: dict[str, nn.Module]) -> Iterator[dict[str, int]]:
    """Count the calls of each quantizer while the block runs (calibration: dynamic quantizers need no
    statistics, but a layer that never runs must still be found and left out, as for static quantizers)."""
    counts = dict.fromkeys(quantizers, 0)
    hooks = [q.register_forward_pre_hook(lambda m, a, n=n: counts.__setitem__(n, counts[n] + 1))
             for n, q in quantizers.items()]
    try:
        yield counts
    finally:
        for h in hooks:
            h.remove()
