"""The amax method names, defined once: the CLI's choices, the calibrators, ``--method auto`` and the analysis
report all derive their lists from here.

The order is the display order and ``--method auto``'s tie-breaking order: a tie keeps the earlier method, and
``max`` (which clips nothing) comes first, then the histogram methods from the least to the most clipping in
typical use.
"""

from __future__ import annotations

#: amax methods computed from a histogram of the observed values (NVIDIA pytorch-quantization's
#: ``HistogramCalibrator.compute_amax(method)``)
HISTOGRAM_METHODS: tuple[str, ...] = ("percentile", "mse", "entropy")

#: every method that yields an amax from observations
AMAX_METHODS: tuple[str, ...] = ("max", *HISTOGRAM_METHODS)

#: what ``quantcli calibrate --method`` accepts: an amax method for every quantizer, or ``auto`` (chosen per
#: activation quantizer among :data:`AMAX_METHODS`)
CALIBRATION_METHODS: tuple[str, ...] = (*AMAX_METHODS, "auto")


def defined_for(method: str, is_fp8: bool) -> bool:
    """Whether ``method`` can choose an amax for the grid: the entropy (KL divergence) search quantizes the
    histogram onto integer levels, so it is defined for integer formats only, not FP8."""
    return not (method == "entropy" and is_fp8)
