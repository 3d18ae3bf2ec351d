"""Calibrators (issue: max and histogram, entropy/mse/percentile): hand cases, reference loops, invariance."""

import numpy as np
import pytest
import torch

from calibrators import (
    HistogramCalibrator,
    MaxCalibrator,
    compute_amax_entropy,
    compute_amax_mse,
    compute_amax_percentile,
)
from quantcli.errors import CalibrationError
from tests.reference_amax import ref_entropy, ref_entropy_vectorized, ref_mse


def random_hist(rng, bins=512):
    h = rng.integers(0, 50, bins).astype(np.float64) * (rng.random(bins) < 0.8)
    h[: bins // 3] += rng.integers(100, 1000, bins // 3)  # bulk near zero, sparse tail
    return h, np.arange(bins + 1, dtype=np.float64) * 0.01


# ----------------------------------------------------------------------------- max


def test_max_per_tensor_and_per_channel():
    x = torch.tensor([[1.0, -5.0, 2.0], [-0.5, 0.25, 3.0]])
    c = MaxCalibrator()
    c.collect(x)
    c.collect(x * 0.5)
    assert c.compute_amax().item() == 5.0
    c0 = MaxCalibrator(axis=0)
    c0.collect(x)
    assert c0.compute_amax().tolist() == [[5.0], [3.0]]
    cn = MaxCalibrator(axis=-1)
    cn.collect(x)
    assert cn.compute_amax().tolist() == [[1.0, 5.0, 3.0]]
    ct = MaxCalibrator(axis=(0, 2))
    ct.collect(torch.arange(24.0).reshape(2, 3, 4) - 12)
    assert ct.compute_amax().shape == (2, 1, 4)


def test_max_shape_change_names_quantizer():
    c = MaxCalibrator(axis=0, name="fc1.input_quantizer")
    c.collect(torch.ones(3, 4))
    with pytest.raises(CalibrationError, match="fc1.input_quantizer"):
        c.collect(torch.ones(5, 4))


def test_empty_calibrator_raises():
    with pytest.raises(CalibrationError, match="no data"):
        MaxCalibrator(name="q").compute_amax()
    with pytest.raises(CalibrationError, match="no data"):
        HistogramCalibrator(name="q").compute_amax("entropy")


@pytest.mark.parametrize("cls", [MaxCalibrator, HistogramCalibrator])
def test_nan_names_quantizer_and_batch(cls):
    c = cls(name="layer.input_quantizer")
    c.collect(torch.ones(4))
    with pytest.raises(CalibrationError, match=r"layer.input_quantizer.*batch 1"):
        c.collect(torch.tensor([1.0, float("nan")]))


# ----------------------------------------------------------------------------- amax methods, hand cases


def test_percentile_of_arange():
    c = HistogramCalibrator()
    c.collect(torch.arange(100.0))
    assert c.compute_amax("percentile", percentile=90).item() == pytest.approx(89, abs=0.1)


def test_entropy_clips_far_outlier():
    g = torch.Generator().manual_seed(0)
    bulk = torch.rand(100_000, generator=g)
    # bulk spans bins 0..255 of [0, 8): candidates from bin 128 reach into it, the outlier at 4 is clipped
    c = HistogramCalibrator()
    c.collect(torch.cat([bulk, torch.tensor([4.0])]))
    assert 0.9 < c.compute_amax("entropy").item() < 1.1
    # a 100x outlier: the bulk fills bins 0..15 of [0, 128); with start_bin below that it is clipped too
    far = HistogramCalibrator()
    far.collect(torch.cat([bulk, torch.tensor([100.0])]))
    assert 0.9 < far.compute_amax("entropy", start_bin=4).item() < 1.1
    # ...while with the default start_bin=128 every candidate in the empty gap has infinite divergence
    # (TensorRT's definition: clipped mass lands in an empty bin), so the max is kept
    assert far.compute_amax("entropy").item() == pytest.approx(100.0625)


def test_mse_many_255_one_256():
    x = torch.cat([torch.full((10_000,), 255.0), torch.tensor([256.0])])
    # bins are 0.25 wide over [0, 512): the values sit at bin centres 255.125 (10,000) and 256.125 (1); the
    # candidates are bin edges. Hand-computed squared errors, err(a) = 10000 * d_bulk^2 + d_outlier^2: signed
    # (bound 127): a=255.0 clips both, 156.25 + 1.27 = 157.5; a=255.25 (scale 2.0098) puts the bulk on code
    # 127 = 255.25, 156.25 + 0.77 = 157.0; a=256.25 (scale 2.0177) puts it on code 126 = 254.23, about 8,000.
    # -> 255.25, below both the max (256) and the 100th percentile (256.25).
    c8 = HistogramCalibrator()
    c8.collect(x)
    assert c8.compute_amax("mse").item() == 255.25
    assert c8.compute_amax("percentile", percentile=100).item() == 256.25
    # unsigned (bound 255): a=255.25 gives 157.0 as above; a=255.5 puts the bulk on code 255 = 255.5: 1406;
    # a=256.0 on code 254 = 254.996: 166; a=256.25 (scale 1.00490) on code 254 = 255.245: 143.5 + 0.016.
    # -> 256.25 (here the same as the 100th percentile, and above the max 256.0)
    c = HistogramCalibrator(unsigned=True)
    c.collect(x)
    assert c.compute_amax("mse").item() == 256.25
    m = MaxCalibrator()
    m.collect(x)
    assert m.compute_amax().item() == 256.0


def test_mse_fp8_lowers_the_error_below_the_max():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50_000, generator=g)
    c = HistogramCalibrator(num_bits=(4, 3))
    c.collect(x)
    amax = c.compute_amax("mse")
    m = MaxCalibrator()
    m.collect(x)

    def sq_error(a):  # E4M3 fake quant by torch's own float8 cast, independent of quantcli's arithmetic
        s = a / 448.0
        q = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32) * s
        return float(((x - q).double() ** 2).sum())

    assert amax.item() != m.compute_amax().item()
    assert sq_error(amax) < sq_error(m.compute_amax())  # what mse is for: a smaller error than the max gives


