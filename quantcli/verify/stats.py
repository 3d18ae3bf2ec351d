"""Streaming comparison of two output tensors over many batches: a handful of sums per output, so memory does
not depend on the number of samples, and every update is a few vectorised numpy reductions.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from quantcli.analysis import quality
from quantcli.errors import VerifyError

#: RMS, relative to the output's RMS, below which the fidelity ratios stop measuring in quantization error: :
# onnxruntime's float kernels (fused Conv, NCHWc layouts, depthwise kernels, its Erf) and PyTorch's round :
# differently. On correct zoo graphs the latency placement left all float they differed by up to 1.4e-5 of the
#: output's RMS (MobileNetV2, the replay's max difference; ConvNeXt 1.0e-6), so measured in this floor the
# replay : ratio stays at 0.014 against its threshold of 0.1. It binds only where quantization changes the
# output by less : than 1e-3 of its RMS, i.e. where (almost) no layer is quantized; the codes and replay-step
# checks still judge : every Q/DQ pair there is
FLOAT_ROUNDING = 1e-3


class PairStats:
    """Running statistics of ``got`` against ``ref`` (same shapes), e.g. onnxruntime vs the fake-quant model.

    ``top1``: also count how often the row-wise argmax agrees (2-D ``(batch, classes)`` outputs only).
    """

    def __init__(self, top1: bool = False):
        self.top1 = top1
        self.count = 0
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.sum_abs = 0.0
        self.err2 = 0.0  # sum (got - ref)^2
        self.n_got = 0.0  # sum got^2
        self.n_ref = 0.0  # sum ref^2
        self.dot = 0.0
        self.identical = 0
        self.nonfinite = 0  # elements where either side is NaN or inf
        # of those, the ones where the two sides differ: one finite and the other not, NaN against inf, +inf
        # against -inf (a model whose float output holds -inf, masked logits, has them on both sides alike)
        self.nonfinite_mismatch = 0
        self.top1_same = 0
        self.top1_total = 0

    def add(self, got: np.ndarray, ref: np.ndarray) -> None:
        if got.shape != ref.shape:
            raise VerifyError(
                f"output shapes differ: onnxruntime {list(got.shape)} vs PyTorch {list(ref.shape)}"
            )
        g = np.asarray(got, np.float64).ravel()
        r = np.asarray(ref, np.float64).ravel()
        finite = np.isfinite(g) & np.isfinite(r)
        if not finite.all():  # rare: only then pay for masking
            self.nonfinite += int(g.size - np.count_nonzero(finite))
            bad_g, bad_r = g[~finite], r[~finite]
            alike = (bad_g == bad_r) | (np.isnan(bad_g) & np.isnan(bad_r))
            self.nonfinite_mismatch += int(bad_g.size - np.count_nonzero(alike))
            g, r = g[finite], r[finite]
        d = g - r
        a = np.abs(d)
        if a.size:
            self.max_abs = max(self.max_abs, float(a.max()))
            self.max_rel = max(self.max_rel, float((a / np.maximum(np.abs(r), 1e-12)).max()))
        self.sum_abs += float(a.sum())
        self.count += d.size
        self.identical += int(d.size - np.count_nonzero(d))
        self.err2 += float(d @ d)
        self.n_got += float(g @ g)
        self.n_ref += float(r @ r)
        self.dot += float(g @ r)
        if self.top1 and got.ndim == 2 and got.shape[1] > 1:
            self.top1_same += int(np.count_nonzero(got.argmax(1) == ref.argmax(1)))
            self.top1_total += got.shape[0]

    @property
    def rms(self) -> float:
        """Root mean square of ``got - ref``."""
        return math.sqrt(self.err2 / self.count) if self.count else 0.0

    @property
    def ref_rms(self) -> float:
        """Root mean square of ``ref`` itself."""
        return math.sqrt(self.n_ref / self.count) if self.count else 0.0

    @property
    def error_scale(self) -> float:
        """The unit the fidelity ratios measure in, for a quantization-error pair (``got``: fake-quant,
        ``ref``: float): the quantization error's RMS, but never below :data:`FLOAT_ROUNDING` of the output's
        RMS. A graph whose layers are (nearly) all float has (nearly) no quantization error, and two float
        runtimes still differ by rounding: measured in that error, correct graphs would fail."""
        return max(self.rms, FLOAT_ROUNDING * self.ref_rms)

    @property
    def cosine(self) -> float | None:
        return quality.cosine(self.dot, self.n_got, self.n_ref)

    @property
    def snr_db(self) -> float | None:
        return quality.snr_db(self.n_ref, self.err2)

    def deviation(self) -> dict[str, Any]:
        """How far ``got`` is from ``ref`` (fidelity, deployment)."""
        return {
            "max_abs_diff": self.max_abs,
            "max_rel_diff": self.max_rel,
            "mean_abs_diff": self.sum_abs / max(self.count, 1),
            "rms_diff": self.rms,
            "nonfinite": self.nonfinite,
            "nonfinite_mismatch": self.nonfinite_mismatch,
        }

    def quality(self) -> dict[str, Any]:
        """How close ``got`` is to the float model ``ref``."""
        out = {
            "cosine": self.cosine,
            "snr_db": self.snr_db,
            "max_abs_error": self.max_abs,
            "mean_abs_error": self.sum_abs / max(self.count, 1),
            "rms_error": self.rms,
            "nonfinite_mismatch": self.nonfinite_mismatch,
        }
        if self.top1_total:
            out["top1_agreement"] = self.top1_same / self.top1_total
        return out


def ratio(num: float, den: float) -> float:
    """``num / den`` for non-negative RMS values: 0 when both are 0, inf when only ``den`` is."""
    if num == 0:
        return 0.0
    return num / den if den > 0 else math.inf
