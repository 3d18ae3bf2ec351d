"""What ``calibrate()`` reads back to the host outside the batches (issue 38): on a GPU every read waits for
the device, and before, the weights cost three reads each and every activation quantizer six more at the end
(its non-finite check, its amax check, the summary's range): hundreds of synchronisations per call. Now the
weights are one reduction each, and the checks and the summary read all quantizers together; the values are
the ones the calibrators gave one by one, bit for bit, and the refusals name the same quantizer and batch.

Reads are counted as ``aten._local_scalar_dense`` (``item``, ``float``, ``int``, ``bool`` of a tensor) on the
device path run on the CPU (nothing read per batch, batches folded): the per-quantizer reads were all of that
kind. The reads the searches make per chunk of histogram rows are theirs (not per quantizer: one chunk holds
many quantizers' rows on a GPU)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import calibrators.batched as batched
import calibrators.scratch as scratch
from calibrators import MaxCalibrator
from calibrators.base import refuse_nonfinite
from calibrators.max import max_abs
from quantcli import quantize_model
from quantcli.calibration import calibrate as calibrate_module
from quantcli.calibration.calibrate import calibrate
from quantcli.errors import CalibrationError
from quantcli.nn import quantizers
from quantcli.nn.amax_checks import amax_span, checked_together
from quantcli.nn.tensor_quantizer import TensorQuantizer
from quantcli.quant.descriptor import QuantDescriptor
from tests.dispatch import OpCounter, searches_not_counted


class HostReads(TorchDispatchMode):
    """Counts the scalar reads to the host dispatched while active, except inside :attr:`paused` blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not self.paused:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def device_path(monkeypatch):
    """The device path on the CPU: nothing read per batch, batches folded, asymmetric mse ranges searched
    together (as on a GPU)."""
    monkeypatch.setattr(scratch, "HOST_READ", set())
    monkeypatch.setattr(batched, "mse_together", lambda device: True)


def _model():
    """Enough quantizers that one read each would show: 12 convolutions and a classifier."""
    torch.manual_seed(0)
    layers = [torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU()]
    for _ in range(11):
        layers += [torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU()]
    layers += [torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 4)]
    return quantize_model(torch.nn.Sequential(*layers).eval())


def _batches(count=3):
    g = torch.Generator().manual_seed(1)
    return [{"input": torch.randn(2, 3, 6, 6, generator=g)} for _ in range(count)]


@pytest.mark.parametrize("method", ["max", "entropy", "mse", "percentile"])
def test_calibrate_reads_nothing_per_quantizer_outside_the_searches(method, device_path, monkeypatch):
    reads = HostReads()
    searches_not_counted(monkeypatch, reads)
    model = _model()
    with reads:
        summary = calibrate(model, _batches(), method, device="cpu")
    assert len(summary.calibrated) >= 26  # 13 weights and 13 or more activations
    assert reads.count == 0


def test_weights_cost_a_reduction_each(device_path):
    """At most 8 operations per weight quantizer (an amin and an amax, a negation and a maximum; the rest
    are views), where the calibrator's fold and checks took 20."""
    model = _model()
    qs = quantizers(model)
    weights = [n for n in qs if n.endswith("weight_quantizer")]
    ops = OpCounter()
    with ops:
        calibrate_module._calibrate_weights(model, qs, "max", 2048, {})
    assert ops.count <= 8 * len(weights) + 4, ops.count  # + the one check of all: a cat, an aminmax, a stack