def test_skip_zeros():
    x = torch.cat([torch.zeros(10_000), torch.linspace(0.1, 1.0, 100)])
    c = HistogramCalibrator(skip_zeros=True)
    c.collect(x)
    assert c.hist.sum().item() == 100
    # without skipping, the 99th percentile is zero-dominated
    c2 = HistogramCalibrator()
    c2.collect(x)
    assert (
        c2.compute_amax("percentile", percentile=50).item()
        < c.compute_amax("percentile", percentile=50).item()
    )


# ----------------------------------------------------------------------------- vectorized == reference


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "fast, slow, cases",
    [
        (
            compute_amax_entropy,
            ref_entropy,
            [{"start_bin": 128}, {"num_bits": 6, "unsigned": True, "stride": 3, "start_bin": 40}],
        ),
        (
            ref_entropy_vectorized,
            ref_entropy,
            [{"start_bin": 128}, {"num_bits": 6, "unsigned": True, "stride": 3, "start_bin": 40}],
        ),
        (
            compute_amax_mse,
            ref_mse,
            [{"start_bin": 64}, {"num_bits": 4, "unsigned": True, "stride": 2, "start_bin": 16}],
        ),
    ],
    ids=["entropy", "fair-entropy-reference", "mse"],
)
def test_vectorized_equals_reference_loop(seed, fast, slow, cases):
    rng = np.random.default_rng(seed)
    h, e = random_hist(rng, 384)
    for kw in cases:
        assert fast(h, e, **kw) == pytest.approx(slow(h, e, **kw)), kw


def test_percentile_equals_reference():
    rng = np.random.default_rng(5)
    h, e = random_hist(rng, 300)
    cdf = np.cumsum(h) / h.sum()
    for p in (50.0, 99.0, 99.99, 100.0):
        idx = int(np.argmax(cdf >= p / 100 - 1e-15))
        assert compute_amax_percentile(h, e, p) == pytest.approx(e[idx + 1])


def test_methods_accept_channel_dimension():
    rng = np.random.default_rng(7)
    hs, es = zip(*(random_hist(rng, 256) for _ in range(3)))
    h, e = np.stack(hs), np.stack(es)
    for fn, kw in ((compute_amax_entropy, {}), (compute_amax_mse, {}), (compute_amax_percentile, {})):
        batched = fn(h, e, **kw)
        assert batched.shape == (3,)
        for c in range(3):
            assert batched[c] == pytest.approx(fn(h[c], e[c], **kw))


# ----------------------------------------------------------------------------- invariance, per-channel


