"""Histogram methods for asymmetric quantizers: the ``(min, max)`` of ``mse`` and ``percentile`` from two
histograms (``max(x, 0)``, ``max(-x, 0)``), checked against numpy on the raw data, not against the
histograms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from calibrators.two_sided_calibrator import TwoSidedHistogramCalibrator


def _skewed(seed: int = 0, n: int = 200_000) -> np.ndarray:
    """A leaky-ReLU-like activation: a long positive tail, a short negative one."""
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32) * 2 + 0.7
    return np.where(x > 0, x, 0.3 * x).astype(np.float32)


def _affine_error(x: np.ndarray, lo: float, hi: float) -> float:
    """Squared error of uint8 affine fake quantization with range [lo, hi], written here in numpy: scale
    (hi - lo) / 255 in float32, zero point round(-lo / scale), codes round-half-even and clipped."""
    scale = np.float32((np.float32(hi) - np.float32(lo)) / np.float32(255))
    zp = np.clip(np.round(-np.float32(lo) / scale), 0, 255)
    q = np.clip(np.round(x / scale) + zp, 0, 255)
    return float((((q - zp) * scale - x).astype(np.float64) ** 2).sum())


def _calibrated(x: np.ndarray, batches: int = 4) -> TwoSidedHistogramCalibrator:
    c = TwoSidedHistogramCalibrator(8, name="t")
    for part in np.array_split(x, batches):
        c.collect(torch.from_numpy(part).view(8, -1))
    return c


def test_mse_range_has_the_least_error_on_the_data():
    x = _skewed()
    lo, hi = (float(v) for v in _calibrated(x).compute_range("mse"))
    # a brute-force grid over both ends, evaluated on the data itself
    grid = min(
        (_affine_error(x, a, b), a, b)
        for a in np.linspace(x.min(), 0.2 * x.min(), 41)
        for b in np.linspace(0.3 * x.max(), x.max(), 41)
    )
    err, err_min_max = _affine_error(x, lo, hi), _affine_error(x, x.min(), x.max())
    assert err < 0.85 * err_min_max  # min/max (what asymmetric quantizers took before) is far off
    assert err <= grid[0] * 1.01, (lo, hi, grid)
    # both ends moved in: the search is not one-sided
    assert 0.95 * x.min() < lo < 0 < hi < 0.95 * x.max()


def test_percentile_clips_each_tail():
    x = _skewed(1)
    lo, hi = (float(v) for v in _calibrated(x).compute_range("percentile", percentile=99.0))
    width = np.abs(x).max() / 2048 * 2  # the histogram's bins: [-2**e, 2**e) in 2 x 2048, 2**e < 2 max |x|
    assert abs(hi - np.percentile(x, 99.0)) <= width
    assert abs(lo - np.percentile(x, 1.0)) <= width
    # percentile 100 clips nothing: the data's own range
    lo, hi = _calibrated(x).compute_range("percentile", percentile=100.0)
    assert float(hi) == x.max() and float(lo) == x.min()


@pytest.mark.parametrize("method", ["mse", "percentile"])
def test_one_signed_data_keeps_zero_at_the_end(method):
    x = np.abs(_skewed(2))
    lo, hi = _calibrated(x).compute_range(method)
    assert float(lo) == 0.0 and 0 < float(hi) <= x.max()
    lo, hi = _calibrated(-x).compute_range(method)
    assert float(hi) == 0.0 and -x.max() <= float(lo) < 0


def test_the_range_does_not_depend_on_batch_order():
    x = _skewed(3)
    parts = np.array_split(x, 6)
    a, b = TwoSidedHistogramCalibrator(8), TwoSidedHistogramCalibrator(8)
    for p in parts:
        a.collect(torch.from_numpy(p))
    for p in reversed(parts):
        b.collect(torch.from_numpy(p))
    for method in ("mse", "percentile"):
        ra, rb = a.compute_range(method), b.compute_range(method)
        assert all(torch.equal(u, v) for u, v in zip(ra, rb)), method


def test_a_non_finite_batch_is_refused_with_the_quantizers_name():
    from quantcli.errors import CalibrationError

    c = TwoSidedHistogramCalibrator(8, name="conv1.input_quantizer")
    with pytest.raises(CalibrationError, match="conv1.input_quantizer: non-finite"):
        c.collect(torch.tensor([1.0, float("nan")]))


def test_an_asymmetric_quantizer_takes_the_methods_range_and_entropy_keeps_min_max():
    """Through ``quantcli.calibrate``: ``mse``/``percentile`` set amin/amax from the two-sided search (they
    took the data's min and max before), ``entropy`` the data's min and max, reported in ``min_max``."""
    from quantcli import calibrate
    from quantcli.nn import quantize_model

    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 16, generator=g)
    batches = [{"x": torch.from_numpy(_skewed(10 + i, 64 * 16)).view(64, 16)} for i in range(4)]
    x = torch.cat([b["x"] for b in batches]).numpy()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 8)

        def forward(self, x):
            return self.fc(x)

    def run(method, **kw):
        model = quantize_model(Net(), {"preset": "uint8-asymmetric"})
        model.fc.weight.data.copy_(w)
        summary = calibrate(model, batches, method, device="cpu", **kw)
        q = model.fc.input_quantizer
        return float(q.amin), float(q.amax), summary.min_max

    lo, hi, min_max = run("mse")
    assert min_max == [] and _affine_error(x, lo, hi) < _affine_error(x, x.min(), x.max())
    want = _calibrated(x, 4).compute_range("mse")
    assert (lo, hi) == (float(want[0]), float(want[1]))
    lo, hi, min_max = run("percentile", percentile=99.0)
    assert min_max == [] and hi < x.max() and lo > x.min()
    lo, hi, min_max = run("entropy")
    assert min_max == ["fc.input_quantizer"] and (lo, hi) == (float(x.min()), float(x.max()))


def test_one_inputs_histogram_is_shared_within_a_forward_pass_only():
    """q/k/v quantizers of one input count it once per forward pass; a tensor object reused by the next pass
    with other values is counted again, not served stale."""
    from calibrators import shared

    x = torch.from_numpy(_skewed(4, 4096))
    a, b = TwoSidedHistogramCalibrator(8), TwoSidedHistogramCalibrator(8)
    with shared.shared_observations():
        a.collect(x)
        b.collect(x)
    assert torch.equal(a.histogram.hist, b.histogram.hist)
    x.mul_(-3)  # the same object, other values, in the next pass
    with shared.shared_observations():
        a.collect(x)
    c = TwoSidedHistogramCalibrator(8)
    c.collect(torch.from_numpy(_skewed(4, 4096)))
    c.collect(x.clone())
    for m in ("mse", "percentile"):
        assert all(torch.equal(u, v) for u, v in zip(a.compute_range(m), c.compute_range(m))), m


def _numpy_signed_hist(x: np.ndarray, nb: int) -> tuple[np.ndarray, int]:
    """The signed histogram written here in numpy (float64): bin ``trunc(x / w) + nb``, ``w = 2**e / nb``,
    ``e`` the smallest exponent with ``max |x| < 2**e``."""
    e = int(np.frexp(np.abs(x).max().astype(np.float64))[1])
    f = np.trunc(x.astype(np.float64) / (2.0**e / nb)).astype(np.int64)
    return np.bincount(f + nb, minlength=2 * nb), e


def test_the_signed_histogram_counts_every_value_in_its_bin_whatever_the_batch_order():
    """One pass over both signs: the counts equal numpy's of ``trunc(x / w)`` over the final range, also when
    the range doubled several times between batches (each doubling re-bins negative bins towards zero, not
    by an arithmetic shift), with values exactly on bin edges, zeros and -0.0."""
    from calibrators.signed_histogram import SignedHistogramCalibrator

    nb = 64
    g = np.random.default_rng(5)
    small = (g.standard_normal(3000) * 0.05).astype(np.float32)
    edges = (np.arange(-40, 40) * (32.0 / nb)).astype(np.float32)  # exact multiples of the final bin width
    large = np.concatenate([g.standard_normal(3000).astype(np.float32) * 6, edges, [0.0, -0.0, -31.9]])
    want, e = _numpy_signed_hist(np.concatenate([small, large]), nb)
    assert e == 5 and np.frexp(np.abs(small).max())[1] <= 0  # the range grew by five doublings or more
    for order in ((small, large), (large, small)):
        c = SignedHistogramCalibrator(num_bins=nb)
        for part in order:
            for piece in np.array_split(part, 3):
                c.collect(torch.from_numpy(piece.astype(np.float32)))
        assert int(c.range_exponent()[0]) == e
        assert np.array_equal(c.hist[0].numpy(), want)
    # the sides the range searches read: max(x, 0) and max(-x, 0), each value of the other sign a zero
    pos, neg, side_edges = c.sides()
    assert int(pos.sum()) == int(neg.sum()) == want.sum()
    assert want[0] == 0 and want[nb] == pos[0] - (want[:nb].sum()) == neg[0] - want[nb + 1 :].sum()
    # each side is the histogram of |x| over the same range (HistogramCalibrator's bins)
    x = np.concatenate([small, large])
    top = 2.0**e
    for side, vals in ((pos, np.maximum(x, 0)), (neg, np.maximum(-x, 0))):
        assert np.array_equal(side.numpy(), np.histogram(vals.astype(np.float64), nb, (0.0, top))[0])
    assert float(side_edges[-1]) == 2.0**e and side_edges.numel() == nb + 1


def test_each_side_is_searched_from_its_own_range():
    """A short negative side (GELU-like: -0.17 against 10) shares the long side's bins; its candidate ends
    start as far into its own range as a histogram of its own would (start_bin / bins of it), so mse can
    still clip it where that lowers the error."""
    from calibrators.two_sided import _candidates

    edges = torch.arange(2049, dtype=torch.float64) * (16.0 / 2048)  # [0, 16): the long side's range
    short = _candidates(edges, torch.tensor(0.17), start_bin=128, stride=1)
    # the side's own range is [0, 0.25): candidates from 0.25 * 128 / 2048 on, every bin below 0.17
    assert float(short[0]) == 0.015625 and float(short[-1]) == np.float32(0.17)
    assert short.numel() == 20 + 1  # edges 2..21 of the shared bins, then 0.17
    own = torch.arange(2049, dtype=torch.float64) * (0.25 / 2048)
    assert float(_candidates(own, torch.tensor(0.17), 128, 1)[0]) == 0.015625


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_the_signed_histogram_of_other_float_dtypes_is_that_of_their_values(dtype):
    from calibrators.signed_histogram import SignedHistogramCalibrator

    x = torch.from_numpy(_skewed(6, 4096)).to(dtype)
    a, b = SignedHistogramCalibrator(num_bins=256), SignedHistogramCalibrator(num_bins=256)
    a.collect(x)
    b.collect(x.float())  # every value of these dtypes but float64 is exactly a float32
    want, _ = _numpy_signed_hist(x.float().numpy(), 256)
    assert np.array_equal(a.hist[0].numpy(), want) and torch.equal(a.hist, b.hist)
