"""`quantcli verify`: verdicts, reports, tampered graphs, per-layer ranking, bad input."""

import json
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from exporters.graph import qdq_pairs
from tests.helpers import assert_clean_error, cli

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("config", ["int8", "int8-per-tensor", "uint8-asymmetric", "fp8", "int4-weight-only"])
def test_passes_for_every_format(config, calibrated, exported):
    r = cli("verify", exported("digits_cnn", config), "--reference", calibrated("digits_cnn", config), "--json",
            "--min-cosine", "0.99")
    rep = json.loads(r.stdout)
    assert r.exit_code == 0, rep["checks"]
    assert rep["passed"] and rep["structure"]["passed"]
    assert rep["num_samples"] == 597  # the held-out set, not the calibration set
    assert rep["quality"]["outputs"]["output_0"]["top1_agreement"] > 0.97
    names = [c["name"] for c in rep["checks"]]
    assert names == ["fidelity.max_abs_diff", "fidelity.codes", "quality.min_cosine"]


def test_text_encoder_passes_with_deployment_reported(calibrated, exported, tmp_path):
    report = tmp_path / "r.json"
    r = cli("verify", exported("text_encoder", "int8"), "--reference", calibrated("text_encoder", "int8"),
            "--report", report, "--min-snr", "20")
    assert r.exit_code == 0, r.output
    rep = json.loads(report.read_text())
    assert set(rep) >= {"passed", "checks", "structure", "fidelity", "quality", "deployment", "layers", "provider"}
    assert rep["deployment"]["graph_optimization"] == "ORT_ENABLE_ALL"
    assert rep["deployment"]["outputs"]["output_0"]["max_abs_diff"] >= 0
    assert rep["provider"] == "CPUExecutionProvider" or torch.cuda.is_available()
    assert "PASS" in r.output


def test_threshold_failure_is_exit_1(calibrated, exported):
    r = cli("verify", exported("digits_cnn"), "--reference", calibrated("digits_cnn"), "--min-snr", "90", "--json")
    assert r.exit_code == 1
    rep = json.loads(r.stdout)
    snr = next(c for c in rep["checks"] if c["name"] == "quality.min_snr_db")
    assert not snr["passed"] and snr["threshold"] == 90 and snr["value"] < 90
    r = cli("verify", exported("digits_cnn"), "--reference", calibrated("digits_cnn"), "--max-abs-diff", "0")
    assert r.exit_code in (0, 1)  # exact 0 only if onnxruntime and PyTorch accumulate identically
    assert "fidelity.max_abs_diff" in r.output


def _tampered(src: Path, dst: Path, edit) -> Path:
    m = onnx.load(str(src))
    edit(m)
    onnx.save(m, str(dst))
    return dst


def _pair(m, quantizer):
    return next(p for p in qdq_pairs(m) if p.quantizer == quantizer)


def test_scale_off_by_one_ulp_fails_and_names_layer(calibrated, exported, tmp_path):
    def edit(m):
        p = _pair(m, "conv2.input_quantizer")
        t = next(t for t in m.graph.initializer if t.name == next(n for n in m.graph.node if n.name == p.dq_node).input[1])
        v = onnx.numpy_helper.to_array(t).astype(np.float32)
        t.CopyFrom(onnx.numpy_helper.from_array(np.nextafter(v, np.float32(np.inf)).astype(np.float32), t.name))

    bad = _tampered(exported("digits_cnn"), tmp_path / "ulp.onnx", edit)
    r = cli("verify", bad, "--reference", calibrated("digits_cnn"), "--json")
    assert r.exit_code == 1
    rep = json.loads(r.stdout)
    assert rep["structure"]["layers_with_problems"] == ["conv2.input_quantizer"]


def test_weight_initializer_altered_fails_and_names_layer(calibrated, exported, tmp_path):
    def edit(m):
        p = _pair(m, "fc1.weight_quantizer")
        t = next(t for t in m.graph.initializer if t.name == p.tensor)
        codes = onnx.numpy_helper.to_array(t).copy()
        codes.flat[5] = codes.flat[5] + 1 if codes.flat[5] < 127 else 126
        t.CopyFrom(onnx.numpy_helper.from_array(codes, t.name))

    bad = _tampered(exported("digits_cnn"), tmp_path / "w.onnx", edit)
    r = cli("verify", bad, "--reference", calibrated("digits_cnn"), "--json")
    assert r.exit_code == 1
    rep = json.loads(r.stdout)
    assert rep["structure"]["layers_with_problems"] == ["fc1.weight_quantizer"]
    assert "stored weight code" in rep["structure"]["problems"][0]


