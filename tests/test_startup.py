"""`quantcli --help` starts fast because the CLI module imports neither torch nor onnx (the README's
claim)."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "onnx", "onnxruntime", "numpy")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_importing_the_cli_imports_no_heavy_module():
    r = _python(f"import sys, quantcli.cli; print([m for m in {HEAVY!r} if m in sys.modules])")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize("args", [["--help"], ["calibrate", "--help"], ["verify", "--help"]])
def test_help_runs_with_heavy_modules_blocked(args):
    # a module set to None in sys.modules raises ImportError on import: any heavy import on this path fails
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in HEAVY)
    r = _python(
        f"import sys; {blocked}; sys.argv = ['quantcli'] + {args!r}; from quantcli.cli import main; main()"
    )
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout.strip(), "no help text"


def test_the_check_can_fail():
    # the same probe run on a module that imports torch reports it: the test above is not vacuous
    r = _python(
        f"import sys, quantcli.calibration.calibrate; print([m for m in {HEAVY!r} if m in sys.modules])"
    )
    assert "torch" in r.stdout
