"""Merging calibrators' statistics across the ranks of a ``torch.distributed`` job, exactly.

Every rank calls :func:`merge_calibrators` with the calibrators of the same quantizers, in the same order.
Afterwards every rank holds the statistics of every rank's batches: the state one process would have reached
collecting all the batches itself, so ``compute_amax`` gives the same amax, bit for bit.

- ``MaxCalibrator``: ``all_reduce(MAX)`` of the running max (a float max is exact and order invariant).
- ``MinMaxCalibrator``: ``MAX`` of the max and ``MAX`` of ``-min`` (that is ``MIN`` of the min: negation is
  exact).
- ``TwoSidedHistogramCalibrator`` (asymmetric quantizers under a histogram method): its :meth:`parts`, a
  ``MinMaxCalibrator`` and a ``SignedHistogramCalibrator``, each merged as below.
- ``HistogramCalibrator``: each channel's histogram covers ``[0, 2**e)``. First ``MAX`` of ``e`` (the widest
  range), then every rank re-bins its counts onto that range with the pairwise bin sums ``collect`` uses when
  a range grows, then ``SUM`` of the int64 counts. With a power-of-two ``num_bins`` every re-binned count is
  exactly the count over the wide range, so the sum is the one-process histogram (the argument is in
  :mod:`calibrators.histogram_calibrator`); other ``num_bins`` are not order invariant in one process either.
  ``SignedHistogramCalibrator`` likewise, its range ``(-2**e, 2**e)`` re-binned by its own truncating shift.

Four small collectives in all, whatever the number of calibrators, each one ``all_reduce`` of one tensor
(no pickling; a round trip costs about 0.1-0.3 ms with Gloo on one host): ``MAX`` of a fixed-size vector that
tells whether every rank holds the same calibrators; ``MAX`` of an int64 header per calibrator (saw data,
first non-finite batch, amax shape); ``MAX`` of a float32 vector holding every max, ``-min`` and range
exponent (small integers, exact in float32); ``SUM`` of an int64 vector holding every re-binned histogram and
batch count. The cost is ``O(quantizers x bins)``, independent of the number of samples. Tensors travel on
the CPU with Gloo and on the current CUDA device with NCCL (which reduces int64 and float32 ``MAX`` and
int64 ``SUM`` natively).

A rank may have seen no batch for a calibrator (fewer batches than ranks, a branch its data did not take): it
contributes nothing and receives the merged state. Problems that every rank must agree on (ranks holding
different calibrators, per-axis shapes that differ, a non-finite batch on some rank) are read from the
reduced headers, so every rank raises the same ``CalibrationError`` and none waits in a collective.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from calibrators.base import Calibrator
from calibrators.histogram_calibrator import HistogramCalibrator
from calibrators.max import MaxCalibrator, MinMaxCalibrator
from calibrators.signed_histogram import SignedHistogramCalibrator
from quantcli.errors import CalibrationError


def world_size(group=None) -> int:
    """Ranks in ``group`` (the default group when ``None``); 1 when ``torch.distributed`` is not
    initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def comm_device(group=None) -> torch.device:
    """Where tensors for ``group``'s collectives live: the current CUDA device for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


#: calibrators whose state is counts over a power-of-two range: ``range_exponent``, ``counts_over``,
#: ``counts_width`` entries per channel, ``load_merged(hist, exp, num_batches, shape)``
HISTOGRAMS = (HistogramCalibrator, SignedHistogramCalibrator)


def identity(cal: Calibrator) -> tuple:
    """What must be equal on every rank for the merge to mean anything: name, kind and settings."""
    if isinstance(cal, SignedHistogramCalibrator):
        return cal.label, "signed histogram", cal.num_bins, cal.num_bits
    if isinstance(cal, HistogramCalibrator):
        return cal.label, "histogram", cal.num_bins, cal.skip_zeros, cal.num_bits, cal.unsigned
    if isinstance(cal, MaxCalibrator):
        return cal.label, "max", cal.num_bits, cal.unsigned
    if isinstance(cal, MinMaxCalibrator):
        return cal.label, "minmax", cal.num_bits
    raise CalibrationError(f"{cal.label}: {type(cal).__name__} cannot be merged across ranks")


def fingerprint(calibrators: Sequence[Calibrator]) -> int:
    """A 62-bit digest of every calibrator's :func:`identity`, in order (the same on every rank iff they
    agree)."""
    digest = hashlib.sha256(repr([identity(c) for c in calibrators]).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


MAX_DIMS = 8
_ABSENT = -(2**62)  # loses every MAX: a rank that saw nothing, a dimension beyond the rank of the amax
HEADER = 4 + 2 * MAX_DIMS  # saw data, non-finite code, ndim, -ndim, dims, -dims


def header(cal: Calibrator, rank: int, world: int) -> list[int]:
    """This rank's integer header of one calibrator, for an ``all_reduce(MAX)``: whether it saw data, its
    first non-finite batch (encoded so that the lowest rank wins), and the amax shape beside its negation,
    so that the MAX also yields the smallest value over the ranks that saw data: they agree iff both are
    equal."""
    if cal.num_batches == 0:
        return [0, -1] + [_ABSENT] * (HEADER - 2)
    shape = () if isinstance(cal, MinMaxCalibrator) else tuple(cal.amax_shape)
    ndim = len(shape)
    if ndim > MAX_DIMS:  # refused by every rank in agreed_shapes (raising here alone would strand the others)
        shape = ()
    bad = cal.first_nonfinite_batch()
    code = -1 if bad is None else (world - rank) << 32 | min(bad, 2**31 - 1)
    pad = [_ABSENT] * (MAX_DIMS - len(shape))
    return [1, code, ndim, -ndim, *shape, *pad, *(-d for d in shape), *pad]


def agreed_shapes(labels: Sequence[str], headers: torch.Tensor, world: int) -> list[tuple[int, ...] | None]:
    """From the MAX-reduced ``(calibrators, HEADER)`` headers: each calibrator's amax shape (``None`` where no
    rank saw data). Raises the same ``CalibrationError`` on every rank for a non-finite batch on some rank or
    per-axis shapes that differ between ranks."""
    shapes = []
    for label, h in zip(labels, headers.tolist()):
        if h[1] >= 0:
            rank, batch = world - (h[1] >> 32), h[1] & (2**32 - 1)
            raise CalibrationError(
                f"{label}: non-finite values (NaN or inf) in calibration batch {batch} of rank {rank}; "
                f"check the input data and the model's numerics"
            )
        if not h[0]:
            shapes.append(None)
            continue
        ndim = h[2]
        if ndim > MAX_DIMS:
            raise CalibrationError(
                f"{label}: an amax of rank {ndim} cannot be merged across ranks (at most {MAX_DIMS})"
            )
        dims, low = h[4 : 4 + ndim], [-d for d in h[4 + MAX_DIMS : 4 + MAX_DIMS + ndim]]
        if ndim != -h[3] or dims != low:
            raise CalibrationError(
                f"{label}: the per-axis dimensions differ between ranks (axis kept); "
                "calibrate per-tensor or keep those dimensions fixed"
            )
        shapes.append(tuple(dims))
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def max_part(cal: Calibrator, shape: tuple[int, ...], channels: int) -> torch.Tensor:
    """This rank's float32 contribution to the ``MAX`` reduction (``-inf`` where it saw nothing)."""
    if isinstance(cal, MaxCalibrator):
        amax = cal.running_amax()
        return torch.full((channels,), float("-inf")) if amax is None else amax.reshape(-1).float().cpu()
    if isinstance(cal, MinMaxCalibrator):
        rng = cal.running_range()
        return (
            torch.full((2,), float("-inf")) if rng is None else torch.stack([-rng[0], rng[1]]).float().cpu()
        )
    exp = cal.range_exponent()
    return torch.full((channels,), float("-inf")) if exp is None else exp.reshape(-1).float().cpu()


