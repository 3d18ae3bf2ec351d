"""Every calibrator's batches kept on a device, folded at once (issue 38).

On a device a calibrator keeps each batch's result there (a max calibrator's ``(min, max)``, a histogram's
counts over the batch's own range) and folds them into its running state every
:data:`calibrators.counting.FOLD_EVERY` batches and before the state is read: about a dozen operations per
calibrator. At the end of a calibration every calibrator folds, one after another; on a GPU, where each
operation costs the host 10-25 us to dispatch and the device only a few, those dozens of operations per
quantizer cost a model of a hundred quantizers tens of milliseconds: more than its forward passes took on the
ResNet-50- and 1 B-decoder-shaped models (``python -m benchmarks.bench_gpu_calibration``).

:func:`fold_together` stacks the kept results of every calibrator of one kind with the same layout (device,
dtype, shape, number of batches and their indices) and folds them with the operations one calibrator's fold
takes, along a leading calibrator axis; each calibrator then holds its row. The values are the ones each
calibrator's own fold gives, bit for bit (a max, a min and integer counts do not depend on how they are
grouped), and so is the first non-finite batch each one reports. What does not fit a group (a calibrator alone
in its layout, a histogram's skipped zeros, batches also counted on the CPU) folds on its own, as before.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from calibrators.base import note_first_nonfinite
from calibrators.counting import fold_abs, fold_signed
from calibrators.histogram_calibrator import HistogramCalibrator
from calibrators.max import MaxCalibrator, MinMaxCalibrator, fold_kept
from calibrators.signed_histogram import SignedHistogramCalibrator


def fold_together(calibrators: Iterable) -> int:
    """Fold the kept device batches of ``calibrators`` (parts, as :meth:`calibrators.base.Calibrator.parts`
    gives them), group by group; returns how many calibrators were folded in groups. Those left fold on their
    own when their state is next read."""
    groups: dict[tuple, list] = {}
    for c in calibrators:
        key = _layout(c)
        if key is not None:
            groups.setdefault(key, []).append(c)
    folded = 0
    for key, group in groups.items():
        if len(group) < 2:
            continue
        FOLDS[key[0]](group, list(key[-1]))
        folded += len(group)
    return folded


def _layout(c) -> tuple | None:
    """What calibrators must share to be folded together: their kind, the kept results' device, dtype and
    shape, and the batches they are of; ``None`` for one with nothing kept or not folded here."""
    kind = type(c)
    if kind in (MaxCalibrator, MinMaxCalibrator):
        pending = c._pending
        if not pending.items:
            return None
        lo = pending.items[0][0]
        if any(i[0].shape != lo.shape for i in pending.items):
            return None
        shape = c._kept_shape if kind is MaxCalibrator else ()
        return (kind, pending.key, tuple(lo.shape), shape, tuple(pending.batches))
    if kind in (HistogramCalibrator, SignedHistogramCalibrator):
        counter = c._device
        if counter is None or not counter.pending or getattr(c, "skip_zeros", False) or c._cpu_new:
            return None  # (batches also counted on the CPU: a model moved between devices)
        counts = counter.pending[0][0]
        return (kind, counts.device, c.num_bins, tuple(c._device_batches))
    return None


def _fold_counts(group: list, batches: list[int]) -> None:
    """:func:`calibrators.counting.fold_abs` or :func:`calibrators.counting.fold_signed` of every calibrator
    at once."""
    fold = fold_abs if isinstance(group[0], HistogramCalibrator) else fold_signed
    out, top, finite = fold([c._device.pending for c in group], group[0].num_bins)
    note_first_nonfinite(group, finite, batches)
    hand_out(group, out, top)


def hand_out(group: list, out: torch.Tensor, top: torch.Tensor) -> None:
    """Each calibrator's row of folded counts over ``[0, 2**top)`` added to its state."""
    for c, counts, exp in zip(group, out.split(1), top.split(1)):  # (one operation each for every row)
        c._device.pending, c._device_batches = [], []
        c._add_counts(counts, exp)
        c._exp_int = None


FOLDS = {
    MaxCalibrator: lambda group, batches: fold_kept(group),
    MinMaxCalibrator: lambda group, batches: fold_kept(group),
    HistogramCalibrator: _fold_counts,
    SignedHistogramCalibrator: _fold_counts,
}
