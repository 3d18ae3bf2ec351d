"""The README's commands work as written (a new user copies them)."""

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _block_after(heading: str) -> str:
    text = README.read_text()
    section = text.split(heading, 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1).strip()


def test_quick_start_command_runs_as_written(tmp_path):
    command = _block_after("## Quick start")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    r = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout
    assert (tmp_path / "digits_cnn.calib.pt").is_file() and (tmp_path / "digits_cnn.onnx").is_file()


def test_test_command_is_the_one_ci_runs():
    assert _block_after("## Run the tests") == "python -m pytest -q"
    assert "python -m pytest -q" in (README.parent / ".ci" / "run").read_text()


def test_python_api_example_runs_as_written(tmp_path, monkeypatch):
    text = README.read_text().split("## Python API", 1)[1]
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    assert (tmp_path / "digits.onnx").is_file()