def test_histogram_independent_of_batch_order_and_size():
    g = torch.Generator().manual_seed(0)
    data = torch.randn(20_000, generator=g) * torch.linspace(0.01, 8, 20_000)
    results = []
    for perm_seed, batch in ((0, 100), (1, 3000), (2, 20_000), (3, 777)):
        perm = torch.randperm(data.numel(), generator=torch.Generator().manual_seed(perm_seed))
        c = HistogramCalibrator()
        for chunk in data[perm].split(batch):
            c.collect(chunk)
        results.append(
            (c.hist, c.bin_edges, {m: c.compute_amax(m).item() for m in ("entropy", "mse", "percentile")})
        )
    h0, e0, a0 = results[0]
    for h, e, a in results[1:]:
        assert torch.equal(h, h0) and torch.equal(e, e0)  # exactly the same histogram
        assert a == a0


def test_per_channel_equals_per_tensor_on_each_channel():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 5, 40, generator=g) * torch.tensor([0.1, 1, 3, 10, 0.5, 2]).view(6, 1, 1)
    pc = HistogramCalibrator(axis=0)
    for b in x.split(2, dim=1):
        pc.collect(b)
    amax_pc = {m: pc.compute_amax(m) for m in ("entropy", "mse", "percentile")}
    assert amax_pc["entropy"].shape == (6, 1, 1)
    for c in range(6):
        single = HistogramCalibrator()
        for b in x[c].split(2, dim=0):
            single.collect(b)
        assert torch.equal(single.hist[0], pc.hist[c])
        for m, a in amax_pc.items():
            assert a[c].item() == pytest.approx(single.compute_amax(m).item())


def test_memory_state_independent_of_batches():
    c = HistogramCalibrator(axis=1)
    for _ in range(50):
        c.collect(torch.randn(8, 16))
    assert c._hist.shape == (16, 2048)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    x = torch.linspace(-3, 3, 1001)
    for cls in (MaxCalibrator, HistogramCalibrator):
        c = cls()
        c.collect(x.to(dtype))
        method = () if cls is MaxCalibrator else ("percentile",)
        assert c.compute_amax(*method).item() == pytest.approx(3.0, rel=0.01)


@pytest.mark.cuda
def test_cuda_collect_stays_on_device():
    x = torch.randn(64, 3072, device="cuda")
    for c in (MaxCalibrator(), HistogramCalibrator(axis=1)):
        c.collect(x)
        amax = c.compute_amax(*(() if isinstance(c, MaxCalibrator) else ("entropy",)))
        assert amax.device.type == "cuda"
    calibrator = HistogramCalibrator()
    calibrator.collect(torch.tensor([1.0, float("inf")], device="cuda"))  # no sync: raised at compute time
    with pytest.raises(CalibrationError, match="batch 0"):
        calibrator.compute_amax("percentile")


@pytest.mark.cuda
def test_cuda_collect_never_synchronizes():
    # every collect path stays on the device: a host synchronisation raises in sync-debug mode
    x = torch.randn(64, 3072, device="cuda")
    cs = [MaxCalibrator(), MaxCalibrator(axis=1), HistogramCalibrator(), HistogramCalibrator(axis=1)]
    for c in cs:
        c.collect(x)  # first batch allocates state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for c in cs:
            c.collect(x * 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_shared_observations_are_exact():
    from calibrators.shared import shared_observations

    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(64, 32, generator=g) * s for s in (0.5, 4.0, 1.0, 30.0, 0.1)]
    wide = torch.randn(10, generator=g) * 100  # gives a calibrator a much larger range first
    alone, first, second = HistogramCalibrator(), HistogramCalibrator(), HistogramCalibrator()
    coarse_alone, coarse = HistogramCalibrator(), HistogramCalibrator()
    fine_alone, fine = HistogramCalibrator(), HistogramCalibrator()
    for c in (coarse_alone, coarse):
        c.collect(wide)
    for x in batches:
        alone.collect(x)
        coarse_alone.collect(x)
        fine_alone.collect(x)
        with shared_observations():
            coarse.collect(x)  # histograms first, over its wide range: counts too coarse for the others
            first.collect(x)  # so this one collects itself...
            second.collect(x)  # ...and this one takes first's counts
            fine.collect(x)
    for got, want in ((first, alone), (second, alone), (coarse, coarse_alone), (fine, fine_alone)):
        assert torch.equal(got.hist, want.hist) and torch.equal(got.bin_edges, want.bin_edges)


