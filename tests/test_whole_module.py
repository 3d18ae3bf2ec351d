"""MODEL as a whole-module checkpoint (torch.save(model)) or a TorchScript archive (issue 16)."""

import json

import numpy as np
import pytest
import torch
from torch import nn

from quantcli import load_calibrated
from quantcli.errors import UntrustedCodeError
from tests.helpers import assert_clean_error, cli


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)
    ).eval()


@pytest.fixture
def files(tmp_path):
    m = _cnn()
    torch.save(m, tmp_path / "cnn.pt")
    torch.save(m.state_dict(), tmp_path / "sd.pt")
    torch.jit.save(torch.jit.script(m), tmp_path / "ts.pt")
    x = np.random.default_rng(0).standard_normal((8, 3, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "x.npz", input=x)
    return m, tmp_path


def test_whole_module_needs_trust_pickle_then_trust_code(files):
    m, d = files
    out = d / "cnn.calib.pt"
    assert_clean_error(
        cli("calibrate", d / "cnn.pt", "--data", d / "x.npz", "--out", out),
        "--trust-pickle",
        "pickled whole module",
        "run any code",
    )
    assert not out.exists()
    r = cli("calibrate", d / "cnn.pt", "--trust-pickle", "--data", d / "x.npz", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)  # 2 layers x (input, weight), and Conv output quantizers (onnxruntime target)
    assert info["quantizers_calibrated"] == 4 + len(info["placement"]["output_quantized"])
    raw = torch.load(out, weights_only=True)  # still plain data
    assert raw["model"]["kind"] == "pickle" and raw["model"]["extra"]["pickle"].dtype == torch.uint8
    import hashlib

    digest = hashlib.sha256((d / "cnn.pt").read_bytes()).hexdigest()
    assert raw["model"]["extra"]["sha256"] == digest
    (d / "cnn.pt").unlink()  # self-contained: the pickle travels inside the checkpoint
    onnx = d / "cnn.onnx"
    assert_clean_error(cli("export", out, "--onnx", onnx), "--trust-code", "cnn.pt", digest)
    assert not onnx.exists()
    with pytest.raises(UntrustedCodeError):
        load_calibrated(out)
    ck = load_calibrated(out, trust_code=True)
    with torch.inference_mode():
        x = torch.randn(2, 3, 8, 8)
        assert torch.allclose(ck.float_model()(x), m(x), atol=1e-6)  # the same network, quantizers off
    assert cli("export", out, "--onnx", onnx, "--trust-code").exit_code == 0
    r = cli("verify", onnx, "--reference", out, "--trust-code", "--json")
    assert r.exit_code == 0, r.output


def test_state_dict_and_torchscript_are_refused_with_what_to_pass(files):
    _, d = files
    r = cli("calibrate", d / "sd.pt", "--data", d / "x.npz", "--out", d / "o.calib.pt")
    assert_clean_error(r, "state dict", "--weights")
    r = cli("calibrate", d / "ts.pt", "--data", d / "x.npz", "--out", d / "o.calib.pt", "--trust-pickle")
    assert_clean_error(r, "TorchScript", "cannot be inserted", "--trust-pickle", "--weights")
    (d / "junk.pt").write_bytes(b"not a checkpoint")
    assert_clean_error(
        cli("calibrate", d / "junk.pt", "--data", d / "x.npz", "--trust-pickle"), "cannot read"
    )
    r = cli("calibrate", "sample_models.digits_cnn:build", "--weights", d / "junk.pt", "--data", d / "x.npz")
    assert_clean_error(r, "cannot read", "junk.pt")
    assert "--trust-pickle" not in r.output  # a damaged file is not a pickle to trust
    assert not list(d.glob("*.calib.pt"))


def test_class_defined_in_a_script_is_named(tmp_path, monkeypatch):
    # a module pickled from a script's __main__ cannot be found again: say which class and what to do
    import sys

    class NetGone(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            return self.fc(x)

    NetGone.__module__, NetGone.__qualname__ = "__main__", "NetGone"
    monkeypatch.setattr(sys.modules["__main__"], "NetGone", NetGone, raising=False)
    torch.save(NetGone(), tmp_path / "net.pt")
    monkeypatch.delattr(sys.modules["__main__"], "NetGone")  # as in a new process: the script is not __main__
    np.savez(tmp_path / "x.npz", x=np.ones((2, 2), np.float32))
    r = cli("calibrate", tmp_path / "net.pt", "--trust-pickle", "--data", tmp_path / "x.npz")
    assert_clean_error(r, "__main__.NetGone", "cannot be imported")


def test_a_pickle_whose_module_is_not_importable_here_says_what_to_do(tmp_path, monkeypatch):
    """A torch.save(model) of a class from the user's own module, read where that module is not importable:
    export said only "cannot unpickle the model in cnn.calib.pt: No module named 'usercnn_7f3a'"."""
    import sys

    (tmp_path / "usercnn_7f3a.py").write_text(
        "from torch import nn\n\n\nclass Net(nn.Sequential):\n"
        "    def __init__(self):\n"
        "        super().__init__(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(144, 3))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import usercnn_7f3a

    torch.save(usercnn_7f3a.Net().eval(), tmp_path / "cnn.pt")
    np.savez(
        tmp_path / "x.npz", input=np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32)
    )
    out = tmp_path / "cnn.calib.pt"
    r = cli("calibrate", tmp_path / "cnn.pt", "--trust-pickle", "--data", tmp_path / "x.npz", "--out", out)
    assert r.exit_code == 0, r.output
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    monkeypatch.delitem(sys.modules, "usercnn_7f3a")
    r = cli("export", out, "--onnx", tmp_path / "cnn.onnx", "--trust-code")
    assert_clean_error(r, "module 'usercnn_7f3a'", "cannot be imported here", "PYTHONPATH", "--weights")
    assert not (tmp_path / "cnn.onnx").exists()


def test_a_scripted_submodule_is_refused_with_what_to_do():
    """A model holding a torch.jit.script submodule ended in an internal error, exit 3
    ("register_forward_pre_hook is not supported on ScriptModules")."""
    from quantcli import quantize_model
    from quantcli.errors import ConfigError

    model = nn.Sequential(nn.Linear(4, 4), torch.jit.script(nn.Sequential(nn.Linear(4, 2), nn.ReLU())))
    with pytest.raises(ConfigError, match="1 is a TorchScript module.*without torch.jit.script"):
        quantize_model(model, example={"input": torch.randn(2, 4)})
