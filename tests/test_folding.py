"""Every calibrator's kept device batches folded at once (:mod:`calibrators.folding`, issue 38): the same
amax, ranges, histograms and refusals as each calibrator's own fold, bit for bit, in a few operations for all
of them instead of a dozen each.

Run on the device path emulated on the CPU (nothing read per batch, batches kept and folded, as on a GPU)."""

from __future__ import annotations

import copy

import pytest
import torch

import calibrators.batched as batched
import calibrators.scratch as scratch
from calibrators import HistogramCalibrator, MaxCalibrator
from calibrators.counting import FOLD_EVERY
from calibrators.folding import fold_together
from calibrators.max import MinMaxCalibrator
from calibrators.signed_histogram import SignedHistogramCalibrator
from quantcli import quantize_model
from quantcli.calibration import calibrate as calibrate_module
from quantcli.calibration.calibrate import calibrate
from quantcli.errors import CalibrationError
from quantcli.nn import quantizers
from tests.dispatch import OpCounter, searches_not_counted

#: operations that make a view or read metadata: no kernel on a GPU
VIEWS = {"view", "select", "slice", "detach", "unbind", "split", "expand", "alias", "_unsafe_view", "t"}


@pytest.fixture
def device_path(monkeypatch):
    monkeypatch.setattr(scratch, "HOST_READ", set())
    monkeypatch.setattr(batched, "mse_together", lambda device: True)


def _model(asymmetric: bool = False, depth: int = 8):
    """``depth`` convolutions behind ReLUs (half their input zeros), and a classifier; ``asymmetric``: behind
    GELUs (negative values too), each input quantizer asymmetric."""
    torch.manual_seed(0)
    act = torch.nn.GELU if asymmetric else torch.nn.ReLU
    layers = [torch.nn.Conv2d(3, 8, 3, padding=1), act()]
    for _ in range(depth - 1):
        layers += [torch.nn.Conv2d(8, 8, 3, padding=1), act()]
    layers += [torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 4)]
    config = {"asymmetric_activations": True}
    return quantize_model(torch.nn.Sequential(*layers).eval(), config if asymmetric else None)


def _batches(count=4, nan_at=None):
    g = torch.Generator().manual_seed(1)
    out = [{"input": torch.randn(2, 3, 6, 6, generator=g) * (1 + b)} for b in range(count)]
    if nan_at is not None:
        out[nan_at]["input"][1, 0, 2, 2] = float("nan")
    return out


def _state(model) -> dict:
    out = {}
    for name, q in quantizers(model).items():
        for attr in ("amax", "amin"):
            v = getattr(q, attr, None)
            if v is not None:
                out[f"{name}.{attr}"] = v
        if q.histogram is not None:
            part = getattr(q.histogram, "histogram", q.histogram)  # an asymmetric one's signed counts
            out[f"{name}.hist"] = part.hist
    return out


@pytest.mark.parametrize("asymmetric", [False, True], ids=["symmetric", "asymmetric"])
@pytest.mark.parametrize("method", ["max", "entropy", "mse", "percentile"])
def test_folded_together_equals_one_by_one(method, asymmetric, device_path, monkeypatch):
    model = _model(asymmetric)
    alone = copy.deepcopy(model)
    calibrate(model, _batches(), method, device="cpu")
    monkeypatch.setattr(calibrate_module, "fold_together", lambda parts: 0)
    calibrate(alone, _batches(), method, device="cpu")
    together, one_by_one = _state(model), _state(alone)
    assert together.keys() == one_by_one.keys()
    assert len(together) >= 18
    for key, value in one_by_one.items():
        assert torch.equal(together[key], value), key


def test_a_group_folds_in_a_few_operations_and_keeps_every_row(device_path):
    """Eight calibrators of four batches: one fold for all of them, and each one's amax is its own."""
    g = torch.Generator().manual_seed(3)
    data = [[torch.randn(32, generator=g) * (i + 1) for _ in range(4)] for i in range(8)]
    cals = [MaxCalibrator(name=f"q{i}") for i in range(8)]
    for i, c in enumerate(cals):
        for x in data[i]:
            c.collect(x)
    ops = OpCounter()
    with ops:
        assert fold_together(cals) == 8
    assert ops.count <= 12 + 4 * len(cals)  # the fold, and a few views per calibrator to hand out its row
    for i, c in enumerate(cals):
        assert c.compute_amax().item() == max(float(x.abs().max()) for x in data[i])


