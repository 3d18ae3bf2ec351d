"""Shared helpers: run the real Typer app in-process, or the installed CLI in a subprocess."""

import os
import subprocess
import sys

from typer.testing import CliRunner

from quantcli.cli import app

runner = CliRunner()


def cli(*args):
    """Invoke the quantcli app in-process; returns click's Result (exit_code, output, stdout, stderr).

    ``--placement`` keeps its default (auto): tests/conftest.py times layers with a stub in this process."""
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
