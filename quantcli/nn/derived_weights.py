"""A weight operand computed from the parameters, as a constant of the exported graph.

A layer whose weight operand is computed from its parameters on every call is traced with that computation, so
the exported graph repeats it on every run. Such operands: weight standardisation in ``forward`` (timm's
``StdConv2d`` and ``ScaledStdConv2d`` in BiT and NFNet models), a weight set by a forward pre-hook (the legacy
``torch.nn.utils.weight_norm`` and ``spectral_norm``), a slice or a transpose of the parameter. onnxruntime
folds no ``BatchNormalization`` in training mode below opset 15 (what TorchScript writes for ``F.batch_norm(w,
None, None, training=True)``), and no ``QuantizeLinear`` of a tensor it computes: a ``QLinearConv`` took
weights standardised and quantized per run, without prepacking them, and the file held the float parameters
(twice, where the exporter's constant folding stored a reshaped copy) instead of codes.

While :func:`constant_operands` is active (an export), each weight quantizer whose input on one forward of the
example batch was not a parameter of the model quantizes, in place of what the graph computes, the value torch
computed (:attr:`quantcli.nn.tensor_quantizer.TensorQuantizer.constant_input`): a constant of the graph, whose
``QuantizeLinear`` the exporter stores as codes (:func:`exporters.fold.fold_weight_quantization`), the codes
the fake-quant model computes, bit for bit; a float layer's (its quantizer disabled) is a float initializer,
and what computed it is left unread and dropped. A quantizer called more than once in a forward takes the
constant only where every call's input was the same (one weight applied twice); where they differ (slices of
one weight) the graph keeps computing them, as it does for any call whose input's shape or dtype differs from
the recorded one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from quantcli.nn.quantizer_inputs import observe_inputs
from quantcli.nn.tensor_quantizer import TensorQuantizer, owner, quantizers, role

WEIGHT = "weight_quantizer"


def computed_inputs(
    model: nn.Module, example: Mapping[str, torch.Tensor]
) -> dict[str, list[torch.Tensor | None]]:
    """Per weight quantizer (by name), its inputs on one forward of ``example``, in call order: a copy of each
    computed one, None for each that was a parameter of the model. Quantizers never called are left out."""
    params = {id(p) for p in model.parameters()}
    seen: dict[str, list[torch.Tensor | None]] = {}

    def record(name: str, x: torch.Tensor) -> None:
        seen.setdefault(name, []).append(None if id(x) in params else x.detach().clone())

    modules = dict(model.named_modules())
    names = [n for n in quantizers(model) if role(n) == WEIGHT and _may_compute(modules.get(owner(n)))]
    observe_inputs(model, example, names, record)  # no forward where no layer may compute its weight
    return seen


def _may_compute(layer: nn.Module | None) -> bool:
    """Whether ``layer``'s weight operand may be no parameter: a computed layer's derived operand
    (:mod:`quantcli.nn.computed`), or a ``weight`` that is no parameter (set by a forward pre-hook)."""
    if layer is None or getattr(layer, "weight_derived", False):
        return True
    return not isinstance(getattr(layer, "weight", None), nn.Parameter)


@contextlib.contextmanager
def constant_operands(model: nn.Module, example: Mapping[str, torch.Tensor]) -> Iterator[list[str]]:
    """While the block runs, every weight quantizer whose input on a forward of ``example`` was computed, one
    value on every call, quantizes that value in place of its input. Yields the quantizers' names; restored
    after."""
    qs = quantizers(model)
    taken: list[tuple[str, TensorQuantizer]] = []
    try:
        for name, found in computed_inputs(model, example).items():
            first = found[0]
            if first is not None and all(x is not None and _same(first, x) for x in found[1:]):
                qs[name].constant_input = first
                taken.append((name, qs[name]))
        yield [name for name, _ in taken]
    finally:
        for _, q in taken:
            q.constant_input = None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
