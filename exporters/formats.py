"""Kept for compatibility: the ONNX storage types of the quantization formats live in :mod:`quantcli.formats`
(the quantize ops' ONNX definition needs them, and the ops sit below the exporters); re-exported here."""

from quantcli.formats import (
    ALL,
    BLOCKED_MIN_OPSET,
    BY_ELEM_TYPE,
    BY_NAME,
    FP8_E4M3,
    INT4,
    INT8,
    INT16,
    INT32,
    MIN_OPSET,
    UINT4,
    UINT8,
    UINT16,
    OnnxQuantType,
    emitted_type,
    format_name,
    integer_type,
    required_opset,
)

__all__ = ["ALL", "BLOCKED_MIN_OPSET", "BY_ELEM_TYPE", "BY_NAME", "FP8_E4M3", "INT4", "INT8", "INT16", "INT32",
           "MIN_OPSET", "UINT4", "UINT8", "UINT16", "OnnxQuantType", "emitted_type", "format_name", "integer_type",
           "required_opset"]
