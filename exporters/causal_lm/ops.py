"""The custom ops a decode graph is traced with, and their ONNX forms for both exporters, in one place.

Each op is a ``torch.library`` custom op whose eager kernel computes what onnxruntime's contrib op computes,
so the decode module runs in PyTorch as its graph runs in onnxruntime: ``GroupQueryAttention``
(:mod:`exporters.causal_lm.attention`) and ``SkipSimplifiedLayerNormalization``
(:mod:`exporters.causal_lm.norm`).
"""

from __future__ import annotations

from exporters.causal_lm import attention, norm


def register_torchscript() -> None:
    """Every op's TorchScript translation (once per process)."""
    attention.register_torchscript()
    norm.register_torchscript()


def dynamo_translations() -> dict:
    """Every op's dynamo translation: ``{torch op overload: onnxscript function}``."""
    return {**attention.dynamo_translations(), **norm.dynamo_translations()}
