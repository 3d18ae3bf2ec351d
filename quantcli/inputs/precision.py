"""A half-precision model (``torch.save(model.half())``, a factory or Hugging Face folder in float16 or
bfloat16) is calibrated and exported in float32, and so is a float64 one (``model.double()``).

Why float32: onnxruntime's integer kernels (``QLinearConv``, ``QGemm``, ``MatMulIntegerToFloat``) take float32
activations around their uint8/int8 codes, ONNX ``QuantizeLinear`` takes float16 only from opset 19 on and
onnxruntime's CPU provider quantizes float16 in few kernels; and a half model fed float32 data fails in torch
("Input type (torch.FloatTensor) and weight type (torch.HalfTensor) should be the same"). Widening float16 or
bfloat16 to float32 is exact, so the float32 model computes what the half one computes, without its rounding
of intermediate results. The data's half-precision arrays are widened the same way
(:func:`quantcli.inputs.data.load_batches`).

A float64 model fed the float32 data stopped with "mat1 and mat2 must have the same dtype"; its weights are
rounded to float32 (a relative change of at most 2**-24 each, far below any quantization step), as its
float64 data already was.
"""

from __future__ import annotations

import torch
from torch import nn

HALF = (torch.float16, torch.bfloat16)
CONVERTED = (*HALF, torch.float64)  # the float dtypes a model is calibrated in float32 from
LOADED_DTYPE = "quantcli_loaded_dtype"  # the attribute naming the dtype a model was loaded in


def converted_dtype(model: nn.Module) -> torch.dtype | None:
    """The half or float64 dtype every floating-point parameter of ``model`` has, or None (float32
    parameters, a mix of dtypes, or none)."""
    kinds = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return kinds.pop() if len(kinds) == 1 and next(iter(kinds)) in CONVERTED else None


def to_float32(model: nn.Module) -> nn.Module:
    """``model`` in float32 (parameters and buffers, in place) when it is a half-precision or float64 model,
    with the dtype it came in recorded (:func:`loaded_dtype`); any other model as it is."""
    dtype = converted_dtype(model)
    if dtype is None:
        return model
    model.float()
    object.__setattr__(model, LOADED_DTYPE, str(dtype).replace("torch.", ""))
    return model


def loaded_dtype(model: nn.Module) -> str | None:
    """``"float16"``/``"bfloat16"``/``"float64"`` for a model :func:`to_float32` converted, else None."""
    return getattr(model, LOADED_DTYPE, None)


def describe(dtype: str) -> str:
    """The summary's line for a model loaded in ``dtype``."""
    if dtype == "float64":
        return (
            "float64 weights, calibrated and exported in float32 (each weight rounded to float32; "
            "onnxruntime's integer kernels take float32 activations); the graph takes float32 inputs, "
            "float64 data is read as float32"
        )
    return (
        f"{dtype} weights, calibrated and exported in float32 (exact widening; onnxruntime's integer kernels "
        f"take float32 activations); the graph takes float32 inputs, {dtype} data is read as float32"
    )
