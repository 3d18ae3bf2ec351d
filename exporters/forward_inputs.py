"""The forward an exporter sees: exactly the example's inputs, each passed to the real forward by name.

quantcli calls every model as ``model(**batch)``. The exporters do not:

- the TorchScript exporter passes inputs by position and appends the default of every parameter after the
  last one given to the graph's inputs, so a non-tensor default (``scale: float = 1.0``) became a graph input
  of its own, and an optional parameter skipped between two given ones had to be passed as None rather than
  its default;
- it matches a trailing dict of keyword inputs to named parameters only, so an input ``forward(**kw)``
  reads (alone or beside named parameters) was dropped ("torch.onnx.export failed: 'x'");
- torch.export binds keyword inputs and their dynamic shapes to named parameters too ("IndexError: list
  index out of range" for ``forward(**kw)``).

:func:`forward_by_name` gives ``model`` an instance ``forward`` whose signature is the inputs' names, for
the duration of the export; ``nn.Module.__call__`` looks the instance attribute up first, so the module and
its scopes are unchanged.
"""

from __future__ import annotations

import contextlib
import inspect

from torch import nn

from quantcli.nn.forward_call import call_by_name


def forward_by_name(model: nn.Module, keys: list[str]) -> contextlib.AbstractContextManager:
    """While in the context, ``model.forward`` takes exactly the inputs ``keys`` (the example's, in forward's
    order), by position or by name, and calls the real forward with each by its name. A forward that
    already takes exactly these, each by position or by name, is left as it is (the TorchScript exporter
    passes them by position, torch.export by name: a keyword-only one, ``forward(self, x, *, gate)``, and a
    positional-only one, ``forward(self, x, /)``, need the wrapper)."""
    params = inspect.signature(model.forward).parameters
    either = inspect.Parameter.POSITIONAL_OR_KEYWORD
    if keys == list(params) and all(p.kind is either for p in params.values()):
        return contextlib.nullcontext()
    return _replaced_forward(model, keys)


@contextlib.contextmanager
def _replaced_forward(model: nn.Module, keys: list[str]):
    bound, own = model.forward, model.__dict__.get("forward")

    def forward(*args, **kwargs):
        return call_by_name(bound, {**dict(zip(keys, args)), **kwargs})

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    forward.__signature__ = inspect.Signature([inspect.Parameter(k, kind) for k in keys])
    model.forward = forward
    try:
        yield
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own
