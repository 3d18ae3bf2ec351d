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
    r = subprocess.run(
        ["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout
    assert (tmp_path / "digits_cnn.calib.pt").is_file() and (tmp_path / "digits_cnn.onnx").is_file()


def test_test_command_is_the_one_ci_runs():
    command = _block_after("## Run the tests")
    assert command == "python -m pytest -q -n auto"
    assert command in (README.parent / ".ci" / "run").read_text().splitlines()


def _blocks_after(heading: str) -> list[str]:
    section = README.read_text().split(heading, 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_own_model_quick_starts_run_as_written(tmp_path, monkeypatch):
    """The Hugging Face classifier + text file and whole-module CNN + image folder commands, on tiny models.

    Each README line runs through the real Typer app in this process (a subprocess per line cost ~15 s here,
    mostly importing transformers); the quick start above covers the installed entry point.
    """
    import shlex

    import numpy as np
    import pytest

    pytest.importorskip("transformers")
    pytest.importorskip("PIL")
    import torch
    from PIL import Image

    from tests.helpers import cli
    from tests.test_user_models_data import TEXTS, _cnn, make_bert_folder

    make_bert_folder(tmp_path / "my-classifier")
    (tmp_path / "texts.txt").write_text("\n".join(TEXTS) + "\n")
    torch.save(_cnn(), tmp_path / "cnn.pt")
    rng = np.random.default_rng(0)
    for i in range(4):
        (tmp_path / "images" / f"{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (40 + 8 * i, 48, 3), dtype=np.uint8)).save(
            tmp_path / "images" / f"{i % 2}" / f"{i}.png"
        )
    monkeypatch.chdir(tmp_path)
    blocks = _blocks_after("## Quick start: your own model")
    assert len(blocks) == 2
    for block, made in zip(blocks, ("my-classifier.onnx", "cnn.onnx")):
        lines = block.splitlines()
        assert len(lines) == 3
        for line in lines:
            argv = shlex.split(line)
            assert argv[0] == "quantcli", line
            r = cli(*argv[1:])
            assert r.exit_code == 0, (line, r.output)
        assert "PASS" in r.stdout and (tmp_path / made).is_file()


def test_transformers_quick_start_runs_as_written(tmp_path, monkeypatch):
    """The four lines of "Quick start: transformers", on a tiny BERT folder and text files."""
    import shlex

    import pytest

    pytest.importorskip("transformers")
    from tests.helpers import cli
    from tests.test_user_models_data import TEXTS, make_bert_folder

    make_bert_folder(tmp_path / "my-encoder")
    # 80 lines: 3 batches, the last held out
    (tmp_path / "texts.txt").write_text("\n".join(TEXTS * 10) + "\n")
    (tmp_path / "held-out.txt").write_text("\n".join(reversed(TEXTS)) + "\n")
    monkeypatch.chdir(tmp_path)
    lines = _blocks_after("## Quick start: transformers")[0].splitlines()
    assert len(lines) == 4
    for line in lines:
        argv = shlex.split(line.split("#")[0])
        assert argv[0] == "quantcli", line
        r = cli(*argv[1:])
        assert r.exit_code == 0, (line, r.output)
    assert "PASS" in r.stdout
    assert (tmp_path / "my-encoder.calib.analysis" / "report.html").is_file()
