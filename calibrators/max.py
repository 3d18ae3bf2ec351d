"""``MaxCalibrator``: running max of ``|x|`` over every axis except ``axis``; ``MinMaxCalibrator``: running
``min(x)`` and ``max(x)``.

Per batch, one reduction (two per axis: a max and a min), and nothing else (``calibrators.base``): on the CPU
the results land in buffers made once and are read on the host; on a device they stay there, a reference per
batch, and every :data:`calibrators.counting.FOLD_EVERY` batches (and before the state is read) they are
folded into the running state by a few operations over all of them at once. Calibrators of one tensor (q, k
and v) share its reduction (:mod:`calibrators.shared`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from calibrators import counting, shared
from calibrators.base import Calibrator, note_first_nonfinite
from calibrators.scratch import HostMinMax, persistent, reads_on_host

#: the key of a tensor's (min, max) in :mod:`calibrators.shared`
MINMAX = ("minmax",)


def batch_min_max(seen: torch.Tensor, x: torch.Tensor, host: HostMinMax):
    """``(min, max)`` of ``x``: Python floats on the CPU (one ``aminmax`` into ``host``'s buffer), 0-d tensors
    on a device; reduced once per tensor object within a :func:`calibrators.shared.shared_observations` scope
    (``seen``: the tensor the layer passed, before any detach)."""
    got = shared.lookup(seen, MINMAX)
    if got is None:
        got = host(x) if reads_on_host(x) else torch.aminmax(x)
        shared.store(seen, MINMAX, got)
    return got


def max_abs(x: torch.Tensor, axes: tuple[int, ...] = ()) -> torch.Tensor:
    """``max |x|`` over every axis but ``axes`` (sorted, non-negative), float32 with the rank kept (0-d when
    ``axes`` is empty): what :class:`MaxCalibrator` gives for a single batch ``x``, reading nothing on the
    host. A NaN or inf in ``x`` makes its slice's value non-finite. On a device one reduction (the infinity
    norm: one kernel, where the CPU's path launches three to five); on the CPU, where that norm is 20-30x
    slower, an ``aminmax`` per tensor or an ``amin`` and an ``amax`` per axis (``aminmax`` along a dimension
    is 5-10x slower than both). (Device or CPU as :func:`calibrators.scratch.reads_on_host` tells them: a test
    takes the device path on the CPU by emptying ``HOST_READ``.)"""
    if not reads_on_host(x) and x.numel():
        reduce = tuple(d for d in range(x.dim()) if d not in axes)
        if not reduce:
            return x.abs().to(torch.float32)
        top = torch.linalg.vector_norm(x, float("inf"), dim=reduce, keepdim=bool(axes))
        return top.to(torch.float32)  # (exact: one of the values)
    if not axes:
        lo, hi = torch.aminmax(x)
    else:
        reduce = tuple(d for d in range(x.dim()) if d not in axes)
        lo, hi = (x.amin(dim=reduce, keepdim=True), x.amax(dim=reduce, keepdim=True)) if reduce else (x, x)
    amax = torch.maximum(-lo, hi).to(torch.float32)
    return amax.reshape([x.shape[d] if d in axes else 1 for d in range(x.dim())] if axes else [])


def _observed(x: torch.Tensor) -> torch.Tensor:
    """``x`` without autograd history: ``detach`` only where there is some (an operation per batch
    otherwise)."""
    return x.detach() if x.requires_grad else x


class _Pending:
    """Per-batch results kept on a device until folded: ``items`` and the batch index of each."""

    def __init__(self) -> None:
        self.items: list = []
        self.batches: list[int] = []
        self.key: tuple | None = None  # (device, dtype) of the items: stacked together when folded

    def add(self, item, batch: int, key: tuple) -> bool:
        """Keep ``item``; True when it is time to fold. A batch of another device or dtype cannot be stacked
        with the ones kept: the caller folds those first (:meth:`mismatch`)."""
        self.items.append(item)
        self.batches.append(batch)
        self.key = key
        return len(self.items) >= counting.FOLD_EVERY

    def mismatch(self, key: tuple) -> bool:
        return bool(self.items) and key != self.key

    def take(self) -> tuple[list, list[int]]:
        items, batches = self.items, self.batches
        self.items, self.batches, self.key = [], [], None
        return items, batches


class MaxCalibrator(Calibrator):
    """Running ``max |x|``; per-tensor when ``axis is None``, else one value per index of the kept axes.

    The amax keeps the input's rank (``(C, 1, 1, 1)`` for ``axis=0`` on a conv weight). State: one tensor (or
    a float on the CPU per tensor), and on a device the batches not yet folded.
    """

    def __init__(self, num_bits: int = 8, axis=None, unsigned: bool = False, name: str | None = None):
        super().__init__(num_bits, axis, unsigned, name)
        self._amax: torch.Tensor | None = None
        self._amax_np: np.ndarray | None = None  # the same memory, where ``_amax`` is a CPU float32 tensor
        self._amax_f: float | None = None
        self._pending = _Pending()
        self._host = HostMinMax()
        self._axis_out: dict = {}  # CPU per-axis: (shape, dtype) -> (min out, max out, their numpy views)

    def collect(self, x: torch.Tensor) -> None:
        """Fold one batch into the running max (on ``x``'s device, no host read on a device)."""
        axes, shape = self._kept(x)
        seen, x = x, _observed(x)
        if reads_on_host(x):
            if not axes:
                lo, hi = batch_min_max(seen, x, self._host)
                if not (math.isfinite(lo) and math.isfinite(hi)):
                    self._refuse_nonfinite()
                v = max(-lo, hi)
                self._amax_f = v if self._amax_f is None else max(self._amax_f, v)
                self._batches += 1
                return
            if self._collect_cpu_axes(x, axes, shape):
                self._batches += 1
                return
        if not axes:
            got = batch_min_max(seen, x, self._host)
        else:
            reduce = tuple(d for d in range(x.dim()) if d not in axes)
            got = (x.amin(dim=reduce, keepdim=True), x.amax(dim=reduce, keepdim=True)) if reduce else (x, x)
        key = (x.device, x.dtype)
        if self._pending.mismatch(key):
            self._fold()
        if self._pending.add(got, self._batches, key):
            self._fold()
        self._batches += 1

    def _collect_cpu_axes(self, x: torch.Tensor, axes, shape) -> bool:
        """Per axis on the CPU: a max and a min into buffers made once, folded into the running max on the
        host. False where that does not apply (every axis kept, bfloat16 which numpy lacks, a state on another
        device)."""
        reduce = tuple(d for d in range(x.dim()) if d not in axes)
        if not reduce or x.dtype == torch.bfloat16 or (self._amax is not None and self._amax_np is None):
            return False
        out = self._axis_out.get((shape, x.dtype))
        if out is None:
            with persistent():
                lo, hi = torch.empty(shape, dtype=x.dtype), torch.empty(shape, dtype=x.dtype)
                out = self._axis_out[(shape, x.dtype)] = (lo, hi, lo.numpy(), hi.numpy())
        lo, hi, lo_np, hi_np = out
        torch.amin(x, dim=reduce, keepdim=True, out=lo)
        torch.amax(x, dim=reduce, keepdim=True, out=hi)
        batch = np.maximum(-lo_np, hi_np).astype(np.float32)
        if not np.isfinite(batch).all():
            self._refuse_nonfinite()
        if self._amax is None:
            with persistent():
                self._amax = torch.from_numpy(batch.copy())
            self._amax_np = self._amax.numpy()
        else:
            np.maximum(self._amax_np, batch, out=self._amax_np)
        return True

    def _fold(self) -> None:
        """The kept device batches into the running max: a few operations for all of them."""
        fold_kept([self])

    def _flush(self) -> None:
        if self._pending.items:
            self._fold()

    def compute_amax(self, *_, **__) -> torch.Tensor:
        """The running max; raises if nothing was collected or a batch was non-finite."""
        self._flush()
        self._check_ready()
        return self._state()

    def _state(self) -> torch.Tensor:
        if self._amax is None:
            return torch.tensor(self._amax_f, dtype=torch.float32)
        if self._amax_f is not None:  # batches seen on both paths (a model moved between devices)
            return torch.maximum(self._amax, torch.tensor(self._amax_f, device=self._amax.device))
        return self._amax.clone()

    def running_amax(self) -> torch.Tensor | None:
        """The max of ``|x|`` so far, float32 in :attr:`amax_shape`, unchecked; ``None`` before the first
        batch."""
        self._flush()
        if self._batches == 0:
            return None
        return self._state()

    def load_merged(self, amax: torch.Tensor, num_batches: int) -> None:
        """Take ``amax``, the running max merged over every rank's ``num_batches`` batches in all, as the
        state."""
        self._pending.take()
        self._amax, self._amax_f, self._amax_np = amax.to(torch.float32).clone(), None, None
        self._merged_from_ranks(num_batches, tuple(amax.shape))

    def reset(self) -> None:
        super().reset()
        self._amax = self._amax_np = None
        self._amax_f = None
        self._pending = _Pending()

    def __repr__(self) -> str:
        return f"MaxCalibrator(num_bits={self.num_bits}, axis={self.axis}, unsigned={self.unsigned})"


class MinMaxCalibrator(Calibrator):
    """Running ``min(x)`` and ``max(x)`` per tensor, for asymmetric (affine) quantization."""

    def __init__(self, num_bits: int = 8, name: str | None = None):
        super().__init__(num_bits, None, True, name)
        self._min: torch.Tensor | None = None
        self._max: torch.Tensor | None = None
        self._min_f: float | None = None  # the same, as Python floats, on the CPU
        self._max_f: float | None = None
        self._pending = _Pending()
        self._host = HostMinMax()

    def collect(self, x: torch.Tensor):
        """Fold one batch into the running range. Returns the batch's ``(min, max)`` (Python floats on the
        CPU, 0-d tensors on a device), for a histogram of the same batch."""
        self._kept_shape = ()
        seen, x = x, _observed(x)
        got = batch_min_max(seen, x, self._host)
        self.add_range(*got)
        return got

    def add_range(self, lo, hi) -> None:
        """Fold one batch's ``(min, max)``, as :func:`batch_min_max` gives them, into the running range."""
        self._kept_shape = ()
        if isinstance(lo, float):
            if not (math.isfinite(lo) and math.isfinite(hi)):
                self._refuse_nonfinite()
            f = self._min_f
            self._min_f = lo if f is None else min(f, lo)
            self._max_f = hi if f is None else max(self._max_f, hi)
        else:
            key = (lo.device, lo.dtype)
            if self._pending.mismatch(key):
                self._fold()
            if self._pending.add((lo, hi), self._batches, key):
                self._batches += 1
                self._fold()
                return
        self._batches += 1

    def _fold(self) -> None:
        fold_kept([self])

    def _flush(self) -> None:
        if self._pending.items:
            self._fold()

    def _state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The running ``(min, max)`` as float32 tensors, from either path or both (a model moved between
        devices)."""
        self._flush()
        if self._min is None:
            return tuple(torch.tensor(v, dtype=torch.float32) for v in (self._min_f, self._max_f))
        if self._min_f is None:
            return self._min, self._max
        dev = self._min.device
        return (
            torch.minimum(self._min, torch.tensor(self._min_f, device=dev)),
            torch.maximum(self._max, torch.tensor(self._max_f, device=dev)),
        )

    def compute_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(min, max)`` seen, widened to include 0 (zero must be exactly representable)."""
        self._flush()
        self._check_ready()
        lo, hi = self._state()
        return lo.clamp(max=0.0), hi.clamp(min=0.0)  # (new tensors: the state stays the calibrator's)

    def compute_amax(self, *_, **__) -> torch.Tensor:
        lo, hi = self.compute_range()
        return torch.maximum(-lo, hi)

    def running_range(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(min, max)`` seen so far (float32 scalars, not widened to 0); ``None`` before the first batch."""
        self._flush()
        if self._batches == 0:
            return None
        return tuple(v.clone() for v in self._state())

    def load_merged(self, lo: torch.Tensor, hi: torch.Tensor, num_batches: int) -> None:
        """Take ``(lo, hi)``, the range merged over every rank's ``num_batches`` batches in all, as the
        state."""
        self._pending.take()
        self._min, self._max = lo.to(torch.float32).clone(), hi.to(torch.float32).clone()
        self._min_f = self._max_f = None
        self._merged_from_ranks(num_batches, ())

    def reset(self) -> None:
        super().reset()
        self._min = self._max = None
        self._min_f = self._max_f = None
        self._pending = _Pending()


def fold_kept(group: list) -> None:
    """The kept device batches of ``group``, max or min/max calibrators of one kind that kept the same
    batches with results of one shape, into their running states at once (:func:`fold_extremes`)."""
    batches = group[0]._pending.batches
    items = [i for c in group for i in c._pending.take()[0]]
    shape = (len(group), len(batches), *items[0][0].shape)
    lo, hi = (torch.stack([i[part] for i in items]).view(shape) for part in (0, 1))
    fold_extremes(group, lo, hi, batches)


def fold_extremes(group: list, lo: torch.Tensor, hi: torch.Tensor, batches: list[int]) -> None:
    """Fold ``(C, K, *shape)`` per-batch minima ``lo`` and maxima ``hi`` (any float dtype) of batches
    ``batches`` into ``group``, calibrators of one kind (:class:`MaxCalibrator` or :class:`MinMaxCalibrator`),
    row ``i`` into ``group[i]``, as each one's own fold of those batches would (its batch count is the
    caller's)."""
    if isinstance(group[0], MaxCalibrator):
        batch = torch.maximum(-lo, hi).to(torch.float32)  # (C, K, *amax shape)
        note_first_nonfinite(group, torch.isfinite(batch.reshape(*batch.shape[:2], -1)).all(2), batches)
        for c, m in zip(group, batch.amax(1).unbind(0)):  # (one operation for every row)
            if c._kept_shape is not None and tuple(c._kept_shape) != tuple(m.shape):
                m = m.view(c._kept_shape)
            if c._amax is None:
                c._amax = m
            else:
                c._amax = torch.maximum(c._amax.to(m.device), m)
                c._amax_np = None
        return
    lo, hi = lo.to(torch.float32), hi.to(torch.float32)  # (C, K)
    note_first_nonfinite(group, torch.isfinite(lo) & torch.isfinite(hi), batches)
    for c, low, high in zip(group, lo.amin(1).unbind(0), hi.amax(1).unbind(0)):
        if c._min is None:
            c._min, c._max = low, high
        else:
            c._min = torch.minimum(c._min.to(low.device), low)
            c._max = torch.maximum(c._max.to(high.device), high)
