"""The calibrator interface: ``collect(x)`` once per batch, ``compute_amax(...)``, ``reset()``.

State is a few small tensors on the input's device, independent of the number of batches. Non-finite
inputs are detected without a host synchronisation on CUDA: the first offending batch index is kept on the
device and reported by ``compute_amax``.
"""

from __future__ import annotations

import torch

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

    def first_nonfinite_batch(self) -> int | None:
        """Index of the first batch that held NaN or inf, else ``None`` (on CUDA, reading it synchronises)."""
        if self._bad_batch is None or int(self._bad_batch) < 0:
            return None
        return int(self._bad_batch)

    def _merged_from_ranks(self, num_batches: int, amax_shape: tuple[int, ...]) -> None:
        """Bookkeeping after ``load_merged``: the batches of every rank; non-finite ones were refused
        before."""
        self._batches = num_batches
        self._kept_shape = tuple(amax_shape)
        self._bad_batch = None

    def _kept(self, x: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(kept axes, amax shape with rank kept) for ``x``; checks kept sizes do not change."""
        axes = normalize_axis(self.axis, x.dim())
        shape = tuple(x.shape[d] if d in axes else 1 for d in range(x.dim())) if axes else ()
        if self._kept_shape is not None and shape != self._kept_shape:
            raise CalibrationError(
                f"{self.label}: the per-axis dimensions changed between batches, {self._kept_shape} -> "
                f"{shape} (axis={self.axis}); calibrate per-tensor or keep those dimensions fixed"
            )
        self._kept_shape = shape
        return axes, shape

    def _note_finite(self, batch_max: torch.Tensor) -> None:
        bad = ~torch.isfinite(batch_max).all()
        if batch_max.device.type == "cpu":
            if bad:
                raise CalibrationError(
                    f"{self.label}: non-finite values (NaN or inf) in calibration batch {self._batches}; "
                    "check the input data and the model's numerics"
                )
            return
        # a fill, not a host copy
        idx = torch.full((), self._batches, dtype=torch.long, device=batch_max.device)
        if self._bad_batch is None:
            self._bad_batch = torch.full((), -1, dtype=torch.long, device=batch_max.device)
        self._bad_batch = torch.where(bad & (self._bad_batch < 0), idx, self._bad_batch)

    def _check_ready(self) -> None:
        if self._batches == 0:
            raise CalibrationError(f"{self.label}: no data was collected; run calibration batches first")
        bad = self.first_nonfinite_batch()
        if bad is not None:
            raise CalibrationError(
                f"{self.label}: non-finite values (NaN or inf) in calibration batch {bad}; "
                "check the input data and the model's numerics"
            )

    def parts(self) -> tuple[Calibrator, ...]:
        """The calibrators whose statistics :func:`calibrators.distributed.merge_calibrators` merges: this
        one, or those a composite one is made of."""
        return (self,)

    def reset(self) -> None:
        self._batches = 0
        self._bad_batch = None
        self._kept_shape = None
