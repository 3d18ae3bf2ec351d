"""A calibrated checkpoint does not run the code it carries without --trust-code (issue 16)."""

import hashlib
import json
import shutil

import numpy as np
import pytest

from quantcli import load_calibrated
from quantcli.errors import UntrustedCodeError
from tests.helpers import assert_clean_error, cli, cli_subprocess

# the factory module writes a marker file when it is executed (at import), wherever it runs from
FACTORY = """
import os
import torch
from torch import nn

open(os.environ["QUANTCLI_TEST_MARKER"], "a").write("ran\\n")

def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
"""


@pytest.fixture
def stored_source_checkpoint(tmp_path, monkeypatch):
    marker = tmp_path / "marker.txt"
    monkeypatch.setenv("QUANTCLI_TEST_MARKER", str(marker))
    work = tmp_path / "work"
    work.mkdir()
    fac = work / "fac.py"
    fac.write_text(FACTORY)
    np.savez(tmp_path / "x.npz", input=np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32))
    ck = work / "c.calib.pt"
    r = cli("calibrate", f"{fac}:build", "--data", tmp_path / "x.npz", "--out", ck, "--json")
    assert r.exit_code == 0, r.output
    assert marker.read_text() == "ran\n"  # calibration imported the factory file the user named
    marker.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(ck, elsewhere / "c.calib.pt")
    shutil.rmtree(work)  # the factory file is gone; its source lives on in the checkpoint
    return elsewhere / "c.calib.pt", marker, hashlib.sha256(FACTORY.encode()).hexdigest()


def test_stored_source_needs_trust_code(stored_source_checkpoint, tmp_path):
    ck, marker, digest = stored_source_checkpoint
    onnx = tmp_path / "m.onnx"
    r = cli("export", ck, "--onnx", onnx)
    assert_clean_error(r, "--trust-code", "fac.py", digest, "nothing was executed")
    assert not marker.exists() and not onnx.exists()
    r = cli("verify", tmp_path / "any.onnx", "--reference", ck)
    assert_clean_error(r, "--trust-code", digest)
    assert not marker.exists()
    with pytest.raises(UntrustedCodeError):
        load_calibrated(ck)
    assert not marker.exists()
    # inspect reads the checkpoint as data: it runs nothing and says what export would need
    r = cli("inspect", ck, "--json")
    assert r.exit_code == 0, r.output
    code = json.loads(r.stdout)["model_code"]
    assert code["needs_trust_code"] and code["sha256"] == digest and code["file"].endswith("fac.py")
    assert json.loads(r.stdout)["model_loads"] is None
    assert not marker.exists()
    # inspect --trust-code rebuilds the model from the stored source (in a fresh process, so the code runs)
    r = cli_subprocess(
        "inspect", ck, "--trust-code", "--json", cwd=tmp_path, env={"QUANTCLI_TEST_MARKER": str(marker)}
    )
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert marker.read_text() == "ran\n"
    marker.unlink()
    assert rep["model_loads"]["quantizers"] == len(rep["quantizers"]) > 0
    assert rep["model_loads"]["parameters"] == (4 * 8 + 8) + (8 * 2 + 2)  # the factory's two Linear layers

    # a fresh process, as a user runs it (this one still holds the module calibration imported from disk)
    r = cli_subprocess(
        "export",
        ck,
        "--onnx",
        onnx,
        "--trust-code",
        "--json",
        cwd=tmp_path,
        env={"QUANTCLI_TEST_MARKER": str(marker)},
    )
    assert r.returncode == 0, r.stderr
    assert onnx.is_file() and marker.read_text() == "ran\n"
    r = cli("verify", onnx, "--reference", ck, "--trust-code", "--json")
    assert r.exit_code == 0, r.output


def test_changed_factory_file_needs_trust_code(tmp_path, monkeypatch):
    marker = tmp_path / "marker.txt"
    monkeypatch.setenv("QUANTCLI_TEST_MARKER", str(marker))
    fac = tmp_path / "fac2.py"
    source = FACTORY + f"# {tmp_path}\n"  # a source no earlier test imported into this process
    fac.write_text(source)
    np.savez(tmp_path / "x.npz", input=np.ones((4, 4), np.float32))
    ck = tmp_path / "c.calib.pt"
    assert cli("calibrate", f"{fac}:build", "--data", tmp_path / "x.npz", "--out", ck).exit_code == 0
    marker.unlink()
    # present and unchanged: runs as today, no flag needed
    assert cli("export", ck, "--onnx", tmp_path / "a.onnx").exit_code == 0
    fac.write_text(source + "# edited\n")
    assert_clean_error(cli("export", ck, "--onnx", tmp_path / "b.onnx"), "changed on disk", "--trust-code")
    assert not marker.exists() and not (tmp_path / "b.onnx").exists()


def test_installed_module_and_samples_need_no_flag(calibrated, tmp_path):
    np.savez(tmp_path / "x.npz", x=np.random.default_rng(0).random((8, 1, 8, 8), dtype=np.float32))
    ck = tmp_path / "m.calib.pt"
    assert (
        cli(
            "calibrate", "sample_models.digits_cnn:build", "--data", tmp_path / "x.npz", "--out", ck
        ).exit_code
        == 0
    )
    assert cli("export", ck, "--onnx", tmp_path / "m.onnx").exit_code == 0
    assert cli("export", calibrated("digits_cnn"), "--onnx", tmp_path / "d.onnx").exit_code == 0
