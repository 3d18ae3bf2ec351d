"""verify on a model that changes tensors in place, as torchvision's and Hugging Face's ResNets do (``out +=
identity``, ``ReLU(inplace=True)``): the replay hands the model onnxruntime's DequantizeLinear outputs and
keeps the quantizers' outputs, and the model's in-place ops must change neither (issue 23: ``fidelity.codes``
0.0016 at ``layer1.0.conv2.output_quantizer`` of a correct torchvision resnet18 export)."""

import json

import numpy as np
import pytest
import torch

from tests.helpers import cli

INPLACE = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        out = self.relu(self.conv1(x))
        out = self.conv2(out)
        out += x  # changes conv2's output quantizer's output in place
        return self.relu(out)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.ReLU(inplace=True)  # changes stem's output quantizer's output in place
        self.block = Block(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        y = self.block(self.act(self.stem(x)))
        # a sum, not a global pooling: the Add's output then reaches a float op, so stem keeps its output
        # quantizer (a mean would let the Add run as QLinearAdd, its skip quantized instead)
        return self.head(y.sum((2, 3)))


def make():
    torch.manual_seed(0)
    return Net().eval()
"""
IN_PLACE_TARGETS = ["stem.output_quantizer", "block.conv2.output_quantizer"]


@pytest.fixture(scope="module")
def inplace(tmp_path_factory):
    root = tmp_path_factory.mktemp("inplace")
    (root / "inplace.py").write_text(INPLACE)
    np.savez(root / "d.npz", x=np.random.default_rng(0).standard_normal((32, 3, 8, 8)).astype(np.float32))
    ck, graph = root / "m.calib.pt", root / "m.onnx"
    assert (
        cli("calibrate", f"{root / 'inplace.py'}:make", "--data", root / "d.npz", "--out", ck).exit_code == 0
    )
    assert cli("export", ck, "--onnx", graph).exit_code == 0
    return root, ck, graph


def test_in_place_ops_do_not_change_the_evidence(inplace):
    root, ck, graph = inplace
    r = cli("verify", graph, "--reference", ck, "--data", root / "d.npz", "--json")
    rep = json.loads(r.stdout)
    quantizers = rep["fidelity"]["quantizers"]
    # the placement quantizes both outputs that change in place
    assert set(IN_PLACE_TARGETS) <= set(quantizers)
    for name in IN_PLACE_TARGETS:  # before the fix: 0.52 and 0.33, onnxruntime's evidence overwritten
        assert quantizers[name]["identical_codes"] == 1.0, (name, quantizers[name])
        assert quantizers[name]["identical_codes_end_to_end"] == 1.0, (name, quantizers[name])
    assert r.exit_code == 0, [c for c in rep["checks"] if not c["passed"]]


def test_captured_quantizer_outputs_are_the_quantizers_own(inplace):
    """``capture`` keeps what the quantizer returned, on its grid, not what ``out += x`` made of it later."""
    from quantcli.inputs.checkpoint import load_calibrated
    from quantcli.nn import quantizers
    from quantcli.verify.replay import capture

    _, ck, _ = inplace
    model = load_calibrated(ck).model
    q = quantizers(model)["block.conv2.output_quantizer"]
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((4, 3, 8, 8)).astype(np.float32))
    with torch.inference_mode(), capture(model, ["block.conv2.output_quantizer"]) as seen:
        model(x)
    # the grid's step: amax / 127 (symmetric), (max - min) / 255 (asymmetric, the onnxruntime target's default
    # for a signed Conv output); a value on the grid is a whole number of steps from 0 either way
    step = (float(q.amax) - float(q.amin)) / 255 if q.desc.asymmetric else float(q.amax) / 127
    codes = seen["block.conv2.output_quantizer"][0] / step
    assert np.abs(codes - np.round(codes)).max() < 1e-3  # on the grid: nothing added after the quantizer


def test_a_node_failing_at_run_time_is_the_graphs_fault_not_bad_input():
    """onnxruntime refusing the inputs is bad input (exit 2); a node of a graph that loaded failing on them is
    a failed check (``graph.runs``, exit 1): the mutation campaign's deleted Adds made ViT's Reshape fail."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from quantcli.errors import GraphRunError, VerifyError
    from quantcli.verify import sessions

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    shape = onnx.numpy_helper.from_array(np.array([3, -1], np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"], name="r")], "g", [x], [y], [shape]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert sessions.run(sess, {"x": np.zeros((3, 4), np.float32)}, "b")[0].shape == (3, 4)
    with pytest.raises(GraphRunError, match="Reshape"):  # 2 x 4 values do not make 3 rows
        sessions.run(sess, {"x": np.zeros((2, 4), np.float32)}, "b")
    with pytest.raises(VerifyError) as refused:  # the wrong rank: refused before any node runs
        sessions.run(sess, {"x": np.zeros((2, 4, 1), np.float32)}, "b")
    assert not isinstance(refused.value, GraphRunError)


INPUT_CHANGED = """
import torch
from torch import nn


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        x /= 4.0  # changes its input in place
        return self.fc2(torch.relu(self.fc1(x)))


def make():
    torch.manual_seed(0)
    return Scaled()
"""


def test_a_forward_that_changes_its_input_in_place_sees_the_data_each_time(tmp_path):
    """Each forward quantcli ran on a batch divided it by 4 again: the example stored in the checkpoint was
    the data / 4**7, the float check left fc1 float for a change quantizing never made, and verify failed a
    correct graph. Now every forward takes its own copy of the batch."""
    (tmp_path / "scaled.py").write_text(INPUT_CHANGED)
    x = np.random.default_rng(2).standard_normal((64, 6)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    model, ck, graph = f"{tmp_path / 'scaled.py'}:make", tmp_path / "s.calib.pt", tmp_path / "s.onnx"
    r = cli("calibrate", model, "--data", tmp_path / "x.npy", "--placement", "all", "--out", ck)
    assert r.exit_code == 0, r.output
    assert "float check" not in r.stderr
    example = torch.load(ck, weights_only=True)["inputs"]["example"]["x"]
    np.testing.assert_array_equal(example.numpy(), x[: example.shape[0]])
    assert cli("export", ck, "--onnx", graph).exit_code == 0
    r = cli("verify", graph, "--reference", ck, "--data", tmp_path / "x.npy")
    assert r.exit_code == 0, r.output
