"""Calibrators fill ``amax``: :class:`MaxCalibrator`, :class:`HistogramCalibrator`, and the amax methods
(entropy, mse, percentile) as pure functions of a histogram in :mod:`calibrators.histogram`.

The calibrators load on first use of an attribute (as :mod:`quantcli` does), so that :mod:`calibrators.methods`,
the method names ``quantcli --help`` lists, imports without torch.
"""

from __future__ import annotations

_LAZY = {
    "MaxCalibrator": "calibrators.max",
    "MinMaxCalibrator": "calibrators.max",
    "HistogramCalibrator": "calibrators.histogram_calibrator",
    "compute_amax_entropy": "calibrators.histogram",
    "compute_amax_mse": "calibrators.histogram",
    "compute_amax_percentile": "calibrators.histogram",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'calibrators' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
