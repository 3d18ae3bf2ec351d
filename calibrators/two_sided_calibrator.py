"""The calibrator of an asymmetric quantizer under a histogram method: a histogram of each sign of ``x`` and
its min and max, searched by :mod:`calibrators.two_sided`."""

from __future__ import annotations

import weakref

import torch

from calibrators import shared
from calibrators.base import Calibrator
from calibrators.histogram_calibrator import HistogramCalibrator
from calibrators.max import MinMaxCalibrator
from calibrators.two_sided import METHODS
from quantcli import defaults

_last: list = [None, None, None]  # [the forward pass's scope, a weak reference to its last input, the pair]


def _forget(_ref) -> None:
    """``x`` is gone: so is its pair."""
    _last[:] = [None, None, None]


def _signs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max(x, 0), max(-x, 0))``, made once for consecutive calls on the very same tensor within one forward
    pass (the q, k and v projections' quantizers read one input): the histogram calibrators then share their
    counts too (:mod:`calibrators.shared`). One pair is kept, within that pass and while ``x`` lives."""
    scope = shared.current_observations()
    held_scope, ref, parts = _last
    if scope is not None and held_scope is scope and ref is not None and ref() is x:
        return parts
    d = x.detach()
    parts = (torch.clamp(d, min=0), torch.clamp(d, max=0).neg_())
    if scope is None:
        _last[:] = [None, None, None]
    else:
        _last[:] = [scope, weakref.ref(x, _forget), parts]
    return parts


class TwoSidedHistogramCalibrator(Calibrator):
    """Per-tensor statistics of ``x`` for an affine (min, max) range: :attr:`positive` holds the histogram of
    ``max(x, 0)``, :attr:`negative` that of ``max(-x, 0)`` (each a :class:`HistogramCalibrator`, so order
    invariance and the merge across ranks are theirs), :attr:`extremes` the min and max. :meth:`parts` are
    what :func:`calibrators.distributed.merge_calibrators` merges."""

    def __init__(self, num_bits: int = 8, num_bins: int = defaults.NUM_BINS, name: str | None = None):
        super().__init__(num_bits, None, True, name)
        self.num_bins = num_bins
        label = name or type(self).__name__
        self.positive = HistogramCalibrator(num_bits, None, True, num_bins=num_bins, name=f"{label} (x > 0)")
        self.negative = HistogramCalibrator(num_bits, None, True, num_bins=num_bins, name=f"{label} (x < 0)")
        self.extremes = MinMaxCalibrator(num_bits, name=label)

    def parts(self) -> tuple[Calibrator, ...]:
        """Its histograms and extremes, merged across ranks each as they are alone."""
        return self.positive, self.negative, self.extremes

    @property
    def num_batches(self) -> int:
        return self.extremes.num_batches

    def first_nonfinite_batch(self) -> int | None:
        return self.extremes.first_nonfinite_batch()

    def collect(self, x: torch.Tensor) -> None:
        self.extremes.collect(x)  # first: refuses a non-finite batch with the quantizer's name
        pos, neg = _signs(x)
        self.positive.collect(pos)  # the same tensors for q/k/v of one input: their histograms are shared
        self.negative.collect(neg)

    def compute_range(self, method: str = "mse", **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """``(min, max)`` by ``method`` (``mse`` or ``percentile``; kwargs go to it), float32 0-d, ``min <= 0
        <= max``."""
        if method not in METHODS:
            raise ValueError(f"no asymmetric range search {method!r}; choose from {sorted(METHODS)}")
        lo, hi = self.extremes.compute_range()
        if method == "mse":
            kwargs.setdefault("num_bits", self.num_bits)
        p, n = self.positive, self.negative
        lo_r, hi_r = METHODS[method](p.hist, p.bin_edges, n.hist, n.bin_edges, lo.cpu(), hi.cpu(), **kwargs)
        return lo_r.to(lo.device), hi_r.to(hi.device)

    def compute_amax(self, method: str = "mse", **kwargs) -> torch.Tensor:
        lo, hi = self.compute_range(method, **kwargs)
        return torch.maximum(-lo, hi)

    def reset(self) -> None:
        super().reset()
        for c in self.parts():
            c.reset()

    def __repr__(self) -> str:
        return f"TwoSidedHistogramCalibrator(num_bits={self.num_bits}, num_bins={self.num_bins})"
