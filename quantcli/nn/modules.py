"""Quantized layer wrappers: each quantizes its input and its weight, then runs the original op.

They subclass the torch layers, so :func:`quantcli.nn.replace.quantize_model` converts a layer in place by
changing its class and adding two ``TensorQuantizer`` children: parameters, hooks and ``state_dict`` keys
stay.

Two more pieces exist where the deployment target's placement asks for them (:mod:`quantcli.nn.placement`):

* ``output_quantizer``: quantizes the layer's output (onnxruntime's ``QLinearConv`` needs a Q on the output of
  every Conv, and no quantized layer reads this one's output directly).
* ``int32_bias``: the bias is rounded to int32 codes of scale ``input_scale * weight_scale`` (per output
  channel), as onnxruntime's ``QLinearConv``/``QGemm`` add it to their int32 accumulators; the exported graph
  holds those codes in a ``DequantizeLinear``, so the fake-quant model and the graph compute the same bias.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from quantcli.quant import arithmetic
from quantcli.quant.one_node import untraced


class QuantMixin:
    """Adds ``input_quantizer`` and ``weight_quantizer``; ``weight_axis`` is the output-channel axis."""

    weight_axis = 0
    int32_bias = False  # set per layer by quantize_model (onnxruntime target)
    #: while an exporter traces, the bias it adds in place of the int32 codes' DequantizeLinear
    #: (:mod:`quantcli.nn.export_hooks`)
    bias_export_hook: Callable[[], torch.Tensor] | None = None

    def quantized_weight(self) -> torch.Tensor:
        return self.weight_quantizer(self.weight)

    def int32_bias_constants(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(codes, scale)`` of the int32 bias, float32 tensors of shape ``(out_channels,)``: the codes
        (integer-valued) of ``bias / (x_scale * w_scale)``; None where the layer adds its float bias (no bias,
        no int32 bias on this target, or formats without one integer scale, e.g. during calibration)."""
        if self.bias is None or not self.int32_bias:
            return None
        sx, sw = self.input_quantizer.integer_scale(), self.weight_quantizer.integer_scale()
        if sx is None or sw is None or sx.numel() != 1:
            return None
        if sw.numel() not in (1, self.bias.shape[0]):
            # per channel of an operand other than the whole weight (a forward convolving with a slice of
            # it): the layer's bias is not that operation's, and nothing adds it as int32 codes
            return None
        scale = arithmetic.bias_scale(sx, sw).to(self.bias.device).expand(self.bias.shape[0]).contiguous()
        return arithmetic.int32_bias_codes(self.bias, scale), scale

    def quantized_bias(self) -> torch.Tensor | None:
        """The bias as the integer kernel adds it: int32 codes of ``x_scale * w_scale``, or the float bias
        where the layer has no int32 bias (other targets, formats without one integer scale, during
        calibration)."""
        if self.bias is None or not self.int32_bias:
            return self.bias
        if self.bias_export_hook is not None:
            return self.bias_export_hook()
        with untraced():  # graph constants when exporting, not traced arithmetic
            constants = self.int32_bias_constants()
        if constants is None:
            return self.bias
        codes, scale = constants
        if torch.onnx.is_in_onnx_export():
            from quantcli.quant.qdq import export_amax  # (loads onnx: only when exporting)

            codes, scale = export_amax(codes), export_amax(scale)
        from quantcli.quant.tensor_quant import Int32BiasFunction

        bias = Int32BiasFunction.apply(codes, scale)
        # no Cast node between DQ and op
        return bias if bias.dtype == self.bias.dtype else bias.to(self.bias.dtype)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        if input_quantized_before(self) is not None:
            return x  # quantized at the input of the padding module before this layer
        return self.input_quantizer(x)

    def quantize_output(self, y: torch.Tensor) -> torch.Tensor:
        q = getattr(self, "output_quantizer", None)
        if q is None or self.__dict__.get("_output_quantized_after") is not None:
            # none, or applied by the ReLU/pooling module after this layer (apply_output_quantizer_after)
            return y
        return q(y)


def _output_quantizer_hook(module: nn.Module, _inputs, output: torch.Tensor) -> torch.Tensor:
    return module.__dict__["_quantcli_output_of"].output_quantizer(output)


def apply_output_quantizer_after(after: nn.Module, layer: nn.Module) -> None:
    """Apply ``layer.output_quantizer`` to the output of ``after`` (a ReLU or pooling module that only
    ``layer``'s output reaches) instead of to ``layer``'s own output.

    The references are plain attributes (not submodules: ``state_dict`` keys stay), which ``copy.deepcopy``
    maps to the copies, and the hook is a module-level function, so a copied model quantizes with its own
    quantizer.
    """
    object.__setattr__(after, "_quantcli_output_of", layer)
    object.__setattr__(layer, "_output_quantized_after", after)
    after.register_forward_hook(_output_quantizer_hook)


def _input_quantizer_hook(module: nn.Module, args: tuple) -> tuple:
    return (module.__dict__["_quantcli_input_of"].input_quantizer(args[0]), *args[1:])


def input_quantized_before(layer: nn.Module) -> nn.Module | None:
    """The module whose input ``layer.input_quantizer`` runs on (:func:`apply_input_quantizer_before`), or
    None where the layer quantizes its own input."""
    return layer.__dict__.get("_input_quantized_before")


