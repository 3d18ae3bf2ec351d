"""Per-batch observations shared by calibrators that see the same tensor object within one forward pass.

The q, k and v projections of an attention layer read one input: within :func:`shared_observations`, the
first of their calibrators to observe it stores what it computed (a max, a batch histogram) under its own
key, and the others take it instead of reading the tensor again. Identity, not equality, decides: a value
is found only for the very tensor object it was stored for, and only within the block.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

_shared: dict | None = None  # (id(tensor), key) -> (weakref to the tensor, value)


@contextlib.contextmanager
def shared_observations():
    """A scope (one forward pass) in which :func:`lookup` finds what :func:`store` stored."""
    global _shared
    outer, _shared = _shared, {}
    try:
        yield
    finally:
        _shared = outer


def active() -> bool:
    return _shared is not None


def lookup(x: torch.Tensor, key: tuple):
    """The value stored for this very tensor under ``key`` in the current scope, else ``None``."""
    if _shared is None:
        return None
    hit = _shared.get((id(x), key))
    return hit[1] if hit is not None and hit[0]() is x else None


def store(x: torch.Tensor, key: tuple, value) -> None:
    """Keep ``value`` for this tensor under ``key`` until the scope ends (nothing outside a scope)."""
    if _shared is not None:
        _shared[(id(x), key)] = (weakref.ref(x), value)
