"""What calibrators share within a scope, so that equal work is done once.

- :func:`shared_observations` (one forward pass): the q, k and v projections of an attention layer read one
  input tensor. The first of their calibrators to observe it stores what it computed (a max, a batch
  histogram) under its own key; the others take it instead of reading the tensor again. Identity decides:
  a value is found only for the very tensor object it was stored for. Inference tensors keep no version
  counter, so a tensor changed in place between two observations cannot be told apart: only layer inputs
  share (``TensorQuantizer.collect``), which q, k and v read one after the other; a layer's output is what a
  forward goes on to change in place (``out += identity``: a folded BatchNorm, an ``nn.Identity``, hands on
  the Conv's very output, which a MobileOne block then summed into in place).
- :func:`shared_searches` (one amax computation over all quantizers): those calibrators then hold equal
  histograms, and an amax search is a pure function of the histogram, its range and the settings. A result
  is found only for tensors equal element by element to the ones it was computed from.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

_scopes: dict[str, dict | None] = {"observations": None, "searches": None}


@contextlib.contextmanager
def _scope(kind: str):
    outer, _scopes[kind] = _scopes[kind], {}
    try:
        yield
    finally:
        _scopes[kind] = outer


def shared_observations():
    """A scope (one forward pass) in which :func:`lookup` finds what :func:`store` stored."""
    return _scope("observations")


def shared_searches():
    """A scope in which :func:`find_equal` finds what :func:`keep_equal` kept."""
    return _scope("searches")


def active() -> bool:
    return _scopes["observations"] is not None


def suspend():
    """Leave the observation scope until :func:`resume` (what is collected meanwhile is neither stored nor
    looked up); returns what :func:`resume` takes."""
    outer, _scopes["observations"] = _scopes["observations"], None
    return outer


def resume(outer) -> None:
    _scopes["observations"] = outer


def lookup(x: torch.Tensor, key: tuple):
    """The value stored for this very tensor under ``key`` in the current scope, else ``None``."""
    seen = _scopes["observations"]
    hit = None if seen is None else seen.get((id(x), key))
    return hit[1] if hit is not None and hit[0]() is x else None


def store(x: torch.Tensor, key: tuple, value) -> None:
    """Keep ``value`` for this tensor under ``key`` until the scope ends (nothing outside a scope)."""
    seen = _scopes["observations"]
    if seen is not None:
        seen[(id(x), key)] = (weakref.ref(x), value)


def find_equal(key: tuple, tensors: tuple[torch.Tensor, ...]):
    """The value kept under ``key`` for tensors equal to ``tensors``, else ``None``."""
    for kept, value in (_scopes["searches"] or {}).get(key, ()):
        if all(torch.equal(a, b) for a, b in zip(kept, tensors)):
            return value
    return None


def keep_equal(key: tuple, tensors: tuple[torch.Tensor, ...], value) -> None:
    """Keep ``value`` under ``key`` for copies of ``tensors`` until the scope ends (nothing outside one)."""
    kept = _scopes["searches"]
    if kept is not None:
        kept.setdefault(key, []).append((tuple(t.clone() for t in tensors), value))
