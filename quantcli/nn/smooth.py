"""The explicit smoothing ``Mul`` of SmoothQuant: ``x * factor`` over the last (channel) dimension.

SmoothQuant (:mod:`quantcli.calibration.smoothquant`) divides a Linear layer's input channel ``j`` by ``s_j``
and multiplies the weight's column ``j`` by ``s_j``. Where the division cannot be folded into the op that
produced the input (a LayerNorm whose output also feeds a residual Add, a GELU), the layer gets a
``SmoothMul`` child named ``input_smooth`` that the layer applies before its input quantizer; it exports as
one ONNX ``Mul`` by a constant. Its ``factor`` (``1 / s``, float32, shape ``(in_features,)``) is a buffer, so
it is in the ``state_dict`` (``<layer>.input_smooth.factor``) and :func:`restore` re-creates it before a
checkpoint's weights are loaded.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

SUFFIX = ".input_smooth.factor"


class SmoothMul(nn.Module):
    """``x * factor``, broadcast over the last dimension of ``x``."""

    def __init__(self, channels: int):
        super().__init__()
        self.register_buffer("factor", torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor

    def extra_repr(self) -> str:
        return f"channels={self.factor.numel()}"


def attach(layer: nn.Module, factor: torch.Tensor) -> SmoothMul:
    """Give ``layer`` (a QuantLinear) an ``input_smooth`` Mul by ``factor`` (``(in_features,)``)."""
    mul = SmoothMul(factor.numel()).to(device=layer.weight.device)
    mul.factor.copy_(factor)
    layer.add_module("input_smooth", mul)
    return mul


def smoothed_layers(model: nn.Module) -> list[str]:
    """Names of the layers that carry an explicit smoothing Mul."""
    return [
        name for name, m in model.named_modules() if isinstance(m._modules.get("input_smooth"), SmoothMul)
    ]


def restore(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> list[str]:
    """Re-create the smoothing Muls a ``state_dict`` holds (``<layer>.input_smooth.factor`` keys), so that a
    strict ``load_state_dict`` fills them; the folded weights need nothing (they are ordinary weights).
    Returns the layers given a Mul."""
    done = []
    for key, value in state_dict.items():
        if not key.endswith(SUFFIX):
            continue
        layer_name = key[: -len(SUFFIX)]
        try:
            layer = model.get_submodule(layer_name)
        except AttributeError:
            continue  # load_state_dict(strict=True) reports the unexpected key
        if "input_smooth" not in layer._modules:
            attach(layer, torch.ones(value.numel()))
            done.append(layer_name)
    return done
