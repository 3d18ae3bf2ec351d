"""The ONNX storage type of each quantization format, and the opset it needs."""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from quantcli.quant.descriptor import (
    format_name as format_name,  # the format names, defined once; re-exported
)


@dataclass(frozen=True)
class OnnxQuantType:
    name: str  # human name: "int8", "uint4", "fp8-e4m3"...
    elem_type: int  # onnx.TensorProto data type of the codes / zero point
    min_opset: int
    qmin: float  # the type's own saturation range
    qmax: float


INT8 = OnnxQuantType("int8", onnx.TensorProto.INT8, 13, -128, 127)
UINT8 = OnnxQuantType("uint8", onnx.TensorProto.UINT8, 13, 0, 255)
INT4 = OnnxQuantType("int4", onnx.TensorProto.INT4, 21, -8, 7)
UINT4 = OnnxQuantType("uint4", onnx.TensorProto.UINT4, 21, 0, 15)
INT16 = OnnxQuantType("int16", onnx.TensorProto.INT16, 21, -32768, 32767)
UINT16 = OnnxQuantType("uint16", onnx.TensorProto.UINT16, 21, 0, 65535)
FP8_E4M3 = OnnxQuantType("fp8-e4m3", onnx.TensorProto.FLOAT8E4M3FN, 19, -448.0, 448.0)
# biases of integer kernels
INT32 = OnnxQuantType("int32", onnx.TensorProto.INT32, 13, -(1 << 31), (1 << 31) - 1)

ALL = (INT8, UINT8, INT4, UINT4, INT16, UINT16, FP8_E4M3, INT32)
BY_ELEM_TYPE = {t.elem_type: t for t in ALL}
BY_NAME = {t.name: t for t in ALL}

BLOCKED_MIN_OPSET = 21
MIN_OPSET = 13


def integer_type(num_bits: int, unsigned: bool) -> OnnxQuantType:
    """The smallest ONNX integer type that holds a ``num_bits`` grid (narrower grids are clipped)."""
    if num_bits <= 4:
        return UINT4 if unsigned else INT4
    if num_bits <= 8:
        return UINT8 if unsigned else INT8
    return UINT16 if unsigned else INT16


def emitted_type(num_bits: int, unsigned: bool) -> OnnxQuantType:
    """The type the ``symbolic`` functions emit: int8/uint8 up to 8 bits (narrower grids clipped), int16
    above.

    torch's TorchScript exporter cannot type int4 tensors, so 2..4-bit grids leave the exporter as clipped
    int8 Q/DQ pairs (the same codes) and :func:`exporters.fold.narrow_types` stores them as int4/uint4.
    """
    if num_bits <= 8:
        return UINT8 if unsigned else INT8
    if unsigned:
        raise ValueError(
            f"unsigned {num_bits}-bit quantization has no ONNX type quantcli exports; use signed"
        )
    return INT16


def required_opset(num_bits, unsigned: bool, blocked: bool) -> int:
    if num_bits == (4, 3) or num_bits == [4, 3]:
        return FP8_E4M3.min_opset
    need = integer_type(num_bits, unsigned).min_opset
    return max(need, BLOCKED_MIN_OPSET if blocked else MIN_OPSET)
