"""``--smoothquant`` smooths only the layers it helps (:mod:`quantcli.calibration.smoothing_gain`).

On the digits sample (no outlier channels) smoothing cost 1 dB of SNR end to end and, through its explicit
Mul, conv2's integer kernel (2x the latency). The layer-output error is recomputed here independently (numpy,
round half to even); the choice is checked on a layer with an outlier input channel (smoothed) and on layers
without (left as they are, and said why).
"""

import json

import numpy as np
import pytest
import torch

from quantcli.calibration.smoothing_gain import MIN_GAIN, relative_error
from quantcli.quant.descriptor import QuantDescriptor
from tests.helpers import cli


def _np_error(x, w, s, input_bits=8, weight_bits=8):
    """The relative output error with symmetric per-tensor inputs and per-row weights, in numpy."""
    x, w, s = (np.asarray(t, np.float64) for t in (x, w, s))
    xs, ws = x / s, w * s
    bx = 2 ** (input_bits - 1) - 1
    sx = np.float32(np.abs(xs).max()) / np.float32(bx)
    xq = np.clip(np.round(xs.astype(np.float32) / sx), -bx - 1, bx) * sx
    bw = 2 ** (weight_bits - 1) - 1
    sw = (np.abs(ws).max(axis=1, keepdims=True).astype(np.float32)) / np.float32(bw)
    wq = np.clip(np.round(ws.astype(np.float32) / sw), -bw - 1, bw) * sw
    ref = x @ w.T
    return float(((xq.astype(np.float64) @ wq.astype(np.float64).T - ref) ** 2).sum() / (ref**2).sum())


def test_relative_error_is_the_layer_outputs_error_with_both_operands_quantized():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    x[:, 3] *= 40  # an outlier channel
    w = torch.randn(8, 16, generator=g)
    s = torch.rand(16, generator=g) + 0.5
    act = QuantDescriptor(num_bits=8)
    wgt = QuantDescriptor(num_bits=8, axis=0)
    for scale in (torch.ones(16), s):
        got = relative_error(x, [w], scale, act, [wgt])
        assert got == pytest.approx(_np_error(x.numpy(), w.numpy(), scale.numpy()), rel=1e-6)
    # 7-bit weights (the grid of a CPU without VNNI) are taken from the descriptor
    got7 = relative_error(x, [w], s, act, [QuantDescriptor(num_bits=7, axis=0)])
    assert got7 == pytest.approx(_np_error(x.numpy(), w.numpy(), s.numpy(), weight_bits=7), rel=1e-6)


def test_only_the_layer_whose_input_has_an_outlier_channel_is_smoothed():
    from quantcli.calibration.smoothquant import smooth_quant
    from quantcli.nn import quantize_model

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=g)
    x[:, 5] *= 60  # fc1's input channel 5: an outlier; fc2's input has none
    model = quantize_model(Net().eval(), {"preset": "int8", "cpu": "x86-vnni"}, example={"x": x[:8]})
    report = smooth_quant(model, [{"x": x[:128]}, {"x": x[128:]}], 0.5, device="cpu")
    assert [g.consumers for g in report.groups] == [["fc1"]]
    assert list(report.skipped) == ["fc2"] and "no outlier channels" in report.skipped["fc2"]
    assert report.to_dict()["min_gain"] == MIN_GAIN


def test_the_digits_sample_is_left_unsmoothed_and_its_graph_keeps_every_integer_kernel(tmp_path):
    """Both Linear layers of digits_cnn gain under 2x (1.2-1.3x): neither is smoothed, so the graph is the
    plain one (no Mul: conv2 keeps its QLinearConv). With --smoothquant-min-gain 0 fc1 and fc2 are smoothed as
    before."""
    from exporters.onnxruntime.fusion import optimized_graph

    def graph_ops(*args):
        ck, graph = tmp_path / "d.calib.pt", tmp_path / "d.onnx"
        r = cli("calibrate", "digits_cnn", "--cpu", "x86-vnni", "--out", ck, "--json", *args)
        assert r.exit_code == 0, r.output
        assert cli("export", ck, "--onnx", graph).exit_code == 0
        return json.loads(r.stdout).get("smoothquant"), [n.op_type for n in optimized_graph(graph).graph.node]

    info, ops = graph_ops("--smoothquant", "0.5")
    assert info["groups"] == [] and sorted(info["skipped"]) == ["fc1", "fc2"]
    assert all("would not lower its quantization error by 2x" in why for why in info["skipped"].values())
    _, plain = graph_ops()
    assert "Mul" not in ops and ops == plain and "QLinearConv" in ops
    ck = tmp_path / "d.calib.pt"
    r = cli(
        "calibrate",
        "digits_cnn",
        "--smoothquant",
        "0.5",
        "--smoothquant-min-gain",
        "0",
        "--out",
        ck,
        "--json",
    )
    assert r.exit_code == 0, r.output
    assert [g["consumers"] for g in json.loads(r.stdout)["smoothquant"]["groups"]] == [["fc1"], ["fc2"]]


def test_min_gain_needs_smoothquant_and_a_number_at_least_0(tmp_path):
    from tests.helpers import assert_clean_error

    out = tmp_path / "x.calib.pt"
    assert_clean_error(
        cli("calibrate", "digits_cnn", "--smoothquant-min-gain", "2", "--out", out), "--smoothquant"
    )
    assert_clean_error(
        cli("calibrate", "digits_cnn", "--smoothquant", "0.5", "--smoothquant-min-gain=-1", "--out", out),
        ">= 0",
    )
    assert not out.exists()
