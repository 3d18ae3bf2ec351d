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

from calibrators.counting import _bin_index, _exponent
from calibrators.histogram_calibrator import HistogramCalibrator
from calibrators.max import MaxCalibrator, MinMaxCalibrator
from calibrators.scratch import to_device
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


def _note_first_nonfinite(group: list, finite: torch.Tensor, batches: list[int]) -> None:
    """``finite[i, k]``: whether calibrator ``group[i]``'s kept batch ``batches[k]`` was finite; each keeps
    the first that was not, on the device, as :meth:`calibrators.base.Calibrator._note_finite_rows` does."""
    bad = ~finite
    first = torch.argmax(bad.to(torch.uint8), dim=1)  # the first maximum: the first bad row
    if batches == list(range(batches[0], batches[0] + len(batches))):
        index = first + batches[0]
    else:
        index = to_device(batches, torch.long, finite.device)[first]
    found = torch.where(bad.any(1), index, -1)
    for i, c in enumerate(group):
        if c._bad_batch is None:
            c._bad_batch = found[i]
        else:  # kept from an earlier fold: the earlier bad batch stays first
            c._bad_batch = torch.where(c._bad_batch < 0, found[i], c._bad_batch)


def _stacked(group: list, part: int) -> torch.Tensor:
    """``(calibrators, batches, *shape)``: element ``part`` of every kept item of every calibrator."""
    items = [i[part] for c in group for i in c._pending.items]
    return torch.stack(items).view(len(group), len(group[0]._pending.items), *items[0].shape)


def _fold_max(group: list, batches: list[int]) -> None:
    lo, hi = _stacked(group, 0), _stacked(group, 1)
    for c in group:
        c._pending.take()
    fold_extremes(group, lo, hi, batches)


def _fold_min_max(group: list, batches: list[int]) -> None:
    lo, hi = _stacked(group, 0), _stacked(group, 1)
    for c in group:
        c._pending.take()
    fold_extremes(group, lo, hi, batches)


def fold_extremes(group: list, lo: torch.Tensor, hi: torch.Tensor, batches: list[int]) -> None:
    """Fold ``(C, K, *shape)`` per-batch minima ``lo`` and maxima ``hi`` (any float dtype) of batches
    ``batches`` into ``group``, calibrators of one kind (:class:`MaxCalibrator` or :class:`MinMaxCalibrator`),
    row ``i`` into ``group[i]``, as each one's own fold of those batches would (its batch count is the
    caller's)."""
    if isinstance(group[0], MaxCalibrator):
        batch = torch.maximum(-lo, hi).to(torch.float32)  # (C, K, *amax shape)
        _note_first_nonfinite(group, torch.isfinite(batch.reshape(*batch.shape[:2], -1)).all(2), batches)
        amax = batch.amax(1)
        for i, c in enumerate(group):
            m = amax[i].view(c._kept_shape if c._kept_shape is not None else amax[i].shape)
            if c._amax is None:
                c._amax = m
            else:
                c._amax = torch.maximum(c._amax.to(m.device), m)
                c._amax_np = None
        return
    lo, hi = lo.to(torch.float32), hi.to(torch.float32)  # (C, K)
    _note_first_nonfinite(group, torch.isfinite(lo) & torch.isfinite(hi), batches)
    lows, highs = lo.amin(1), hi.amax(1)
    for i, c in enumerate(group):
        if c._min is None:
            c._min, c._max = lows[i], highs[i]
        else:
            c._min = torch.minimum(c._min.to(lows.device), lows[i])
            c._max = torch.maximum(c._max.to(highs.device), highs[i])


