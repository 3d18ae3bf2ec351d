"""verify's float reference is the model as loaded, before quantcli transforms it (BatchNorm folding,
SmoothQuant, placement rewrites): a transformation that changes what the model computes fails
``reference.transformations`` instead of hiding behind a PASS (issue 23: BatchNorm folding deleted timm's
BatchNormAct2d activations, and verify, comparing with the same folded model, passed a graph at cosine -0.001
to the user's model)."""

import json

import numpy as np
import pytest
import torch
from torch import nn

from quantcli.inputs.checkpoint import load_calibrated
from tests.helpers import cli
from tests.test_verify_inplace import INPLACE


@pytest.fixture
def user_model(tmp_path):
    (tmp_path / "net.py").write_text(INPLACE)
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).standard_normal((32, 3, 8, 8)).astype(np.float32))
    return f"{tmp_path / 'net.py'}:make", tmp_path / "d.npz"


def _pipeline(spec, data, root):
    ck, graph = root / "m.calib.pt", root / "m.onnx"
    assert cli("calibrate", spec, "--data", data, "--out", ck).exit_code == 0
    assert cli("export", ck, "--onnx", graph).exit_code == 0
    r = cli("verify", graph, "--reference", ck, "--data", data, "--json")
    return r.exit_code, json.loads(r.stdout), ck


def test_a_transformation_that_changes_an_activation_fails_verify(user_model, tmp_path, monkeypatch):
    """A rewrite that replaces ``act`` (a ReLU) by a Softplus after placement, in calibrate and in every later
    load alike (a non-negative activation, so the placement's uint8 grid still holds): the graph, the
    fake-quant model and the transformed float model all agree; only the model as loaded differs."""
    from quantcli.calibration import job
    from quantcli.inputs import checkpoint
    from quantcli.nn.replace import quantize_model

    def wrong_rewrite(model, *args, **kwargs):
        out = quantize_model(model, *args, **kwargs)
        model.act = nn.Softplus()
        return out

    monkeypatch.setattr(job, "quantize_model", wrong_rewrite)
    monkeypatch.setattr(checkpoint, "quantize_model", wrong_rewrite)
    code, rep, _ = _pipeline(*user_model, tmp_path)
    check = next(c for c in rep["checks"] if c["name"] == "reference.transformations")
    assert code == 1 and not check["passed"] and check["value"] > 0.1, check
    assert rep["reference"]["float_model"] == "as loaded"
    # the check names where the float model changed: the first module whose output differs (issue 35)
    assert "first module that differs: act (its output moved by relative RMS" in check["detail"], check
    assert rep["reference"]["first_difference"]["module"] == "act"
    # every other check compares the graph with the fake-quant model, which carries the same rewrite: it
    # passes
    assert all(c["passed"] for c in rep["checks"] if c["name"].startswith("fidelity"))


def test_correct_transformations_pass_and_the_reference_is_the_model_as_loaded(user_model, tmp_path):
    spec, data = user_model
    code, rep, ck = _pipeline(spec, data, tmp_path)
    check = next(c for c in rep["checks"] if c["name"] == "reference.transformations")
    assert code == 0 and check["passed"] and check["value"] < 1e-5, check
    loaded = load_calibrated(ck)
    assert loaded.has_original
    fmodel = loaded.float_model()
    # the user's model, no quantcli modules
    assert not any("quantizer" in n for n, _ in fmodel.named_modules())
    from quantcli.inputs.loading import build_model

    x = torch.from_numpy(np.load(data)["x"][:4])
    with torch.inference_mode():
        assert torch.equal(fmodel(x), build_model(loaded.spec)(x))  # bit for bit the factory's model


def test_a_checkpoint_without_the_model_as_loaded_verifies_against_the_transformed_one(user_model, tmp_path):
    spec, data = user_model
    _, _, ck = _pipeline(spec, data, tmp_path)
    stored = torch.load(ck, weights_only=True)
    del stored["original"]
    torch.save(stored, ck)
    r = cli("verify", tmp_path / "m.onnx", "--reference", ck, "--data", data, "--json")
    rep = json.loads(r.stdout)
    assert r.exit_code == 0 and rep["reference"]["float_model"].startswith("as transformed")
    assert "reference.transformations" not in {c["name"] for c in rep["checks"]}
