"""Half-precision checkpoints (issue 35, item 8): ``torch.save(model.half())`` calibrated with float32 data
(was torch's "Input type (torch.FloatTensor) and weight type (torch.HalfTensor) should be the same") and with
float16 data (was: calibrate exit 0, then export failed in ONNX shape inference, "QuantizeLinear ...
unsupported type: tensor(float16)"). The model is widened to float32, which the summary says."""

import json

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from quantcli.inputs.precision import converted_dtype, loaded_dtype, to_float32
from tests import user_models
from tests.helpers import cli

HALF = user_models.module("half_precision")


@pytest.fixture(scope="module")
def pickled(tmp_path_factory):
    root = tmp_path_factory.mktemp("half")
    calib, held = user_models.write_data("half_precision", root)
    with np.load(calib) as z:
        np.savez(root / "calib16.npz", input=z["input"].astype(np.float16))
    path = root / "model_fp16.pt"
    torch.save(HALF.make(), path)  # the whole module, in float16
    return path, {"float32": calib, "float16": root / "calib16.npz"}, held


@pytest.mark.parametrize("data", ["float32", "float16"])
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_half_precision_whole_module_calibrates_exports_and_verifies(pickled, data, exporter, tmp_path):
    path, calib, held = pickled
    ck, graph = tmp_path / "c.calib.pt", tmp_path / "m.onnx"
    r = cli("calibrate", path, "--trust-pickle", "--data", calib[data], "--out", ck, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["precision"].startswith("float16 weights, calibrated and exported in float32")
    assert len(info["layers"]["quantized"]) == 3
    r = cli("export", ck, "--onnx", graph, "--exporter", exporter, "--trust-code")
    assert r.exit_code == 0, r.output
    (x,) = onnx.load(graph).graph.input
    assert x.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    r = cli("verify", graph, "--reference", ck, "--data", held, "--trust-code")
    assert r.exit_code == 0, r.output
    with np.load(held) as z:
        batch = {"input": z["input"]}
    got = user_models.onnx_outputs(graph, batch)[0]
    with torch.inference_mode():  # the half model itself, in float16 (independent of quantcli's widening)
        want = HALF.make()(torch.from_numpy(batch["input"]).half()).float().numpy()
    assert user_models.cosine(got, want) > 0.99


def test_a_float64_model_calibrates_exports_and_verifies(pickled, tmp_path):
    """``torch.save(model.double())`` with float64 data stopped calibrate in the first forward ("mat1 and mat2
    must have the same dtype"): the data is read as float32, the model is now too."""
    _, calib, held = pickled
    path, ck, graph = tmp_path / "model_fp64.pt", tmp_path / "c.calib.pt", tmp_path / "m.onnx"
    torch.save(HALF.float_model().double().eval(), path)
    with np.load(calib["float32"]) as z:
        np.savez(tmp_path / "calib64.npz", input=z["input"].astype(np.float64))
    r = cli("calibrate", path, "--trust-pickle", "--data", tmp_path / "calib64.npz", "--out", ck, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["precision"].startswith("float64 weights, calibrated and exported in float32")
    assert cli("export", ck, "--onnx", graph, "--trust-code").exit_code == 0
    r = cli("verify", graph, "--reference", ck, "--data", held, "--trust-code")
    assert r.exit_code == 0, r.output
    with np.load(held) as z:
        batch = {"input": z["input"]}
    got = user_models.onnx_outputs(graph, batch)[0]
    with torch.inference_mode():  # the float64 model itself, on float64 inputs
        want = torch.load(path, weights_only=False)(torch.from_numpy(batch["input"]).double()).numpy()
    assert user_models.cosine(got, want) > 0.99


def test_float64_models_are_narrowed_and_say_so():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)).double()
    before = [p.detach().clone() for p in model.parameters()]
    assert to_float32(model) is model and loaded_dtype(model) == "float64"
    assert all(torch.equal(p, b.float()) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_models_are_widened_and_say_so(dtype):
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)).to(dtype)
    before = [p.detach().clone() for p in model.parameters()]
    assert converted_dtype(model) == dtype
    assert to_float32(model) is model and loaded_dtype(model) == str(dtype).split(".")[1]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(p.to(dtype), b) for p, b in zip(model.parameters(), before))  # exact


def test_float32_and_mixed_models_are_left_as_they_are():
    mixed = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2).half())
    for model in (nn.Linear(3, 4), mixed):
        dtypes = [p.dtype for p in model.parameters()]
        assert to_float32(model) is model and loaded_dtype(model) is None
        assert [p.dtype for p in model.parameters()] == dtypes
