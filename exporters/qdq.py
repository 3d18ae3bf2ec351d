"""Kept for compatibility: the Q/DQ specs and their TorchScript emission are part of the quantize ops'
definition and live in :mod:`quantcli.qdq` (the ops sit below the exporters); ``exporters.qdq`` re-exports them."""

from quantcli.qdq import (
    QdqSpec,
    affine_qdq,
    affine_spec,
    check_opset,
    constant_value,
    e4m3_qdq,
    e4m3_spec,
    emit,
    int32_bias_dq,
    symmetric_qdq,
    symmetric_quantize,
    symmetric_spec,
)

__all__ = ["QdqSpec", "affine_qdq", "affine_spec", "check_opset", "constant_value", "e4m3_qdq", "e4m3_spec", "emit",
           "int32_bias_dq", "symmetric_qdq", "symmetric_quantize", "symmetric_spec"]
