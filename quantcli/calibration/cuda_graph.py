"""The observing pass of a ``max`` calibration captured once as a CUDA graph and replayed per batch
(issue 38).

On a GPU a small model's forward pass is bound by the host: each operation costs microseconds of Python and a
kernel launch, and observing adds an ``aminmax`` and its bookkeeping per quantizer per batch. Where every
observing calibrator keeps a per-tensor min and max (:class:`calibrators.MaxCalibrator` without an axis,
:class:`calibrators.max.MinMaxCalibrator`: ``--method max``, and asymmetric quantizers under ``entropy``)
and every batch has the first one's inputs (names, shapes, dtypes), the first batch runs as usual and the
forward pass with each quantizer's ``aminmax`` is captured as a CUDA graph, whose tail writes every
quantizer's min and max of the batch into one row of a history on the device. Each later batch is then a copy
of its inputs and a replay: no Python per layer or quantizer. After the last batch the history is folded into
the calibrators at once (:func:`calibrators.folding.fold_extremes`): the same amax, ranges and first
non-finite batch as observing batch by batch gives, bit for bit.

Where the graph cannot be captured (an operation that reads a value back to the host, a quantizer called
twice in one pass) the batches are observed one by one, as without it. :func:`plan` says whether a
calibration qualifies; :class:`GraphedPass` captures and replays.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from calibrators import MaxCalibrator
from calibrators.folding import fold_together
from calibrators.max import MinMaxCalibrator, fold_extremes

#: the fewest batches worth a capture: the first batch runs as usual, and a capture costs about two forward
#: passes (a warm-up on a side stream, then the capture itself)
MIN_BATCHES = 4


def plan(batches: Sequence[dict], observing: dict, counted: dict, dev: torch.device, alone: bool) -> bool:
    """Whether the observing pass over ``batches`` can be a replayed CUDA graph: on a CUDA device, in one
    process, no quantizer whose calls are counted, every observing quantizer a per-tensor max or min/max, at
    least :data:`MIN_BATCHES` batches, each with the first one's input names, shapes and dtypes."""
    if dev.type != "cuda" or not alone or counted or len(batches) < MIN_BATCHES or not observing:
        return False
    for q in observing.values():
        c = q.calibrator
        if type(c) not in (MaxCalibrator, MinMaxCalibrator) or getattr(c, "axis", None) is not None:
            return False
        if q._block is not None:
            return False
    first = {k: (v.shape, v.dtype) for k, v in batches[0].items()}
    return all({k: (v.shape, v.dtype) for k, v in b.items()} == first for b in batches[1:])


class _Slot:
    """What one quantizer observed in a pass: the ``aminmax`` of its input (during the capture, tensors in the
    graph's own memory, which each replay writes the batch's values into) and how often it was called."""

    def __init__(self) -> None:
        self.lo: torch.Tensor | None = None
        self.hi: torch.Tensor | None = None
        self.calls = 0

    def collect(self, x: torch.Tensor) -> None:
        self.calls += 1
        self.lo, self.hi = torch.aminmax(x.detach())


class CaptureRefused(Exception):
    """The pass cannot be replayed as it was captured (a quantizer called more than once)."""


