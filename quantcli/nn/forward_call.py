"""A model called on one keyword batch, whatever kinds of parameter its ``forward`` has.

quantcli calls every model as ``model(**batch)``. A ``forward`` with positional-only parameters
(``def forward(self, x, /)``) refuses its inputs by name ("got some positional-only arguments passed as
keyword arguments"): :func:`call_forward` passes those by position, in order, and every other input by name.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping

from torch import nn


def call_forward(model: nn.Module, batch: Mapping):
    """``model(**batch)``, with the inputs of ``forward``'s positional-only parameters passed by position (as
    many of them, in order, as the batch gives)."""
    return _call(model, positional_only(model.forward), batch)


def call_by_name(forward: Callable, inputs: Mapping):
    """``forward(**inputs)`` (a bound ``forward`` itself, not the module) as :func:`call_forward` calls."""
    return _call(forward, positional_only(forward), inputs)


def _call(fn: Callable, names: tuple[str, ...], inputs: Mapping):
    if not names:
        return fn(**inputs)
    args = []
    for name in names:
        if name not in inputs:
            break
        args.append(inputs[name])
    given = set(names[: len(args)])
    return fn(*args, **{k: v for k, v in inputs.items() if k not in given})


def positional_only(forward: Callable) -> tuple[str, ...]:
    """The names of ``forward``'s positional-only parameters, in order (a bound method's first left out)."""
    fn = getattr(forward, "__func__", None)
    return _positional_only(fn, True) if fn is not None else _positional_only(forward, False)


@functools.lru_cache(maxsize=256)
def _positional_only(fn: Callable, bound: bool) -> tuple[str, ...]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read
        return ()
    return tuple(p.name for p in params[1 if bound else 0 :] if p.kind is inspect.Parameter.POSITIONAL_ONLY)