def apply_input_quantizer_before(before: nn.Module, layer: nn.Module) -> None:
    """Apply ``layer.input_quantizer`` to the input of ``before`` (a zero padding module whose output only
    ``layer`` reads) instead of to ``layer``'s own input: the same codes, the padding's zeros being the zero
    point's code (references and copies as in :func:`apply_output_quantizer_after`)."""
    object.__setattr__(before, "_quantcli_input_of", layer)
    object.__setattr__(layer, "_input_quantized_before", before)
    before.register_forward_pre_hook(_input_quantizer_hook)


class QuantLinear(nn.Linear, QuantMixin):
    #: while an exporter traces, the op it computes this layer's output with when the input quantizer is
    # dynamic : (:mod:`quantcli.nn.export_hooks`)
    export_hook: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        smooth = self._modules.get("input_smooth")  # SmoothQuant's explicit Mul (quantcli.nn.smooth), if any
        if smooth is not None:
            input = smooth(input)
        exported = dynamic_export(self, input)
        if exported is not None:
            return exported
        # only a 2-D input exports as Gemm (QGemm takes an int32 bias); 3-D is MatMul + Add, whose
        # MatMulIntegerToFloat adds a float bias
        bias = self.quantized_bias() if input.dim() == 2 else self.bias
        return self.quantize_output(F.linear(self.input_quantizer(input), self.quantized_weight(), bias))


#: :func:`dynamic_export`'s default bias: the layer's own ``bias`` (None where it has none)
OWN_BIAS = object()


def dynamic_export(layer: nn.Module, input: torch.Tensor, bias=OWN_BIAS) -> torch.Tensor | None:
    """A layer computing ``F.linear(x, self.weight, bias)`` with a dynamic (run-time uint8) input quantizer,
    while exporting: its export hook's output, or DynamicQuantizeLinear -> MatMulInteger; ``None`` otherwise
    (the caller computes its forward). ``bias``: the one the operation adds, where it is not the layer's own
    (``F.linear(x, self.weight)`` in a module that adds its ``bias`` later: None)."""
    if not (layer.input_quantizer.dynamic_uint8 and layer.input_quantizer.mode == "quantize"):
        return None
    if bias is OWN_BIAS:
        bias = layer._parameters.get("bias")
    hook = getattr(layer, "export_hook", None)
    if hook is not None:
        return hook(input, bias)
    if torch.onnx.is_in_onnx_export():
        from quantcli.nn.dynamic import dynamic_linear

        return dynamic_linear(layer, input, bias)
    return None


class _QuantConvNd(QuantMixin):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.quantize_output(
            self._conv_forward(self.quantize_input(input), self.quantized_weight(), self.quantized_bias())
        )


class QuantConv1d(_QuantConvNd, nn.Conv1d):
    pass


class QuantConv2d(_QuantConvNd, nn.Conv2d):
    pass


class QuantConv3d(_QuantConvNd, nn.Conv3d):
    pass


class _QuantConvTransposeNd(QuantMixin):
    weight_axis = 1  # weight is (Cin, Cout / groups, *kernel)
    _fn = None
    _dims = 0

    def forward(self, input: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        output_padding = self._output_padding(
            input, output_size, self.stride, self.padding, self.kernel_size, self._dims, self.dilation
        )
        return self.quantize_output(
            type(self)._fn(
                self.input_quantizer(input),
                self.quantized_weight(),
                self.bias,
                self.stride,
                self.padding,
                output_padding,
                self.groups,
                self.dilation,
            )
        )


class QuantConvTranspose1d(_QuantConvTransposeNd, nn.ConvTranspose1d):
    _fn = staticmethod(F.conv_transpose1d)
    _dims = 1


class QuantConvTranspose2d(_QuantConvTransposeNd, nn.ConvTranspose2d):
    _fn = staticmethod(F.conv_transpose2d)
    _dims = 2


class QuantConvTranspose3d(_QuantConvTransposeNd, nn.ConvTranspose3d):
    _fn = staticmethod(F.conv_transpose3d)
    _dims = 3


class _QuantPoolMixin:
    """An average pooling module whose input is quantized (``input_quantizer``), so that onnxruntime runs it
    on codes and the residual Add before it as ``QLinearAdd`` (:mod:`quantcli.nn.placement`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(self.input_quantizer(input))


QUANT_POOL_CLASSES: dict[type, type] = {
    cls: type(f"Quant{cls.__name__}", (_QuantPoolMixin, cls), {"__module__": __name__})
    for cls in (
        nn.AvgPool1d,
        nn.AvgPool2d,
        nn.AvgPool3d,
        nn.AdaptiveAvgPool1d,
        nn.AdaptiveAvgPool2d,
        nn.AdaptiveAvgPool3d,
    )
}
for _cls in QUANT_POOL_CLASSES.values():  # importable by name (pickle, copy)
    globals()[_cls.__name__] = _cls


QUANT_CLASSES: dict[type, type] = {
    nn.Linear: QuantLinear,
    nn.Conv1d: QuantConv1d,
    nn.Conv2d: QuantConv2d,
    nn.Conv3d: QuantConv3d,
    nn.ConvTranspose1d: QuantConvTranspose1d,
    nn.ConvTranspose2d: QuantConvTranspose2d,
    nn.ConvTranspose3d: QuantConvTranspose3d,
}
