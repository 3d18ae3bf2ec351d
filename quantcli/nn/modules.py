"""Quantized layer wrappers: each quantizes its input and its weight, then runs the original op.

They subclass the torch layers, so :func:`quantcli.nn.replace.quantize_model` converts a layer in place by
changing its class and adding two ``TensorQuantizer`` children: parameters, hooks and ``state_dict`` keys stay.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class QuantMixin:
    """Adds ``input_quantizer`` and ``weight_quantizer``; ``weight_axis`` is the output-channel axis."""

    weight_axis = 0

    def quantized_weight(self) -> torch.Tensor:
        return self.weight_quantizer(self.weight)


class QuantLinear(nn.Linear, QuantMixin):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        smooth = self._modules.get("input_smooth")  # SmoothQuant's explicit Mul (quantcli.nn.smooth), if any
        if smooth is not None:
            input = smooth(input)
        if self.input_quantizer.dynamic_uint8 and self.input_quantizer.mode == "quantize":
            from quantcli.nn.dynamic import dynamic_linear, exporting

            if exporting():  # DynamicQuantizeLinear -> MatMulInteger
                return dynamic_linear(self, input)
        return F.linear(self.input_quantizer(input), self.quantized_weight(), self.bias)


class _QuantConvNd(QuantMixin):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(self.input_quantizer(input), self.quantized_weight(), self.bias)


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
        return type(self)._fn(
            self.input_quantizer(input), self.quantized_weight(), self.bias, self.stride, self.padding,
            output_padding, self.groups, self.dilation,
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


QUANT_CLASSES: dict[type, type] = {
    nn.Linear: QuantLinear,
    nn.Conv1d: QuantConv1d,
    nn.Conv2d: QuantConv2d,
    nn.Conv3d: QuantConv3d,
    nn.ConvTranspose1d: QuantConvTranspose1d,
    nn.ConvTranspose2d: QuantConvTranspose2d,
    nn.ConvTranspose3d: QuantConvTranspose3d,
}
