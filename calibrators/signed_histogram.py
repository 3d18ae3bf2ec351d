"""``SignedHistogramCalibrator``: a streaming histogram of ``x`` itself (both signs), per tensor, in one pass.

The histogram of an asymmetric quantizer's input (:mod:`calibrators.two_sided`). Bin ``f`` counts the values
with ``trunc(x / w) == f``, ``w = 2**e / num_bins``, for ``f`` in ``(-num_bins, num_bins)``: the range is
``(-2**e, 2**e)``, ``e`` the smallest exponent with every ``|x|`` seen so far ``< 2**e``. Stored at ``f +
num_bins`` (index 0 stays empty). Truncation makes each sign's bins those of :class:`HistogramCalibrator`'s
``|x|``: ``hist[:, num_bins + k]`` and ``hist[:, num_bins - k]`` hold ``x`` and ``-x`` in ``[k w, (k + 1) w)``
for ``k >= 1``; bin ``f = 0`` holds ``(-w, w)``, the zero bin of both sides (where a value of either sign is
counted as a zero of the other side anyway, :meth:`SignedHistogramCalibrator.sides`).

Exactly order-invariant for the reason :mod:`calibrators.histogram_calibrator` gives for ``|x|``: when the
range doubles ``k`` times, bin ``f`` goes to ``trunc(f / 2**k)``, and ``trunc(trunc(y) / 2**k) == trunc(y /
2**k)``, so the histogram is the one that would have been built over the final range from the start. One
pass per batch (scale, truncate, count) where a histogram of each sign would take two, over tensors of the
batch's size.

One exponent serves both signs, so the shorter side has fewer bins than a histogram of its own would give it:
still as many per unit as a symmetric quantizer's histogram of ``|x|`` has, that is four or more per
quantization step of the full range.
"""

from __future__ import annotations

import math

import torch

from calibrators import shared
from calibrators.base import Calibrator
from calibrators.counting import (
    DeviceSignedCounter,
    HostSignedCounter,
    fold_signed,
    sides_of_signed,
    signed_merged,
    small_values,
)
from calibrators.histogram_calibrator import SIGNED_COUNTS, edges_of
from calibrators.max import MINMAX, _observed, batch_min_max
from calibrators.scratch import HostMinMax, reads_on_host
from quantcli import defaults

#: the key of a tensor's device counts in :mod:`calibrators.shared`
SIGNED_PIECES = "signed_pieces"

__all__ = ["SignedHistogramCalibrator", "signed_merged"]


