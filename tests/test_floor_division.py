"""Python's ``//`` exported by the TorchScript exporter floors, as torch computes it.

torch's translation of ``aten::floor_divide`` truncates toward zero, so ``-(-size // stride)`` (TensorFlow's
"same" padding, as many ``Conv2d`` subclasses write ``ceil``) came out as ``floor``: a stride-2 layer on a
15x15 input lost its padding, export reported success, and verify failed the graph (cosine 0.86). The
expected values are torch's own eager results on the same inputs.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from exporters import aten_symbolics
from tests.helpers import cli


class FloorDivisions(nn.Module):
    """``//`` on a traced size, on an int tensor by a scalar and by a negative tensor, and on floats."""

    def forward(self, x):
        size = x.shape[-1]
        pad = (-(-size // 2) - 1) * 2 + 3 - size  # "same" padding of a 3-wide, stride-2 window
        ints = torch.arange(-9, 10)
        return (
            F.pad(x, [pad // 2, pad - pad // 2]) // 0.75,
            ints // 4,
            ints // torch.tensor(-3),
            torch.floor_divide(x, -0.5),
        )


@pytest.mark.parametrize("opset", [11, 13, 17])
def test_floor_division_is_exported_rounding_down(tmp_path, opset):
    aten_symbolics.register()
    model, x = FloorDivisions(), torch.randn(2, 3, 15)
    path = tmp_path / "floor.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=False, input_names=["x"], opset_version=opset)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})
    with torch.no_grad():
        want = [t.numpy() for t in model(x)]
    assert want[0].shape == (2, 3, 17)  # ceil(15 / 2) = 8 windows need 2 pixels of padding
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_array_equal(g, w)


# a Conv2d subclass with weight standardisation and reflect "same" padding written with floor division, as the
# explorers' model has it
SAME_BY_FLOOR_DIVISION = """
import torch
import torch.nn.functional as F
from torch import nn


class SameConv(nn.Conv2d):
    def forward(self, x):
        ih, iw = x.shape[-2:]
        s, k = self.stride[0], self.kernel_size[0]
        ph = max((-(-ih // s) - 1) * s + k - ih, 0)
        pw = max((-(-iw // s) - 1) * s + k - iw, 0)
        x = F.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2], mode="reflect")
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = SameConv(3, 8, 3, stride=2)
        self.c2 = SameConv(8, 16, 3, stride=2)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.c2(F.relu(self.c1(x))))
        return self.fc(x.mean((2, 3)))


def make():
    torch.manual_seed(0)
    return Net().eval()
"""


def _padded_shapes(path, x: np.ndarray) -> list[tuple[int, ...]]:
    """The shapes the graph's Pad nodes produce on ``x`` (the pads are computed in the graph, from sizes)."""
    model = onnx.load(str(path))
    pads = [n.output[0] for n in model.graph.node if n.op_type == "Pad"]
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in pads)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [y.shape for y in session.run(pads, {"x": x})]


def test_same_padding_by_floor_division_survives_the_torchscript_export(tmp_path):
    (tmp_path / "net.py").write_text(SAME_BY_FLOOR_DIVISION)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((32, 3, 15, 15)).astype(np.float32))
    np.savez(tmp_path / "held.npz", x=rng.standard_normal((16, 3, 15, 15)).astype(np.float32))
    ck, graph = tmp_path / "net.calib.pt", tmp_path / "net.onnx"
    r = cli("calibrate", f"{tmp_path / 'net.py'}:make", "--data", tmp_path / "calib.npz", "--out", ck)
    assert r.exit_code == 0, r.output
    r = cli("export", ck, "--onnx", graph, "--exporter", "torchscript")
    assert r.exit_code == 0, r.output
    # 15x15 stride 2: 1 pixel each side (was none); then 8x8 stride 2: 1 after (was none)
    assert _padded_shapes(graph, np.load(tmp_path / "held.npz")["x"][:1]) == [(1, 3, 17, 17), (1, 8, 9, 9)]
    r = cli("verify", graph, "--reference", ck, "--data", tmp_path / "held.npz")
    assert r.exit_code == 0, r.output


def test_export_warns_when_its_graph_computes_something_else(tmp_path):
    """With torch's own truncating translation back for one export, the graph loses its padding: export
    itself now says so (it said success), measured in verify's unit on the example batch."""
    import json

    (tmp_path / "net.py").write_text(SAME_BY_FLOOR_DIVISION)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((32, 3, 15, 15)).astype(np.float32))
    ck = tmp_path / "net.calib.pt"
    assert (
        cli(
            "calibrate", f"{tmp_path / 'net.py'}:make", "--data", tmp_path / "calib.npz", "--out", ck
        ).exit_code
        == 0
    )
    r = cli("export", ck, "--onnx", tmp_path / "right.onnx", "--json")
    assert r.exit_code == 0 and "warning" not in r.stderr, r.output
    right = json.loads(r.stdout)["graph_agreement"]
    assert right["passed"] and max(right["outputs"].values()) < 0.1
    aten_symbolics.register()
    torch.onnx.unregister_custom_op_symbolic("aten::floor_divide", aten_symbolics.MIN_OPSET)
    try:
        r = cli("export", ck, "--onnx", tmp_path / "wrong.onnx", "--json")
    finally:
        torch.onnx.register_custom_op_symbolic(
            "aten::floor_divide", aten_symbolics.CORRECTED["aten::floor_divide"], aten_symbolics.MIN_OPSET
        )
    assert r.exit_code == 0, r.output
    wrong = json.loads(r.stdout)["graph_agreement"]
    assert not wrong["passed"] and max(wrong["outputs"].values()) > 10
    assert "warning: the graph does not compute what the model does" in r.stderr
