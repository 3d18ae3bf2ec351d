"""Merging calibrators' statistics across the ranks of a ``torch.distributed`` job, exactly.

Every rank calls :func:`merge_calibrators` with the calibrators of the same quantizers, in the same order.
Afterwards every rank holds the statistics of every rank's batches: the state one process would have reached
collecting all the batches itself, so ``compute_amax`` gives the same amax, bit for bit.

- ``MaxCalibrator``: ``all_reduce(MAX)`` of the running max (a float max is exact and order invariant).
- ``MinMaxCalibrator``: ``MAX`` of the max and ``MAX`` of ``-min`` (that is ``MIN`` of the min: negation is exact).
- ``HistogramCalibrator``: each channel's histogram covers ``[0, 2**e)``. First ``MAX`` of ``e`` (the widest
  range), then every rank re-bins its counts onto that range with the pairwise bin sums ``collect`` uses when
  a range grows, then ``SUM`` of the int64 counts. With a power-of-two ``num_bins`` every re-binned count is
  exactly the count over the wide range, so the sum is the one-process histogram (the argument is in
  :mod:`calibrators.histogram_calibrator`); other ``num_bins`` are not order invariant in one process either.

Three collectives in all, whatever the number of calibrators: an ``all_gather_object`` of a small header per
calibrator (kind, settings, batches, shape, first non-finite batch), one ``all_reduce(MAX)`` of a float32
vector holding every max, ``-min`` and range exponent (exponents are small integers, exact in float32), and one
``all_reduce(SUM)`` of an int64 vector holding every histogram. The cost is ``O(quantizers x bins)``,
independent of the number of samples. Tensors travel on the CPU with Gloo and on the current CUDA device
with NCCL (which reduces float32 ``MAX`` and int64 ``SUM`` natively).

A rank may have seen no batch for a calibrator (fewer batches than ranks, a branch its data did not take): it
contributes nothing and receives the merged state. Problems that every rank must agree on (ranks holding
different calibrators, per-axis shapes that differ, a non-finite batch on some rank) are read from the
gathered headers, so every rank raises the same ``CalibrationError`` and none waits in a collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from calibrators.base import Calibrator
from calibrators.histogram_calibrator import HistogramCalibrator
from calibrators.max import MaxCalibrator, MinMaxCalibrator
from quantcli.errors import CalibrationError


@dataclass(frozen=True)
class Header:
    """What a rank tells the others about one calibrator before any statistics travel."""

    label: str
    kind: str
    settings: tuple
    num_batches: int
    amax_shape: tuple[int, ...] | None
    channels: int
    nonfinite_batch: int | None


def world_size(group=None) -> int:
    """Ranks in ``group`` (the default group when ``None``); 1 when ``torch.distributed`` is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def comm_device(group=None) -> torch.device:
    """Where tensors for ``group``'s collectives live: the current CUDA device for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def header(cal: Calibrator) -> Header:
    """The header of one calibrator (reads the device once on CUDA, for the non-finite bookkeeping)."""
    if isinstance(cal, HistogramCalibrator):
        kind, settings = "histogram", (cal.num_bins, cal.skip_zeros, cal.num_bits, cal.unsigned)
        exp = cal.range_exponent()
        channels = 0 if exp is None else int(exp.numel())
    elif isinstance(cal, MaxCalibrator):
        kind, settings, channels = "max", (cal.num_bits, cal.unsigned), 0
    elif isinstance(cal, MinMaxCalibrator):
        kind, settings, channels = "minmax", (cal.num_bits,), 0
    else:
        raise CalibrationError(f"{cal.label}: {type(cal).__name__} cannot be merged across ranks")
    shape = cal.amax_shape if kind != "minmax" else ()
    return Header(cal.label, kind, settings, cal.num_batches, shape if cal.num_batches else None, channels,
                  cal.first_nonfinite_batch() if cal.num_batches else None)


def agreed_layout(headers_by_rank: list[list[Header]]) -> list[tuple[int, tuple[int, ...] | None, int]]:
    """Per calibrator ``(total batches, amax shape, channels)`` over all ranks; raises the same
    ``CalibrationError`` on every rank when the ranks disagree or one of them saw a non-finite batch."""
    first = headers_by_rank[0]
    for r, hs in enumerate(headers_by_rank):
        mine = [(h.label, h.kind, h.settings) for h in hs]
        theirs = [(h.label, h.kind, h.settings) for h in first]
        if mine != theirs:
            diff = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            raise CalibrationError(
                f"ranks 0 and {r} calibrate different quantizers ({len(theirs)} vs {len(mine)}, first difference at "
                f"#{diff}); every rank must quantize the same model with the same config and method")
    layout = []
    for i, h0 in enumerate(first):
        column = [hs[i] for hs in headers_by_rank]
        for r, h in enumerate(column):
            if h.nonfinite_batch is not None:
                raise CalibrationError(
                    f"{h0.label}: non-finite values (NaN or inf) in calibration batch {h.nonfinite_batch} of rank {r}; "
                    "check the input data and the model's numerics")
        seen = {(h.amax_shape, h.channels) for h in column if h.num_batches}
        if len(seen) > 1:
            raise CalibrationError(
                f"{h0.label}: the per-axis dimensions differ between ranks ({sorted(s for s, _ in seen)}, "
                f"axis kept); calibrate per-tensor or keep those dimensions fixed")
        shape, channels = next(iter(seen), (None, 0))
        layout.append((sum(h.num_batches for h in column), shape, channels))
    return layout


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def max_part(cal: Calibrator, shape: tuple[int, ...], channels: int) -> torch.Tensor:
    """This rank's float32 contribution to the ``MAX`` reduction (``-inf`` where it saw nothing)."""
    if isinstance(cal, MaxCalibrator):
        amax = cal.running_amax()
        return torch.full((_numel(shape),), float("-inf")) if amax is None else amax.reshape(-1).float().cpu()
    if isinstance(cal, MinMaxCalibrator):
        rng = cal.running_range()
        return torch.full((2,), float("-inf")) if rng is None else torch.stack([-rng[0], rng[1]]).float().cpu()
    exp = cal.range_exponent()
    return torch.full((channels,), float("-inf")) if exp is None else exp.reshape(-1).float().cpu()


