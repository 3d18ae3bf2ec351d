"""Shared helpers: run the real Typer app in-process, or the installed CLI in a subprocess."""

import os
import subprocess
import sys

from typer.testing import CliRunner

from quantcli.cli import app

runner = CliRunner()


def cli(*args):
    """Invoke the quantcli app in-process; returns click's Result (exit_code, output, stdout, stderr)."""
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def cli_subprocess(*args, cwd=None, env=None):
    """Run ``python -m quantcli`` as a user would (no TTY)."""
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "quantcli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=e, timeout=300)


def assert_clean_error(result, *fragments):
    """Exit 2, one line mentioning every fragment, no traceback."""
    text = result.output if hasattr(result, "output") else result.stdout + result.stderr
    code = result.exit_code if hasattr(result, "exit_code") else result.returncode
    assert code == 2, text
    assert "Traceback" not in text, text
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, text
    for f in fragments:
        assert f in text, (f, text)
