"""Counting one batch into a histogram in a handful of torch operations, on the CPU and on a device.

The histogram calibrators bin on power-of-two ranges (:mod:`calibrators.histogram_calibrator` gives the
argument): ``nb`` bins of width ``w = 2**e / nb`` over ``[0, 2**e)`` for ``|x|``, or ``2 nb`` bins ``trunc(x /
w)`` over ``(-2**e, 2**e)`` for ``x`` (:mod:`calibrators.signed_histogram`), ``e`` the smallest exponent with
every value ``< 2**e``; when the range doubles ``k`` times, bin ``i`` goes to ``i >> k`` (:func:`merged`,
:func:`signed_merged`), exactly. So counts made over any range no wider than the final one add up, after
re-binning, to the histogram over the final range, bit for bit. How a batch is counted is what differs between
the CPU and a device:

- CPU (:class:`HostSignedCounter`): reading the batch's min and max costs nothing on the host
  (:class:`calibrators.scratch.HostMinMax`), so the running exponent is a Python int and the running counts
  are re-binned only when it grows. A batch is scaled by ``nb / 2**e``, truncated to integers ``f`` in ``(-nb,
  nb)``, offset and counted with ``torch.bincount`` (the counts of :data:`HOST_ADD_EVERY` batches added into
  the running ones at once): four operations after the ``aminmax``, for both calibrators (truncation gives
  each sign the bins of ``|x|``, so the ``|x|`` histogram is read off the signed one: its bin ``k`` is ``f =
  k`` plus ``f = -k``). Where one bin holds much of the data (the zeros after a ReLU) a plain count increments
  one counter back to back and each increment waits for the last; then consecutive values are counted into
  ``LANES`` copies of the histogram by the offsets (one operation either way; same counts). Measured on the
  sample models: a bin with half the values counts 20% faster in lanes, one with 15% slower. Otherwise a
  histogram of ``|x|`` alone counts magnitudes instead (abs, max of the bits, scale, truncate, count: the
  input is read once, then its scratch copy), as fast on signed data as before these counters.
- CPU, small float32 batches (at most :data:`NUMPY_MAX` values, :func:`small_values`): the same arithmetic in
  numpy on the batch's memory, read in place (:meth:`HostSignedCounter.count_small_abs`,
  :meth:`HostSignedCounter.count_small`), each value added at its bin with ``np.add.at``. A numpy call costs
  about a microsecond where a torch operation costs two to five through the dispatcher, and below some ten
  thousand values that is what a batch costs (``benchmarks.bench_calibrators``, host time): faster at every
  size up to :data:`NUMPY_MAX` on one or two threads, the same counts bit for bit.
- Device (:class:`DeviceAbsCounter`, :class:`DeviceSignedCounter`): no value is read back per batch (that
  would synchronise with the host). Each batch is counted over its *own* power-of-two range, taken on the
  device from the exponent bits of its extreme values, with ``torch.histc`` (shared-memory atomics on a GPU: a
  spike of zeros does not serialise on one global counter), and the counts are kept, a reference per batch,
  with the range they were made over. Every :data:`FOLD_EVERY` batches, and before the state is read, all of
  them are re-binned to the widest range and summed by a few operations over all of them at once
  (:func:`fold_abs`, :func:`fold_signed`). ``|x|``: five operations per batch (abs, max of the bits, mask,
  divide, count); ``x``: five (aminmax, mask, divide, and one count per sign).

``histc`` counts in float32, exact below ``2**24`` per bin: batches of more values are counted in chunks of
:data:`CHUNK` (more operations, on tensors large enough for that not to matter). Values a device count cannot
place (zeros divided by a zero range, magnitudes that underflow when scaled) all belong to bin 0, and are put
there from the batch's size: every value of a finite batch is counted exactly once.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from calibrators import scratch as _scratch
from calibrators.scratch import CHUNK, generation, persistent, scratch, to_device

#: device batches kept before their counts are folded into the running histogram
FOLD_EVERY = 128
#: rows of the buffers a device counter writes each batch's range into, made (and viewed row by row)
#: together: few enough that a calibration of a few batches does not pay for a whole round's views up front
#: (on a GPU's host, 0.5 ms per counter for FOLD_EVERY rows), enough that the views cost a fraction of an
#: operation a batch (mse on digits_cnn: 5.57 per quantizer per batch, against 5.41 with FOLD_EVERY rows)
SLOT_ROWS = 32
#: histogram copies consecutive values are counted into on the CPU when one bin dominates
LANES = 4
#: CPU batches whose counts are added into the running counts together (two operations for all of them)
HOST_ADD_EVERY = 8
#: float32 CPU batches of at most this many values are counted in numpy, where one operation costs about a
#: microsecond against two to five through torch's dispatcher (``benchmarks.bench_calibrators``)
NUMPY_MAX = 1 << 14
_FLOAT32_MAX = float(np.finfo(np.float32).max)

#: the integer dtype of a float dtype's width, and the mask of its exponent bits
_EXPONENT_BITS = {
    torch.float32: (torch.int32, 0x7F800000),
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
}
_SIGN_BIT = {torch.int32: -(1 << 31), torch.int16: -(1 << 15)}


def merged(hist: torch.Tensor, shift: torch.Tensor, nb: int) -> torch.Tensor:
    """``hist`` (rows, nb) with groups of ``2**shift[r]`` adjacent bins summed into bin ``i >> shift[r]`` (the
    range grew by ``2**shift``); shifts below 0 count as 0."""
    shift = shift.reshape(-1).clamp(min=0, max=62)
    src = torch.arange(nb, device=hist.device).unsqueeze(0)
    dst = torch.bitwise_right_shift(src, shift.unsqueeze(1)).clamp_(max=nb - 1)
    out = torch.zeros_like(hist)
    out.scatter_add_(1, dst.expand_as(hist), hist)
    return out


def signed_merged(hist: torch.Tensor, shift: torch.Tensor, nb: int) -> torch.Tensor:
    """``hist`` (rows, 2 nb), bin ``f + nb`` holding ``trunc(x / w) == f``, re-binned onto a range
    ``2**shift[r]`` times wider: bin ``f`` goes to ``trunc(f / 2**shift[r])``."""
    shift = shift.reshape(-1).clamp(min=0, max=62).to(hist.device).unsqueeze(1)
    f = torch.arange(-nb, nb, device=hist.device).unsqueeze(0)
    dst = torch.bitwise_right_shift(f.abs(), shift).mul_(f.sign()).add_(nb)
    out = torch.zeros_like(hist)
    out.scatter_add_(1, dst.expand_as(hist), hist)
    return out


def abs_of_signed(signed: torch.Tensor, nb: int) -> torch.Tensor:
    """``(rows, nb)`` counts of ``|x|`` from ``(rows, 2 nb)`` counts of ``trunc(x / w)`` (same range): bin
    ``k`` of ``|x|`` is ``f = k`` plus ``f = -k`` (``f = 0`` once)."""
    out = signed[:, nb:].clone()
    out[:, 1:] += signed[:, 1:nb].flip(1)
    return out


def sides_of_signed(signed: torch.Tensor, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pos, neg)`` ``(rows, nb)``: the counts of ``max(x, 0)`` and of ``max(-x, 0)`` from ``(rows, 2 nb)``
    counts of ``trunc(x / w)`` (same range; a value of the other sign is a zero of each side)."""
    pos, neg = signed[:, nb:].clone(), signed[:, 1 : nb + 1].flip(1)
    pos[:, 0] += signed[:, :nb].sum(1)
    neg[:, 0] += signed[:, nb + 1 :].sum(1)
    return pos, neg