class GraphedPass:
    """The observing pass over static copies of a batch's inputs, captured as a CUDA graph.

    ``run(batch)`` runs the model on a batch (the caller's own forward, with its error handling). Use:
    ``capture(batch)`` once (raises where the pass cannot be captured; nothing is observed then),
    ``replay(batch)`` per batch, then ``finish(first_batch)``, which folds what the replays observed into the
    calibrators.
    """

    def __init__(self, observing: dict, run: Callable[[dict], object], batches: int) -> None:
        self.observing = observing
        self.run = run
        self.capacity = batches
        self.replays = 0
        self.static: dict[str, torch.Tensor] = {}
        self.graph: torch.cuda.CUDAGraph | None = None
        self.slots: dict[str, _Slot] = {}
        self.names: list[str] | None = None  # the quantizers the warm-up pass called, in calling order
        self.history: torch.Tensor | None = None  # (capacity, 2, quantizers) float32: min and max per batch
        self.row: torch.Tensor | None = None  # (1,) int64: the history row the next replay writes

    def capture(self, batch: dict) -> None:
        self.static = {k: v.clone() for k, v in batch.items()}
        dev = next(iter(self.static.values())).device
        with self._slots_in():
            with _side_stream(dev):  # a warm-up pass: lazily made state (workspaces) made outside the graph
                self.run(self.static)
            self._check_calls()
            self.names = list(self.slots)  # in the order they ran
            self.slots = {n: _Slot() for n in self.names}
            self.history = torch.zeros(self.capacity, 2, len(self.names), device=dev)
            self.row = torch.zeros(1, dtype=torch.long, device=dev)
            self.graph = _capture(self._step, dev)

    def _step(self) -> None:
        """One observing pass over the static inputs, its quantizers' min and max written into the history's
        next row: what the graph holds."""
        for s in self.slots.values():
            s.calls = 0
        self.run(self.static)
        self._check_calls()
        if self.names:
            lo = torch.stack([self.slots[n].lo.to(torch.float32) for n in self.names])
            hi = torch.stack([self.slots[n].hi.to(torch.float32) for n in self.names])
            self.history.index_copy_(0, self.row, torch.stack([lo, hi]).unsqueeze(0))
        self.row.add_(1)

    def _check_calls(self) -> None:
        """Every quantizer the pass calls is called once, and the capture calls those the warm-up did."""
        if any(s.calls != 1 for s in self.slots.values()):
            raise CaptureRefused("a quantizer is called more than once per forward pass")
        if self.names is not None and list(self.slots) != self.names:
            raise CaptureRefused("the pass called other quantizers when captured than before")

    def replay(self, batch: dict) -> None:
        for k, v in batch.items():
            self.static[k].copy_(v)
        self.graph.replay()
        self.replays += 1

    def finish(self, first_batch: int) -> None:
        """Fold the replayed batches (numbered from ``first_batch``) into the observing calibrators."""
        names = self.names or []
        if self.replays and names:
            cals = [self.observing[n].calibrator for n in names]
            fold_together(cals)  # the batches observed before the capture: theirs come first
            history = self.history[: self.replays]  # (R, 2, Q)
            batches = list(range(first_batch, first_batch + self.replays))
            for kind in (MaxCalibrator, MinMaxCalibrator):
                index = [i for i, c in enumerate(cals) if type(c) is kind]
                if not index:
                    continue
                rows = torch.tensor(index, device=history.device) if len(index) < len(cals) else None
                part = history if rows is None else history.index_select(2, rows)
                group = [cals[i] for i in index]
                for c in group:
                    c._flush()  # anything fold_together left (a calibrator alone in its layout)
                fold_extremes(group, part[:, 0].t(), part[:, 1].t(), batches)
                for c in group:
                    c._batches += self.replays
        self.graph = None
        self.static = {}
        self.history = self.row = None

    @contextlib.contextmanager
    def _slots_in(self):
        """Within the block each observing quantizer's calibrator is a :class:`_SlotProxy`, its own again
        afterwards."""
        saved = {n: q.calibrator for n, q in self.observing.items()}
        for n, q in self.observing.items():
            q.calibrator = _SlotProxy(self, n)
        try:
            yield
        finally:
            for n, q in self.observing.items():
                q.calibrator = saved[n]


def _capture(step: Callable[[], None], dev: torch.device) -> torch.cuda.CUDAGraph:
    """``step`` captured as a CUDA graph (its operations recorded, not run), on a side stream that follows
    the current one. Not ``torch.cuda.graph``, which synchronises with the device, collects Python's garbage
    and empties the allocator's cache before each capture: milliseconds, and every cached block allocated
    again."""
    graph = torch.cuda.CUDAGraph()
    with _side_stream(dev):
        graph.capture_begin()
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
    """A quantizer's stand-in calibrator: forwards to the pass's current slot for that quantizer (made anew
    for the capture after the warm-up)."""

    def __init__(self, owner: GraphedPass, name: str) -> None:
        self.owner, self.name = owner, name

    def collect(self, x: torch.Tensor) -> None:
        slot = self.owner.slots.get(self.name)
        if slot is None:
            slot = self.owner.slots[self.name] = _Slot()
        slot.collect(x)
