"""Export hooks: how an exporter that traces the model its own way puts its ops in place of quantcli's.

torch.export (the ``dynamo`` exporter, :mod:`exporters.dynamo`) traces with fake tensors and does not call the
``symbolic`` functions of :mod:`quantcli.quant.tensor_quant`. So the exporter reads every constant first, from
real values, and hands modules a hook that their ``forward`` calls, while it is set, instead of the eager
computation:

* ``TensorQuantizer.export_hook(x) -> Tensor``: the quantizer's output (in place of fake quantization);
* ``QuantMixin.bias_export_hook() -> Tensor``: the bias a layer with an int32 bias adds (in place of
  dequantizing its int32 codes);
* ``QuantLinear.export_hook(x, bias) -> Tensor``: the output of a Linear whose input quantizer is dynamic (in
  place of ``linear(fake_quant_dynamic(x), ..., bias)``; ``x`` is the input after SmoothQuant's ``Mul``, if
  any; ``bias`` the one the ``F.linear`` call adds, the layer's own for a Linear).

Each is a class attribute that is ``None`` by default. :func:`export_hooks` sets them for the duration of a
``with`` block and removes them in a ``finally``, so after an export, failed or not, the model computes as it
did before. Nothing is global: the hooks belong to the modules of one model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from torch import nn

HOOKS = ("export_hook", "bias_export_hook")


@contextmanager
def export_hooks(hooks: Iterable[tuple[nn.Module, str, Callable]]) -> Iterator[None]:
    """Set each ``(module, hook name, function)`` while the block runs; remove them all when it ends."""
    installed: list[tuple[nn.Module, str]] = []
    try:
        for module, name, fn in hooks:
            if name not in HOOKS or not hasattr(type(module), name):
                raise ValueError(
                    f"{type(module).__name__} has no export hook {name!r} (hooks: {', '.join(HOOKS)})"
                )
            object.__setattr__(module, name, fn)  # an instance attribute over the class's None
            installed.append((module, name))
        yield
    finally:
        for module, name in installed:
            module.__dict__.pop(name, None)
