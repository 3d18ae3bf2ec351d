"""Crafted checkpoints run no code without --trust-code (issue 24, security): every case checks that a marker
file the named code would write is never written."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantcli.files import atomic_write
from tests.helpers import assert_clean_error, cli, cli_subprocess

# writes the marker at import, then builds the digits_cnn sample model (so a load that goes through would
# work)
EVIL = """
import os
open(os.environ["QUANTCLI_TEST_MARKER"], "a").write("ran\\n")

def make():
    from sample_models.digits_cnn import build
    return build()
"""


def _crafted(src: Path, dst: Path, model: dict) -> Path:
    data = torch.load(src, map_location="cpu", weights_only=True)
    data["model"] = model
    torch.save(data, dst)
    return dst


@pytest.fixture
def marker(tmp_path, monkeypatch):
    m = tmp_path / "marker.txt"
    monkeypatch.setenv("QUANTCLI_TEST_MARKER", str(m))
    return m


def test_file_spec_without_stored_source_runs_nothing(calibrated, tmp_path, marker):
    evil = tmp_path / "evil.py"
    evil.write_text(EVIL)
    ck = _crafted(
        calibrated("digits_cnn"),
        tmp_path / "c.calib.pt",
        {"kind": "file", "spec": f"{evil}:make", "path": str(evil), "source": None},
    )
    for args in (
        ("export", ck, "--onnx", tmp_path / "m.onnx"),
        ("verify", tmp_path / "m.onnx", "--reference", ck),
        ("analyze", ck, "--out", tmp_path / "a"),
        ("export", ck, "--onnx", tmp_path / "m.onnx", "--trust-code"),
    ):  # no stored bytes to approve
        assert_clean_error(cli(*args), "does not store its source", "nothing is run")
        assert not marker.exists(), args
    assert not (tmp_path / "m.onnx").exists() and not (tmp_path / "a").exists()
    r = cli("inspect", ck, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["model_code"]["needs_trust_code"] is True
    assert json.loads(r.stdout)["model_code"]["rebuildable"] is False
    r = cli("inspect", ck)  # says that nothing can rebuild it, not that --trust-code would
    assert r.exit_code == 0 and "cannot be rebuilt" in r.stdout and "--trust-code" not in r.stdout, r.stdout
    assert not marker.exists()


def test_stored_source_must_match_the_file_byte_for_byte(calibrated, tmp_path, marker):
    """The stored source is one program; the file on disk another: the file's code never runs, the stored one
    only with --trust-code."""
    evil = tmp_path / "evil.py"
    evil.write_text(EVIL)
    stored = EVIL.replace('"ran\\n"', '"stored\\n"')
    ck = _crafted(
        calibrated("digits_cnn"),
        tmp_path / "c.calib.pt",
        {"kind": "file", "spec": f"{evil}:make", "path": str(evil), "source": stored},
    )
    assert_clean_error(cli("export", ck, "--onnx", tmp_path / "m.onnx"), "changed on disk", "--trust-code")
    assert not marker.exists()
    r = cli("inspect", ck, "--json")
    assert json.loads(r.stdout)["model_code"]["needs_trust_code"] is True
    # same text, other bytes: still not the stored code
    evil.write_bytes(stored.replace("\n", "\r\n").encode())
    assert_clean_error(cli("export", ck, "--onnx", tmp_path / "m.onnx"), "changed on disk")
    assert not marker.exists()


def test_no_message_prints_the_named_files_content(calibrated, tmp_path, marker):
    secret = tmp_path / "secrets.txt"
    secret.write_text("hunter2\n")  # as Python: NameError naming it
    for source in (None, "def make():\n    pass\n"):
        ck = _crafted(
            calibrated("digits_cnn"),
            tmp_path / "c.calib.pt",
            {"kind": "file", "spec": f"{secret}:make", "path": str(secret), "source": source},
        )
        for args in (("export", ck, "--onnx", tmp_path / "m.onnx"), ("inspect", ck)):
            r = cli(*args)
            assert "hunter2" not in r.output, r.output


def _write_cwdmod(folder: Path) -> None:
    (folder / "cwdmod.py").write_text(EVIL)


def test_module_from_the_working_directory_is_not_imported(calibrated, tmp_path, marker):
    work = tmp_path / "work"
    work.mkdir()
    _write_cwdmod(work)
    env = {"QUANTCLI_TEST_MARKER": str(marker)}
    # a checkpoint that names it and lies about its distribution
    ck = _crafted(
        calibrated("digits_cnn"),
        work / "c.calib.pt",
        {
            "kind": "module",
            "spec": "cwdmod:make",
            "path": None,
            "source": None,
            "extra": {"distribution": "quantcli", "version": "0.1.0"},
        },
    )
    for args in (
        ("export", ck, "--onnx", work / "m.onnx"),
        ("verify", work / "m.onnx", "--reference", ck),
        ("analyze", ck, "--out", work / "a"),
    ):
        r = cli_subprocess(*args, cwd=work, env=env)
        assert_clean_error(r, "cwdmod", "--trust-code", "nothing was imported")
        assert not marker.exists(), args
    r = cli_subprocess("inspect", ck, "--json", cwd=work, env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["model_code"]["needs_trust_code"] is True
    assert not marker.exists()
    # calibrated honestly from that folder: the user's own command imports it; a checkpoint still needs
    # consent
    honest = work / "h.calib.pt"
    x = work / "x.pt"
    torch.save({"x": torch.rand(8, 1, 8, 8)}, x)
    r = cli_subprocess("calibrate", "cwdmod:make", "--data", x, "--out", honest, cwd=work, env=env)
    assert r.returncode == 0, r.stderr
    assert marker.read_text() == "ran\n"
    marker.unlink()
    assert_clean_error(
        cli_subprocess("export", honest, "--onnx", work / "m.onnx", cwd=work, env=env),
        "no installed distribution",
        "--trust-code",
    )
    assert not marker.exists() and not (work / "m.onnx").exists()
    r = cli_subprocess("export", honest, "--onnx", work / "m.onnx", "--trust-code", cwd=work, env=env)
    assert r.returncode == 0, r.stderr
    assert marker.read_text() == "ran\n"


def test_module_shadowing_an_installed_package_is_not_imported(calibrated, tmp_path, marker):
    """``python -m quantcli`` puts the working directory first on sys.path: a ``sample_models/`` there would
    shadow the installed one the checkpoint recorded."""
    ck = tmp_path / "m.calib.pt"
    x = tmp_path / "x.pt"
    torch.save({"x": torch.rand(8, 1, 8, 8)}, x)
    assert cli("calibrate", "sample_models.digits_cnn:build", "--data", x, "--out", ck).exit_code == 0
    provenance = torch.load(ck, weights_only=True)["model"]["extra"]
    assert provenance["distribution"] == "quantcli"  # recorded at calibration
    work = tmp_path / "work"
    (work / "sample_models").mkdir(parents=True)
    (work / "sample_models" / "__init__.py").write_text(EVIL)
    (work / "sample_models" / "digits_cnn.py").write_text(EVIL.replace("make", "build"))
    env = {"QUANTCLI_TEST_MARKER": str(marker)}
    # the CLI puts the working directory last on sys.path (python -m puts it first): a regular install wins
    # and loads; an editable one (a meta-path finder, consulted after sys.path) would lose to it, and is
    # refused
    r = cli_subprocess("export", ck, "--onnx", work / "m.onnx", cwd=work, env=env)
    assert r.returncode == 0 or "working directory" in r.stderr, r.stderr
    assert not marker.exists()
    # a script run from that folder has it first: the library refuses before importing anything
    script = (
        "import sys; sys.path.insert(0, ''); from quantcli import load_calibrated; "
        f"load_calibrated({str(ck)!r})"
    )
    r = subprocess.run(
        [sys.executable, "-c", script],
        cwd=work,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert r.returncode == 1 and "UntrustedCodeError" in r.stderr and "working directory" in r.stderr, (
        r.stderr
    )
    assert not marker.exists()


def test_standard_library_module_is_not_imported(calibrated, tmp_path):
    ck = _crafted(
        calibrated("digits_cnn"),
        tmp_path / "c.calib.pt",
        {
            "kind": "module",
            "spec": "this:make",
            "path": None,
            "source": None,
            "extra": {"distribution": "quantcli", "version": "0.1.0"},
        },
    )
    r = cli_subprocess("export", ck, "--onnx", tmp_path / "m.onnx", cwd=tmp_path)
    assert_clean_error(r, "this:make".split(":")[0], "--trust-code")
    assert "Zen of Python" not in r.stdout + r.stderr  # `import this` prints it


def test_checkpoint_naming_no_known_model_kind_runs_nothing(calibrated, tmp_path, marker):
    _write_cwdmod(tmp_path)
    ck = _crafted(
        calibrated("digits_cnn"),
        tmp_path / "c.calib.pt",
        {"kind": "other", "spec": "cwdmod:make", "path": None, "source": None},
    )
    r = cli_subprocess(
        "export", ck, "--onnx", tmp_path / "m.onnx", cwd=tmp_path, env={"QUANTCLI_TEST_MARKER": str(marker)}
    )
    assert_clean_error(r, "damaged", "model")
    assert not marker.exists()


def test_atomic_writes_use_the_umask(tmp_path, calibrated):
    old = os.umask(0o022)
    try:
        out = tmp_path / "r.json"
        atomic_write(out, lambda tmp: Path(tmp).write_text("{}"))
        assert stat.S_IMODE(out.stat().st_mode) == 0o644
        r = cli("calibrate", "digits_cnn", "--out", tmp_path / "d.calib.pt", "--num-samples", "32")
        assert r.exit_code == 0, r.output
        assert stat.S_IMODE((tmp_path / "d.calib.pt").stat().st_mode) == 0o644
        os.umask(0o027)
        atomic_write(out, lambda tmp: Path(tmp).write_text("{}"))
        assert stat.S_IMODE(out.stat().st_mode) == 0o640
    finally:
        os.umask(old)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX modes")
def test_analysis_folder_uses_the_umask(calibrated, tmp_path):
    old = os.umask(0o022)
    try:
        r = cli("analyze", calibrated("digits_cnn"), "--out", tmp_path / "a", "--num-samples", "8")
        assert r.exit_code == 0, r.output
        assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o755
        assert stat.S_IMODE((tmp_path / "a" / "report.html").stat().st_mode) == 0o644
    finally:
        os.umask(old)
