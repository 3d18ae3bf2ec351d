"""The calibrator of an asymmetric quantizer under a histogram method: a histogram of ``x`` over both signs
and its min and max, searched by :mod:`calibrators.two_sided`."""

from __future__ import annotations

import torch

from calibrators import shared
from calibrators.base import Calibrator
from calibrators.counting import small_values
from calibrators.max import MinMaxCalibrator
from calibrators.scratch import reads_on_host
from calibrators.signed_histogram import SignedHistogramCalibrator
from calibrators.two_sided import METHODS, range_entropy
from quantcli import defaults


class TwoSidedHistogramCalibrator(Calibrator):
    """Per-tensor statistics of ``x`` for an affine (min, max) range: :attr:`extremes` holds the min and max,
    :attr:`histogram` a :class:`SignedHistogramCalibrator` of ``x`` (so order invariance and the merge across
    ranks are theirs). :meth:`parts` are what :func:`calibrators.distributed.merge_calibrators` merges."""

    def __init__(self, num_bits: int = 8, num_bins: int = defaults.NUM_BINS, name: str | None = None):
        super().__init__(num_bits, None, True, name)
        self.num_bins = num_bins
        label = name or type(self).__name__
        self.extremes = MinMaxCalibrator(num_bits, name=label)
        self.histogram = SignedHistogramCalibrator(num_bits, num_bins=num_bins, name=f"{label} (histogram)")

    def parts(self) -> tuple[Calibrator, ...]:
        """Its extremes and histogram, merged across ranks each as they are alone."""
        return self.extremes, self.histogram

    @property
    def num_batches(self) -> int:
        return self.extremes.num_batches

    def first_nonfinite_batch(self) -> int | None:
        return self.extremes.first_nonfinite_batch()

    def state_version(self) -> tuple:
        return self.extremes.state_version(), self.histogram.state_version()

    def result_key(self, method: str, kwargs: dict) -> tuple:
        """What :meth:`compute_range` keeps and finds a search's result under."""
        if method == "mse":
            kwargs = {"num_bits": self.num_bits, **kwargs}
        return ("range", method, tuple(sorted(kwargs.items())))

    def collect(self, x: torch.Tensor) -> None:
        """One reduction to the batch's min and max serves both parts: on the CPU the extremes make it (and
        refuse a non-finite batch with the quantizer's name), on a device the histogram, into the row its
        counts read."""
        a = small_values(x)
        if a is not None:  # a small float32 batch: in numpy (calibrators.counting)
            lo, hi = float(a.min()), float(a.max())
            self.extremes.add_range(lo, hi)  # refuses a non-finite batch
            self.histogram.collect_small(a, lo, hi)
        elif reads_on_host(x):
            self.histogram.collect(x, self.extremes.collect(x))
        else:
            self.extremes.add_range(*self.histogram.collect(x))

    def compute_range(self, method: str = "mse", **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """``(min, max)`` by ``method`` (``mse`` or ``percentile``; kwargs go to it), float32 0-d, ``min <= 0
        <= max``."""
        if method not in METHODS:
            raise ValueError(f"no asymmetric range search {method!r}; choose from {sorted(METHODS)}")
        if method == "mse":
            kwargs.setdefault("num_bits", self.num_bits)
        key = self.result_key(method, kwargs)
        # searched with all quantizers of a model at once (calibrators.batched: after the checks below passed,
        # on statistics that have not changed since)
        found = self.kept_result(key)
        if found is not None:
            return found
        stats = self.statistics()
        lo, hi = stats[2:]
        # q/k/v calibrators of one input hold equal statistics: one search serves them (calibrators.shared)
        found = shared.find_equal(key, stats)
        if found is None:
            pos, neg, edges = self.histogram.sides()
            found = METHODS[method](pos, edges, neg, edges, lo.cpu(), hi.cpu(), **kwargs)
            shared.keep_equal(key, stats, found)
        return found[0].to(lo.device), found[1].to(hi.device)

    def statistics(self) -> tuple[torch.Tensor, ...]:
        """What every range search reads (the histogram's exponent and counts, the data's min and max): equal
        for calibrators that observed the same values."""
        lo, hi = self.extremes.compute_range()
        return self.histogram.range_exponent(), self.histogram.hist, lo, hi

    def compute_entropy_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(min, max)`` clipped at ``|x|``'s entropy threshold
        (:func:`calibrators.two_sided.range_entropy`): a candidate of ``--method auto``."""
        lo, hi = self.extremes.compute_range()
        pos, neg, edges = self.histogram.sides()
        found = range_entropy(pos, edges, neg, edges, lo.cpu(), hi.cpu(), self.num_bits)
        return found[0].to(lo.device), found[1].to(hi.device)

    def compute_amax(self, method: str = "mse", **kwargs) -> torch.Tensor:
        lo, hi = self.compute_range(method, **kwargs)
        return torch.maximum(-lo, hi)

    def reset(self) -> None:
        super().reset()
        for c in self.parts():
            c.reset()

    def __repr__(self) -> str:
        return f"TwoSidedHistogramCalibrator(num_bits={self.num_bits}, num_bins={self.num_bins})"