def test_shared_searches_search_equal_histograms_once(monkeypatch):
    from calibrators import histogram_calibrator
    from calibrators.shared import shared_searches

    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(4096, generator=g), torch.randn(4096, generator=g)
    same, twin, other = HistogramCalibrator(), HistogramCalibrator(), HistogramCalibrator()
    same.collect(x)
    twin.collect(x.clone())
    other.collect(y)
    want = {c: {m: c.compute_amax(m) for m in ("entropy", "mse", "percentile")} for c in (same, twin, other)}
    calls = []

    def counted(fn):
        def wrapper(*a, **k):
            calls.append(fn)
            return fn(*a, **k)

        return wrapper

    methods = {m: counted(fn) for m, fn in histogram_calibrator.METHODS.items()}
    monkeypatch.setattr(histogram_calibrator, "METHODS", methods)
    with shared_searches():
        got = {
            c: {m: c.compute_amax(m) for m in ("entropy", "mse", "percentile")} for c in (same, twin, other)
        }
        p99 = [c.compute_amax("percentile", percentile=99.0) for c in (same, twin)]
    assert len(calls) == 3 * 2 + 1  # twin reuses same's searches; another setting is a new search
    assert torch.equal(p99[0], p99[1])
    for c in want:
        for m in want[c]:
            assert torch.equal(got[c][m], want[c][m])


@pytest.mark.parametrize("n", [1, 3, 1023, 1024, 5000, 65536])
def test_counting_in_lanes_equals_counting_once(n):
    from calibrators.counting import HostSignedCounter

    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g).relu() * 3 - 0.5  # a spike, and both signs
    plain, lanes = HostSignedCounter(2048), HostSignedCounter(2048)
    lanes.spiky, lanes._checked = True, 10**9  # counting in lanes throughout
    e = HostSignedCounter.batch_exponent(float(x.min()), float(x.max()))
    for c in (plain, lanes):
        c.count(x, e)
    want = torch.bincount((x.double() * 2048 / 2.0**e).trunc().long() + 2048, minlength=4096)
    assert torch.equal(plain.signed()[0], want)
    assert torch.equal(lanes.signed()[0], want)
    assert int(lanes.lanes[1:].sum()) > 0 or n < 2  # the lanes were used


def test_cpu_histogram_equals_direct_count_on_spiky_and_smooth_batches():
    """Batches alternate between ReLU-like (one dominant bin: counted in interleaved copies) and smooth ones,
    with the range growing midway; the histogram is the direct count over the final range."""
    g = torch.Generator().manual_seed(11)
    batches = [torch.randn(3000 + 7 * i, generator=g) * (1 + 5 * (i > 3)) for i in range(8)]
    batches = [b.relu() if i % 2 else b for i, b in enumerate(batches)]
    # non-contiguous ones too
    batches = [b.view(-1, 10)[:, :7] if b.numel() % 10 == 0 else b for b in batches]
    c = HistogramCalibrator(num_bins=256)
    for b in batches:
        c.collect(b)
    seen = torch.cat([b.reshape(-1) for b in batches]).abs()
    top = float(c.bin_edges[0, -1])
    want = torch.bincount((seen.double() * 256 / top).floor().long(), minlength=256)
    assert top > float(seen.max()) >= top / 2
    assert torch.equal(c.hist[0], want)


@pytest.mark.parametrize("scale", [1, 5000, 10**7])  # totals below 2**24, above it, above 2**31
def test_entropy_float32_screening_is_close_and_the_choice_is_float64s(scale):
    from calibrators import histogram

    rng = np.random.default_rng(scale % 97)
    h = torch.tensor(random_hist(rng, 1024)[0] * scale).unsqueeze(0)
    e = torch.arange(1025, dtype=torch.float64) * 0.01
    hh = h.clone()
    hh[:, 0] = hh[:, 1]
    cand = torch.arange(128, 1025)
    bounds, k_last = histogram._bounds(cand, 128)
    tables = histogram._entropy_tables(hh)
    screened = histogram._entropy_divergences(
        hh, tables, cand, *histogram._bin_terms(tables, bounds, k_last, 128, torch.float32)
    )
    exact = histogram._entropy_divergences(
        hh, tables, cand, *histogram._bin_terms(tables, bounds, k_last, 128, torch.float64)
    )
    finite = torch.isfinite(exact)
    assert torch.equal(finite, torch.isfinite(screened))
    # the docstring's bound; 1e-4 is the re-scoring window
    assert float((screened - exact)[finite].abs().max()) < 1e-5
    best = int(cand[len(cand) - 1 - int(torch.argmin(exact.flip(-1)))])  # the last of equal minima
    assert float(compute_amax_entropy(h, e)) == pytest.approx(float(e[best]))


