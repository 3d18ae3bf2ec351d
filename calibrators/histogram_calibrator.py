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
import struct

import torch

from calibrators import shared
from calibrators.base import Calibrator
from calibrators.histogram import METHODS
from quantcli import defaults


class HistogramCalibrator(Calibrator):
    """Collects ``hist`` of shape ``(channels, num_bins)`` (channels = 1 per-tensor) and searches amax with
    one of :data:`calibrators.histogram.METHODS`. State is ``O(channels * num_bins)``, whatever the batch
    count.
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
        self._buf_f: torch.Tensor | None = None
        self._buf_i: torch.Tensor | None = None
        self._hist: torch.Tensor | None = None  # (C, num_bins) int64
        self._exp: torch.Tensor | None = None  # (C,) int64: range is [0, 2**exp)
        self._exp_int: int | None = None  # the same, as a Python int, on the per-tensor CPU path
        self._amax_shape: tuple[int, ...] = ()
        self._flat_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._spiky = False  # the last CPU batch had one dominant bin

    @property
    def counts_width(self) -> int:
        """Entries of :attr:`hist` per channel."""
        return self.num_bins

    def _scratch(
        self, shape: tuple[int, ...], device: torch.device, index_dtype: torch.dtype = torch.int32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reusable float32 / integer buffers: a fresh allocation per batch costs more (page faults) than the
        histogram itself. Sized by the largest batch seen, so memory does not grow with the batch count."""
        n = shape[0] * shape[1]
        f, i = self._buf_f, self._buf_i
        if f is None or f.device != device or f.numel() < n or i.dtype != index_dtype:
            f = torch.empty(n, dtype=torch.float32, device=device)
            i = torch.empty(n, dtype=index_dtype, device=device)
            self._buf_f, self._buf_i = f, i
        return f[:n].view(shape), i[:n].view(shape)

    def _signature(self, shape) -> tuple:
        return ("histogram", self.num_bins, self.skip_zeros, shape)

    def _absorb(self, counts: torch.Tensor, exp: int, batch_exp: int) -> bool:
        """Add another calibrator's counts of this very batch, made over ``[0, 2**exp)``; ``batch_exp`` is the
        batch's own exponent. Exact only if that range is no coarser than the one this calibrator would reach
        itself, ``max(own, batch_exp)``: then the counts merge up to it. Returns False (collect yourself) if
        not.
        """
        own = self._exp_int
        target = batch_exp if self._hist is None else max(own, batch_exp)
        if exp > target:
            return False
        if self._hist is None:
            self._hist = torch.zeros_like(counts)
        elif target > own:
            self._merge(torch.tensor([target - own]))
        self._hist += (
            counts if exp == target else _merged(counts, torch.tensor([target - exp]), self.num_bins)
        )
        self._exp = torch.tensor([target], dtype=torch.long)
        self._exp_int = target
        self._batches += 1
        return True

    def collect(self, x: torch.Tensor) -> None:
        """Add one batch (any float dtype, any device; stays there). Works on ``x.detach()``: no graph is
        recorded, without the cost of entering ``no_grad`` once per batch."""
        axes, shape = self._kept(x)
        self._amax_shape = shape
        # per-tensor histograms on the CPU (small, and the range check below reads the host for free)
        share = (
            shared.active()
            and not axes
            and x.device.type == "cpu"
            and (self._hist is None or self._exp_int is not None)
        )
        if share:
            hit = shared.lookup(x, self._signature(shape))
            if hit is not None and self._absorb(*hit):
                return
        if not axes and x.device.type == "cpu" and (self._hist is None or self._exp_int is not None):
            counts, exp, batch_exp = self._collect_cpu_scalar(x.detach(), want_counts=share)
        else:
            counts, exp, batch_exp = self._collect(x.detach(), axes, want_counts=share)
        if share and counts is not None:
            shared.store(x, self._signature(shape), (counts, exp, batch_exp))

    def _collect(self, x: torch.Tensor, axes, want_counts: bool):
        """Histogram one batch into the state; returns ``(this batch's counts, their exponent)`` if asked."""
        if axes:
            rest = [d for d in range(x.dim()) if d not in axes]
            channels = 1
            for d in axes:
                channels *= x.shape[d]
            src = x.permute(*axes, *rest)
        else:
            channels, src = 1, x
        per = x.numel() // max(channels, 1)
        a, idx = self._scratch((channels, per), x.device)
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
                self._merge(shift)
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
        return None, None, None

    def _collect_cpu_scalar(self, x: torch.Tensor, want_counts: bool):
        """Per-tensor on the CPU: the same scheme with the exponent as a Python int (host reads are free), on
        flat buffers, in as few passes as the torch ops allow: abs, max, scale, truncate, count."""
        flat = x.reshape(-1)
        a, idx = self._flat_scratch(flat.numel())
        if flat.dtype == torch.float32:
            torch.abs(flat, out=a)
        else:
            a.copy_(flat)  # any float dtype in, float32 out
            a.abs_()
        # max |x| from the bit patterns: for non-negative floats the int32 order is the float order (NaN's
        # patterns lie above inf's), and an integer max runs twice as fast as a NaN-propagating float one
        m = _float_of_bits(int(a.view(torch.int32).max()))
        if not math.isfinite(m):
            self._note_finite(torch.tensor(m))
        exp = batch_exp = math.frexp(m)[1]  # m < 2**exp
        nb = self.num_bins
        if self._hist is None:
            self._hist = torch.zeros(1, nb, dtype=torch.long)
            self._exp = torch.tensor([exp], dtype=torch.long)
            self._exp_int = exp
        elif exp > self._exp_int:
            self._merge(torch.tensor([exp - self._exp_int]))
            self._exp = torch.tensor([exp], dtype=torch.long)
            self._exp_int = exp
        zeros = int((a == 0).sum()) if self.skip_zeros else 0
        a.mul_(math.ldexp(float(nb), -self._exp_int))  # exact: a power of two
        idx.copy_(a)  # truncation == floor for non-negative values; every bin < nb since |x| < 2**e
        counts, self._spiky = count_bins(idx, nb, self._spiky)
        if zeros:
            counts[0] -= zeros
        self._hist.view(-1).add_(counts)
        self._batches += 1
        return (counts.view(1, nb), self._exp_int, batch_exp) if want_counts else (None, None, None)

    def _flat_scratch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat float32 / bin-index CPU buffers of ``n`` elements (views of :meth:`_scratch`'s, kept per
        size). Bin indices are int16 when every lane's bin fits: the passes over them move half the bytes."""
        views = self._flat_views
        v = views.get(n)
        if v is None or v[0].data_ptr() != (self._buf_f.data_ptr() if self._buf_f is not None else None):
            f, i = self._scratch((1, n), torch.device("cpu"), index_dtype(self.num_bins))
            if len(views) > 64:
                views.clear()
            v = views[n] = (f.view(-1), i.view(-1))
        return v

    def _merge(self, shift: torch.Tensor) -> None:
        """Sum groups of ``2**shift[c]`` adjacent bins of each channel (the range grew by ``2**shift``)."""
        self._hist = _merged(self._hist, shift.to(self._hist.device), self.num_bins)

    @property
    def hist(self) -> torch.Tensor:
        """``(channels, num_bins)`` counts (a copy)."""
        self._check_ready()
        return self._hist.clone()

    @property
    def bin_edges(self) -> torch.Tensor:
        """``(channels, num_bins + 1)`` edges in the input's units."""
        self._check_ready()
        top = torch.ldexp(torch.ones(self._exp.shape, device=self._exp.device), self._exp.to(torch.int32))
        steps = torch.arange(self.num_bins + 1, device=top.device, dtype=torch.float64) / self.num_bins
        return top.to(torch.float64).unsqueeze(1) * steps.unsqueeze(0)

    def range_exponent(self) -> torch.Tensor | None:
        """``(channels,)`` int64 ``e``: channel ``c``'s histogram covers ``[0, 2**e[c])``; ``None`` before
        data."""
        return None if self._hist is None else self._exp.clone()

    def counts_over(self, exp: torch.Tensor) -> torch.Tensor:
        """``(channels, num_bins)`` int64: the counts re-binned onto the ranges ``[0, 2**exp[c])``, no
        narrower than :meth:`range_exponent`, by the pairwise bin sums ``collect`` uses when a range grows:
        exactly the histogram of the same values built over those ranges from the start (power-of-two
        ``num_bins``)."""
        if self._hist is None:
            raise ValueError(f"{self.label}: no data collected")
        shift = exp.to(device=self._exp.device, dtype=torch.long).reshape(-1) - self._exp
        if bool((shift < 0).any()):
            raise ValueError(f"{self.label}: counts_over needs ranges at least as wide as the histogram's")
        return _merged(self._hist, shift, self.num_bins)

    def load_merged(
        self, hist: torch.Tensor, exp: torch.Tensor, num_batches: int, amax_shape: tuple[int, ...]
    ) -> None:
        """Take ``hist`` over ``[0, 2**exp)``, merged over every rank's ``num_batches`` batches in all, as the
        state; ``amax_shape`` as :attr:`amax_shape` (a rank that saw no batch cannot know it)."""
        self._hist = hist.to(torch.long).clone()
        self._exp = exp.to(device=hist.device, dtype=torch.long).reshape(-1).clone()
        per_tensor_cpu = tuple(amax_shape) == () and hist.device.type == "cpu"
        self._exp_int = int(self._exp[0]) if per_tensor_cpu else None
        self._amax_shape = tuple(amax_shape)
        self._merged_from_ranks(num_batches, amax_shape)

    def compute_amax(self, method: str = "entropy", **kwargs) -> torch.Tensor:
        """amax from the histogram: ``"entropy"``, ``"mse"`` or ``"percentile"`` (kwargs go to the method).

        Returns the per-tensor scalar, or the per-axis amax with the input's rank kept. Can be called
        repeatedly with different methods without collecting again.
        """
        self._check_ready()
        if method not in METHODS:
            raise ValueError(f"unknown histogram method {method!r}; choose from {sorted(METHODS)}")
        if method in ("entropy", "mse"):
            kwargs.setdefault("num_bits", self.num_bits)
            kwargs.setdefault("unsigned", self.unsigned)
        # q/k/v calibrators of one input hold equal histograms: one search serves them (calibrators.shared)
        key = ("amax", method, tuple(sorted(kwargs.items())), self._amax_shape)
        found = shared.find_equal(key, (self._exp, self._hist))
        if found is not None:
            return found.clone()
        hist = self._hist.to(torch.float64)
        if self.skip_zeros and (hist.sum(dim=1) == 0).any():
            raise ValueError(f"{self.label}: every collected value was zero and skip_zeros is set")
        amax = METHODS[method](hist, self.bin_edges, **kwargs)
        amax = amax.reshape(self._amax_shape) if self._amax_shape else amax.reshape(())
        shared.keep_equal(key, (self._exp, self._hist), amax.clone())
        return amax

    def reset(self) -> None:
        super().reset()
        self._hist = None
        self._exp = None
        self._exp_int = None
        self._buf_f = self._buf_i = None
        self._flat_views = {}
        self._spiky = False

    def __repr__(self) -> str:
        return (
            f"HistogramCalibrator(num_bits={self.num_bits}, axis={self.axis}, unsigned={self.unsigned}, "
            f"num_bins={self.num_bins}, skip_zeros={self.skip_zeros})"
        )


