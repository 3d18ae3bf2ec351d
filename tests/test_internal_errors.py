"""An exception quantcli did not expect is an internal error, not bad input (issue 35, item 11): exit 3 and
one line that says so; and what torchvision's import does to ``torch.onnx.symbolic_helper`` no longer breaks
the TorchScript export."""

import json

import numpy as np

from tests.helpers import cli, cli_subprocess

# a model file as torchvision users have one: torchvision's ops run `import torch.onnx.symbolic_helper`, which
# binds torch's backward-compatibility module (no `_type_utils`, no `_maybe_get_const`) to that name; the
# forward calls torch.diff and a cumsum of bool, the two ops exporters/aten_symbolics.py translates
TORCHVISION_LIKE = """
import torch
import torch.onnx.symbolic_helper  # what `import torchvision` does
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.conv(x).mean((2, 3))
        steps = torch.diff(y, dim=1, prepend=y[:, :1])
        return self.fc(y) + (steps > 0).cumsum(-1)[:, :4].to(y.dtype)


def make():
    torch.manual_seed(0)
    return Net().eval()
"""


def test_torchscript_export_after_torchvisions_import(tmp_path):
    """In a fresh process (as a user runs it) whose model file imports ``torch.onnx.symbolic_helper`` first:
    was "error: AttributeError: module 'torch.onnx.symbolic_helper' has no attribute '_type_utils'"."""
    (tmp_path / "net.py").write_text(TORCHVISION_LIKE)
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((16, 3, 8, 8)).astype(np.float32))
    ck, graph = tmp_path / "net.calib.pt", tmp_path / "net.onnx"
    r = cli_subprocess("calibrate", tmp_path / "net.py:make", "--data", tmp_path / "x.npy", "--out", ck)
    assert r.returncode == 0, r.stderr
    r = cli_subprocess("export", ck, "--onnx", graph, "--exporter", "torchscript", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["pairs_by_format"]


def test_an_internal_error_is_exit_3_and_says_so(calibrated, tmp_path, monkeypatch):
    """A bug (here: an AttributeError inside the export) is not reported as bad input."""
    import exporters.onnx_export as onnx_export

    def broken(*a, **k):
        raise AttributeError("module 'torch.onnx.symbolic_helper' has no attribute '_type_utils'")

    monkeypatch.setattr(onnx_export, "export_onnx", broken)
    r = cli("export", calibrated("digits_cnn"), "--onnx", tmp_path / "m.onnx", "--json")
    assert r.exit_code == 3, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "internal error" in lines[0] and "AttributeError" in lines[0], r.stderr
    assert "report" in lines[0] and "QUANTCLI_DEBUG=1" in lines[0]
    got = json.loads(r.stdout)
    assert got["exit_code"] == 3 and got["kind"] == "AttributeError"
    assert not (tmp_path / "m.onnx").exists()


def test_what_the_machine_refuses_stays_exit_2(calibrated, tmp_path, monkeypatch):
    """An OSError (a permission, a missing device) is something the user can act on: exit 2, named, not an
    internal error."""
    import exporters.onnx_export as onnx_export

    def refused(*a, **k):
        raise PermissionError(13, "Permission denied", str(tmp_path / "m.onnx"))

    monkeypatch.setattr(onnx_export, "export_onnx", refused)
    r = cli("export", calibrated("digits_cnn"), "--onnx", tmp_path / "m.onnx")
    assert r.exit_code == 2, r.output
    assert "PermissionError" in r.stderr and "internal error" not in r.stderr
