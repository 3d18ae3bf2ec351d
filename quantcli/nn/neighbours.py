"""A layer kept float must not cost the quantized Conv before it its integer kernel.

onnxruntime runs a Conv as ``QLinearConv`` only when a ``QuantizeLinear`` takes its output (through a ReLU it
absorbs). Where every reader of a Conv's output is a quantized layer, that Q is the reader's input quantizer
(:mod:`quantcli.nn.placement` adds an output quantizer only where some reader is not). When a later step keeps
such a reader float (``--placement auto``: a ``ConvTranspose``, which onnxruntime's CPU provider has no
integer kernel for, measured slower quantized), switching off its input quantizer too takes the Conv's only Q
away, and the Conv falls back to float: on the zoo's U-Net, two Convs before the two ConvTransposes ("the Relu
after it feeds ConvTranspose, not a QuantizeLinear"). :func:`inputs_to_keep` finds those input quantizers: a
``Q -> DQ`` in front of a float layer costs one requantization and buys the Conv its integer kernel.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from quantcli.nn.modules import QuantMixin
from quantcli.nn.placement import _CONVS, _is_node, _kind, read_graph


def _quantized_conv(m: nn.Module) -> bool:
    """A Conv with its input and weight quantized and no output quantizer of its own on."""
    out = getattr(m, "output_quantizer", None)
    return (
        isinstance(m, _CONVS)
        and m.input_quantizer.enabled
        and m.weight_quantizer.enabled
        and not (out is not None and out.enabled)
    )


def inputs_to_keep(model: nn.Module, example: Mapping[str, torch.Tensor], kept_float: set[str]) -> list[str]:
    """The input quantizers (names) of the layers ``kept_float`` whose input is the output of a quantized Conv
    (through ReLU and ops that commute with quantization) that has no output quantizer of its own: the Q that
    Conv's ``QLinearConv`` needs. Only calibrated quantizers are returned (their amax exists)."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantMixin)}
    if not kept_float or not layers:
        return []
    graph = read_graph(model, layers, example)
    modules = dict(model.named_modules())
    keep = []
    for node in graph.nodes:
        if node.op != "call_module" or node.target not in kept_float or node.target not in layers:
            continue
        q = layers[node.target].input_quantizer
        src = node.args[0] if node.args else None
        while _is_node(src) and _kind(src, modules) in ("relu", "commuting") and src.args:
            src = src.args[0]
        if (
            q.amax is not None
            and _is_node(src)
            and src.op == "call_module"
            and src.target in layers
            and src.target not in kept_float
            and _quantized_conv(layers[src.target])
        ):
            keep.append(q.name or f"{node.target}.input_quantizer")
    return sorted(set(keep))