def _after_last_batch(
    counter: OpCounter, method: str, depth: int, asymmetric: bool = False
) -> tuple[int, int]:
    """What ``counter`` counts after the last batch of ``depth`` convolutions' calibration (from zero at that
    batch's end), and the activation quantizers calibrated."""
    batches = _batches()

    def progress(i):
        if i == len(batches) - 1:
            counter.count = 0

    with counter:
        summary = calibrate(_model(asymmetric, depth=depth), batches, method, device="cpu", progress=progress)
    return counter.count, sum(1 for n in summary.calibrated if not n.endswith("weight_quantizer"))


def _end_kernels(method: str, depth: int, monkeypatch) -> int:
    """Operations that launch a kernel after the last batch of ``depth`` convolutions' calibration (the
    searches not counted: theirs are per chunk of rows, not per quantizer)."""
    kernels = KernelOps()
    searches_not_counted(monkeypatch, kernels)
    count, activations = _after_last_batch(kernels, method, depth)
    assert activations == depth + 1
    return count


@pytest.mark.parametrize("method", ["max", "entropy"])
def test_the_end_of_calibration_costs_a_kernel_or_two_per_quantizer(method, device_path, monkeypatch):
    """After the last batch (the folds, the checks, each amax handed to its quantizer) each activation
    quantizer more costs at most 2 operations that launch a kernel (its amax's own copy); folded one by one
    it cost over 12."""
    few, many = _end_kernels(method, 4, monkeypatch), _end_kernels(method, 20, monkeypatch)
    assert (many - few) / 16 <= 2, (few, many)


def _end_ops(method: str, depth: int, asymmetric: bool, monkeypatch) -> tuple[int, int]:
    """Every operation dispatched after the last batch of ``depth`` convolutions' calibration (views and
    searches included), the searches chunked as on a GPU with memory to spare (one chunk for every row), and
    the activation quantizers calibrated."""
    import calibrators.histogram as histogram

    monkeypatch.setattr(histogram, "_chunk_elements", lambda device: 1 << 27)
    return _after_last_batch(OpCounter(), method, depth, asymmetric)


@pytest.mark.parametrize("asymmetric", [False, True], ids=["symmetric", "asymmetric"])
@pytest.mark.parametrize("method", ["max", "entropy", "mse", "percentile"])
def test_each_quantizer_more_costs_a_few_operations_after_the_last_batch(
    method, asymmetric, device_path, monkeypatch
):
    """Everything after the last batch, views included (on a GPU's host each dispatch costs about 14 us):
    each activation quantizer more adds at most 3 operations (its amax's clone or clamps, its weight's amax
    in the range check), 6 for asymmetric mse (whose descent evaluates its candidates in chunks of rows, more
    chunks for more rows). Handed out by a select and a view per calibrator, with bin edges made per
    histogram and a range's bounds applied per quantizer, it was 9-28."""
    (few, n_few), (many, n_many) = (_end_ops(method, d, asymmetric, monkeypatch) for d in (4, 20))
    assert n_many > n_few
    limit = 6 if (method, asymmetric) == ("mse", True) else 3
    assert (many - few) / (n_many - n_few) <= limit, (few, many, n_few, n_many)


def _awkward_batches(i: int, g: torch.Generator) -> list[torch.Tensor]:
    """Batches each fold must treat alike: signed, all >= 0 (zeros and none), all zeros (a zero range),
    with subnormals, and (calibrator 2 only) a NaN."""
    out = [
        torch.randn(40, 30, generator=g) * (i + 1),
        torch.relu(torch.randn(40, 30, generator=g)) * 3,
        torch.rand(40, 30, generator=g) + 0.5,
        torch.zeros(40, 30),
        torch.randn(40, 30, generator=g) * 1e-39,
        torch.randn(40, 30, generator=g) * 2 ** (i - 2),
    ]
    if i == 2:
        out[4][5, 5] = float("nan")
    return out


