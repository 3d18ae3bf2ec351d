"""Calibrators fill ``amax``: :class:`MaxCalibrator`, :class:`HistogramCalibrator`, and the amax methods
(entropy, mse, percentile) as pure functions of a histogram in :mod:`calibrators.histogram`."""

from calibrators.histogram import compute_amax_entropy, compute_amax_mse, compute_amax_percentile
from calibrators.histogram_calibrator import HistogramCalibrator
from calibrators.max import MaxCalibrator, MinMaxCalibrator

__all__ = [
    "MaxCalibrator",
    "MinMaxCalibrator",
    "HistogramCalibrator",
    "compute_amax_entropy",
    "compute_amax_mse",
    "compute_amax_percentile",
]