def counts_part(cal, exp: torch.Tensor, channels: int) -> torch.Tensor:
    """This rank's counts re-binned onto the agreed ranges ``exp``, flat (zeros where it saw nothing)."""
    if cal.range_exponent() is None:
        return torch.zeros(channels * cal.counts_width, dtype=torch.long)
    return cal.counts_over(exp).reshape(-1).cpu()


def merge_calibrators(calibrators: Sequence[Calibrator], group=None) -> None:
    """Merge every calibrator's statistics across the ranks of ``group`` in place (see the module docstring).

    Call on every rank with the same calibrators in the same order, after the last ``collect``. A calibrator
    that no rank fed stays empty (``num_batches == 0``). Without an initialised process group, or with one
    rank, nothing happens.
    """
    world = world_size(group)
    if world == 1:
        return
    calibrators = [part for c in calibrators for part in c.parts()]  # a composite merges part by part
    dev = comm_device(group)
    # 1. the same calibrators everywhere? (a fixed-size vector: ranks that disagree cannot deadlock here)
    n, fp = len(calibrators), fingerprint(calibrators)
    agree = torch.tensor([n, -n, fp, -fp], dtype=torch.long, device=dev)
    dist.all_reduce(agree, op=dist.ReduceOp.MAX, group=group)
    if agree.tolist() != [n, -n, fp, -fp]:
        raise CalibrationError(
            "the ranks calibrate different quantizers (names, kinds or settings differ); every rank must "
            "quantize the same model with the same config, method and num_bins"
        )
    if n == 0:
        return
    # 2. who saw data, what shape, any non-finite batch
    rank = dist.get_rank(group)
    headers = torch.tensor([header(c, rank, world) for c in calibrators], dtype=torch.long, device=dev)
    dist.all_reduce(headers, op=dist.ReduceOp.MAX, group=group)
    shapes = agreed_shapes([c.label for c in calibrators], headers.cpu(), world)
    live = [(c, shape, _numel(shape)) for c, shape in zip(calibrators, shapes) if shape is not None]
    if not live:
        return
    # 3. every max, -min and range exponent
    maxima = torch.cat([max_part(c, shape, channels) for c, shape, channels in live]).to(dev)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    pieces = maxima.cpu().split([_max_width(c, channels) for c, _, channels in live])
    # 4. every histogram, re-binned onto the agreed ranges, and every batch count
    counts = [
        counts_part(c, p.long(), channels)
        for (c, _, channels), p in zip(live, pieces)
        if isinstance(c, HISTOGRAMS)
    ]
    batches = torch.tensor([c.num_batches for c, _, _ in live], dtype=torch.long)
    summed = torch.cat([*counts, batches]).to(dev)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
    summed = summed.cpu()
    hists = iter(summed[: summed.numel() - len(live)].split([t.numel() for t in counts]))
    totals = summed[summed.numel() - len(live) :].tolist()
    for (c, shape, channels), piece, total in zip(live, pieces, totals):
        home = _home(c, dev)
        if isinstance(c, MaxCalibrator):
            c.load_merged(piece.reshape(shape).to(home), total)
        elif isinstance(c, MinMaxCalibrator):
            c.load_merged((-piece[0]).to(home), piece[1].to(home), total)
        else:
            hist = next(hists).reshape(channels, c.counts_width).to(home)
            c.load_merged(hist, piece.long().to(home), total, shape)


def _max_width(cal: Calibrator, channels: int) -> int:
    """Entries of ``cal`` in the MAX vector: its amax (one per channel), min and max, or range exponents."""
    return 2 if isinstance(cal, MinMaxCalibrator) else channels


def _home(cal: Calibrator, comm: torch.device) -> torch.device:
    """The device a calibrator's state lives on (the comm device for a rank that saw no batch)."""
    if isinstance(cal, HISTOGRAMS):
        exp = cal.range_exponent()
        return comm if exp is None else exp.device
    if isinstance(cal, MaxCalibrator):
        amax = cal.running_amax()
        return comm if amax is None else amax.device
    rng = cal.running_range()
    return comm if rng is None else rng[0].device
