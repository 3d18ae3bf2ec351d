"""Shared helpers: run the real Typer app in-process, or the installed CLI in a subprocess."""

import os
import subprocess
import sys

from typer.testing import CliRunner

from quantcli.cli import app

runner = CliRunner()


def cli(*args):
    """Invoke the quantcli app in-process; returns click's Result (exit_code, output, stdout, stderr).

    ``--placement`` keeps its default (auto), for the deployment CPU tests/conftest.py names
    (``QUANTCLI_CPU``)."""
    return runner.invoke(
        app, [str(a) for a in args], catch_exceptions=False, env={"QUANTCLI_PLACEMENT": None}
    )


def cli_subprocess(*args, cwd=None, env=None):
    """Run ``python -m quantcli`` as a user would (no TTY)."""
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "quantcli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=e,
        timeout=300,
    )


def assert_clean_error(result, *fragments):
    """Exit 2 and exactly one line on STDERR mentioning every fragment; no traceback anywhere, and nothing on
    stdout (a ``--json`` consumer reading stdout must not mistake an error for output)."""
    if hasattr(result, "exit_code"):  # click's Result keeps the two streams apart
        code, out, err = result.exit_code, result.stdout, result.stderr
    else:
        code, out, err = result.returncode, result.stdout, result.stderr
    assert code == 2, out + err
    assert "Traceback" not in out + err, out + err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, f"stderr: {err!r} stdout: {out!r}"
    assert out.strip() == "", f"stdout should be empty on error: {out!r}"
    for f in fragments:
        assert f in lines[0], (f, err)


def model_folder(folder, source: str, shape: tuple[int, ...]):
    """``folder`` with ``model.py`` (``source``, a user's model file with ``make()``) and ``x.npy`` (32 seeded
    standard-normal samples of ``shape``): the pair ``calibrate model.py:make --data x.npy`` takes."""
    import numpy as np

    (folder / "model.py").write_text(source)
    np.save(folder / "x.npy", np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    return folder


def load_module(path, name: str = "user_model"):
    """The Python module in file ``path``, imported under ``name``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def calibrated_file(tmp_path, source: str, arrays: dict, *calibrate_args, name: str = "m"):
    """``source`` (a user's model file with ``make()``) written to ``tmp_path / "net.py"``, ``arrays`` saved
    as ``d.npz``, and calibrated through the CLI with ``--placement all`` (every layer quantized, whatever
    the CPU) and ``calibrate_args``: ``(checkpoint, data)``."""
    import numpy as np

    (tmp_path / "net.py").write_text(source)
    np.savez(tmp_path / "d.npz", **arrays)
    ck = tmp_path / f"{name}.calib.pt"
    args = ("--data", tmp_path / "d.npz", "--placement", "all", "--out", ck, *calibrate_args)
    r = cli("calibrate", f"{tmp_path / 'net.py'}:make", *args)
    assert r.exit_code == 0, r.output
    return ck, tmp_path / "d.npz"


def exported_and_verified(ck, data, graph, *export_args):
    """``ck`` exported to ``graph`` through the CLI (``export_args``), and verify's exit 0 on ``data``."""
    r = cli("export", ck, "--onnx", graph, *export_args)
    assert r.exit_code == 0, r.output
    r = cli("verify", graph, "--reference", ck, "--data", data)
    assert r.exit_code == 0, r.output
    return graph
