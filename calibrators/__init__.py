"""Calibrators fill ``amax``: :class:`MaxCalibrator`, :class:`HistogramCalibrator`, and the amax methods
(entropy, mse, percentile) as pure functions of a histogram in :mod:`calibrators.histogram`.

The calibrators load on first use of an attribute (as :mod:`quantcli` does), so that
:mod:`calibrators.methods`, the method names ``quantcli --help`` lists, imports without torch.
"""

from __future__ import annotations

from quantcli.lazy import lazy_getattr

_LAZY = {
    "MaxCalibrator": "calibrators.max",
    "MinMaxCalibrator": "calibrators.max",
    "HistogramCalibrator": "calibrators.histogram_calibrator",
    "compute_amax_entropy": "calibrators.histogram",
    "compute_amax_mse": "calibrators.histogram",
    "compute_amax_percentile": "calibrators.histogram",
}

__all__ = list(_LAZY)


__getattr__ = lazy_getattr("calibrators", _LAZY)