def test_max_calibrators_of_one_tensor_reduce_it_once(monkeypatch):
    import calibrators.max as cmax
    from calibrators.shared import shared_observations

    calls = []
    real = torch.aminmax
    monkeypatch.setattr(cmax.torch, "aminmax", lambda t, **kw: calls.append(1) or real(t, **kw))
    g = torch.Generator().manual_seed(5)
    batches = [torch.randn(16, 8, generator=g) * s for s in (1.0, 3.0, 0.5)]
    alone, q, k, v = MaxCalibrator(), MaxCalibrator(), MaxCalibrator(), MaxCalibrator()
    for x in batches:
        alone.collect(x)
        with shared_observations():
            for c in (q, k, v):
                c.collect(x)
            k.collect(x.clone())  # another tensor object, equal values: reduced again
    assert len(calls) == 3 * 3  # alone, the shared one, the clone: per batch
    for c in (q, k, v):
        assert torch.equal(c.compute_amax(), alone.compute_amax())


def _host_batches(g) -> list[torch.Tensor]:
    """Small and large CPU batches, the range growing midway and a small one after large ones: zeros,
    negative zeros, an all-zero batch, one-signed ones, a ReLU-like spike, non-contiguous ones."""
    sizes = [64, 5, 3000, 64, 1, 40_000, 16, 257, 4096, 64]
    batches = []
    for i, n in enumerate(sizes):
        x = torch.randn(n, generator=g) * (0.3 if i < 4 else 6.0)
        if i % 3 == 1:
            x = x.relu()
        if i == 6:
            x = -x.abs()
        if i == 8:
            x = torch.zeros_like(x)
        x[: min(3, n)] = torch.tensor([0.0, -0.0, 0.0])[: min(3, n)]
        batches.append(x.view(-1, 4)[:, :3] if n % 4 == 0 and i % 2 else x)
    return batches


@pytest.mark.parametrize("path", ["numpy for small batches", "torch only"])
def test_cpu_paths_equal_a_direct_count(path, monkeypatch):
    """Both CPU counting paths (small float32 batches in numpy, the rest through torch; or torch alone) give
    the count made here by plain arithmetic over the final range, for ``|x|`` (with and without skip_zeros)
    and for ``x`` (with the batches' min and max)."""
    from calibrators import counting
    from calibrators.signed_histogram import SignedHistogramCalibrator
    from calibrators.two_sided_calibrator import TwoSidedHistogramCalibrator

    if path == "torch only":
        monkeypatch.setattr(counting, "NUMPY_MAX", 0)
    batches = _host_batches(torch.Generator().manual_seed(5))
    absolute, skipping = HistogramCalibrator(), HistogramCalibrator(skip_zeros=True)
    signed, two_sided = SignedHistogramCalibrator(), TwoSidedHistogramCalibrator()
    for x in batches:
        for c in (absolute, skipping, signed, two_sided):
            c.collect(x)
    seen = torch.cat([b.reshape(-1) for b in batches]).double()
    top = float(absolute.bin_edges[0, -1])
    assert top > float(seen.abs().max()) >= top / 2
    want = torch.bincount((seen.abs() * 2048 / top).floor().long(), minlength=2048)
    assert torch.equal(absolute.hist[0], want)
    want[0] -= int((seen == 0).sum())
    assert torch.equal(skipping.hist[0], want)
    want_signed = torch.bincount((seen * 2048 / top).trunc().long() + 2048, minlength=4096)
    for c in (signed, two_sided.histogram):
        assert 2.0 ** int(c.range_exponent()[0]) == top
        assert torch.equal(c.hist[0], want_signed)
    lo, hi = two_sided.extremes.compute_range()
    assert (float(lo), float(hi)) == (float(seen.min()), float(seen.max()))


def test_small_batches_are_counted_without_torch_arithmetic():
    """A small float32 batch is counted in numpy: the only torch operations are those of reading it as a numpy
    array (no reduction, no arithmetic, no count)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from calibrators.two_sided_calibrator import TwoSidedHistogramCalibrator

    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, 16)
    narrower = x * 0.5  # inside the range the first batch set: nothing re-binned
    for c in (HistogramCalibrator(), TwoSidedHistogramCalibrator()):
        c.collect(x)
        names = Names()
        with names:
            c.collect(narrower)
        assert names.names <= {"detach", "to", "resolve_conj", "resolve_neg"}, names.names