_LANES, _LANE_ROW = 4, 1024


def _float_of_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<i", bits))[0]


@functools.lru_cache(maxsize=8)
def _lane_offsets(nb: int, dtype: torch.dtype) -> torch.Tensor:
    return ((torch.arange(_LANE_ROW) % _LANES) * nb).to(dtype)


def index_dtype(bins: int) -> torch.dtype:
    """Bin indices for :func:`bincount_interleaved` over ``bins`` bins: int16 where its lanes' bins fit (the
    passes over them then move half the bytes of int32)."""
    return torch.int16 if _LANES * bins <= torch.iinfo(torch.int16).max else torch.int32


def count_bins(idx: torch.Tensor, nb: int, spiky: bool) -> tuple[torch.Tensor, bool]:
    """``(torch.bincount(idx, minlength=nb), whether the next batch should count interleaved)``. Where one bin
    holds much of the data (a ReLU's zeros), back-to-back increments of one counter stall the count; the batch
    after one whose largest bin held over a quarter of the values counts in interleaved copies
    (:func:`bincount_interleaved`; same counts, either way). Measured on the sample models: a bin with half
    the values counts 20% faster interleaved, one with 15% slower."""
    counts = bincount_interleaved(idx, nb) if spiky else torch.bincount(idx, minlength=nb)
    return counts, int(counts.max()) > idx.numel() // 4


