"""Quantizer modules, quantized layer wrappers, module replacement and per-layer config."""

from quantcli.nn.config import PRESETS, QuantConfig, load_config
from quantcli.nn.modules import QUANT_CLASSES, QuantConv1d, QuantConv2d, QuantConv3d, QuantLinear
from quantcli.nn.replace import quantize_model
from quantcli.nn.tensor_quantizer import TensorQuantizer, quantizers

__all__ = [
    "PRESETS",
    "QuantConfig",
    "load_config",
    "QUANT_CLASSES",
    "QuantLinear",
    "QuantConv1d",
    "QuantConv2d",
    "QuantConv3d",
    "quantize_model",
    "quantizers",
    "TensorQuantizer",
]
