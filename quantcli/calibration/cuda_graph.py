"""The observing pass captured once as a CUDA graph and replayed per batch (issue 38).

On a GPU a small model's forward pass is bound by the host: each operation costs microseconds of Python and a
kernel launch, and observing adds a handful of operations and their bookkeeping per quantizer per batch (an
``aminmax``; a histogram's five). Where every observing calibrator is one whose batch is a fixed set of
tensors on the device, and every batch has the first one's inputs (names, shapes, dtypes), the first batch
runs as usual and the forward pass with each quantizer's observation is captured as a CUDA graph. The
calibrators the graph can record, and what a batch leaves of each:

- a per-tensor max or min/max (:class:`calibrators.MaxCalibrator` without an axis,
  :class:`calibrators.max.MinMaxCalibrator`: ``--method max``, and asymmetric quantizers under ``entropy``):
  the batch's min and max;
- a per-tensor ``|x|`` histogram (:class:`calibrators.HistogramCalibrator` without an axis or
  ``skip_zeros``: ``entropy``, ``mse``, ``percentile``): the counts of each piece over the batch's own range
  and that range (:class:`calibrators.counting.DeviceAbsCounter`);
- a two-sided histogram (:class:`calibrators.two_sided_calibrator.TwoSidedHistogramCalibrator`: asymmetric
  quantizers under ``mse`` and ``percentile``): the batch's min and max, and each sign's counts and range
  (:class:`calibrators.counting.DeviceSignedCounter`).

The graph's tail copies all of them, as float32 (exact), into one row of a history on the device, at a row
index the graph itself advances. Each later batch is then a copy of its inputs and a replay: no Python per
layer or quantizer. When the history's rows are full, and after the last batch, its rows are folded into the
calibrators at once, by the arithmetic their own folds use (:func:`calibrators.max.fold_extremes`,
:func:`calibrators.counting.fold_abs_stacked`, :func:`calibrators.counting.fold_signed_stacked`): the same
amax, ranges, histograms and first non-finite batch as observing batch by batch gives, bit for bit.

Where the graph cannot be captured (an operation that reads a value back to the host, a quantizer called
twice in one pass) the batches are observed one by one, as without it. :func:`plan` says whether a
calibration qualifies; :class:`GraphedPass` captures and replays.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from calibrators import HistogramCalibrator, MaxCalibrator
from calibrators.base import note_first_nonfinite
from calibrators.counting import DeviceAbsCounter, DeviceSignedCounter, fold_abs_stacked, fold_signed_stacked
from calibrators.folding import fold_together, hand_out
from calibrators.max import MinMaxCalibrator, fold_extremes
from calibrators.two_sided_calibrator import TwoSidedHistogramCalibrator

#: the fewest batches worth a capture: the first batch runs as usual, and a capture costs about two forward
#: passes (a warm-up on a side stream, then the capture itself)
MIN_BATCHES = 4
#: the most device memory the history of replayed batches takes (float32 rows); when its rows are full they
#: are folded into the calibrators and written again
HISTORY_BYTES = 256 << 20
#: ``torch.cuda.CUDAGraph.capture_begin``'s ``capture_error_mode`` (see :func:`_capture`)
CAPTURE_MODE = "relaxed"

EXTREMES, ABS, SIGNED = "extremes", "abs", "signed"


def kind(calibrator) -> str | None:
    """What a replayed batch leaves of ``calibrator`` (see the module), or ``None`` where a graph cannot
    record it."""
    t = type(calibrator)
    if t in (MaxCalibrator, MinMaxCalibrator):
        return EXTREMES if getattr(calibrator, "axis", None) is None else None
    if t is HistogramCalibrator:
        return ABS if calibrator.axis is None and not calibrator.skip_zeros else None
    if t is TwoSidedHistogramCalibrator:
        return SIGNED
    return None


def plan(batches: Sequence[dict], observing: dict, counted: dict, dev: torch.device, alone: bool) -> bool:
    """Whether the observing pass over ``batches`` can be a replayed CUDA graph: on a CUDA device, in one
    process, no quantizer whose calls are counted, every observing quantizer's calibrator one a graph records
    (:func:`kind`), at least :data:`MIN_BATCHES` batches, each with the first one's input names, shapes and
    dtypes."""
    if dev.type != "cuda" or not alone or counted or len(batches) < MIN_BATCHES or not observing:
        return False
    for q in observing.values():
        if kind(q.calibrator) is None or q._block is not None:
            return False
    first = {k: (v.shape, v.dtype) for k, v in batches[0].items()}
    return all({k: (v.shape, v.dtype) for k, v in b.items()} == first for b in batches[1:])


def _history_rows(replays: int, width: int) -> int:
    """Rows of the history for ``replays`` batches of ``width`` floats each: one per batch, within
    :data:`HISTORY_BYTES`."""
    return max(1, min(replays, HISTORY_BYTES // (4 * max(1, width))))


class _Observed:
    """What a pass observed of one tensor for one kind of calibrator: ``outputs``, tensors in the graph's
    memory that each replay writes the batch's values into (in the order the history row holds them), and
    ``pieces``, the values of each counted piece (histograms)."""

    def __init__(self, outputs: list[torch.Tensor], pieces: list[int]) -> None:
        self.outputs, self.pieces = outputs, pieces
        self.offset = -1  # where the outputs start in a history row


def _observe(how: str, num_bins: int, x: torch.Tensor) -> _Observed:
    """One batch's observation of ``x`` by a calibrator of kind ``how``, by the operations the calibrator's
    own device path runs. Outputs: ``[min, max]``; ``[counts of each piece..., q]``; or ``[pos, neg of each
    piece..., (min, max), [-p, q]]``."""
    if how == EXTREMES:
        return _Observed(list(torch.aminmax(x)), [])
    if how == ABS:
        entries = DeviceAbsCounter(num_bins).count(x)
        return _Observed([e[0] for e in entries] + [entries[0][1]], [e[2] for e in entries])
    counter = DeviceSignedCounter(num_bins)
    torch.aminmax(x, out=counter.bounds_out(x))
    entries = counter.count(x)
    counts = [t for e in entries for t in e[:2]]
    return _Observed(counts + [entries[0][2], entries[0][3]], [e[4] for e in entries])


class _Slot:
    """One quantizer's observation in a pass (tensors of one input observed by several quantizers of a kind
    are observed once) and how often the pass called it."""

    def __init__(self, how: str, num_bins: int) -> None:
        self.how, self.num_bins = how, num_bins
        self.observed: _Observed | None = None
        self.calls = 0

    def collect(self, x: torch.Tensor, seen: dict) -> None:
        self.calls += 1
        key = (self.how, self.num_bins, id(x))
        found = seen.get(key)
        if found is None:  # (x kept with it: its id names no other tensor during the pass)
            found = seen[key] = (x, _observe(self.how, self.num_bins, x.detach()))
        self.observed = found[1]


class CaptureRefused(Exception):
    """The pass cannot be replayed as it was captured (a quantizer called more than once, or other
    quantizers or shapes in the capture than in the warm-up)."""


class GraphedPass:
    """The observing pass over static copies of a batch's inputs, captured as a CUDA graph.

    ``run(batch)`` runs the model on a batch (the caller's own forward, with its error handling). Use:
    ``capture(batch)`` once (raises where the pass cannot be captured; nothing is observed then),
    ``replay(batch)`` per batch, then ``finish()``, which folds what the replays observed into the
    calibrators. The replays are batches ``first_batch``, ``first_batch + 1``, ...
    """

    def __init__(
        self, observing: dict, run: Callable[[dict], object], batches: int, first_batch: int = 1
    ) -> None:
        self.observing = observing
        self.run = run
        self.batches = batches
        self.first_batch = first_batch
        self.replays = 0
        self.static: dict[str, torch.Tensor] = {}
        self.graph: torch.cuda.CUDAGraph | None = None
        self.slots: dict[str, _Slot] = {}
        self.names: list[str] | None = None  # the quantizers the warm-up pass called, in calling order
        self.width = 0  # floats per history row
        self.history: torch.Tensor | None = None  # (rows, width) float32: what each replay observed
        self.row: torch.Tensor | None = None  # (1,) int64: the history row the next replay writes
        self._pending = 0  # rows written since the history was last folded
        self._seen: dict = {}

    def capture(self, batch: dict) -> None:
        self.static = {k: v.clone() for k, v in batch.items()}
        dev = next(iter(self.static.values())).device
        with self._slots_in():
            with _side_stream(dev):  # a warm-up pass: lazily made state (workspaces) made outside the graph
                self._observe_pass()
            self._check_calls()
            self.names = list(self.slots)  # in the order they ran
            self.width = self._lay_out()
            rows = _history_rows(self.batches - self.first_batch, self.width)
            self.history = torch.zeros(rows, self.width, device=dev)
            self.row = torch.zeros(1, dtype=torch.long, device=dev)
            self.graph = _capture(self._step, dev)

    def _observe_pass(self) -> None:
        for s in self.slots.values():
            s.calls = 0
        self._seen = {}
        try:
            self.run(self.static)
        finally:
            self._seen = {}

    def _lay_out(self) -> int:
        """Give each distinct observation of the pass its place in a history row; returns the row's width."""
        width = 0
        for n in self.names:
            o = self.slots[n].observed
            if o.offset < 0:
                o.offset = width
                width += sum(t.numel() for t in o.outputs)
        return width

    def _step(self) -> None:
        """One observing pass over the static inputs, what it observed written into the history's next row:
        what the graph holds."""
        self._observe_pass()
        self._check_calls()
        if self._lay_out() != self.width:
            raise CaptureRefused("the pass observed other shapes when captured than before")
        distinct = {id(s.observed): s.observed for s in self.slots.values()}.values()
        outputs = [t.reshape(-1).to(torch.float32) for o in distinct for t in o.outputs]
        if outputs:
            self.history.index_copy_(0, self.row, torch.cat(outputs).unsqueeze(0))
        self.row.add_(1)

    def _check_calls(self) -> None:
        """Every quantizer the pass calls is called once, and the capture calls those the warm-up did."""
        if any(s.calls != 1 for s in self.slots.values()):
            raise CaptureRefused("a quantizer is called more than once per forward pass")
        if self.names is not None and list(self.slots) != self.names:
            raise CaptureRefused("the pass called other quantizers when captured than before")

    def replay(self, batch: dict) -> None:
        if self._pending == self.history.shape[0]:  # every row written: fold them before this batch's
            self._fold()
            self.row.zero_()
        for k, v in batch.items():
            self.static[k].copy_(v)
        self.graph.replay()
        self.replays += 1
        self._pending += 1

    def finish(self) -> None:
        """Fold the replayed batches into the observing calibrators."""
        if self.history is not None:
            self._fold()
        self.graph = None
        self.static = {}
        self.history = self.row = None

    def _fold(self) -> None:
        """The history's rows written since the last fold into the calibrators, after each calibrator's own
        earlier batches (its first non-finite batch stays the first)."""
        count, self._pending = self._pending, 0
        if not count or not self.names:
            return
        rows = self.history[:count]  # (R, width)
        start = self.first_batch + self.replays - count
        batches = list(range(start, start + count))
        cals = {n: self.observing[n].calibrator for n in self.names}
        parts = [p for c in cals.values() for p in c.parts()]
        fold_together(parts)
        for p in parts:
            p._flush()
        extremes: dict[type, list] = {}  # kind -> [(calibrator, column of its min)]
        counts: dict[tuple, list] = {}  # (kind, bins, pieces) -> [(calibrator, observation)]
        for n, c in cals.items():
            s = self.slots[n]
            o = s.observed
            if s.how == EXTREMES:
                extremes.setdefault(type(c), []).append((c, o.offset))
            elif s.how == ABS:
                counts.setdefault((ABS, s.num_bins, tuple(o.pieces)), []).append((c, o))
            else:
                lohi = o.offset + 2 * s.num_bins * len(o.pieces)
                extremes.setdefault(MinMaxCalibrator, []).append((c.extremes, lohi))
                counts.setdefault((SIGNED, s.num_bins, tuple(o.pieces)), []).append((c.histogram, o))
        for group in extremes.values():
            lo_cols = torch.tensor([col for _, col in group], device=rows.device)
            cals_of = [c for c, _ in group]
            fold_extremes(cals_of, rows[:, lo_cols].t(), rows[:, lo_cols + 1].t(), batches)
            for c in cals_of:
                c._batches += count
        for (how, nb, pieces), group in counts.items():
            _fold_counts(how, nb, pieces, group, rows, batches)

    @contextlib.contextmanager
    def _slots_in(self):
        """Within the block each observing quantizer's calibrator is a :class:`_SlotProxy`, its own again
        afterwards."""
        saved = {n: q.calibrator for n, q in self.observing.items()}
        for n, q in self.observing.items():
            q.calibrator = _SlotProxy(self, n, kind(saved[n]), getattr(saved[n], "num_bins", 0))
        try:
            yield
        finally:
            for n, q in self.observing.items():
                q.calibrator = saved[n]


def _fold_counts(
    how: str, nb: int, pieces: tuple, group: list, rows: torch.Tensor, batches: list[int]
) -> None:
    """Fold the histogram counts of replayed batches, ``rows`` ``(R, width)`` of the history, into ``group``,
    ``(calibrator, observation)`` pairs whose observations have ``pieces`` (values per piece) of ``nb`` bins
    each, as :func:`calibrators.folding.fold_together` folds their kept batches."""
    r, p, c = rows.shape[0], len(pieces), len(group)
    dev = rows.device
    base = torch.tensor([o.offset for _, o in group], device=dev).view(1, c, 1)
    values = [sum(pieces) * r] * c
    if how == ABS:  # [counts of each piece (p x nb), q]
        bins = (base + torch.arange(p * nb, device=dev).view(1, 1, -1)).view(-1)
        counted = rows[:, bins].view(r, c, p, nb).transpose(0, 1).reshape(c, r * p, nb)
        q = rows[:, (base + p * nb).view(-1)].t().repeat_interleave(p, 1)  # (c, r * p)
        out, top, finite = fold_abs_stacked(counted, q, values, nb)
    else:  # [pos, neg of each piece (p x 2 x nb), (min, max), [-p, q]]
        bins = (base + torch.arange(2 * p * nb, device=dev).view(1, 1, -1)).view(-1)
        counted = rows[:, bins].view(r, c, p, 2, nb).transpose(0, 1).reshape(c, r * p, 2, nb)
        tail = (base + 2 * p * nb + torch.arange(4, device=dev).view(1, 1, -1)).view(-1)
        lohi, sides = rows[:, tail].view(r, c, 2, 2).transpose(0, 1).repeat_interleave(p, 1).unbind(2)
        out, top, finite = fold_signed_stacked(*counted.unbind(2), lohi, sides, values, nb)
    cals = [cal for cal, _ in group]
    note_first_nonfinite(cals, finite, [b for b in batches for _ in range(p)])
    hand_out(cals, out, top)
    for cal in cals:
        cal._batches += r


def _capture(step: Callable[[], None], dev: torch.device) -> torch.cuda.CUDAGraph:
    """``step`` captured as a CUDA graph (its operations recorded, not run), on a side stream that follows
    the current one. Not ``torch.cuda.graph``, which synchronises with the device, collects Python's garbage
    and empties the allocator's cache before each capture: milliseconds, and every cached block allocated
    again.

    Captured in CUDA's relaxed mode: the default (global) mode refuses every "potentially unsafe" runtime call
    made while capturing, and ``histc`` asks the driver for the free memory (``cudaMemGetInfo``) on each call
    to choose its kernel. Relaxed mode still refuses what cannot be captured (a read back to the host, a
    synchronisation), which :class:`GraphedPass`'s callers catch and fall back from."""
    graph = torch.cuda.CUDAGraph()
    with _side_stream(dev):
        graph.capture_begin(capture_error_mode=CAPTURE_MODE)
        try:
            step()
        except BaseException:
            with contextlib.suppress(RuntimeError):  # the capture ends either way; step's error is the one
                graph.capture_end()
            raise
        graph.capture_end()
    return graph


@contextlib.contextmanager
def _side_stream(dev: torch.device):
    """Work in the block runs on a side stream that follows the current one, which then waits for it (how a
    CUDA graph's warm-up is run)."""
    current = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        yield
    current.wait_stream(side)


class _SlotProxy:
    """A quantizer's stand-in calibrator: forwards to the pass's current slot for that quantizer (made by the
    warm-up, observed again by the capture)."""

    def __init__(self, owner: GraphedPass, name: str, how: str, num_bins: int) -> None:
        self.owner, self.name, self.how, self.num_bins = owner, name, how, num_bins

    def collect(self, x: torch.Tensor) -> None:
        slot = self.owner.slots.get(self.name)
        if slot is None:
            slot = self.owner.slots[self.name] = _Slot(self.how, self.num_bins)
        slot.collect(x, self.owner._seen)
