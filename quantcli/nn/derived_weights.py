"""A computed layer's derived weight operand as a constant of the exported graph.

A layer whose weight operand is computed from its parameters in ``forward`` (weight standardisation: timm's
``StdConv2d`` and ``ScaledStdConv2d`` in BiT and NFNet models; a slice or a transpose of the parameter) is
traced with that computation, so the exported graph repeats it on every run: onnxruntime folds no
``BatchNormalization`` in training mode below opset 15 (what TorchScript writes for ``F.batch_norm(w, None,
None, training=True)``), and no ``QuantizeLinear`` of a tensor it computes, so its ``QLinearConv`` took
weights standardised and quantized per run, without prepacking them. While :func:`constant_operands` is active
(an export), each such layer takes, in place of the tensor it computes, the operand torch computed on one
forward of the example batch: a constant of the graph, whose ``QuantizeLinear`` the exporter stores as codes
(:func:`exporters.fold.fold_weight_quantization`), the codes the fake-quant model computes, bit for bit. A
float layer's operand is a float initializer.

A layer whose operation runs more than once in a forward takes the constant where every call's operand was
the same (one weight applied twice); where they differ (slices of one weight) it keeps its computation, as
does any call whose operand's shape or dtype differs from the recorded one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from quantcli.nn.computed import ComputedLayer, weight_operand_calls


@contextlib.contextmanager
def constant_operands(model: nn.Module, example: Mapping[str, torch.Tensor]) -> Iterator[list[str]]:
    """While the block runs, every computed layer with a derived weight operand, all of whose operations took
    one value on a forward of ``example``, takes that value as a constant (``ComputedLayer.constant_weight``).
    Yields the names of the layers that do; restored after."""
    calls = weight_operand_calls(model, example)
    layers: list[tuple[str, ComputedLayer]] = []
    try:
        for name, m in model.named_modules():
            if isinstance(m, ComputedLayer) and m.weight_derived:
                found = calls.get(name, [])
                if found and all(_same(found[0], w) for w in found[1:]):
                    m.constant_weight = found[0]
                    layers.append((name, m))
        yield [name for name, _ in layers]
    finally:
        for _, m in layers:
            m.constant_weight = None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
