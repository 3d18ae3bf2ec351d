"""What observing costs per quantizer per batch, counted in torch operations (issue 38): at most 3 for max and
6 for the histogram methods, on the CPU's path and on the device path (run here on the CPU: nothing read back
per batch, batches folded every ``FOLD_EVERY``), whose results are the CPU path's bit for bit. And the
searches of a model's quantizers made together give what each quantizer's own search gives."""

from __future__ import annotations

import pytest
import torch

import calibrators.scratch as scratch
from calibrators import HistogramCalibrator, MaxCalibrator
from calibrators.batched import search_histograms, search_ranges
from calibrators.counting import FOLD_EVERY, HOST_ADD_EVERY
from calibrators.two_sided_calibrator import TwoSidedHistogramCalibrator
from quantcli import quantize_model
from quantcli.calibration.calibrate import calibrate
from quantcli.nn import quantizers
from tests.dispatch import calibration_ops

LIMIT = {"max": 3, "entropy": 6, "mse": 6, "percentile": 6}
METHODS = list(LIMIT)


def _batches(name: str, count: int, size: int) -> list[dict]:
    """``count`` batches of ``size`` samples cut from a sample model's own calibration batches (cycled; within
    a batch, since the text batches' lengths differ)."""
    from sample_models import digits_cnn, text_encoder

    source = (digits_cnn if name == "digits_cnn" else text_encoder).calibration_batches()
    pieces = [
        {k: v[i : i + size] for k, v in b.items()}
        for b in source
        for i in range(0, next(iter(b.values())).shape[0] - size + 1, size)
    ]
    return [pieces[j % len(pieces)] for j in range(count)]


def _quantized(name: str):
    from quantcli.inputs.loading import load_model

    return quantize_model(load_model(name)[0])


@pytest.fixture
def device_path(monkeypatch):
    """The device path on the CPU: no value read back per batch, batches kept and folded."""
    monkeypatch.setattr(scratch, "HOST_READ", set())


@pytest.mark.parametrize("name", ["digits_cnn", "text_encoder"])
@pytest.mark.parametrize("method", METHODS)
def test_cpu_path_operations_per_quantizer_per_batch(name, method):
    # two additions of HOST_ADD_EVERY batches' counts within the batches counted
    got = calibration_ops(_quantized(name), _batches(name, 2 * HOST_ADD_EVERY + 1, 4), method)
    assert got.quantizers >= 3
    assert 0 < got.per_quantizer_batch <= LIMIT[method], got


@pytest.mark.parametrize(
    "name, method",
    # digits_cnn: max and min/max, |x| and two-sided histograms; text_encoder: q/k/v sharing, two-sided
    [("digits_cnn", m) for m in METHODS] + [("text_encoder", "max"), ("text_encoder", "mse")],
)
def test_device_path_operations_per_quantizer_per_batch(name, method, device_path):
    # one fold of FOLD_EVERY batches within the batches counted: its operations are part of the average
    got = calibration_ops(_quantized(name), _batches(name, FOLD_EVERY + 2, 2), method)
    assert got.quantizers >= 3
    assert 0 < got.per_quantizer_batch <= LIMIT[method], got


