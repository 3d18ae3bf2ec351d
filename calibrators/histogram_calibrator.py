"""``HistogramCalibrator``: a streaming histogram of ``|x|``, per-tensor or per-channel, on ``x``'s device.

Binning scheme (why the result depends only on the data, not on batch order or batch size): each channel's
histogram covers ``[0, 2**e)`` with ``num_bins`` bins, ``e`` the smallest exponent with every value seen so
far ``< 2**e``. When a batch raises ``e`` by ``k``, adjacent groups of ``2**k`` bins are summed. With a
power-of-two ``num_bins`` the bin width is a power of two, every division is exact, and
``floor(floor(x/w)/2**k) == floor(x/(w*2**k))``: the merged histogram is exactly the one that would have been
built over the final range from the start. So the final histogram is a function of the multiset of values
alone (other ``num_bins`` agree within one bin). The price: the range is at most 2x the max, so at least half
the bins hold data.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from calibrators import shared
from calibrators.base import Calibrator
from calibrators.counting import (
    DeviceAbsCounter,
    HostSignedCounter,
    fold_abs,
    merged,
    small_values,
)
from calibrators.histogram import METHODS
from calibrators.max import _observed, batch_min_max
from calibrators.scratch import HostMinMax, persistent, reads_on_host, scratch
from quantcli import defaults

#: keys of a tensor's counts in :mod:`calibrators.shared`: signed counts on the CPU (both histogram
#: calibrators make them alike), ``|x|`` counts of one batch over its own range on a device
SIGNED_COUNTS, ABS_COUNTS, MAGNITUDE_COUNTS = "signed_counts", "abs_counts", "magnitude_counts"


def edges_of(exp: torch.Tensor, num_bins: int) -> torch.Tensor:
    """``(rows, num_bins + 1)`` float64 bin edges of histograms over ``[0, 2**exp)`` (``exp`` ``(rows,)``
    int64): ``2**exp * k / num_bins``, exact."""
    top = torch.ldexp(torch.ones(exp.shape, dtype=torch.float64, device=exp.device), exp.to(torch.int32))
    return top.unsqueeze(1) * _steps(num_bins, exp.device)


@functools.lru_cache(maxsize=16)
def _steps(num_bins: int, device: torch.device) -> torch.Tensor:
    """``(1, num_bins + 1)`` float64 ``k / num_bins``."""
    with persistent():
        return (torch.arange(num_bins + 1, device=device, dtype=torch.float64) / num_bins).unsqueeze(0)


class HistogramCalibrator(Calibrator):
    """Collects ``hist`` of shape ``(channels, num_bins)`` (channels = 1 per-tensor) and searches amax with
    one of :data:`calibrators.histogram.METHODS`. State is ``O(channels * num_bins)``, whatever the batch
    count.

    Per tensor a batch costs a handful of operations (:mod:`calibrators.counting`): on the CPU the signed
    counts of ``x`` (the ``|x|`` histogram is read off them), on a device ``|x|`` counted over the batch's own
    range and folded every few dozen batches. Per channel, the counts of every channel at once over
    per-channel ranges.
    """

    def __init__(
        self,
        num_bits: int = 8,
        axis=None,
        unsigned: bool = False,
        num_bins: int = defaults.NUM_BINS,
        skip_zeros: bool = False,
        name: str | None = None,
    ):
        super().__init__(num_bits, axis, unsigned, name)
        if not isinstance(num_bins, int) or num_bins < 2:
            raise ValueError(f"num_bins must be an int >= 2, got {num_bins!r}")
        self.num_bins = num_bins
        self.skip_zeros = skip_zeros
        self._hist: torch.Tensor | None = None  # (C, num_bins) int64: the counts folded so far
        self._exp: torch.Tensor | None = None  # (C,) int64: range is [0, 2**exp)
        self._exp_int: int | None = None  # the same, as a Python int, per tensor on the CPU
        self._amax_shape: tuple[int, ...] = ()
        self._host = HostMinMax()
        self._cpu: HostSignedCounter | None = None  # per tensor on the CPU: counts not yet folded
        self._cpu_new = False
        self._device: DeviceAbsCounter | None = None  # per tensor on a device: batches not yet folded
        self._device_batches: list[int] = []  # the batch of each pending piece
        self._zeros = 0  # skip_zeros: exact zeros of the batches not yet folded (an int, or a device tensor)

    @property
    def counts_width(self) -> int:
        """Entries of :attr:`hist` per channel."""
        return self.num_bins

    def collect(self, x: torch.Tensor) -> None:
        """Add one batch (any float dtype, any device; stays there). Works on ``x`` without its autograd
        history: no graph is recorded, without the cost of entering ``no_grad`` once per batch."""
        if self.axis is None:
            a = small_values(x)
            if a is not None:
                self._kept_shape = self._amax_shape = ()
                self._collect_small(a)
                return
        axes, shape = self._kept(x)
        self._amax_shape = shape
        seen, x = x, _observed(x)
        if axes:
            self._flush()
            self._collect(x, axes)
        elif reads_on_host(x):
            self._collect_cpu(seen, x)
        else:
            self._collect_device(seen, x)

    def _collect_cpu(self, seen: torch.Tensor, x: torch.Tensor) -> None:
        """Per tensor on the CPU: the batch counted by magnitude, or where one bin dominates by sign in lanes
        (:class:`calibrators.counting.HostSignedCounter`), at the running range; or another calibrator's
        counts of this tensor where no coarser."""
        if self._cpu is None:
            self._start_cpu()
        if not self._cpu.spiky:
            self._collect_magnitudes(seen, x)
            return
        lo, hi = batch_min_max(seen, x, self._host)
        if not (math.isfinite(lo) and math.isfinite(hi)):
            self._refuse_nonfinite()
        target = self._cpu.target(lo, hi)
        hit = shared.lookup(seen, (SIGNED_COUNTS, self.num_bins))
        if hit is not None and hit[1] <= target:
            self._cpu.add(hit[0], hit[1], target)
        else:
            counts = self._cpu.count(x, target)
            shared.store(seen, (SIGNED_COUNTS, self.num_bins), (counts, self._cpu.exp))
        if self.skip_zeros:
            self._zeros += int((x == 0).sum())
        self._cpu_new = True
        self._batches += 1

    def _start_cpu(self) -> HostSignedCounter:
        self._cpu = HostSignedCounter(self.num_bins)
        if self._exp_int is not None:  # a state loaded or folded before: no narrower than it
            self._cpu.exp = self._exp_int
        return self._cpu

    def _collect_small(self, a: np.ndarray) -> None:
        """A small float32 batch (:func:`calibrators.counting.small_values`): its magnitudes counted in numpy
        (cheaper to count again than to look up another calibrator's counts of the same tensor)."""
        c = self._cpu
        if c is None:
            c = self._start_cpu()
        if not math.isfinite(c.count_small_abs(a)):
            self._refuse_nonfinite()
        if self.skip_zeros:
            self._zeros += a.size - int(np.count_nonzero(a))
        self._cpu_new = True
        self._batches += 1

    def _collect_magnitudes(self, seen: torch.Tensor, x: torch.Tensor) -> None:
        """The batch's ``|x|`` counted at the running range widened to its max (shared with calibrators of
        this tensor as the signed counts are)."""
        c = self._cpu
        key = (MAGNITUDE_COUNTS, self.num_bins)
        hit = shared.lookup(seen, key)
        if hit is not None and math.isfinite(hit[2]) and hit[1] <= c.target(-hit[2], hit[2]):
            c.add_abs(hit[0], hit[1], c.target(-hit[2], hit[2]))
        else:
            top = c.abs_max(x)
            if not math.isfinite(top):
                self._refuse_nonfinite()
            counts = c.count_abs(x, c.target(-top, top))
            shared.store(seen, key, (counts, c.exp, top))
        if self.skip_zeros:
            self._zeros += int((x == 0).sum())
        self._cpu_new = True
        self._batches += 1

    def _collect_device(self, seen: torch.Tensor, x: torch.Tensor) -> None:
        """Per tensor on a device: ``|x|`` counted over the batch's own range, kept until folded."""
        if self._device is None:
            self._device = DeviceAbsCounter(self.num_bins)
        key = (ABS_COUNTS, self.num_bins)
        entries = shared.lookup(seen, key)
        if entries is None:
            entries = self._device.count(x)
            shared.store(seen, key, entries)
        else:
            self._device.pending.extend(entries)
        self._device_batches.extend([self._batches] * len(entries))
        if self.skip_zeros:
            self._zeros = self._zeros + (x == 0).sum()
        self._batches += 1
        if self._device.full():
            self._flush()

    def _flush(self) -> None:
        """Fold the counts not yet in :attr:`_hist` into it (the range grows to the widest)."""
        if self._cpu is not None and self._cpu_new:
            counts = self._cpu.abs_counts()
            self._add_counts(counts, torch.tensor([self._cpu.exp]))
            self._exp_int = int(self._exp[0])
            self._cpu.exp = self._exp_int
            self._cpu.clear()
            self._cpu_new = False
        if self._device is not None and self._device.pending:
            counts, exp, finite = fold_abs([self._device.pending], self.num_bins)
            self._note_finite_rows(finite[0], self._device_batches)
            self._device.pending, self._device_batches = [], []
            self._add_counts(counts, exp)
            self._exp_int = None

    def _add_counts(self, counts: torch.Tensor, exp: torch.Tensor) -> None:
        """Add ``(1, nb)`` counts over ``[0, 2**exp)`` to the state, re-binning both to the wider range."""
        if self.skip_zeros:
            counts[:, 0] -= self._zeros
            self._zeros = 0
        if self._hist is None:
            self._hist, self._exp = counts, exp.to(counts.device)
            return
        hist, own = self._hist.to(counts.device), self._exp.to(counts.device)
        top = torch.maximum(own, exp)
        both = merged(torch.cat([hist, counts]), torch.cat([top - own, top - exp]), self.num_bins)
        self._hist, self._exp = both.sum(0, keepdim=True), top

    def _collect(self, x: torch.Tensor, axes) -> None:
        """Per channel: every channel's batch histogram at once over the per-channel ranges (exponents kept as
        a tensor: no host read), added into the state."""
        rest = [d for d in range(x.dim()) if d not in axes]
        channels = 1
        for d in axes:
            channels *= x.shape[d]
        src = x.permute(*axes, *rest)
        per = x.numel() // max(channels, 1)
        a = scratch("channel_abs", x.device, torch.float32, (channels, per))
        idx = scratch("channel_bins", x.device, torch.int32, (channels, per))
        if src.dtype == torch.float32:
            torch.abs(src, out=a.view(src.shape))  # one pass, channels first
        else:
            a.view(src.shape).copy_(src)  # any float dtype in, float32 out
            a.abs_()
        batch_max = a.amax(dim=1)
        self._note_finite(batch_max)
        _, exp = torch.frexp(batch_max)  # batch_max < 2**exp (and 2**exp <= 2 * batch_max)
        exp = exp.to(torch.long)
        nb = self.num_bins
        if self._hist is None:
            self._hist = torch.zeros(channels, nb, dtype=torch.long, device=x.device)
            self._exp = exp
        else:
            new_exp = torch.maximum(self._exp, torch.where(torch.isfinite(batch_max), exp, self._exp))
            shift = new_exp - self._exp
            # on the CPU a host check is free and skips the no-op merge; on CUDA always merge (no sync)
            if x.device.type != "cpu" or bool(shift.any()):
                self._hist = merged(self._hist, shift, nb)
            self._exp = new_exp
        self._exp_int = None  # the tensor path owns the exponent now
        zeros = (a == 0).sum(dim=1) if self.skip_zeros else None
        # bin = floor(|x| * nb / 2**e): exact, nb and 2**e being powers of two; |x| < 2**e so bin < nb
        per_bin = torch.ldexp(torch.full_like(batch_max, float(nb)), -self._exp.to(torch.int32))
        torch.mul(a, per_bin.unsqueeze(1), out=a)
        idx.copy_(a)  # truncation == floor for non-negative values
        if channels > 1:
            idx += torch.arange(0, channels * nb, nb, dtype=torch.int32, device=x.device).unsqueeze(1)
        idx.clamp_(0, channels * nb - 1)  # only NaN/inf (already reported) could fall outside
        # accumulate in place: a bincount would allocate and zero a channels x bins table every batch (and
        # synchronise on CUDA to size its output)
        ones = torch.ones((), dtype=torch.long, device=x.device).expand(idx.numel())
        self._hist.view(-1).index_add_(0, idx.view(-1), ones)
        if zeros is not None:
            self._hist[:, 0] -= zeros
        self._batches += 1

    @property
    def hist(self) -> torch.Tensor:
        """``(channels, num_bins)`` counts (a copy)."""
        self._flush()
        self._check_ready()
        return self._hist.clone()

    @property
    def bin_edges(self) -> torch.Tensor:
        """``(channels, num_bins + 1)`` edges in the input's units."""
        self._flush()
        self._check_ready()
        return edges_of(self._exp, self.num_bins)

    def range_exponent(self) -> torch.Tensor | None:
        """``(channels,)`` int64 ``e``: channel ``c``'s histogram covers ``[0, 2**e[c])``; ``None`` before
        data."""
        self._flush()
        return None if self._hist is None else self._exp.clone()

    def counts_over(self, exp: torch.Tensor) -> torch.Tensor:
        """``(channels, num_bins)`` int64: the counts re-binned onto the ranges ``[0, 2**exp[c])``, no
        narrower than :meth:`range_exponent`, by the pairwise bin sums ``collect`` uses when a range grows:
        exactly the histogram of the same values built over those ranges from the start (power-of-two
        ``num_bins``)."""
        self._flush()
        if self._hist is None:
            raise ValueError(f"{self.label}: no data collected")
        shift = exp.to(device=self._exp.device, dtype=torch.long).reshape(-1) - self._exp
        if bool((shift < 0).any()):
            raise ValueError(f"{self.label}: counts_over needs ranges at least as wide as the histogram's")
        return merged(self._hist, shift, self.num_bins)

    def load_merged(
        self, hist: torch.Tensor, exp: torch.Tensor, num_batches: int, amax_shape: tuple[int, ...]
    ) -> None:
        """Take ``hist`` over ``[0, 2**exp)``, merged over every rank's ``num_batches`` batches in all, as the
        state; ``amax_shape`` as :attr:`amax_shape` (a rank that saw no batch cannot know it)."""
        self._drop_pending()
        self._hist = hist.to(torch.long).clone()
        self._exp = exp.to(device=hist.device, dtype=torch.long).reshape(-1).clone()
        per_tensor_cpu = tuple(amax_shape) == () and hist.device.type == "cpu"
        self._exp_int = int(self._exp[0]) if per_tensor_cpu else None
        self._amax_shape = tuple(amax_shape)
        self._merged_from_ranks(num_batches, amax_shape)

    def search_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hist int64 (channels, num_bins), e int64 (channels,))``, the counts over ``[0, 2**e)`` an amax
        search reads (checked: data was collected, and with ``skip_zeros`` some value was not zero; not
        copied: not to be changed)."""
        self._flush()
        self._check_ready()
        if self.skip_zeros and (self._hist.sum(dim=1) == 0).any():
            raise ValueError(f"{self.label}: every collected value was zero and skip_zeros is set")
        return self._hist, self._exp

    def search_input(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hist float64 (channels, num_bins), bin_edges)``: what an amax search reads (checked as
        :meth:`search_counts`)."""
        hist, exp = self.search_counts()
        return hist.to(torch.float64), edges_of(exp, self.num_bins)

    def search_kwargs(self, method: str, kwargs: dict) -> dict:
        """``kwargs`` completed with this calibrator's grid where ``method`` searches one (entropy, mse)."""
        if method not in METHODS:
            raise ValueError(f"unknown histogram method {method!r}; choose from {sorted(METHODS)}")
        kwargs = dict(kwargs)
        if method in ("entropy", "mse"):
            kwargs.setdefault("num_bits", self.num_bits)
            kwargs.setdefault("unsigned", self.unsigned)
        return kwargs

    def shaped(self, amax: torch.Tensor) -> torch.Tensor:
        """A search's ``(channels,)`` result in :attr:`amax_shape` (``()`` per tensor)."""
        shape = tuple(self._amax_shape) if self._amax_shape else ()
        return amax if tuple(amax.shape) == shape else amax.reshape(shape)

    def compute_amax(self, method: str = "entropy", **kwargs) -> torch.Tensor:
        """amax from the histogram: ``"entropy"``, ``"mse"`` or ``"percentile"`` (kwargs go to the method).

        Returns the per-tensor scalar, or the per-axis amax with the input's rank kept. Can be called
        repeatedly with different methods without collecting again.
        """
        self._flush()
        self._check_ready()
        kwargs = self.search_kwargs(method, kwargs)
        key = ("amax", method, tuple(sorted(kwargs.items())), self._amax_shape)
        found = self.kept_result(key)  # searched with all quantizers of a model at once (calibrators.batched)
        if found is None:  # q/k/v calibrators of one input hold equal histograms: one search serves them
            found = shared.find_equal(key, self.statistics())
        if found is not None:
            return found.clone()
        hist, edges = self.search_input()
        amax = self.shaped(METHODS[method](hist, edges, **kwargs))
        shared.keep_equal(key, self.statistics(), amax.clone())
        return amax

    def statistics(self) -> tuple[torch.Tensor, ...]:
        """What every amax search reads (the range exponent and the counts): equal for calibrators that
        observed the same values."""
        self._flush()
        self._check_ready()
        return self._exp, self._hist

    def result_key(self, method: str, kwargs: dict) -> tuple:
        """What :meth:`compute_amax` keeps and finds a search's result under (:meth:`keep_result`)."""
        kwargs = self.search_kwargs(method, kwargs)
        return ("amax", method, tuple(sorted(kwargs.items())), self._amax_shape)

    def _drop_pending(self) -> None:
        self._cpu, self._cpu_new = None, False
        self._device, self._device_batches = None, []
        self._zeros = 0

    def reset(self) -> None:
        super().reset()
        self._hist = None
        self._exp = None
        self._exp_int = None
        self._drop_pending()

    def __repr__(self) -> str:
        return (
            f"HistogramCalibrator(num_bits={self.num_bits}, axis={self.axis}, unsigned={self.unsigned}, "
            f"num_bins={self.num_bins}, skip_zeros={self.skip_zeros})"
        )