@pytest.mark.parametrize(
    "shape, axis",
    [((5, 3, 3, 3), None), ((5, 3, 3, 3), 0), ((6, 4), 0), ((4, 6), 1), ((5, 3, 2), (0, 2)), ((7,), 0)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_max_abs_is_numpys_max_of_abs(shape, axis, dtype, device):
    """On the CPU amin and amax, on a GPU the infinity norm: numpy's max of abs either way."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    axes = () if axis is None else (axis,) if isinstance(axis, int) else axis
    reduce = tuple(d for d in range(len(shape)) if d not in axes)
    want = np.abs(x.to(torch.float32).numpy()).max(axis=reduce, keepdims=bool(axes))
    x = x.to(device)
    got = max_abs(x, axes)
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
    assert np.array_equal(got.cpu().numpy(), want)
    x.view(-1)[4] = float("nan")
    assert not torch.isfinite(max_abs(x, axes)).all()


@pytest.mark.parametrize(
    "desc",
    [
        QuantDescriptor(num_bits=8),
        QuantDescriptor(num_bits=8, axis=0),
        QuantDescriptor(num_bits=8, axis=1),
        QuantDescriptor(num_bits=4, block_sizes={-1: 16}),
        QuantDescriptor(num_bits=4, block_sizes={-1: 32}),  # a partial last block: 40 = 32 + 8
        QuantDescriptor(num_bits=8, axis=0, scale_amax=0.75),
    ],
    ids=["tensor", "axis0", "axis1", "blocks", "partial_block", "scaled"],
)
def test_calibrate_max_is_the_calibrators_amax_bit_for_bit(desc):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(6, 40, generator=g) * torch.linspace(0.1, 4, 40)
    old, new = TensorQuantizer(desc, name="old"), TensorQuantizer(desc, name="new")
    old.start_calibration("max")
    old.collect(w)
    want = old.load_calib_amax("max")
    got = new.calibrate_max(w)
    assert got.shape == want.shape and torch.equal(got, want)
    assert new.mode == "quantize" and new.calibrator is None


def test_a_non_finite_weight_is_refused_by_its_quantizers_name():
    model = _model()
    with torch.no_grad():
        model[4].weight[0, 0, 0, 0] = float("inf")
    with pytest.raises(CalibrationError, match=r"^4\.weight_quantizer: amax must be finite .* NaN or inf"):
        calibrate(model, _batches(), "max", device="cpu")


def test_amax_span_is_min_and_max_over_all_values():
    amaxes = [torch.tensor(2.5), torch.tensor([[0.5], [7.0]]), torch.empty(0), torch.tensor([3.0, 1.0])]
    assert amax_span(amaxes) == (0.5, 7.0)
    assert all(math.isnan(v) for v in amax_span(amaxes + [torch.tensor([1.0, float("nan")])]))
    assert all(math.isnan(v) for v in amax_span([]))


def test_checked_together_refuses_the_first_bad_amax_at_the_end_of_the_block():
    qs = [TensorQuantizer(QuantDescriptor(num_bits=8), name=f"q{i}") for i in range(4)]
    with pytest.raises(CalibrationError, match=r"^q1: amax must be finite and >= 0; hint$"):
        with checked_together("hint"):
            qs[0].set_amax(torch.tensor(1.0))
            qs[1].set_amax(torch.tensor(-1.0))  # kept: not refused here
            qs[2].set_amax(torch.tensor(float("inf")))
            set_inside = qs[1].amax.clone()
    assert float(set_inside) == -1.0
    with checked_together():  # all valid: nothing raised
        for q in qs:
            q.set_amax(torch.tensor([0.0, 2.0]))
    with pytest.raises(CalibrationError, match="q3: amax must be finite"):  # outside a block: at once
        qs[3].set_amax(torch.tensor(float("nan")))
    with pytest.raises(ValueError, match="own"), checked_together():  # the block's own error wins
        qs[0].set_amax(torch.tensor(-1.0))
        raise ValueError("own")


def test_non_finite_batches_are_read_together_and_refused_in_order(device_path):
    g = torch.Generator().manual_seed(2)
    cals = [MaxCalibrator(name=f"q{i}") for i in range(5)]
    for b in range(6):
        for i, c in enumerate(cals):
            x = torch.randn(16, generator=g)
            if (i, b) in ((3, 1), (2, 4)):
                x[5] = float("nan")
            c.collect(x)
    reads = HostReads()
    first = r"^q2: non-finite values \(NaN or inf\) in calibration batch 4;"
    with reads, pytest.raises(CalibrationError, match=first):
        refuse_nonfinite(cals)
    assert reads.count == 0  # one stacked read (a copy, not a scalar read)
    with pytest.raises(CalibrationError, match="q3: .* batch 1;"):
        refuse_nonfinite(cals[3:])
    clean = cals[:2]
    refuse_nonfinite(clean)
    with reads:
        for c in clean:
            c.compute_amax()
    assert reads.count == 0  # known finite: their own checks read nothing
