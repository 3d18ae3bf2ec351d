"""The default ONNX opset: the lowest that the quantization formats need and the model's own ops are best
expressed in.

Formats set a hard minimum (an int8 per-axis QuantizeLinear needs 13, float8 19, int4 and blocked 21): below
it the graph cannot be written. The model's ops set a preference: ``LayerNormalization`` exists from opset 17;
below it the exporter decomposes a LayerNorm into ReduceMean/Sub/Pow/Sqrt/Div/Mul/Add. onnxruntime (1.31)
fuses that pattern back into ``LayerNormalization`` (and loses the static shapes after it, so its
``SkipLayerNormalization`` fusion does not form); other runtimes may not. At 17 the onnxruntime target's
export keeps ``SkipLayerNormalization`` away itself (:mod:`exporters.onnxruntime.cpu_fusions`: its CPU kernel
is slower than what it replaces); ``python -m benchmarks.bench_opset`` counts and times both opsets. An
explicit opset below the preference is allowed (the LayerNorm is decomposed, and the export says so).
``HardSwish`` (MobileNetV3, LCNet) exists from opset 14; below it TorchScript writes ``HardSigmoid`` and
``Mul``, which onnxruntime neither fuses into the convolution before them in a float region nor runs as one
node between a DequantizeLinear and a QuantizeLinear: timm's lcnet_050 at 64 px ran 1.28x its float graph at
batch 1 from opset 13, 1.19x from 14, the same codes (1 thread, a 2-core AMD EPYC with VNNI).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from quantcli.nn.tensor_quantizer import quantizers
from quantcli.quant import formats

LAYER_NORM_OPSET = 17  # ONNX LayerNormalization
#: torch's TorchScript exporter translates ``scaled_dot_product_attention`` (transformers' default attention
# in : Llama/Qwen2-style decoders, which have no LayerNorm) from opset 14; below it that export cannot be
# written
ATTENTION_OPSET = 14
HARD_SWISH_OPSET = 14  # ONNX HardSwish


#: format_opset's "format" for a model with no quantizer enabled
NO_QUANTIZER = "no quantizer enabled"


def format_opset(model: nn.Module) -> tuple[int, str]:
    """(lowest opset the model's enabled quantizers need, the format that needs it); with no quantizer
    enabled, the project's minimum and ``"a float graph (no quantizer enabled)"``."""
    enabled = [q for q in quantizers(model).values() if q.enabled]
    if not enabled:
        return formats.MIN_OPSET, NO_QUANTIZER
    need, why = formats.MIN_OPSET, "int8"
    for q in enabled:
        blocked = q._block is not None
        unsigned = q.desc.unsigned or q.desc.asymmetric
        op = formats.required_opset(q.desc.num_bits, unsigned, blocked)
        if op > need:
            need, why = op, formats.format_name(q.desc.num_bits, unsigned, blocked)
    return need, why


_LAYER_NORM_FUNCTIONS = (torch.nn.functional.layer_norm, torch.layer_norm, torch.native_layer_norm)
_ATTENTION_FUNCTIONS = (torch.nn.functional.scaled_dot_product_attention,)
_HARD_SWISH_FUNCTIONS = (torch.nn.functional.hardswish,)


class OpProbe(TorchFunctionMode):
    """Records, during one forward pass, whether the model calls a layer norm (``nn.LayerNorm`` or
    ``F.layer_norm`` called directly: module scans miss the functional form),
    ``scaled_dot_product_attention`` and a hard swish."""

    def __init__(self):
        super().__init__()
        self.layer_norm = False
        self.attention = False
        self.hard_swish = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _LAYER_NORM_FUNCTIONS:
            self.layer_norm = True
        elif func in _HARD_SWISH_FUNCTIONS:
            self.hard_swish = True
        elif func in _ATTENTION_FUNCTIONS or (
            func is torch.nn.functional.multi_head_attention_forward and not _needs_weights(args, kwargs)
        ):
            # nn.MultiheadAttention(need_weights=False) calls scaled_dot_product_attention from inside
            # multi_head_attention_forward, where no mode sees it
            self.attention = True
        return func(*args, **(kwargs or {}))


def _needs_weights(args: tuple, kwargs: dict | None) -> bool:
    """``need_weights`` of a ``F.multi_head_attention_forward`` call (its 16th parameter, default True)."""
    kwargs = kwargs or {}
    if "need_weights" in kwargs:
        return bool(kwargs["need_weights"])
    return bool(args[15]) if len(args) > 15 else True


def ops_opset(model: nn.Module, probe: OpProbe | None = None) -> tuple[int, str]:
    """(opset the model's own ops are best expressed in, why); ``probe``: an :class:`OpProbe` that watched a
    forward pass of the model."""
    if (probe is not None and probe.layer_norm) or any(isinstance(m, nn.LayerNorm) for m in model.modules()):
        return LAYER_NORM_OPSET, "LayerNorm (LayerNormalization)"
    if probe is not None and probe.attention:
        return ATTENTION_OPSET, "scaled_dot_product_attention"
    if (probe is not None and probe.hard_swish) or any(isinstance(m, nn.Hardswish) for m in model.modules()):
        return HARD_SWISH_OPSET, "hard swish (HardSwish)"
    return formats.MIN_OPSET, ""
