"""The calibrator interface: ``collect(x)`` once per batch, ``compute_amax(...)``, ``reset()``.

State is a few small tensors on the input's device, independent of the number of batches. On the CPU a batch's
statistics are read on the host as they are made (free there), and a non-finite batch is refused at once. On a
device nothing is read back per batch: a batch's results are kept on the device until folded into the running
state (:mod:`calibrators.counting`), and the first non-finite batch's index is kept there too and reported by
``compute_amax``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from calibrators.scratch import to_device
from quantcli.errors import CalibrationError


def normalize_axis(axis, ndim: int) -> tuple[int, ...]:
    """Kept axes as sorted non-negative ints; ``None`` -> ``()`` (per-tensor)."""
    if axis is None:
        return ()
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise CalibrationError(f"axis {a} is out of range for a tensor of rank {ndim}")
        out.append(a % ndim)
    return tuple(sorted(set(out)))


class Calibrator:
    """Base class: naming, batch counting and non-finite bookkeeping."""

    def __init__(self, num_bits: int = 8, axis=None, unsigned: bool = False, name: str | None = None):
        self.num_bits = num_bits
        self.axis = axis
        self.unsigned = unsigned
        self.name = name
        self._batches = 0
        self._bad_batch: torch.Tensor | None = None
        self._kept_shape: tuple[int, ...] | None = None
        self._loads = 0  # states taken whole (load_merged, reset): with the batch count, the state's version
        self._results: dict = {}  # searches done (calibrators.batched): key -> (state version, result)

    @property
    def label(self) -> str:
        return self.name or type(self).__name__

    @property
    def num_batches(self) -> int:
        return self._batches

    @property
    def amax_shape(self) -> tuple[int, ...] | None:
        """The amax's shape (the input's rank kept, ``()`` per-tensor); ``None`` before the first batch."""
        return self._kept_shape

    def _flush(self) -> None:
        """Fold batches kept on a device into the running state (a no-op where there are none)."""

    def first_nonfinite_batch(self) -> int | None:
        """Index of the first batch that held NaN or inf, else ``None`` (on CUDA, reading it synchronises)."""
        self._flush()
        if self._bad_batch is None or int(self._bad_batch) < 0:
            return None
        return int(self._bad_batch)

    def state_version(self) -> tuple[int, int]:
        """Changes whenever the statistics do (a batch collected, a state loaded, a reset)."""
        return self._batches, self._loads

    def keep_result(self, key: tuple, result) -> None:
        """Keep a search's ``result`` for the current statistics (:mod:`calibrators.batched`)."""
        self._results[key] = (self.state_version(), result)

    def kept_result(self, key: tuple):
        """The result kept under ``key`` if the statistics have not changed since, else ``None``."""
        found = self._results.get(key)
        return found[1] if found is not None and found[0] == self.state_version() else None

    def _merged_from_ranks(self, num_batches: int, amax_shape: tuple[int, ...]) -> None:
        """Bookkeeping after ``load_merged``: the batches of every rank; non-finite ones were refused
        before."""
        self._batches = num_batches
        self._kept_shape = tuple(amax_shape)
        self._bad_batch = None
        self._loads += 1

    def _kept(self, x: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(kept axes, amax shape with rank kept) for ``x``; checks kept sizes do not change."""
        if self.axis is None:  # per tensor: the common case, without the general bookkeeping below
            self._kept_shape = ()
            return (), ()
        axes = normalize_axis(self.axis, x.dim())
        shape = tuple(x.shape[d] if d in axes else 1 for d in range(x.dim())) if axes else ()
        if self._kept_shape is not None and shape != self._kept_shape:
            raise CalibrationError(
                f"{self.label}: the per-axis dimensions changed between batches, {self._kept_shape} -> "
                f"{shape} (axis={self.axis}); calibrate per-tensor or keep those dimensions fixed"
            )
        self._kept_shape = shape
        return axes, shape

    def _nonfinite(self, batch: int) -> CalibrationError:
        """The error for non-finite values in ``batch``, naming this calibrator's quantizer."""
        return CalibrationError(
            f"{self.label}: non-finite values (NaN or inf) in calibration batch {batch}; "
            "check the input data and the model's numerics"
        )

    def _note_finite(self, batch_max: torch.Tensor) -> None:
        bad = ~torch.isfinite(batch_max).all()
        if batch_max.device.type == "cpu":
            if bad:
                raise self._nonfinite(self._batches)
            return
        # a fill, not a host copy
        idx = torch.full((), self._batches, dtype=torch.long, device=batch_max.device)
        if self._bad_batch is None:
            self._bad_batch = torch.full((), -1, dtype=torch.long, device=batch_max.device)
        self._bad_batch = torch.where(bad & (self._bad_batch < 0), idx, self._bad_batch)

    def _refuse_nonfinite(self) -> None:
        """Raise for the batch being collected now (on the CPU, where its values were just read)."""
        raise self._nonfinite(self._batches)

    def _note_finite_rows(self, finite: torch.Tensor, batches: list[int]) -> None:
        """Device: ``finite[i]`` says whether batch ``batches[i]`` was finite; keeps the first that was not on
        the device (no host read)."""
        note_first_nonfinite([self], finite.unsqueeze(0), batches)

    def _check_ready(self) -> None:
        if self._batches == 0:
            raise CalibrationError(f"{self.label}: no data was collected; run calibration batches first")
        bad = self.first_nonfinite_batch()
        if bad is not None:
            raise self._nonfinite(bad)

    def parts(self) -> tuple[Calibrator, ...]:
        """The calibrators whose statistics :func:`calibrators.distributed.merge_calibrators` merges: this
        one, or those a composite one is made of."""
        return (self,)

    def reset(self) -> None:
        self._loads += 1
        self._results = {}
        self._batches = 0
        self._bad_batch = None
        self._kept_shape = None


def note_first_nonfinite(calibrators: list[Calibrator], finite: torch.Tensor, batches: list[int]) -> None:
    """``finite[i, k]``: whether calibrator ``calibrators[i]``'s batch ``batches[k]`` was finite; each keeps
    the first that was not, on the device (no host read), after any it kept from an earlier fold."""
    bad = ~finite
    first = torch.argmax(bad.to(torch.uint8), dim=1)  # the first maximum: the first bad row
    if batches == list(range(batches[0], batches[0] + len(batches))):
        index = first + batches[0]
    else:
        index = to_device(batches, torch.long, finite.device)[first]
    found = torch.where(bad.any(1), index, -1)
    for c, f in zip(calibrators, found.unbind(0)):  # (one operation for every row)
        if c._bad_batch is None:
            c._bad_batch = f
        else:  # kept from an earlier fold: the earlier bad batch stays first
            c._bad_batch = torch.where(c._bad_batch < 0, f, c._bad_batch)


def refuse_nonfinite(calibrators: Iterable[Calibrator]) -> None:
    """Raise, as its own ``compute_amax`` would, for the first of ``calibrators`` that saw a non-finite batch.

    On a device each calibrator keeps the index of its first non-finite batch there, and its own check reads
    it back: a host synchronisation per quantizer at the end of calibration. Here they are read together,
    one read per device; the ones found finite are then known to be, so their own checks read nothing."""
    parts = [p for c in calibrators for p in c.parts()]
    for p in parts:
        p._flush()
    kept = [p for p in parts if p._bad_batch is not None]
    by_device: dict[torch.device, list[Calibrator]] = {}
    for p in kept:
        by_device.setdefault(p._bad_batch.device, []).append(p)
    first: dict[int, int] = {}
    for group in by_device.values():
        values = torch.stack([p._bad_batch for p in group]).tolist()  # (0-d each, as every fold keeps it)
        first.update((id(p), v) for p, v in zip(group, values))
    for p in kept:
        if first[id(p)] >= 0:
            raise p._nonfinite(first[id(p)])
    for p in kept:
        p._bad_batch = None