def test_removed_qdq_pair_fails_and_names_layer(calibrated, exported, tmp_path):
    def edit(m):
        p = _pair(m, "fc2.input_quantizer")
        for n in m.graph.node:
            for i, name in enumerate(n.input):
                if name == p.output:
                    n.input[i] = p.tensor
        keep = [n for n in m.graph.node if n.name not in (p.q_node, p.dq_node)]
        del m.graph.node[:]
        m.graph.node.extend(keep)

    bad = _tampered(exported("digits_cnn"), tmp_path / "rm.onnx", edit)
    r = cli("verify", bad, "--reference", calibrated("digits_cnn"), "--json")
    assert r.exit_code == 1
    rep = json.loads(r.stdout)
    assert "fc2.input_quantizer: Q/DQ pair missing from the graph" in rep["structure"]["problems"]


def test_per_layer_ranks_badly_calibrated_layer_first(calibrated, tmp_path):
    ck = torch.load(calibrated("digits_cnn"), weights_only=True)
    target = "fc1.input_quantizer"
    bad = ck["quantizers"][target]["amax"] * 0.01
    ck["quantizers"][target]["amax"] = bad
    ck["state_dict"][f"{target}.amax"] = bad
    torch.save(ck, tmp_path / "bad.calib.pt")
    assert cli("export", tmp_path / "bad.calib.pt", "--onnx", tmp_path / "bad.onnx").exit_code == 0
    r = cli("verify", tmp_path / "bad.onnx", "--reference", tmp_path / "bad.calib.pt", "--per-layer", "--json")
    rep = json.loads(r.stdout)
    assert rep["layers"][0]["quantizer"] == target and rep["layers"][0]["rank"] == 1
    assert rep["layers"][0]["snr_db"] < rep["layers"][1]["snr_db"]
    assert r.exit_code == 0  # a bad calibration is faithfully exported: fidelity passes, the ranking shows it


def test_bad_input(calibrated, exported, tmp_path):
    ref = calibrated("digits_cnn")
    (tmp_path / "corrupt.onnx").write_bytes(b"\x08\x07garbage")
    assert_clean_error(cli("verify", tmp_path / "corrupt.onnx", "--reference", ref), "not a valid ONNX model")
    assert_clean_error(cli("verify", exported("text_encoder"), "--reference", ref), "do not match the checkpoint")
    np.savez(tmp_path / "wrong.npz", x=np.zeros((4, 1, 9, 9), np.float32))
    assert_clean_error(cli("verify", exported("digits_cnn"), "--reference", ref, "--data", tmp_path / "wrong.npz"),
                       "has shape [4, 1, 9, 9] but the graph expects")
    np.savez(tmp_path / "ok.npz", x=np.random.default_rng(0).random((5, 1, 8, 8), dtype=np.float32))
    r = cli("verify", exported("digits_cnn"), "--reference", ref, "--data", tmp_path / "ok.npz", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["num_samples"] == 5
    if not torch.cuda.is_available():
        assert_clean_error(cli("verify", exported("digits_cnn"), "--reference", ref, "--provider", "cuda"), "CUDA")
    assert_clean_error(cli("verify", exported("digits_cnn"), "--reference", tmp_path / "nope.pt"), "does not exist")


def test_ci_example_script(tmp_path):
    script = REPO / "examples" / "ci.sh"
    r = subprocess.run(["bash", str(script), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "digits_cnn.onnx").is_file() and json.loads((tmp_path / "report.json").read_text())["passed"]
    r = subprocess.run(["bash", str(script), str(tmp_path)], capture_output=True, text=True, timeout=600,
                       env={**__import__("os").environ, "MIN_SNR": "99"})
    assert r.returncode == 1, r.stdout + r.stderr  # the job fails on a failed check


def test_auto_provider_falls_back_to_cpu_when_cuda_cannot_load(calibrated, exported, monkeypatch):
    import quantcli.verify as v

    real = v._session
    monkeypatch.setattr(v, "choose_provider", lambda p="auto": "CUDAExecutionProvider")

    def session(model, provider, optimize):
        if provider == "CUDAExecutionProvider":
            raise v.VerifyError("onnxruntime cannot load the model: libcudnn.so.9: cannot open shared object file")
        return real(model, provider, optimize)

    monkeypatch.setattr(v, "_session", session)
    rep = v.verify_onnx(exported("digits_cnn"), calibrated("digits_cnn"), provider="auto", deployment=False)
    assert rep.provider == "CPUExecutionProvider" and "libcudnn" in rep.provider_note and rep.passed
    with pytest.raises(v.VerifyError, match="libcudnn"):
        v.verify_onnx(exported("digits_cnn"), calibrated("digits_cnn"), provider="cuda", deployment=False)