@pytest.mark.parametrize("name", ["digits_cnn", "text_encoder"])
@pytest.mark.parametrize("method", METHODS)
def test_device_path_calibrates_as_the_cpu_path_bit_for_bit(name, method, monkeypatch):
    """Batches counted each over its own range on the device and folded give the CPU path's histograms, so the
    same amax and ranges, exactly (over more than one fold, with batches of several sizes; folds of 16 batches
    here, for time: how many a fold takes does not change what it computes)."""
    from calibrators import counting

    monkeypatch.setattr(counting, "FOLD_EVERY", 16)
    batches = [b for size in (3, 5) for b in _batches(name, 16 + 7, size)]
    results = []
    for host in ({"cpu"}, set()):
        monkeypatch.setattr(scratch, "HOST_READ", host)
        model = _quantized(name)
        calibrate(model, batches, method, device="cpu")
        results.append({n: (q.amax, q.amin) for n, q in quantizers(model).items() if q.amax is not None})
    assert results[0].keys() == results[1].keys() and len(results[0]) > 3
    for n, (amax, amin) in results[0].items():
        assert torch.equal(results[1][n][0], amax), n
        assert (amin is None) == (results[1][n][1] is None) and (
            amin is None or torch.equal(results[1][n][1], amin)
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_device_path_counts_equal_a_direct_count(dtype, device_path):
    """Both histograms on the device path, against counts made here by plain arithmetic on the raw
    values over the final range: zeros, negative zeros, all-zero and one-signed batches, a range that grows,
    and half-precision inputs."""
    from calibrators.signed_histogram import SignedHistogramCalibrator

    g = torch.Generator().manual_seed(7)
    batches = []
    for i in range(FOLD_EVERY + 40):
        x = torch.randn(257 + i % 5, generator=g) * (0.3 if i < 60 else 6.0)
        if i % 9 == 0:
            x = x.relu()
        if i % 11 == 0:
            x = -x.abs()
        if i % 13 == 0:
            x = torch.zeros_like(x)
        x[:3] = torch.tensor([0.0, -0.0, 0.0])
        batches.append(x.to(dtype))
    absolute, signed = HistogramCalibrator(), SignedHistogramCalibrator()
    for x in batches:
        absolute.collect(x)
        signed.collect(x)
    seen = torch.cat(batches).to(torch.float64)
    top = float(absolute.bin_edges[0, -1])
    assert top > float(seen.abs().max()) >= top / 2
    want = torch.bincount((seen.abs() * 2048 / top).floor().long(), minlength=2048)
    assert torch.equal(absolute.hist[0], want)
    e = int(signed.range_exponent()[0])
    assert 2.0**e == top
    want_signed = torch.bincount((seen * 2048 / 2.0**e).trunc().long() + 2048, minlength=4096)
    assert torch.equal(signed.hist[0], want_signed)


def test_device_path_reports_the_first_non_finite_batch(device_path):
    from quantcli.errors import CalibrationError

    for c in (MaxCalibrator(name="q"), HistogramCalibrator(name="q"), TwoSidedHistogramCalibrator(name="q")):
        for i in range(FOLD_EVERY + 5):
            x = torch.randn(64)
            if i in (FOLD_EVERY + 1, FOLD_EVERY + 3):
                x[7] = float("nan") if i == FOLD_EVERY + 1 else float("inf")
            c.collect(x)  # nothing raised per batch: on a GPU that would be a host read
        with pytest.raises(CalibrationError, match=f"q: non-finite .* batch {FOLD_EVERY + 1};"):
            c.compute_amax() if isinstance(c, MaxCalibrator) else c.compute_amax("percentile")


# ------------------------------------------------------------------------------------------ batched searches


def _histogram_calibrators():
    """Calibrators of different shapes and settings: per tensor (two equal), per channel, 4-bit, unsigned,
    FP8, other num_bins."""
    spec = [
        ({}, 1.0),
        ({}, 1.0),  # the same data again: equal histograms
        ({"axis": 1}, 3.0),
        ({"num_bits": 4}, 0.2),
        ({"unsigned": True}, 7.0),
        ({"num_bits": (4, 3)}, 2.0),
        ({"num_bins": 512}, 40.0),
    ]
    cals = []
    for i, (kw, scale) in enumerate(spec):
        c = HistogramCalibrator(**kw)
        gen = torch.Generator().manual_seed(100 + (i if i != 1 else 0))
        for _ in range(3):
            x = torch.randn(32, 24, generator=gen) * scale
            c.collect(x.relu() if kw.get("unsigned") else x)
        cals.append(c)
    return cals


@pytest.mark.parametrize(
    "method, kwargs", [("entropy", {}), ("mse", {}), ("percentile", {"percentile": 99.9})]
)
def test_histogram_searches_together_equal_one_by_one(method, kwargs, monkeypatch):
    from calibrators import histogram_calibrator

    alone = [
        c.compute_amax(method, **kwargs) if not (method == "entropy" and i == 5) else None
        for i, c in enumerate(_histogram_calibrators())
    ]
    together = _histogram_calibrators()
    searched = search_histograms(together, method, kwargs)
    assert searched == (6 if method == "entropy" else 7)  # entropy is not defined for FP8

    def searched_again(*_, **__):
        raise AssertionError("searched again")

    # from here on, only kept results can answer
    monkeypatch.setattr(
        histogram_calibrator, "METHODS", dict.fromkeys(histogram_calibrator.METHODS, searched_again)
    )
    for i, (c, want) in enumerate(zip(together, alone)):
        if want is None:
            continue
        got = c.compute_amax(method, **kwargs)
        assert got.shape == want.shape and torch.equal(got, want), i
    together[0].collect(torch.randn(32, 24))  # new statistics: the kept result no longer answers
    with pytest.raises(AssertionError, match="searched again"):
        together[0].compute_amax(method, **kwargs)


def test_range_percentiles_together_equal_one_by_one(monkeypatch):
    from calibrators import two_sided_calibrator

    def made():
        out = []
        for i, (shift, scale) in enumerate([(0.5, 1.0), (-2.0, 0.3), (0.0, 9.0), (3.0, 0.01)]):
            c = TwoSidedHistogramCalibrator(name=f"t{i}")
            g = torch.Generator().manual_seed(i)
            for _ in range(4):
                c.collect(torch.randn(40, 10, generator=g) * scale + shift * scale)
            out.append(c)
        return out

    alone = [c.compute_range("percentile", percentile=99.0) for c in made()]
    together = made()
    assert search_ranges(together, "percentile", {"percentile": 99.0}) == 4
    monkeypatch.setattr(two_sided_calibrator, "METHODS", {"percentile": None, "mse": None})  # kept ones only
    for c, want in zip(together, alone):
        got = c.compute_range("percentile", percentile=99.0)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def _range_error(c: TwoSidedHistogramCalibrator, lo: torch.Tensor, hi: torch.Tensor) -> float:
    """The squared error range_mse minimises, of ``(lo, hi)`` on ``c``'s histogram."""
    from calibrators.two_sided import _errors, _points, _side

    pos, neg, edges = c.histogram.sides()
    points = _points((_side(pos, edges), _side(neg, edges)))
    return float(_errors(lo.cpu().reshape(1), hi.cpu().reshape(1), points, c.num_bits))


def test_range_mse_searches_together_equal_one_by_one(monkeypatch):
    """The asymmetric mse search of many quantizers in step (calibrators.two_sided.ranges_mse, what a GPU
    runs; here on the CPU) ends where each quantizer's own search ends, or, where errors tie to float64
    rounding, at a pair of the same error."""
    from calibrators import batched

    def made():
        out = []
        spec = [(0.5, 1.0), (-2.0, 0.3), (0.0, 9.0), (3.0, 0.01), (0.7, 2.0), (0.0, 0.05)]
        for i, (shift, scale) in enumerate(spec):
            c = TwoSidedHistogramCalibrator(num_bits=8 if i != 3 else 6, name=f"t{i}")
            g = torch.Generator().manual_seed(20 + i)
            for _ in range(4):
                x = torch.randn(64, 50, generator=g) * scale + shift * scale
                c.collect(torch.where(x > 0, x, 0.3 * x) if i == 4 else x.relu() if i == 5 else x)
            out.append(c)
        return out

    alone = [c.compute_range("mse") for c in made()]
    monkeypatch.setattr(batched, "mse_together", lambda device: True)
    together = made()
    assert search_ranges(together, "mse", {}) == 6
    same = 0
    for c, want in zip(together, alone):
        got = c.kept_result(c.result_key("mse", {}))
        assert got is not None
        if all(torch.equal(a, b) for a, b in zip(got, want)):
            same += 1
        else:
            assert _range_error(c, *got) == pytest.approx(_range_error(c, *want), rel=1e-9)
    assert same >= 4


@pytest.mark.parametrize("name", ["digits_cnn", "text_encoder"])
@pytest.mark.parametrize("method", ["entropy", "mse", "percentile"])
def test_calibrate_searches_together_as_one_by_one(name, method, monkeypatch):
    """calibrate() searches every quantizer's histogram in one call per kind; the amax are each quantizer's
    own search's (here: with the batched search switched off)."""
    from quantcli.calibration import calibrate as calibrate_module

    batches = _batches(name, 4, 8)
    got = _quantized(name)
    calibrate(got, batches, method, device="cpu")
    monkeypatch.setattr(calibrate_module, "search_histograms", lambda *a, **k: 0)
    monkeypatch.setattr(calibrate_module, "search_ranges", lambda *a, **k: 0)
    want = _quantized(name)
    calibrate(want, batches, method, device="cpu")
    w = {n: q for n, q in quantizers(want).items() if q.amax is not None}
    assert len(w) > 3
    for n, q in quantizers(got).items():
        if n in w:
            assert torch.equal(q.amax, w[n].amax), n
