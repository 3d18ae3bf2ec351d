"""A forward that branches on a tensor's value (``if x.mean() > 0``): torchscript traces the path the example
batch took and the graph computes it for every input. The export names the branch (a warning, the graph's
metadata), and verify, failing such a graph on data that takes the other path, says so instead of "export the
checkpoint again", which cannot help. The dynamo exporter refuses the branch, in one line."""

from __future__ import annotations

import json

import numpy as np
import onnx

from tests.helpers import assert_clean_error, cli, cli_subprocess

BRANCHY = """
import torch
import torch.nn.functional as F
from torch import nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.fc = nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(8, 2)

    def forward(self, x):
        if x.mean() > 0:
            h = self.a(x)
        else:
            h = -3 * self.b(x)
        return self.fc(F.relu(h))


def make():
    torch.manual_seed(0)
    return Branchy()
"""
BRANCH_LINE = next(i for i, line in enumerate(BRANCHY.splitlines(), 1) if "if x.mean()" in line)


def _calibrated(tmp_path, source: str = BRANCHY):
    (tmp_path / "branchy.py").write_text(source)
    rng = np.random.default_rng(0)
    np.save(tmp_path / "pos.npy", (rng.standard_normal((32, 6)) + 1).astype(np.float32))
    np.save(tmp_path / "neg.npy", (rng.standard_normal((32, 6)) - 1).astype(np.float32))
    ck = tmp_path / "b.calib.pt"
    model = f"{tmp_path / 'branchy.py'}:make"
    r = cli("calibrate", model, "--data", tmp_path / "pos.npy", "--placement", "all", "--out", ck)
    assert r.exit_code == 0, r.output
    return ck


def test_the_export_names_the_branch_and_verify_blames_it(tmp_path):
    ck, graph = _calibrated(tmp_path), tmp_path / "b.onnx"
    r = cli("export", ck, "--onnx", graph)
    assert r.exit_code == 0, r.output
    where = f"branchy.py:{BRANCH_LINE}"
    assert f"branches on a tensor's value ({where})" in r.stderr
    meta = {p.key: p.value for p in onnx.load(str(graph)).metadata_props}
    assert meta["quantcli.traced_branches"] == f'["{where}"]'
    r = cli("verify", graph, "--reference", ck, "--data", tmp_path / "pos.npy")
    assert r.exit_code == 0, r.output  # the path the graph holds
    r = cli("verify", graph, "--reference", ck, "--data", tmp_path / "neg.npy", "--json")
    assert r.exit_code == 1
    failed = [c["detail"] for c in json.loads(r.stdout)["checks"] if not c["passed"]]
    assert any(f"branches on a tensor's value ({where})" in d for d in failed), failed
    assert not any("export the checkpoint again" in d for d in failed), failed


def test_a_model_without_branches_gets_no_note(calibrated, tmp_path):
    r = cli("export", calibrated("digits_cnn"), "--onnx", tmp_path / "d.onnx", "--json")
    assert r.exit_code == 0, r.output
    assert "branches" not in r.stderr
    meta = {p.key for p in onnx.load(str(tmp_path / "d.onnx")).metadata_props}
    assert "quantcli.traced_branches" not in meta


def test_dynamo_refuses_the_branch_in_one_line(tmp_path):
    """torch.fx's own warning line ("W1128 ... symbolic_shapes.py ...") came before the error."""
    ck = _calibrated(tmp_path)
    r = cli_subprocess("export", ck, "--onnx", tmp_path / "d.onnx", "--exporter", "dynamo", cwd=tmp_path)
    assert_clean_error(r, "data-dependent")
    assert not (tmp_path / "d.onnx").exists()


NEARBY = BRANCHY.replace("h = -3 * self.b(x)", "h = self.a(x) * 1.02")


def test_verify_names_the_branch_where_only_the_replay_fails(tmp_path):
    """The other path differs from the traced one by less than the output check's bound: only
    fidelity.replay_steps failed, and it named the quantizer alone, not the branch."""
    ck = _calibrated(tmp_path, NEARBY)
    graph = tmp_path / "b.onnx"
    assert cli("export", ck, "--onnx", graph).exit_code == 0
    r = cli("verify", graph, "--reference", ck, "--data", tmp_path / "neg.npy", "--json")
    assert r.exit_code == 1
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert not checks["fidelity.replay_steps"]["passed"]
    assert (
        f"branches on a tensor's value (branchy.py:{BRANCH_LINE})"
        in checks["fidelity.replay_steps"]["detail"]
    )
