"""A quality target (``--min-cosine``) must not cost the layers around a float layer their integer kernels.

onnxruntime fuses a Gemm into ``QGemm`` only up to a QuantizeLinear on its output; that Q is the next layer's
input quantizer. Keeping the next layer float by switching off its input quantizer left the layer before
running in float between its Q/DQ, its weights dequantized on every run: on a user's outlier MLP the graph was
1.9x onnxruntime's own ``quantize_static`` and slower than float, with no word from calibrate. The target
search's step 6 (``quantcli.calibration.mixed_precision``) keeps the float layer's input quantizer where the
target stays met (and onnxruntime does not then quantize the float layer itself), and otherwise runs the layer
before in float as well.

The expected layers come from the models' construction (which quantizer is the sensitive one), the fused
kernels from onnxruntime's own optimized graph, and the quality from the exported graph run in onnxruntime
against the float model.
"""

import collections
import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from exporters.onnxruntime.fusion import optimized_graph
from tests.helpers import cli, load_module

SOURCE = '''
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 64), nn.Linear(64, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def input_outlier():
    """fc1's unit 0 is always about 60 after its ReLU: fc2's input range is 60 wide and its other inputs
    (0-2) get a few codes each. fc2 must be float with its input float."""
    torch.manual_seed(0)
    m = MLP().eval()
    with torch.no_grad():
        m.fc1.bias[0] = 60.0
        m.fc2.weight[:, 0] *= 0.01
    return m


def weight_outlier():
    """fc3's weight has one entry far beyond the others (reading fc2's unit 0, always 0): on a per-tensor
    grid its other weights get a few codes each. fc3's weights must be float; its input can stay quantized."""
    torch.manual_seed(0)
    m = MLP().eval()
    with torch.no_grad():
        m.fc2.bias[0] = -50.0
        m.fc3.weight[0, 0] = 20.0
    return m
'''

TARGET = 0.9995


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("target_fusion")
    (d / "mlp.py").write_text(SOURCE)
    (d / "per_tensor_fc3.yaml").write_text(
        'preset: int8\ncpu: x86-vnni\nrules:\n  - pattern: "fc3.weight_quantizer"\n    axis: null\n'
    )
    (d / "vnni.yaml").write_text("preset: int8\ncpu: x86-vnni\n")
    g = np.random.default_rng(0)
    np.savez(d / "calib.npz", x=g.standard_normal((128, 16)).astype(np.float32))
    np.savez(d / "hold.npz", x=g.standard_normal((128, 16)).astype(np.float32))
    return d


def _calibrate_and_export(d, factory: str, config: str):
    ck, graph = d / f"{factory}.calib.pt", d / f"{factory}.onnx"
    r = cli(
        "calibrate",
        f"{d / 'mlp.py'}:{factory}",
        "--config",
        d / config,
        "--data",
        d / "calib.npz",
        "--holdout",
        d / "hold.npz",
        "--min-cosine",
        str(TARGET),
        "--placement",
        "all",
        "--out",
        ck,
        "--json",
    )
    assert r.exit_code == 0, r.output
    mixed = json.loads(r.stdout)["mixed_precision"]
    r = cli("export", ck, "--onnx", graph)
    assert r.exit_code == 0, r.output
    return mixed, graph


def _gemms(graph) -> dict[str, str]:
    """What onnxruntime runs each Gemm as, by the weight's module (from the node's name)."""
    out = {}
    for n in optimized_graph(graph).graph.node:
        if n.op_type in ("QGemm", "Gemm", "FusedGemm", "MatMulIntegerToFloat", "DynamicQuantizeMatMul"):
            layer = next((f"fc{i}" for i in (1, 2, 3) if f"fc{i}" in n.name), n.name)
            out[layer] = n.op_type
    return out


def _deployed_cosine(d, factory: str, graph) -> float:
    model = getattr(load_module(d / "mlp.py", f"mlp_{factory}"), factory)()
    x = np.load(d / "hold.npz")["x"]
    with torch.inference_mode():
        want = model(torch.from_numpy(x)).double().numpy().reshape(-1)
    sess = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": x})[0].astype(np.float64).reshape(-1)
    return float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))


def test_a_float_layer_whose_input_is_the_sensitive_part_takes_the_layer_before_with_it(files):
    mixed, graph = _calibrate_and_export(files, "input_outlier", "vnni.yaml")
    assert mixed["met"] and mixed["kept_float"] == ["fc2"]
    # fc2's input quantizer cannot stay (it is what misses the target), so fc1 loses its output Q: it runs
    # float, weights and all, rather than float between Q/DQ with its weights dequantized on every run
    assert mixed["inputs_kept"] == [] and mixed["float_too"] == ["fc1"] and mixed["unfused"] == []
    assert set(mixed["quantizers_disabled"]) == {
        f"fc{i}.{r}_quantizer" for i in (1, 2) for r in ("input", "weight")
    }
    kernels = _gemms(graph)
    assert kernels["fc3"] == "QGemm" and kernels["fc1"] in ("Gemm", "FusedGemm"), kernels
    ops = collections.Counter(n.op_type for n in optimized_graph(graph).graph.node)
    assert ops["DequantizeLinear"] == 0, ops  # no weight dequantized at run time, no Q/DQ serving nothing
    assert _deployed_cosine(files, "input_outlier", graph) >= TARGET


def test_a_float_layer_keeps_its_input_quantizer_when_the_target_allows_and_the_layer_before_fuses(files):
    mixed, graph = _calibrate_and_export(files, "weight_outlier", "per_tensor_fc3.yaml")
    assert mixed["met"] and mixed["kept_float"] == ["fc3"]
    # fc3's weights are what miss the target: its input Q stays, and it is fc2's output Q
    assert mixed["inputs_kept"] == ["fc3"] and mixed["float_too"] == [] and mixed["unfused"] == []
    assert mixed["quantizers_disabled"] == ["fc3.weight_quantizer"]
    kernels = _gemms(graph)
    assert kernels["fc1"] == kernels["fc2"] == "QGemm", kernels
    assert kernels["fc3"] in ("Gemm", "FusedGemm"), kernels  # float, not quantized by onnxruntime itself
    assert _deployed_cosine(files, "weight_outlier", graph) >= TARGET