class SignedHistogramCalibrator(Calibrator):
    """Collects ``hist`` of shape ``(1, 2 * num_bins)`` (see the module); :meth:`sides` gives the histograms
    of ``max(x, 0)`` and ``max(-x, 0)`` that :mod:`calibrators.two_sided` searches.

    A batch costs a handful of operations (:mod:`calibrators.counting`): on the CPU scale, truncate, offset,
    count and add, at the running range; on a device the counts of each sign over the batch's own ranges,
    folded every few dozen batches. The batch's min and max come with it where the caller has them (the
    extremes of :class:`calibrators.two_sided_calibrator.TwoSidedHistogramCalibrator`).
    """

    def __init__(self, num_bits: int = 8, num_bins: int = defaults.NUM_BINS, name: str | None = None):
        super().__init__(num_bits, None, False, name)
        if not isinstance(num_bins, int) or num_bins < 2 or num_bins & (num_bins - 1):
            raise ValueError(f"num_bins must be a power of two >= 2, got {num_bins!r}")
        self.num_bins = num_bins
        self._hist: torch.Tensor | None = None  # (1, 2 * num_bins) int64: the counts folded so far
        self._exp_int: int | None = None  # the range is (-2**exp, 2**exp): a Python int on the CPU path,
        self._exp: torch.Tensor | None = None  # else a (1,) int64 tensor on the histogram's device
        self._host = HostMinMax()
        self._cpu: HostSignedCounter | None = None  # counts on the CPU not yet folded
        self._cpu_new = False
        self._device: DeviceSignedCounter | None = None  # device batches not yet folded
        self._device_batches: list[int] = []

    @property
    def counts_width(self) -> int:
        """Entries of :attr:`hist` per channel."""
        return 2 * self.num_bins

    def collect(self, x: torch.Tensor, bounds=None):
        """Add one batch (any float dtype, any device). ``bounds``: on the CPU the batch's ``(min, max)``
        where the caller has them (Python floats it checked finite), else they are reduced here. Returns the
        batch's ``(min, max)``: floats on the CPU, 0-d tensors on a device (reduced here, or taken with the
        counts of another calibrator of this tensor)."""
        self._kept_shape = ()  # per tensor
        a = small_values(x)
        if a is not None:
            bounds = float(a.min()), float(a.max())
            if not (math.isfinite(bounds[0]) and math.isfinite(bounds[1])):
                self._refuse_nonfinite()
            self.collect_small(a, *bounds)
            return bounds
        seen, x = x, _observed(x)
        if reads_on_host(x):
            if bounds is None:
                bounds = batch_min_max(seen, x, self._host)
                if not (math.isfinite(bounds[0]) and math.isfinite(bounds[1])):
                    self._refuse_nonfinite()
            self._collect_cpu(seen, x, *bounds)
            return bounds
        return self._collect_device(seen, x)

    def collect_small(self, a, lo: float, hi: float) -> None:
        """Add a small float32 batch, its values ``a`` (:func:`calibrators.counting.small_values`) with its
        finite ``(min, max)``: counted in numpy (cheaper to count again than to look up another calibrator's
        counts of the same tensor)."""
        self._kept_shape = ()
        c = self._cpu
        if c is None:
            c = self._start_cpu()
        c.count_small(a, c.target(lo, hi))
        self._cpu_new = True
        self._batches += 1

    def _start_cpu(self) -> HostSignedCounter:
        self._cpu = HostSignedCounter(self.num_bins)
        if self._exp_int is not None:
            self._cpu.exp = self._exp_int
        return self._cpu

    def _collect_cpu(self, seen: torch.Tensor, x: torch.Tensor, lo: float, hi: float) -> None:
        if self._cpu is None:
            self._start_cpu()
        target = self._cpu.target(lo, hi)
        key = (SIGNED_COUNTS, self.num_bins)
        hit = shared.lookup(seen, key)  # q/k/v quantizers of one input: counted once
        if hit is not None and hit[1] <= target:  # counts no coarser than this calibrator's own range
            self._cpu.add(hit[0], hit[1], target)
        else:
            counts = self._cpu.count(x, target)
            shared.store(seen, key, (counts, self._cpu.exp))
        self._cpu_new = True
        self._batches += 1

    def _collect_device(self, seen: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's min and max into a fresh row (the counts read them side by side), its counts kept until
        folded; calibrators of this tensor take both from the first (:mod:`calibrators.shared`)."""
        if self._device is None:
            self._device = DeviceSignedCounter(self.num_bins)
        key = (SIGNED_PIECES, self.num_bins)
        found = shared.lookup(seen, key)
        if found is None:
            bounds = self._device.bounds_out(x)
            torch.aminmax(x, out=bounds)
            shared.store(seen, MINMAX, bounds)  # a max calibrator of this tensor reads it too
            entries = self._device.count(x)
            shared.store(seen, key, (entries, bounds))
        else:
            entries, bounds = found
            self._device.pending.extend(entries)
        self._device_batches.extend([self._batches] * len(entries))
        self._batches += 1
        if self._device.full():
            self._flush()
        return bounds

    def _flush(self) -> None:
        """Fold the counts not yet in :attr:`_hist` into it (the range grows to the widest)."""
        if self._cpu is not None and self._cpu_new:
            self._add_counts(self._cpu.signed(), torch.tensor([self._cpu.exp]))
            self._exp_int = int(self._exp[0])
            self._exp = None
            self._cpu.exp = self._exp_int
            self._cpu.clear()
            self._cpu_new = False
        if self._device is not None and self._device.pending:
            counts, exp, finite = fold_signed([self._device.pending], self.num_bins)
            self._note_finite_rows(finite[0], self._device_batches)
            self._device.pending, self._device_batches = [], []
            self._add_counts(counts, exp)
            self._exp_int = None

    def _add_counts(self, counts: torch.Tensor, exp: torch.Tensor) -> None:
        """Add ``(1, 2 nb)`` counts over ``(-2**exp, 2**exp)`` to the state, both re-binned to the wider
        range."""
        own = self._own_exponent()
        if self._hist is None:
            self._hist, self._exp = counts, exp.to(counts.device)
            return
        hist, own = self._hist.to(counts.device), own.to(counts.device)
        top = torch.maximum(own, exp)
        nb = self.num_bins
        both = signed_merged(torch.cat([hist, counts]), torch.cat([top - own, top - exp]), nb)
        self._hist, self._exp = both.sum(0, keepdim=True), top

    def _own_exponent(self) -> torch.Tensor | None:
        """The folded counts' exponent as a ``(1,)`` tensor (without folding first)."""
        if self._hist is None:
            return None
        return torch.tensor([self._exp_int]) if self._exp_int is not None else self._exp

    @property
    def hist(self) -> torch.Tensor:
        """``(1, 2 * num_bins)`` counts (a copy)."""
        self._flush()
        self._check_ready()
        return self._hist.clone()

    def search_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hist int64 (1, 2 num_bins), e int64 (1,))``, the counts over ``(-2**e, 2**e)`` a range search
        reads (checked: data was collected; not copied: not to be changed)."""
        self._flush()
        self._check_ready()
        return self._hist, self._own_exponent()

    def sides(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(histogram of max(x, 0), histogram of max(-x, 0), their edges)``: ``num_bins`` counts each over
        the edges ``[0, 2**e]`` (float64, ``num_bins + 1``), each the histogram ``HistogramCalibrator`` would
        make of it over that range, on the CPU (where the range searches run). A value of the other sign is a
        zero of each: counted in its bin 0."""
        hist, exp = self.search_counts()
        pos, neg = sides_of_signed(hist.cpu(), self.num_bins)
        return pos[0], neg[0], edges_of(exp.cpu(), self.num_bins)[0]

    def range_exponent(self) -> torch.Tensor | None:
        """``(1,)`` int64 ``e``: the histogram covers ``(-2**e, 2**e)``; ``None`` before data."""
        self._flush()
        own = self._own_exponent()
        return None if own is None else own.clone()

    def counts_over(self, exp: torch.Tensor) -> torch.Tensor:
        """``(1, 2 * num_bins)`` int64: the counts re-binned onto ``(-2**exp, 2**exp)``, no narrower than
        :meth:`range_exponent`, exactly as ``collect`` re-bins when the range grows."""
        own = self.range_exponent()
        if own is None:
            raise ValueError(f"{self.label}: no data collected")
        shift = exp.to(device=own.device, dtype=torch.long).reshape(-1) - own
        if bool((shift < 0).any()):
            raise ValueError(f"{self.label}: counts_over needs a range at least as wide as the histogram's")
        return signed_merged(self._hist, shift, self.num_bins)

    def load_merged(
        self, hist: torch.Tensor, exp: torch.Tensor, num_batches: int, amax_shape: tuple[int, ...] = ()
    ) -> None:
        """Take ``hist`` over ``(-2**exp, 2**exp)``, merged over every rank's ``num_batches`` batches, as the
        state."""
        self._drop_pending()
        self._hist = hist.to(torch.long).reshape(1, -1).clone()
        exp = exp.to(device=hist.device, dtype=torch.long).reshape(1).clone()
        cpu = hist.device.type == "cpu"
        self._exp, self._exp_int = (None, int(exp[0])) if cpu else (exp, None)
        self._merged_from_ranks(num_batches, ())

    def compute_amax(self, *_, **__) -> torch.Tensor:
        raise TypeError(
            f"{self.label}: a signed histogram gives a range (calibrators.two_sided), not an amax"
        )

    def _drop_pending(self) -> None:
        self._cpu, self._cpu_new = None, False
        self._device, self._device_batches = None, []

    def reset(self) -> None:
        super().reset()
        self._hist = self._exp = self._exp_int = None
        self._drop_pending()

    def __repr__(self) -> str:
        return f"SignedHistogramCalibrator(num_bits={self.num_bits}, num_bins={self.num_bins})"
