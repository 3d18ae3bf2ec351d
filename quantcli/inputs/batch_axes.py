"""Which axis of each input holds the samples.

Most models take every input batch-first, and so does quantcli by default. Some do not: DLRM's reference code
passes a recommender's sparse features as ``offsets`` ``(tables, batch)`` and ``indices`` ``(tables,
bags_total)``, whose batch is on axis 1 and nowhere. Cutting such a batch on axis 0 (for the example batch a
checkpoint stores, for ``--batch-size`` or ``--num-samples``) cuts the tables instead, and the forward fails.

:func:`batch_axes` finds each input's batch axis from the batch itself: when every input's first axis has
one size, that is the batch (axis 0 everywhere, as before). Otherwise the batch size is the first-axis size
of the floating-point inputs (the features: index and offset tensors are integers), or where those differ
the one size all of them have on some axis (a sequence-first RNN's input and initial state), and each input's
batch axis is its first axis of that size; an input with no axis of that size has none (it is passed whole,
and a batch that holds one cannot be cut). A batch without floating-point inputs to decide keeps axis 0.
"""

from __future__ import annotations

import torch

from quantcli.errors import DataError

Batch = dict[str, torch.Tensor]
Axes = dict[str, "int | None"]


def batch_axes(batch: Batch) -> Axes:
    """Input name -> the axis of its samples, or None (a scalar; an input that has no batch axis)."""
    first = {k: int(v.shape[0]) for k, v in batch.items() if v.dim()}
    if len(set(first.values())) <= 1:
        return {k: 0 if v.dim() else None for k, v in batch.items()}
    n = _size_of_features(batch, first)
    return {k: _axis_of(v, n) for k, v in batch.items()}


def _size_of_features(batch: Batch, first: dict[str, int]) -> int:
    """The batch size: the floating-point inputs' common first-axis size; else the one size (not 1) that
    every floating-point input has on some axis (a sequence-first RNN's ``x`` ``(time, batch, features)`` and
    ``h0`` ``(layers, batch, hidden)``); else the first input's first-axis size."""
    floats = [v for k, v in batch.items() if k in first and v.is_floating_point()]
    firsts = {int(v.shape[0]) for v in floats}
    if len(firsts) == 1:
        return firsts.pop()
    shared = set.intersection(*(set(v.shape) for v in floats)) - {1} if floats else set()
    return shared.pop() if len(shared) == 1 else next(iter(first.values()))


def _axis_of(t: torch.Tensor, n: int) -> int | None:
    return next((a for a, s in enumerate(t.shape) if s == n), None)


def batch_size(batch: Batch, axes: Axes | None = None) -> int:
    """How many samples ``batch`` holds (1 for a batch of scalars)."""
    axes = batch_axes(batch) if axes is None else axes
    for k, a in axes.items():
        if a is not None:
            return int(batch[k].shape[a])
    return 1


def is_batch_first(axes: Axes) -> bool:
    """Whether every input that is not a scalar has its samples on axis 0 (the default layout)."""
    return all(a == 0 for a in axes.values() if a is not None)


def unbatched(batch: Batch, axes: Axes) -> list[str]:
    """The inputs of ``batch`` (not scalars) that have no batch axis: passed whole, they cannot be cut."""
    return [k for k, a in axes.items() if a is None and batch[k].dim()]


def take(batch: Batch, start: int, stop: int, axes: Axes | None = None, where: str = "batch") -> Batch:
    """Samples ``start:stop`` of every input, each cut along its own batch axis. Raises DataError when an
    input has no batch axis (nothing says which of its parts belong to those samples)."""
    axes = batch_axes(batch) if axes is None else axes
    whole = unbatched(batch, axes)
    if whole:
        n = batch_size(batch, axes)
        raise DataError(
            f"{where}: cannot take samples {start}..{stop} of {n}: input {whole[0]!r} "
            f"{list(batch[whole[0]].shape)} has no axis of {n} samples (its values belong to the batch as a "
            "whole, as EmbeddingBag indices do); save one file per batch (a directory of .npz/.pt files), or "
            "pass --batch-size/--num-samples that do not cut a batch"
        )
    out = {}
    for k, v in batch.items():
        a = axes[k]
        out[k] = v if a is None else v.narrow(a, start, max(0, min(stop, v.shape[a]) - start))
    return out


def head(batch: Batch, n: int) -> Batch:
    """The first ``n`` samples of ``batch`` (each input along its batch axis), or the whole batch where an
    input has no batch axis (it cannot be cut; a few samples more are only more work)."""
    axes = batch_axes(batch)
    return batch if unbatched(batch, axes) else take(batch, 0, n, axes)


def split(batch: Batch, n: int) -> tuple[Batch, Batch | None]:
    """(the first ``n`` samples, the rest or None when nothing is left); a batch with an input that has no
    batch axis is not cut: ``(batch, None)``."""
    axes = batch_axes(batch)
    total = batch_size(batch, axes)
    if unbatched(batch, axes) or total <= n:
        return batch, None
    return take(batch, 0, n, axes), take(batch, n, total, axes)


def describe(batch: Batch, axes: Axes | None = None) -> str:
    """``offsets: axis 1, indices: none (passed whole)`` for the inputs that are not batch-first (scalars
    aside); empty when all are."""
    axes = batch_axes(batch) if axes is None else axes
    whole = set(unbatched(batch, axes))
    return ", ".join(
        f"{k}: axis {a}" if a is not None else f"{k}: none (passed whole)"
        for k, a in axes.items()
        if (a is not None and a != 0) or k in whole
    )