def _state_of(c) -> list:
    if isinstance(c, MaxCalibrator):
        state = [c._amax]
    elif isinstance(c, MinMaxCalibrator):
        state = [c._min, c._max]
    else:
        state = [c._hist, c._exp]
    return state + [c._bad_batch]


@pytest.mark.parametrize(
    "make",
    [
        lambda n: MaxCalibrator(name=n),
        lambda n: MaxCalibrator(axis=1, name=n),
        lambda n: MinMaxCalibrator(name=n),
        lambda n: HistogramCalibrator(name=n),
        lambda n: SignedHistogramCalibrator(name=n),
    ],
    ids=["max", "max_per_channel", "min_max", "histogram", "signed_histogram"],
)
def test_a_group_fold_equals_each_calibrators_own(make, device_path):
    g = torch.Generator().manual_seed(6)
    cals = [make(f"q{i}") for i in range(4)]
    for i, c in enumerate(cals):
        for x in _awkward_batches(i, g):
            c.collect(x)
    alone = copy.deepcopy(cals)
    assert fold_together(cals) == 4
    for c, a in zip(cals, alone):
        a._flush()
        for got, want in zip(_state_of(c), _state_of(a)):  # bit for bit (a NaN where its own has one)
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=c.label)
    bad = [int(c._bad_batch) for c in cals]
    assert bad == [-1, -1, 4, -1]


def test_zeros_are_counted_in_bin_zero_as_on_the_cpu(device_path, monkeypatch):
    """histc leaves the zeros out (one bin of them serialises its atomic adds on a GPU); the fold puts them
    back: the device path's counts of a ReLU's output equal the host path's, bin for bin."""
    g = torch.Generator().manual_seed(4)
    xs = [torch.relu(torch.randn(3, 700, generator=g)) * 3 for _ in range(3)]
    xs[1][0, :50] = 0.0
    device = HistogramCalibrator(name="device")
    for x in xs:
        device.collect(x)
    monkeypatch.setattr(scratch, "HOST_READ", {"cpu"})
    host = HistogramCalibrator(name="host")
    for x in xs:
        host.collect(x)
    zeros = sum(int((x == 0).sum()) for x in xs)
    assert zeros > 3000
    assert torch.equal(device.hist, host.hist)
    assert int(device.hist[0, 0]) >= zeros


def test_a_non_finite_batch_is_refused_with_the_same_name_and_batch(device_path, monkeypatch):
    model = _model()
    with pytest.raises(CalibrationError) as together:
        calibrate(copy.deepcopy(model), _batches(nan_at=2), "max", device="cpu")
    monkeypatch.setattr(calibrate_module, "fold_together", lambda parts: 0)
    with pytest.raises(CalibrationError) as one_by_one:
        calibrate(model, _batches(nan_at=2), "max", device="cpu")
    assert "calibration batch 2" in str(together.value)
    assert str(together.value) == str(one_by_one.value)


def test_folds_during_the_batches_then_together(device_path):
    """More batches than a fold holds: each calibrator folds its first round alone, the rest together; the
    running max over both is every batch's."""
    g = torch.Generator().manual_seed(5)
    n = FOLD_EVERY + 3
    data = [[torch.randn(8, generator=g) for _ in range(n)] for _ in range(3)]
    cals = [MaxCalibrator(name=f"q{i}") for i in range(3)]
    for b in range(n):
        for i, c in enumerate(cals):
            c.collect(data[i][b])
    assert fold_together(cals) == 3
    for i, c in enumerate(cals):
        assert c.compute_amax().item() == max(float(x.abs().max()) for x in data[i])


class KernelOps(OpCounter):
    """Counts, unless :attr:`paused`, the operations that are not views (on a GPU, a kernel each)."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and func.overloadpacket.__name__ not in VIEWS:
            self.count += 1
        return func(*args, **(kwargs or {}))