def _fold_counts(group: list, batches: list[int]) -> None:
    """:func:`calibrators.counting.fold_abs` of every calibrator at once: each one's pieces re-binned onto the
    widest of its own ranges."""
    nb = group[0].num_bins
    rows = len(group[0]._device.pending)
    counts = torch.stack([p[0] for c in group for p in c._device.pending]).view(len(group), rows, nb)
    q = torch.stack([p[1] for c in group for p in c._device.pending]).view(len(group), rows)
    finite = torch.isfinite(q)
    exp = torch.where(finite, _exponent(q), 0)  # (C, R); a zero batch: 0, as frexp(0) gives
    top = exp.amax(1, keepdim=True)  # (C, 1)
    dst = torch.bitwise_right_shift(_bin_index(nb, counts.device).unsqueeze(0), (top - exp).unsqueeze(2))
    out = torch.zeros(len(group), nb, dtype=torch.long, device=counts.device)
    out.scatter_add_(1, dst.view(len(group), -1), counts.to(torch.long).view(len(group), -1))
    # what histc could not place (zeros: outside its range; zeros divided by a zero range; subnormals) belongs
    # to bin 0
    _unplaced_to(out, 0, [sum(p[2] for p in c._device.pending) for c in group])
    _note_first_nonfinite(group, finite, batches)
    _hand_out(group, out, top.view(-1))


def _fold_signed(group: list, batches: list[int]) -> None:
    """:func:`calibrators.counting.fold_signed` of every calibrator at once: each one's pieces re-binned onto
    ``(-2**e, 2**e)``, ``e`` the exponent of its widest batch extent."""
    nb = group[0].num_bins
    c_, r_ = len(group), len(group[0]._device.pending)
    pending = [p for c in group for p in c._device.pending]
    pos = torch.stack([p[0] for p in pending]).view(c_, r_, nb)  # exact integers, float32
    neg = torch.stack([p[1] for p in pending]).view(c_, r_, nb)
    lohi = torch.stack([p[2] for p in pending]).to(torch.float32).view(c_, r_, 2)  # each batch's (min, max)
    sides = torch.stack([p[3] for p in pending]).to(torch.float32).view(c_, r_, 2)  # [-p, q]
    finite = torch.isfinite(lohi).all(2)
    lo, hi = lohi.unbind(2)
    neg = neg * (lo < 0).unsqueeze(2)  # min >= 0: that count was of positive values over [0, 2 min)
    exp = torch.where(finite, _exponent(torch.maximum(-lo, hi)), 0)
    top = exp.amax(1, keepdim=True)  # (C, 1)
    e_neg, e_pos = _exponent(sides).unbind(2)
    index = _bin_index(nb, pos.device).unsqueeze(0)
    dst_pos = torch.bitwise_right_shift(index, (top - e_pos).clamp_(min=0).unsqueeze(2)).add_(nb)
    dst_neg = torch.bitwise_right_shift(index, (top - e_neg).clamp_(min=0).unsqueeze(2)).neg_().add_(nb)
    out = torch.zeros(c_, 2 * nb, dtype=torch.long, device=pos.device)
    out.scatter_add_(
        1, torch.cat([dst_pos, dst_neg], 1).view(c_, -1), torch.cat([pos, neg], 1).to(torch.long).view(c_, -1)
    )
    _unplaced_to(out, nb, [sum(p[4] for p in c._device.pending) for c in group])
    _note_first_nonfinite(group, finite, batches)
    _hand_out(group, out, top.view(-1))


def _unplaced_to(out: torch.Tensor, column: int, values: list[int]) -> None:
    """What histc did not place (zeros, zeros divided by a zero range) into ``out[:, column]``: each row's
    ``values`` counted less those placed."""
    placed = out.sum(1)
    if len(set(values)) == 1:
        out[:, column] += values[0] - placed
    else:
        out[:, column] += to_device(values, torch.long, out.device) - placed


def _hand_out(group: list, out: torch.Tensor, top: torch.Tensor) -> None:
    """Each calibrator's row of folded counts over ``[0, 2**top)`` added to its state."""
    for i, c in enumerate(group):
        c._device.pending, c._device_batches = [], []
        c._add_counts(out[i : i + 1], top[i : i + 1])
        c._exp_int = None


FOLDS = {
    MaxCalibrator: _fold_max,
    MinMaxCalibrator: _fold_min_max,
    HistogramCalibrator: _fold_counts,
    SignedHistogramCalibrator: _fold_signed,
}
