"""quantcli: post-training quantization of PyTorch models for ONNX Runtime and TensorRT.

Heavy modules (torch, onnx) load on first use of an attribute, so ``quantcli --help`` starts fast.
"""

from __future__ import annotations

from quantcli.lazy import lazy_getattr

__version__ = "0.1.0"

_LAZY = {
    "QuantDescriptor": "quantcli.quant.descriptor",
    "ScaledQuantDescriptor": "quantcli.quant.descriptor",
    "fake_tensor_quant": "quantcli.quant.tensor_quant",
    "fake_affine_tensor_quant": "quantcli.quant.tensor_quant",
    "scaled_e4m3": "quantcli.quant.tensor_quant",
    "quantize_model": "quantcli.nn.replace",
    "calibrate": "quantcli.calibration.calibrate",
    "load_calibrated": "quantcli.inputs.checkpoint",
    "Calibrated": "quantcli.inputs.checkpoint",
    "save_calibrated": "quantcli.inputs.checkpoint",
    "verify_onnx": "quantcli.verify",
}

__all__ = ["__version__", "tensor_quant", *_LAZY]


_lazy_getattr = lazy_getattr("quantcli", _LAZY)


def __getattr__(name: str):
    if name == "tensor_quant":  # the module, callable as TensorQuantFunction.apply
        import importlib

        return importlib.import_module("quantcli.quant.tensor_quant")
    return _lazy_getattr(name)