def counts_part(cal: HistogramCalibrator, exp: torch.Tensor, channels: int) -> torch.Tensor:
    """This rank's counts re-binned onto the agreed ranges ``exp``, flat (zeros where it saw nothing)."""
    if cal.range_exponent() is None:
        return torch.zeros(channels * cal.num_bins, dtype=torch.long)
    return cal.counts_over(exp).reshape(-1).cpu()


def merge_calibrators(calibrators: Sequence[Calibrator], group=None) -> None:
    """Merge every calibrator's statistics across the ranks of ``group`` in place (see the module docstring).

    Call on every rank with the same calibrators in the same order, after the last ``collect``. A calibrator
    that no rank fed stays empty (``num_batches == 0``). Without an initialised process group, or with one
    rank, nothing happens.
    """
    if world_size(group) == 1:
        return
    dev = comm_device(group)
    gathered: list = [None] * world_size(group)
    dist.all_gather_object(gathered, [header(c) for c in calibrators], group=group)
    layout = agreed_layout(gathered)
    live = [(c, shape, channels, total) for c, (total, shape, channels) in zip(calibrators, layout) if total]
    if not live:
        return
    maxima = torch.cat([max_part(c, shape, channels) for c, shape, channels, _ in live]).to(dev)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    maxima = maxima.cpu()
    pieces, at = [], 0
    for c, shape, channels, _ in live:
        n = 2 if isinstance(c, MinMaxCalibrator) else channels if isinstance(c, HistogramCalibrator) else _numel(shape)
        pieces.append(maxima[at : at + n])
        at += n
    hists = [(c, p.long(), channels) for (c, _, channels, _), p in zip(live, pieces) if isinstance(c, HistogramCalibrator)]
    counts = None
    if hists:
        counts = torch.cat([counts_part(c, exp, channels) for c, exp, channels in hists]).to(dev)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    at = 0
    for (c, shape, channels, total), piece in zip(live, pieces):
        home = _home(c, dev)
        if isinstance(c, MaxCalibrator):
            c.load_merged(piece.reshape(shape).to(home), total)
        elif isinstance(c, MinMaxCalibrator):
            c.load_merged((-piece[0]).to(home), piece[1].to(home), total)
        else:
            n = channels * c.num_bins
            hist = counts[at : at + n].reshape(channels, c.num_bins).to(home)
            at += n
            c.load_merged(hist, piece.long().to(home), total, shape)


def _home(cal: Calibrator, comm: torch.device) -> torch.device:
    """The device a calibrator's state lives on (the comm device for a rank that saw no batch)."""
    if isinstance(cal, HistogramCalibrator):
        exp = cal.range_exponent()
        return comm if exp is None else exp.device
    if isinstance(cal, MaxCalibrator):
        amax = cal.running_amax()
        return comm if amax is None else amax.device
    rng = cal.running_range()
    return comm if rng is None else rng[0].device
