"""``MaxCalibrator``: running max of ``|x|`` over every axis except ``axis``."""

from __future__ import annotations

import math

import torch

from calibrators import shared
from calibrators.base import Calibrator


class MaxCalibrator(Calibrator):
    """Running ``max |x|``; per-tensor when ``axis is None``, else one value per index of the kept axes.

    The amax keeps the input's rank (``(C, 1, 1, 1)`` for ``axis=0`` on a conv weight). State: one tensor.
    """

    def __init__(self, num_bits: int = 8, axis=None, unsigned: bool = False, name: str | None = None):
        super().__init__(num_bits, axis, unsigned, name)
        self._amax: torch.Tensor | None = None
        self._amax_f: float | None = None

    def collect(self, x: torch.Tensor) -> None:
        """Fold one batch into the running max (on ``x``'s device, no host copy; on ``x.detach()``)."""
        axes, shape = self._kept(x)
        seen, x = x, x.detach()
        if not axes and x.device.type == "cpu" and x.numel():
            # per-tensor on the CPU: a Python float is the cheapest running state (a host read costs nothing
            # here); q/k/v calibrators of one input reduce it once (calibrators.shared: keyed by the very
            # tensor the layer passed, not by the detached view made here)
            v = shared.lookup(seen, ("absmax",))
            if v is None:
                lo, hi = torch.aminmax(x)
                v = max(-float(lo), float(hi))
                shared.store(seen, ("absmax",), v)
            if not math.isfinite(v):
                self._note_finite(torch.tensor(v))
            prev = self._amax_f
            self._amax_f = v if prev is None else max(prev, v)
            self._batches += 1
            return
        if not axes:  # one pass, no |x| temporary
            lo, hi = torch.aminmax(x)
            batch = torch.maximum(-lo, hi).to(torch.float32)
        else:
            reduce = tuple(d for d in range(x.dim()) if d not in axes)
            hi = x.amax(dim=reduce, keepdim=True) if reduce else x
            lo = x.amin(dim=reduce, keepdim=True) if reduce else x
            batch = torch.maximum(-lo, hi).reshape(shape).to(torch.float32)
        self._note_finite(batch)
        self._amax = batch if self._amax is None else torch.maximum(self._amax, batch)
        self._batches += 1

    def compute_amax(self, *_, **__) -> torch.Tensor:
        """The running max; raises if nothing was collected or a batch was non-finite."""
        self._check_ready()
        if self._amax is None:
            return torch.tensor(self._amax_f, dtype=torch.float32)
        if self._amax_f is not None:  # batches seen on both paths (a model moved between devices)
            return torch.maximum(self._amax, torch.tensor(self._amax_f, device=self._amax.device))
        return self._amax.clone()

    def running_amax(self) -> torch.Tensor | None:
        """The max of ``|x|`` so far, float32 in :attr:`amax_shape`, unchecked; ``None`` before the first
        batch."""
        if self._batches == 0:
            return None
        if self._amax is None:
            return torch.tensor(self._amax_f, dtype=torch.float32)
        if self._amax_f is not None:
            return torch.maximum(self._amax, torch.tensor(self._amax_f, device=self._amax.device))
        return self._amax.clone()

    def load_merged(self, amax: torch.Tensor, num_batches: int) -> None:
        """Take ``amax``, the running max merged over every rank's ``num_batches`` batches in all, as the
        state."""
        self._amax, self._amax_f = amax.to(torch.float32).clone(), None
        self._merged_from_ranks(num_batches, tuple(amax.shape))

    def reset(self) -> None:
        super().reset()
        self._amax = None
        self._amax_f = None

    def __repr__(self) -> str:
        return f"MaxCalibrator(num_bits={self.num_bits}, axis={self.axis}, unsigned={self.unsigned})"


class MinMaxCalibrator(Calibrator):
    """Running ``min(x)`` and ``max(x)`` per tensor, for asymmetric (affine) quantization."""

    def __init__(self, num_bits: int = 8, name: str | None = None):
        super().__init__(num_bits, None, True, name)
        self._min: torch.Tensor | None = None
        self._max: torch.Tensor | None = None
        self._min_f: float | None = None  # the same, as Python floats, on the per-tensor CPU path
        self._max_f: float | None = None

    def collect(self, x: torch.Tensor) -> None:
        seen, x = x, x.detach()
        if x.device.type == "cpu" and x.numel():
            # on the CPU Python floats are the cheapest running state (a host read costs nothing here), and
            # q/k/v calibrators of one input reduce it once (calibrators.shared: keyed by the very tensor)
            got = shared.lookup(seen, ("minmax",))
            if got is None:
                lo, hi = torch.aminmax(x)
                got = (float(lo), float(hi))
                shared.store(seen, ("minmax",), got)
            if not (math.isfinite(got[0]) and math.isfinite(got[1])):
                self._note_finite(torch.tensor(got))
            f = self._min_f
            self._min_f = got[0] if f is None else min(f, got[0])
            self._max_f = got[1] if f is None else max(self._max_f, got[1])
            self._batches += 1
            return
        lo, hi = (v.to(torch.float32) for v in torch.aminmax(x))
        self._note_finite(torch.stack([lo, hi]))
        self._min = lo if self._min is None else torch.minimum(self._min, lo.to(self._min.device))
        self._max = hi if self._max is None else torch.maximum(self._max, hi.to(self._max.device))
        self._batches += 1

    def _state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The running ``(min, max)`` as float32 tensors, from either path or both (a model moved between
        devices)."""
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
        self._check_ready()
        lo, hi = self._state()
        return lo.clamp(max=0.0).clone(), hi.clamp(min=0.0).clone()

    def compute_amax(self, *_, **__) -> torch.Tensor:
        lo, hi = self.compute_range()
        return torch.maximum(-lo, hi)

    def extent(self):
        """``max(-min, max)`` so far: a Python float while the state is the CPU path's alone, else a 0-d
        float32 tensor on the state's device (no host read); ``None`` before the first batch."""
        if self._batches == 0:
            return None
        if self._min is None:
            return max(-self._min_f, self._max_f)
        lo, hi = self._state()
        return torch.maximum(-lo, hi)

    def running_range(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(min, max)`` seen so far (float32 scalars, not widened to 0); ``None`` before the first batch."""
        if self._batches == 0:
            return None
        return tuple(v.clone() for v in self._state())

    def load_merged(self, lo: torch.Tensor, hi: torch.Tensor, num_batches: int) -> None:
        """Take ``(lo, hi)``, the range merged over every rank's ``num_batches`` batches in all, as the
        state."""
        self._min, self._max = lo.to(torch.float32).clone(), hi.to(torch.float32).clone()
        self._min_f = self._max_f = None
        self._merged_from_ranks(num_batches, ())

    def reset(self) -> None:
        super().reset()
        self._min = self._max = None
        self._min_f = self._max_f = None