def signed_of_sides(pos: torch.Tensor, neg: torch.Tensor, nb: int) -> torch.Tensor:
    """``(rows, 2 nb)`` counts of ``trunc(x / w)`` from ``(rows, nb)`` counts of the positive values and zeros
    (``pos``) and of the negative values by magnitude (``neg``), both over the same range."""
    zero = pos[:, :1] + neg[:, :1]
    empty = torch.zeros_like(zero)
    return torch.cat([empty, neg[:, 1:].flip(1), zero, pos[:, 1:]], dim=1)


# --------------------------------------------------------------------------------------------------- CPU


@functools.lru_cache(maxsize=4)
def _lane_pattern(nb: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    """``nb + (i % LANES) * 2 nb`` for ``i < n``: the offsets that put consecutive values into separate copies
    of a signed histogram. Cached for the largest ``n`` asked; a prefix serves a smaller batch."""
    with persistent():
        return ((torch.arange(n) % LANES) * (2 * nb) + nb).to(dtype)


def _lane_offsets(nb: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    """The offsets for ``n`` values: one row of ``_LANE_ROW`` broadcast over the batch where ``n`` is a
    multiple of it (a cache-resident row; activations mostly are), else a prefix of a full-length pattern."""
    if n % _LANE_ROW == 0:
        return _lane_pattern(nb, dtype, _LANE_ROW)
    size = 1 << max(10, (n - 1).bit_length())  # a few sizes only, each a prefix of the next
    return _lane_views(_lane_pattern(nb, dtype, size), n)


_LANE_ROW = 1024


@functools.lru_cache(maxsize=256)
def _lane_views(pattern: torch.Tensor, n: int) -> torch.Tensor:
    with persistent():
        return pattern[:n]


@functools.lru_cache(maxsize=8)
def _offset(nb: int, dtype: torch.dtype) -> torch.Tensor:
    """``nb`` as a 0-d tensor of the bin index dtype (a Python int costs a conversion per call)."""
    with persistent():
        return torch.tensor(nb, dtype=dtype)


def index_dtype(bins: int) -> torch.dtype:
    """Bin indices over ``LANES`` copies of ``bins`` bins: int16 where they fit (the passes over them then
    move half the bytes of int32)."""
    return torch.int16 if LANES * bins <= torch.iinfo(torch.int16).max + 1 else torch.int32


def small_values(x: torch.Tensor) -> np.ndarray | None:
    """A CPU batch's values as a flat numpy array (shared memory: nothing copied for a contiguous one) where
    it is counted in numpy: float32, a plain tensor without autograd history, ``1 .. NUMPY_MAX`` values, and
    the CPU read on the host (:data:`calibrators.scratch.HOST_READ`); else ``None``."""
    if (
        type(x) is torch.Tensor
        and x.dtype == torch.float32
        and x.is_cpu
        and not x.requires_grad
        and 0 < x.numel() <= NUMPY_MAX
        and "cpu" in _scratch.HOST_READ  # read at each call: tests empty it
    ):
        return x.numpy().reshape(-1)
    return None


_numpy_pool: list = [np.empty(0, np.float32), np.empty(0, np.intp)]


def _numpy_scratch(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``n`` values of the process's numpy scratch buffers (float32, ``intp``), grown where
    smaller. Shared by every counter, as :func:`calibrators.scratch.scratch` is: their work runs one after
    another."""
    if _numpy_pool[0].size < n:
        _numpy_pool[:] = [np.empty(n, np.float32), np.empty(n, np.intp)]
    return _numpy_pool[0][:n], _numpy_pool[1][:n]


class HostSignedCounter:
    """Counts of ``trunc(x / w)`` of CPU batches, ``w = 2**exp / nb``, accumulated over a range that grows
    with the data (see the module). State: ``LANES`` copies of ``2 nb`` int64 counts; :meth:`signed` sums
    them.

    For a histogram of ``|x|`` alone (:meth:`abs_counts`) a batch may instead be counted by magnitude
    (:meth:`abs_max`, :meth:`count_abs`: abs, max of the bits, scale, truncate, count: one pass over the
    input, then over the scratch copy; ``nb`` bins): cheaper where the data are not concentrated in one bin.
    Where they are (the zeros after a ReLU), the signed count in lanes is. Both kinds add up into one
    histogram.
    """

    def __init__(self, nb: int):
        self.nb = nb
        self.exp: int | None = None  # the counts are over (-2**exp, 2**exp)
        self.lanes: torch.Tensor | None = None  # (LANES, 2 nb) int64
        self._lane0: torch.Tensor | None = None
        self._flat: torch.Tensor | None = None
        self._lanes_np = None
        self.spiky = False
        self._checked = 0  # batches since the last look at the counts
        self._scales: dict = {}
        self._kept_views: tuple | None = None
        self._narrow: list[torch.Tensor] = []  # counts of batches not yet added: (2 nb,) each
        self._wide: list[torch.Tensor] = []  # ... counted in lanes: (LANES * 2 nb,) each
        self._magnitudes: list[torch.Tensor] = []  # ... counted by magnitude: (nb,) each
        self.absolute: torch.Tensor | None = None  # (nb,) int64: counts of |x| over [0, 2**exp)
        self._absolute_np = None
        self._top = self._top_np = None  # the max of a batch's bit patterns, and the host's view of it
        self._rolled = np.zeros(2 * nb, np.int64)  # small batches' signed counts, not yet added (f mod 2 nb)
        self._rolled_new = False
        self._numpy_kept: tuple | None = None  # (shape, values, bins) scratch arrays of small batches
        self._numpy_scales: dict[int, np.float32] = {}

    @staticmethod
    def batch_exponent(lo: float, hi: float) -> int:
        """The exponent of a batch's own range: ``max |x| < 2**e`` (``0`` for an all-zero batch)."""
        return math.frexp(max(-lo, hi))[1]

    def target(self, lo: float, hi: float) -> int:
        """The exponent after a batch with this min and max: the running one or the batch's, whichever is
        wider."""
        e = self.batch_exponent(lo, hi)
        return e if self.exp is None else max(e, self.exp)

    def _widen(self, exp: int) -> None:
        """Bring the counts to ``(-2**exp, 2**exp)`` (allocating them after a start or a :meth:`clear`)."""
        if self.lanes is not None and exp <= self.exp:
            return  # the common case: nothing to do (and no context entered: that costs microseconds)
        self._add_batches()
        with persistent():
            if self.lanes is None:
                self._set(
                    torch.zeros(LANES, 2 * self.nb, dtype=torch.long), torch.zeros(self.nb, dtype=torch.long)
                )
            else:
                shift = torch.tensor([exp - self.exp])
                self._set(
                    signed_merged(self.lanes, shift, self.nb),
                    merged(self.absolute.view(1, -1), shift, self.nb)[0],
                )
        self.exp = exp if self.exp is None else max(self.exp, exp)

    def _set(self, lanes: torch.Tensor, absolute: torch.Tensor) -> None:
        self.lanes, self.absolute = lanes, absolute
        with persistent():
            self._lane0, self._flat = lanes[0], lanes.view(-1)
            self._lanes_np, self._absolute_np = lanes.numpy(), absolute.numpy()

    def _scale(self, dtype: torch.dtype, exp: int) -> torch.Tensor:
        """``nb / 2**exp`` as a float32 tensor made once per exponent: a Python scalar costs a conversion per
        call. 0-d for float32 input; for half inputs one element, so the product is computed in float32 (in
        half precision the scale could overflow)."""
        t = self._scales.get((exp, dtype))
        if t is None:
            s = math.ldexp(float(self.nb), -exp)
            with persistent():
                t = torch.tensor(s if dtype == torch.float32 else [s], dtype=torch.float32)
            self._scales[(exp, dtype)] = t
        return t

    def count(self, x: torch.Tensor, exp: int) -> torch.Tensor:
        """Count one batch, every ``|x| < 2**exp``, at the range ``exp`` (no narrower than the running one).
        Returns this batch's counts (for calibrators of the same tensor: :meth:`add`)."""
        self._widen(exp)
        nb = self.nb
        scaled, bins, flat, rows, scale = self._views(x)
        torch.mul(x, scale, out=scaled)  # exact: a power of two
        bins.copy_(scaled)  # truncation: f in (-nb, nb)
        if self.spiky:
            (flat if rows is None else rows).add_(_lane_offsets(nb, flat.dtype, flat.numel()))
            counts = torch.bincount(flat, minlength=LANES * 2 * nb)
        else:
            flat.add_(_offset(nb, flat.dtype))
            counts = torch.bincount(flat, minlength=2 * nb)
        self._keep(counts)
        self._look()
        return counts

    def _views(self, x: torch.Tensor) -> tuple:
        """The scratch tensors a batch like ``x`` is counted in, and the scale: kept while ``x``'s shape,
        dtype and the range stay and no scratch buffer was replaced (even looking them up costs
        microseconds)."""
        key = (x.shape, x.dtype, self.exp, generation())
        if self._kept_views is None or self._kept_views[0] != key:
            idt, n = index_dtype(2 * self.nb), x.numel()
            views = (
                scratch("scaled", x.device, torch.float32, x.shape),
                scratch("bins", x.device, idt, x.shape),
                scratch("bins", x.device, idt, (n,)),
                scratch("bins", x.device, idt, (n // _LANE_ROW, _LANE_ROW)) if n % _LANE_ROW == 0 else None,
                self._scale(x.dtype, self.exp),
            )
            self._kept_views = (key, views)
        return self._kept_views[1]

    def abs_max(self, x: torch.Tensor) -> float:
        """``max |x|`` of a batch, with ``|x|`` left in the scratch buffer :meth:`count_abs` counts (abs, then
        the max of the bit patterns: for non-negative floats their order, NaN above inf; an integer max runs
        twice as fast as a float one). Two operations; the max is read on the host without another."""
        if self._top is None:
            with persistent():
                self._top = torch.zeros(1, dtype=torch.int32)
                self._top_np = self._top.numpy().view(np.float32)
        a = scratch("scaled", x.device, torch.float32, x.shape)
        if x.dtype == torch.float32:
            torch.abs(x, out=a)
        else:  # abs keeps its input's dtype; copysign(x, 1) is |x| and casts to float32 (exact)
            torch.copysign(x, 1.0, out=a)
        torch.amax(
            scratch("scaled", x.device, torch.float32, (x.numel(),), torch.int32), 0, True, out=self._top
        )
        return float(self._top_np[0])

    def count_abs(self, x: torch.Tensor, exp: int) -> torch.Tensor:
        """Count the magnitudes :meth:`abs_max` left of the batch ``x``, every one ``< 2**exp``, at the range
        ``exp``: scale, truncate, count (``nb`` bins). Returns the counts (for calibrators of the same tensor:
        :meth:`add_abs`)."""
        self._widen(exp)
        n = x.numel()
        a = scratch("scaled", x.device, torch.float32, (n,))
        bins = scratch("bins", x.device, index_dtype(2 * self.nb), (n,))
        a.mul_(self._scale(torch.float32, self.exp))  # exact: a power of two
        bins.copy_(a)  # truncation == floor for non-negative values, every bin < nb
        counts = torch.bincount(bins, minlength=self.nb)
        self._keep(counts, self._magnitudes)
        self._look()
        return counts

    def add_abs(self, counts: torch.Tensor, counts_exp: int, exp: int) -> None:
        """Add another counter's magnitude counts of a batch, made over ``counts_exp <= exp``."""
        self._widen(exp)
        if counts_exp < self.exp:
            counts = merged(counts.view(1, -1), torch.tensor([self.exp - counts_exp]), self.nb)[0]
        self._keep(counts, self._magnitudes)

    def _keep(self, counts: torch.Tensor, kind: list | None = None) -> None:
        """Keep a batch's counts to be added with the next ones (:data:`HOST_ADD_EVERY` at a time)."""
        if kind is None:
            kind = self._wide if counts.numel() > 2 * self.nb else self._narrow
        kind.append(counts)
        if len(self._wide) + len(self._narrow) + len(self._magnitudes) >= HOST_ADD_EVERY:
            self._add_batches()

    def _add_batches(self) -> None:
        """Add the kept batches' counts into the state: two operations for each kind kept."""
        for kept, into in (
            (self._narrow, self._lane0),
            (self._wide, self._flat),
            (self._magnitudes, self.absolute),
        ):
            if kept:
                into.add_(torch.stack(kept).sum(0) if len(kept) > 1 else kept[0])
                kept.clear()
        if self._rolled_new:  # small batches' signed counts, f at f mod 2 nb: bin f + nb of lane 0
            nb, row, rolled = self.nb, self._lanes_np[0], self._rolled
            row[nb:] += rolled[:nb]
            row[:nb] += rolled[nb:]
            rolled[:] = 0
            self._rolled_new = False

    # ---------------------------------------------------------------- small float32 batches, in numpy

    def count_small_abs(self, a: np.ndarray) -> float:
        """Count the magnitudes of a small float32 batch (``a``: its values, 1-D, read in place: see
        :func:`small_values`) at the running range widened to its max, in numpy: abs, max, scale, truncate,
        add at the bins. Returns ``max |a|``; NaN or inf where the batch is not finite (then nothing is
        counted)."""
        m, idx = self._numpy_views(a.size)
        np.abs(a, out=m)
        top = float(m.max())  # NaN propagates
        if not top <= _FLOAT32_MAX:
            return top
        e = math.frexp(top)[1]
        exp = e if self.exp is None or e > self.exp else self.exp
        if self.lanes is None or exp > self.exp:
            self._widen(exp)
        np.multiply(m, self._numpy_scale(exp), out=m)  # exact: a power of two
        np.copyto(idx, m, casting="unsafe")  # truncation == floor for non-negative values, every bin < nb
        np.add.at(self._absolute_np, idx, 1)
        return top

    def count_small(self, a: np.ndarray, exp: int) -> None:
        """Count the values of a small float32 batch (as :meth:`count_small_abs` reads them), every ``|a| <
        2**exp``, at the range ``exp``, in numpy: scale, truncate, offset, add at the bins."""
        if self.lanes is None or exp > self.exp:
            self._widen(exp)
        m, idx = self._numpy_views(a.size)
        np.multiply(a, self._numpy_scale(self.exp), out=m)  # exact: a power of two
        np.copyto(idx, m, casting="unsafe")  # truncation: f in (-nb, nb)
        # negative indices count from the end: f at f mod 2 nb, with no pass to offset it (the state's bin
        # f + nb is added when the counts are, :meth:`_add_batches`)
        np.add.at(self._rolled, idx, 1)
        self._rolled_new = True

    def _numpy_views(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Scratch arrays of ``n`` values (float32, and ``intp`` bins: what ``np.add.at`` indexes with
        unconverted), kept while the size stays."""
        kept = self._numpy_kept
        if kept is None or kept[0] != n:
            kept = self._numpy_kept = (n, *_numpy_scratch(n))
        return kept[1], kept[2]

    def _numpy_scale(self, exp: int) -> np.float32:
        """``nb / 2**exp`` as a float32 scalar (the product then stays float32, as the torch path's)."""
        s = self._numpy_scales.get(exp)
        if s is None:
            s = self._numpy_scales[exp] = np.float32(math.ldexp(float(self.nb), -exp))
        return s

    def add(self, counts: torch.Tensor, counts_exp: int, exp: int) -> None:
        """Add another counter's counts of a batch, made over ``counts_exp <= exp``, at the range ``exp``."""
        self._widen(exp)
        if counts_exp < self.exp:
            shift = torch.tensor([self.exp - counts_exp])
            counts = signed_merged(counts.view(-1, 2 * self.nb), shift, self.nb).view(-1)
        self._keep(counts)

    def _look(self) -> None:
        """Every 8th batch, decide whether to count in lanes: while one bin holds over a quarter of the values
        so far (read on the host from the state: no torch operation)."""
        self._checked -= 1
        if self._checked > 0:
            return
        self._checked = 8
        per_bin = self._lanes_np.sum(0)
        self.spiky = bool(
            per_bin.max() * 4 > per_bin.sum() or self._absolute_np.max() * 4 > self._absolute_np.sum()
        )

    def signed(self) -> torch.Tensor | None:
        """``(1, 2 nb)`` int64 counts over ``(-2**exp, 2**exp)``; ``None`` before the first batch."""
        self._add_batches()
        return None if self.lanes is None else self.lanes.sum(0, keepdim=True)

    def abs_counts(self) -> torch.Tensor | None:
        """``(1, nb)`` int64 counts of ``|x|`` over ``[0, 2**exp)`` from both kinds of counts; ``None`` before
        the first batch."""
        signed = self.signed()
        return None if signed is None else abs_of_signed(signed, self.nb) + self.absolute

    def clear(self) -> None:
        """Drop the counts, keeping the range (after they were taken into a calibrator's state)."""
        self.lanes = self._lane0 = self._flat = self._lanes_np = None
        self.absolute = self._absolute_np = None
        self._narrow, self._wide, self._magnitudes = [], [], []
        self._rolled[:] = 0
        self._rolled_new = False


# ------------------------------------------------------------------------------------------------ device


def _bits_of(dtype: torch.dtype) -> tuple[torch.dtype, int]:
    found = _EXPONENT_BITS.get(dtype)
    if found is None:
        raise TypeError(f"cannot count {dtype} values on a device; use float32, bfloat16 or float16")
    return found


def _slots(
    dtype: torch.dtype,
    device: torch.device,
    width: int,
    view_shape: tuple[int, ...] | None = None,
    columns: bool = False,
):
    """A fresh ``(SLOT_ROWS, width)`` buffer for the next batches: its rows (as floats, as bits, optionally
    viewed as ``view_shape`` for broadcasting) and, where ``columns``, per column its elements as 0-d views;
    every view made here by a few operations for all the rows. Fresh each time, so a row stays valid as long
    as a pending batch refers to it (calibrators of one tensor share them)."""
    ibits, _ = _bits_of(dtype)
    with persistent():
        buf = torch.empty(SLOT_ROWS, width, dtype=dtype, device=device)
        rows = buf.unbind(0)
        bits = buf.view(ibits).unbind(0)
        shaped = buf.view(SLOT_ROWS, *view_shape).unbind(0) if view_shape is not None else None
        cols = tuple(col.unbind(0) for col in buf.unbind(1)) if columns else None
    return rows, bits, shaped, cols


class DeviceAbsCounter:
    """``|x|`` counts of device batches, each over its own range, kept until folded (see the module).

    ``pending``: per counted piece ``(counts (nb,) float32, q, values)``, ``q`` a 0-d float32 power of two
    with the piece's values in ``[0, 2 q)``.
    """

    def __init__(self, nb: int):
        self.nb = nb
        self.pending: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self._round: tuple | None = None
        self._used = 0

    def count(self, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """Count one batch; returns its pending entries (also for calibrators of the same tensor)."""
        if self._round is None or self._used == SLOT_ROWS:
            self._round, self._used = _slots(torch.float32, x.device, 1), 0
        rows, bits, _, _ = self._round
        q, q_bits = rows[self._used], bits[self._used]
        self._used += 1
        n = x.numel()
        a = scratch("abs", x.device, torch.float32, x.shape)
        if x.dtype == torch.float32:
            torch.abs(x, out=a)
        else:  # abs keeps its input's dtype; copysign(x, 1) is |x| and casts to float32 (exact)
            torch.copysign(x, 1.0, out=a)
        flat = scratch("abs", x.device, torch.float32, (n,))
        top = scratch("abs_top", x.device, torch.int32, (1,))
        # the max of the bit patterns is the bits of max |x| (non-negative floats order as their bits; NaN
        # above inf), and its exponent bits alone are the power of two q with max |x| in [q, 2 q)
        torch.amax(scratch("abs", x.device, torch.float32, (n,), torch.int32), 0, keepdim=True, out=top)
        torch.bitwise_and(top, 0x7F800000, out=q_bits)
        entries = []
        for piece in scratch("abs", x.device, torch.float32, (n,), "chunks") if n > CHUNK else (flat,):
            torch.div(piece, q, out=piece)  # exact: a power of two; |x| / q in [0, 2)
            # zeros (half of a ReLU's output) are left out: all in one bin, they serialise histc's atomic adds
            # (10x its time on a GPU); the fold puts every value histc did not place into bin 0. The bins are
            # those of [0, 2): a value the lower edge moves lies in bin 0 either way
            entries.append((torch.histc(piece, self.nb, _TINY, 2), q, piece.numel()))
        self.pending.extend(entries)
        return entries

    def full(self) -> bool:
        return len(self.pending) >= FOLD_EVERY


class DeviceSignedCounter:
    """Counts of ``trunc(x / w)`` of device batches, each sign over its own range, kept until folded.

    ``pending``: per counted piece ``(pos, neg, lohi, sides, values)``: the counts (``(nb,)`` float32 each) of
    the values ``>= 0`` over ``[0, 2 sides[1])`` and of the magnitudes of those ``< 0`` over ``[0, -2
    sides[0])``, the batch's ``(min, max)`` and the powers of two ``sides`` (0-d rows of ``(2,)`` tensors in
    the input's dtype).
    """

    def __init__(self, nb: int):
        self.nb = nb
        self.pending: list[tuple] = []
        self._rounds: dict = {}
        self._used = 0

    def bounds_out(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the next batch's ``aminmax`` goes (0-d views of a fresh row): the ``(min, max)`` that
        :meth:`count` then reads."""
        key = (x.dtype, x.device, x.dim())
        r = self._rounds.get(key)
        if r is None or self._used == SLOT_ROWS:
            bounds = _slots(x.dtype, x.device, 2, columns=True)  # (min, max): aminmax's out
            sides = _slots(x.dtype, x.device, 2, (2,) + (1,) * x.dim())
            self._rounds = {key: (bounds, sides)}
            self._used = 0
            r = self._rounds[key]
        self._next = (r, self._used)
        self._used += 1
        lo, hi = r[0][3]
        return lo[self._next[1]], hi[self._next[1]]

    def count(self, x: torch.Tensor) -> list[tuple]:
        """Count one batch whose min and max :meth:`bounds_out` received; returns its pending entries."""
        (lohi_rows, lohi_bits, _, _), (side_rows, side_bits, side_shaped, _) = self._next[0]
        k = self._next[1]
        _, mask = _bits_of(x.dtype)
        ibits, _ = _bits_of(x.dtype)
        # [min & (sign | exponent), max & exponent] = [-p, q]: powers of two with min in (-2 p, -p], max in
        # [q, 2 q)
        torch.bitwise_and(lohi_bits[k], _side_masks(ibits, mask, x.device), out=side_bits[k])
        n = x.numel()
        y = scratch("signed", x.device, torch.float32, (2, *x.shape))
        torch.div(x, side_shaped[k], out=y)  # [x / -p, x / q]: exact, powers of two
        halves = scratch("signed", x.device, torch.float32, (2, n), "rows")
        if n > CHUNK:  # pieces of each half (a view each, made once)
            halves = [h.split(CHUNK) for h in halves]
        else:
            halves = [(h,) for h in halves]
        entries = []
        for neg_piece, pos_piece in zip(*halves):
            pos = torch.histc(pos_piece, self.nb, 0, 2)  # x >= 0 (zeros here)
            neg = torch.histc(neg_piece, self.nb, _TINY, 2)  # x < 0, by magnitude (zeros excluded)
            entries.append((pos, neg, lohi_rows[k], side_rows[k], pos_piece.numel()))
        self.pending.extend(entries)
        return entries

    def full(self) -> bool:
        return len(self.pending) >= FOLD_EVERY


#: below every positive float32 quotient the signed count can produce: ``histc``'s lower edge that leaves out
#: 0
_TINY = 2.0**-149


@functools.lru_cache(maxsize=16)
def _side_masks(ibits: torch.dtype, exponent: int, device: torch.device) -> torch.Tensor:
    with persistent():
        return torch.tensor([_SIGN_BIT[ibits] | exponent, exponent], dtype=ibits, device=device)


@functools.lru_cache(maxsize=16)
def _bin_index(nb: int, device: torch.device) -> torch.Tensor:
    """``(1, nb)`` int64 ``0 .. nb-1``."""
    with persistent():
        return torch.arange(nb, device=device).unsqueeze(0)


def _exponent(v: torch.Tensor) -> torch.Tensor:
    """``e`` with ``|v| < 2**e`` as int64 (``frexp``'s: 0 for 0)."""
    return torch.frexp(v)[1].to(torch.long)


def _stacked(pendings: list[list], part: int, shape: tuple[int, ...]) -> torch.Tensor:
    """``(calibrators, pieces, *shape)``: element ``part`` of every pending piece of every calibrator."""
    return torch.stack([p[part] for pending in pendings for p in pending]).view(
        len(pendings), len(pendings[0]), *shape
    )


def _values(pendings: list[list], part: int) -> list[int]:
    """Per calibrator, the values its pending pieces hold (element ``part`` of each piece)."""
    return [sum(p[part] for p in pending) for pending in pendings]


def _place(
    width: int, dst: torch.Tensor, counts: torch.Tensor, column: int, values: list[int]
) -> torch.Tensor:
    """``(calibrators, width)`` int64: each calibrator's ``counts`` (its rows of ``(C, rows, nb)``) summed
    into the bins ``dst`` of one histogram, and what histc did not place (zeros, zeros over a zero range,
    magnitudes that underflowed: each calibrator's ``values`` less those placed) into ``column``."""
    c = counts.shape[0]
    out = torch.zeros(c, width, dtype=torch.long, device=counts.device)
    out.scatter_add_(1, dst.reshape(c, -1), counts.to(torch.long).reshape(c, -1))
    placed = out.sum(1)
    if len(set(values)) == 1:
        out[:, column] += values[0] - placed
    else:
        out[:, column] += to_device(values, torch.long, out.device) - placed
    return out


def fold_abs(pendings: list[list], nb: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(counts (C, nb) int64, e (C,) int64, finite (C, pieces) bool)`` for the pending ``|x|`` counts of C
    calibrators (as many pieces each): each one's counts re-binned onto ``[0, 2**e)``, ``e`` the widest of its
    ranges, and whether each piece's batch was finite."""
    return fold_abs_stacked(_stacked(pendings, 0, (nb,)), _stacked(pendings, 1, ()), _values(pendings, 2), nb)


def fold_abs_stacked(
    counts: torch.Tensor, q: torch.Tensor, values: list[int], nb: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fold_abs` of pieces already stacked: ``counts`` ``(C, K, nb)`` float32 (exact integers), ``q``
    ``(C, K)`` their powers of two, ``values`` per calibrator the values its K pieces hold."""
    finite = torch.isfinite(q)  # q: 0 for a zero batch, inf for a non-finite one
    # [0, 2 q) = [0, 2**e); a zero batch: e = 0, as frexp(0) gives; a non-finite one (refused later): 0
    exp = torch.where(finite, _exponent(q), 0)
    top = exp.amax(1, keepdim=True)
    dst = torch.bitwise_right_shift(_bin_index(nb, counts.device).unsqueeze(0), (top - exp).unsqueeze(2))
    return _place(nb, dst, counts, 0, values), top.view(-1), finite


def fold_signed(pendings: list[list], nb: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(counts (C, 2 nb) int64, e (C,) int64, finite (C, pieces) bool)`` for the pending signed counts of C
    calibrators (as many pieces each): each one's counts re-binned onto ``(-2**e, 2**e)``, ``e`` the exponent
    of its widest batch extent ``max(-min, max)``."""
    parts = (_stacked(pendings, i, shape) for i, shape in enumerate(((nb,), (nb,), (2,), (2,))))
    return fold_signed_stacked(*parts, _values(pendings, 4), nb)


def fold_signed_stacked(
    pos: torch.Tensor, neg: torch.Tensor, lohi: torch.Tensor, sides: torch.Tensor, values: list[int], nb: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fold_signed` of pieces already stacked: ``pos``, ``neg`` ``(C, K, nb)`` float32 counts, ``lohi``
    ``(C, K, 2)`` their batches' ``(min, max)`` and ``sides`` ``(C, K, 2)`` their ``[-p, q]`` (any float
    dtype), ``values`` per calibrator the values its K pieces hold."""
    # float32 (exact): frexp is not defined for every half dtype on every device
    lohi, sides = lohi.to(torch.float32), sides.to(torch.float32)
    finite = torch.isfinite(lohi).all(2)
    lo, hi = lohi.unbind(2)
    neg = neg * (lo < 0).unsqueeze(2)  # min >= 0: that count was of positive values over [0, 2 min)
    # the batch's own exponent, as the CPU takes it: of max(-min, max), 0 for an all-zero batch
    exp = torch.where(finite, _exponent(torch.maximum(-lo, hi)), 0)
    top = exp.amax(1, keepdim=True)
    e_neg, e_pos = _exponent(sides).unbind(2)
    index = _bin_index(nb, pos.device).unsqueeze(0)
    # positive bin k goes to f = k >> shift, negative bin k to f = -(k >> shift), stored at f + nb
    dst_pos = torch.bitwise_right_shift(index, (top - e_pos).clamp_(min=0).unsqueeze(2)).add_(nb)
    dst_neg = torch.bitwise_right_shift(index, (top - e_neg).clamp_(min=0).unsqueeze(2)).neg_().add_(nb)
    dst = torch.cat([dst_pos, dst_neg], 1)
    return _place(2 * nb, dst, torch.cat([pos, neg], 1), nb, values), top.view(-1), finite