def bincount_interleaved(idx: torch.Tensor, nb: int) -> torch.Tensor:
    """``torch.bincount(idx, minlength=nb)`` for bins in ``[0, nb)``, faster on skewed data: consecutive
    elements count into ``_LANES`` separate copies of the histogram, summed at the end. A plain count
    increments the same counter back to back when a bin dominates (the zeros after a ReLU), and each
    increment then waits for the previous one: ReLU outputs count at about half the speed of smooth data.
    Overwrites ``idx``."""
    whole = idx.numel() - idx.numel() % _LANE_ROW
    idx[:whole].view(-1, _LANE_ROW).add_(_lane_offsets(nb, idx.dtype))
    return torch.bincount(idx, minlength=_LANES * nb).view(_LANES, nb).sum(0)


def _merged(hist: torch.Tensor, shift: torch.Tensor, nb: int) -> torch.Tensor:
    """``hist`` (channels, nb) with groups of ``2**shift[c]`` adjacent bins summed into bin ``i >>
    shift[c]``."""
    shift = shift.reshape(-1).clamp(min=0, max=62)
    src = torch.arange(nb, device=hist.device).unsqueeze(0)
    dst = torch.bitwise_right_shift(src, shift.unsqueeze(1)).clamp_(max=nb - 1)
    out = torch.zeros_like(hist)
    out.scatter_add_(1, dst.expand_as(hist), hist)
    return out
