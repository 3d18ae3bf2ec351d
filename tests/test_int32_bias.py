"""A layer's int32 bias never saturates: where a channel's bias code would leave the int32 range (its weights
near zero beside its bias), calibration widens that channel's weight range as onnxruntime's
``quantize_static`` does (quantcli.calibration.int32_bias). Before, the code was clamped and the channel lost
its bias, in the fake-quant model and the graph alike, and verify passed."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from quantcli import quantize_model
from quantcli.calibration.calibrate import calibrate
from quantcli.calibration.int32_bias import LIMIT, TINY, _not_cleared, fit_int32_biases, widening_ratios
from quantcli.quant import arithmetic

DEAD = 5  # the output channel whose weights are near zero


class Net(nn.Module):
    def __init__(self, tiny: float = 1e-6):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 8, 3, padding=1)
        with torch.no_grad():
            self.conv2.weight[DEAD] *= tiny
            self.conv2.bias[DEAD] = 0.5

    def forward(self, x):
        return self.conv2(torch.relu(self.conv1(x)))


def _batches(size: float = 1.0):
    g = torch.Generator().manual_seed(1)
    return [{"x": size * torch.randn(8, 3, 12, 12, generator=g)} for _ in range(3)]


def _calibrated(tiny: float = 1e-6):
    model = quantize_model(Net(tiny).eval())
    summary = calibrate(model, _batches(), "max", device="cpu")
    return model, summary


def test_widening_ratios():
    bias = torch.tensor([0.5, -0.5, 1e-3, 0.0])
    scale = torch.tensor([1e-10, 1e-10, 1e-10, 1e-10])
    r = widening_ratios(bias, scale)
    want = 0.5 / (1e-10 * LIMIT)  # |bias| / (scale * limit), computed here in float64
    assert r.dtype == torch.float64
    assert r[0].item() == pytest.approx(want, rel=1e-6) and r[1].item() == pytest.approx(want, rel=1e-6)
    assert r[2].item() == 1.0 and r[3].item() == 1.0  # codes of 1e7 and 0 fit


def test_the_dead_channel_keeps_its_bias_and_only_it_is_widened():
    model, summary = _calibrated()
    conv2 = model.conv2
    codes, scale = conv2.int32_bias_constants()
    assert codes.abs().max().item() <= LIMIT  # nothing clamped
    # the bias the integer kernel adds is the float bias, to half a code (codes near 2**31 are float32: to
    # 64 codes there, a relative 2**-24)
    b = conv2.bias.detach().double()
    assert ((codes.double() * scale.double() - b).abs() <= scale / 2 * 1.001 + b.abs() * 2**-23).all()
    # every other channel's amax is its weights' own max |w|, as max calibration takes it
    w_max = conv2.weight.detach().abs().amax(dim=(1, 2, 3))
    amax = conv2.weight_quantizer.amax.reshape(-1)
    others = [c for c in range(8) if c != DEAD]
    assert torch.equal(amax[others], w_max[others])
    assert amax[DEAD] > 2 * w_max[DEAD]  # (the factor itself: onnxruntime's, below)
    assert [(w.layer, w.channels) for w in summary.widened] == [("conv2", 1)]
    assert summary.to_dict()["widened_for_int32_bias"][0]["layer"] == "conv2"


def test_the_widened_scale_is_onnxruntimes():
    """The weight scale of the widened channel against onnxruntime's own adjustment
    (``QDQQuantizer._adjust_weight_scale_for_int32_bias``) of the scales the calibration had before it, to
    float32 rounding."""
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer

    model, _ = _calibrated()
    conv2 = model.conv2
    d = conv2.weight_quantizer.desc  # max calibration's symmetric scale, on the weights' grid (7 or 8 bits)
    bound = arithmetic.symmetric_bound(d.num_bits, d.unsigned)
    w_before = conv2.weight.detach().abs().amax(dim=(1, 2, 3)) / bound
    s_in = conv2.input_quantizer.integer_scale().numpy()
    bias_tp = onnx.numpy_helper.from_array(conv2.bias.detach().numpy(), "bias")
    adjusted, want = QDQQuantizer._adjust_weight_scale_for_int32_bias(
        None, s_in, w_before.numpy().copy(), "w", bias_tp, True
    )
    assert adjusted
    got = conv2.weight_quantizer.integer_scale().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got[DEAD] > 2 * w_before[DEAD].item()


@pytest.mark.parametrize(
    "tiny, bias, size",
    [(0.0, 0.5, 1e-10), (1e-36, 0.5, 1.0), (1e-41, 0.5, 1.0), (1e-41, 0.0, 1.0)],
    ids=["dead-channel-tiny-inputs", "weights-1e-36", "subnormal-weights", "subnormal-weights-zero-bias"],
)
def test_dead_and_subnormal_channels_get_a_normal_bias_scale(tiny, bias, size):
    """A pruned channel (weights 0, placeholder scale 1.0) on tiny inputs, or weights so small that the bias
    scale input_scale x weight_scale underflows float32: calibrate raised an internal error ("still saturates
    after widening", or "amax must be finite": an infinite ratio), or wrote a bias scale of 0 with codes 0 / 0
    (the fake-quant model all NaN, the graph's codes INT32_MIN). The channel's amax is now set from the bias
    scale it needs, at least float32's smallest normal number."""
    torch.manual_seed(0)
    net = Net(tiny).eval()
    with torch.no_grad():
        if size != 1.0:  # only the dead channel's bias: every other one would leave the range on such inputs
            net.conv1.bias.zero_()
            net.conv2.bias.zero_()
        net.conv2.bias[DEAD] = bias
    model = quantize_model(net)
    summary = calibrate(model, _batches(size), "max", device="cpu")
    codes, scale = model.conv2.int32_bias_constants()
    assert bool((scale >= TINY).all()) and bool(torch.isfinite(codes).all()) and codes.abs().max() <= LIMIT
    b = model.conv2.bias.detach().double()
    assert ((codes.double() * scale.double() - b).abs() <= scale / 2 * 1.001 + b.abs() * 2**-23).all()
    with torch.inference_mode():
        assert bool(torch.isfinite(model(**_batches(size)[0])).all())
    assert [(w.layer, w.channels) for w in summary.widened] == [("conv2", 1)]
    assert summary.widened[0].underflowed == (1 if bias == 0.0 else 0)


def test_models_whose_biases_fit_are_left_alone():
    model, summary = _calibrated(tiny=1.0)
    assert summary.widened == []
    w_max = model.conv2.weight.detach().abs().amax(dim=(1, 2, 3))
    assert torch.equal(model.conv2.weight_quantizer.amax.reshape(-1), w_max)
    assert fit_int32_biases(model) == []


def test_the_screen_passes_every_layer_whose_code_may_overflow():
    """The bound computed for all layers at once never clears a layer with a code over the limit: codes just
    over it, and just under it with another channel's weights far larger (so the smallest scale bounds it)."""
    model, _ = _calibrated(tiny=1.0)
    conv2 = model.conv2
    layers = [("conv2", conv2)]
    assert _not_cleared(layers) == []
    _, scale = conv2.int32_bias_constants()
    with torch.no_grad():
        for k in (1.001, 0.995):
            conv2.bias[DEAD] = float(scale[DEAD]) * LIMIT * k
            assert _not_cleared(layers) == layers, k
        conv2.bias[DEAD] = float(scale[DEAD]) * LIMIT * 0.3  # (a bound: it may pass some layers that fit)
    assert _not_cleared(layers) == []


def test_the_graph_adds_the_bias_in_onnxruntime(tmp_path):
    """End to end: the exported graph's dead channel outputs its bias (0.5) in onnxruntime; clamped, it
    output 0.005."""
    import onnxruntime as ort

    from exporters import export_onnx

    model, _ = _calibrated()
    x = _batches()[0]["x"]
    path = tmp_path / "m.onnx"
    export_onnx(model, {"x": x}, path)
    out = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    ref = Net().eval()(x).detach().numpy()
    assert abs(out[:, DEAD].mean() - 0.5) < 0.02, out[:, DEAD].mean()
    assert np.abs(out - ref).max() < 0.1
