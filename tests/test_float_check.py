"""Never change the float model in silence (issue 35): every transformation calibrate makes is compared,
module by module and quantizers off, with the model as loaded on the example batch; a BatchNorm fold or a
layer conversion that changes a module's output is undone and reported with the layer and the cause, a
placement rewrite or SmoothQuant that does stops calibrate (exit 2) naming the module, and verify's
``reference.transformations`` names the first module that differs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from quantcli.errors import TransformationError
from quantcli.nn import fold_bn, placement
from quantcli.nn.module_outputs import capture, differences
from quantcli.nn.replace import quantize_model
from quantcli.nn.tensor_quantizer import quantizers
from tests.helpers import assert_clean_error, cli

NET = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


def make():
    torch.manual_seed(0)
    m = Net()
    g = torch.Generator().manual_seed(1)
    for bn in (m.bn1, m.bn2):
        bn.running_mean.copy_(0.3 * torch.randn(8, generator=g))
        bn.running_var.copy_(0.5 + torch.rand(8, generator=g))
    return m.eval()
"""


def _net(tmp_path):
    (tmp_path / "net.py").write_text(NET)
    namespace: dict = {}
    exec(NET, namespace)
    return namespace["make"]


def _wrong_fold(monkeypatch):
    """BatchNorm folding that forgets the shift ``t`` when it folds into conv2 (8 input channels; conv1 has
    3): a fold bug."""
    right = fold_bn.fold_parameters

    def fold(weight, bias, s, t, axis=0, groups=1):
        w, b = right(weight, bias, s, t, axis, groups)
        return (w, b - t.to(b.dtype)) if weight.shape[1] == 8 else (w, b)

    monkeypatch.setattr(fold_bn, "fold_parameters", fold)


def test_a_wrong_fold_is_caught_named_and_undone(tmp_path, monkeypatch):
    make = _net(tmp_path)
    model, loaded = make(), make()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    _wrong_fold(monkeypatch)
    quantize_model(model, "int8", example={"x": x})
    report = model.quantcli_report
    # bn1 folded, bn2 left as loaded: the wrong fold is named with the module whose output moved
    assert [(f.layer, f.batchnorm) for f in report.batchnorm.folded] == [("conv1", "bn1")]
    assert isinstance(model.bn2, nn.BatchNorm2d) and isinstance(model.bn1, nn.Identity)
    (reverted,) = report.float_check["reverted"]
    assert reverted["kind"] == "fold" and reverted["layer"] == "bn2"
    assert "folding BatchNorm bn2 into conv2 changed bn2" in reverted["cause"]
    assert ("bn2", "folding it changed the float output (float check)") in report.batchnorm.skipped
    for q in quantizers(model).values():
        q.set_mode("disabled")
    with torch.no_grad():
        torch.testing.assert_close(model(x), loaded(x), rtol=1e-5, atol=1e-6)
        assert torch.equal(model.conv2.weight, loaded.conv2.weight)  # the unfolded layer is the user's


def test_without_the_check_the_wrong_fold_changes_the_model(tmp_path, monkeypatch):
    """The control: the same wrong fold, unchecked, moves the output (so the check above has something to
    catch)."""
    make = _net(tmp_path)
    model, loaded = make(), make()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    _wrong_fold(monkeypatch)
    quantize_model(model, "int8", example={"x": x}, check_float=False)
    assert report_folds(model) == ["bn1", "bn2"]
    diffs = differences(capture(loaded, {"x": x}), capture(model, {"x": x}), skip={"conv1", "conv2"})
    assert diffs and diffs[0][0] == "bn2" and diffs[0][1] > 0.01


def report_folds(model) -> list[str]:
    return [f.batchnorm for f in model.quantcli_report.batchnorm.folded]


def test_calibrate_reports_the_undone_fold_and_the_checkpoint_verifies(tmp_path, monkeypatch):
    _net(tmp_path)
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).standard_normal((16, 3, 8, 8)).astype(np.float32))
    _wrong_fold(monkeypatch)
    ck = tmp_path / "m.calib.pt"
    spec = f"{tmp_path / 'net.py'}:make"
    r = cli("calibrate", spec, "--data", tmp_path / "d.npz", "--out", tmp_path / "shown.pt")
    assert r.exit_code == 0, r.output
    assert "warning: float check: folding BatchNorm bn2 into conv2 changed bn2" in r.stderr
    assert "1 transformation(s) undone" in r.stdout
    r = cli("calibrate", spec, "--data", tmp_path / "d.npz", "--out", ck, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert [x["layer"] for x in info["float_check"]["reverted"]] == ["bn2"]
    graph = tmp_path / "m.onnx"
    assert cli("export", ck, "--onnx", graph).exit_code == 0
    r = cli("verify", graph, "--reference", ck, "--data", tmp_path / "d.npz", "--json")
    check = next(c for c in json.loads(r.stdout)["checks"] if c["name"] == "reference.transformations")
    assert check["passed"] and check["value"] < 1e-5


def test_a_placement_rewrite_that_changes_the_model_stops_calibrate_naming_the_module(tmp_path, monkeypatch):
    """A placement rewrite that changes what ``head`` computes (a hook that shifts its output): calibrate
    exits 2 naming ``head`` and writes nothing."""
    _net(tmp_path)
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).standard_normal((16, 3, 8, 8)).astype(np.float32))
    right = placement.analyse

    def wrong(model, layers, *args, **kwargs):
        p, graph = right(model, layers, *args, **kwargs)
        model.head.register_forward_hook(lambda m, a, out: out * 1.5)
        return p, graph

    monkeypatch.setattr(placement, "analyse", wrong)
    from quantcli.nn import replace

    monkeypatch.setattr(replace, "analyse", wrong)
    r = cli(
        "calibrate", f"{tmp_path / 'net.py'}:make", "--data", tmp_path / "d.npz", "--out", tmp_path / "m.pt"
    )
    assert_clean_error(r, "placement changed what the float model computes: head")
    assert not (tmp_path / "m.pt").exists()


def test_quantize_model_raises_on_a_placement_change(tmp_path, monkeypatch):
    make = _net(tmp_path)
    model = make()
    from quantcli.nn import replace

    right = replace.analyse

    def wrong(model, layers, *args, **kwargs):
        p, graph = right(model, layers, *args, **kwargs)
        model.head.register_forward_hook(lambda m, a, out: out + 1)
        return p, graph

    monkeypatch.setattr(replace, "analyse", wrong)
    with pytest.raises(TransformationError, match="head"):
        quantize_model(model, "int8", example={"x": torch.randn(2, 3, 8, 8)})


ENCODER = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.norm(x))))


def make():
    torch.manual_seed(0)
    return Net().eval()
"""


def test_a_smoothquant_that_changes_the_model_stops_calibrate_naming_the_module(tmp_path, monkeypatch):
    (tmp_path / "net.py").write_text(ENCODER)
    x = np.random.default_rng(0).standard_normal((32, 6, 16)).astype(np.float32)
    x[..., 3] *= 30  # an outlier channel for SmoothQuant to move
    np.savez(tmp_path / "d.npz", x=x)
    from quantcli.calibration import smoothquant

    right = smoothquant.smooth_quant

    def wrong(model, *args, **kwargs):
        report = right(model, *args, **kwargs)
        with torch.no_grad():
            model.fc2.weight.mul_(1.01)  # a smoothing bug: the weight scaled, nothing divided
        return report

    monkeypatch.setattr(smoothquant, "smooth_quant", wrong)
    spec = f"{tmp_path / 'net.py'}:make"
    out = tmp_path / "m.pt"
    r = cli("calibrate", spec, "--data", tmp_path / "d.npz", "--smoothquant", "0.5", "--out", out)
    assert_clean_error(r, "SmoothQuant changed what the float model computes: fc2", "without --smoothquant")
    assert not out.exists()
    monkeypatch.setattr(smoothquant, "smooth_quant", right)  # the real one keeps the model: it passes
    r = cli("calibrate", spec, "--data", tmp_path / "d.npz", "--smoothquant", "0.5", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["smoothquant"]["counts"]["layernorm"] == 1


class Sampling(nn.Module):
    """A forward that draws random numbers (a VAE's sampling, noise injection) and counts its calls."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        h = self.bn(self.conv(x)) + 0.1 * torch.randn_like(x[:, :1])
        return self.fc(h.mean((2, 3))) + self.calls


def test_random_draws_and_changing_state_in_forward_are_not_transformations():
    torch.manual_seed(0)
    model = Sampling().eval()
    model.bn.running_var.fill_(2.0)
    quantize_model(model, "int8", example={"x": torch.randn(4, 3, 8, 8)})
    check = model.quantcli_report.float_check
    assert check["reverted"] == [] and [f.batchnorm for f in model.quantcli_report.batchnorm.folded] == ["bn"]
    assert check["unstable"] == [""]  # the model's own output counts calls: not compared, nothing blamed


def test_relative_change_reads_shapes_rounding_and_non_finite_values():
    from quantcli.nn.module_outputs import SAMPLE, fingerprint, relative_change

    x = torch.linspace(-1, 1, 3 * SAMPLE).reshape(3, SAMPLE)
    assert relative_change(fingerprint(x), fingerprint(x.clone())) == 0.0
    assert relative_change(fingerprint(x), fingerprint(x[:, 1:])) == float("inf")  # a lost padding column
    assert 0.09 < relative_change(fingerprint(x), fingerprint(1.1 * x)) < 0.11
    assert relative_change(fingerprint(x), fingerprint(x + 1e-9)) == 0.0  # rounding
    y = x.clone().view(-1)  # every 3rd value is sampled
    y[0], y[30] = float("nan"), float("inf")
    assert relative_change(fingerprint(y), fingerprint(y.clone())) == 0.0  # NaN where NaN was: unchanged
    z = y.clone()
    z[30] = -float("inf")
    assert relative_change(fingerprint(y), fingerprint(z)) == float("inf")
    assert len(fingerprint(x).values[0]) <= SAMPLE


ATTENTION = """
import torch
from torch import nn


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        w = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) / 4.0, dim=-1)
        return w @ self.v(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.mixer = Mixer()
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.mixer(x))


def make():
    torch.manual_seed(0)
    net = Net().eval()
    with torch.no_grad():
        net.mixer.v.weight[5] *= 40  # an outlier channel of V for SmoothQuant to move into out
    return net
"""


def test_smoothquant_folded_into_a_linear_changes_what_runs_before_the_reader_and_nothing_after(
    tmp_path, monkeypatch
):
    """SmoothQuant's 1 / s folded into V's output channels: the attention module returning softmax . V carries
    the divided tensor by design and is not blamed (BERT's attention.self); the reader (out), multiplied back,
    must compute what it did."""
    (tmp_path / "net.py").write_text(ATTENTION)
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).standard_normal((32, 6, 16)).astype(np.float32))
    spec = f"{tmp_path / 'net.py'}:make"
    out = tmp_path / "m.pt"
    r = cli("calibrate", spec, "--data", tmp_path / "d.npz", "--smoothquant", "0.5", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    groups = json.loads(r.stdout)["smoothquant"]["groups"]
    assert {"consumers": ["out"], "fold": "linear", "into": "mixer.v"}.items() <= next(
        g for g in groups if g["consumers"] == ["out"]
    ).items()

    from quantcli.calibration import smoothquant

    right = smoothquant.smooth_quant

    def wrong(model, *args, **kwargs):
        report = right(model, *args, **kwargs)
        with torch.no_grad():
            model.out.weight.mul_(1.01)  # the reader's columns off by 1 %
        return report

    monkeypatch.setattr(smoothquant, "smooth_quant", wrong)
    out.unlink()
    r = cli("calibrate", spec, "--data", tmp_path / "d.npz", "--smoothquant", "0.5", "--out", out)
    assert_clean_error(r, "SmoothQuant changed what the float model computes: out ", "without --smoothquant")
    assert not out.exists()


def test_expected_changes_take_the_modules_between_the_producer_and_its_readers():
    from quantcli.calibration.float_check import expected_changes

    order = ["a.q", "a.v", "a.self", "a.drop", "a.out", "a", "head"]  # finish order
    reference = dict.fromkeys(order)
    assert expected_changes([], [("a.v", ["a.out"])], reference) == {"a.v", "a.self", "a.drop"}
    assert expected_changes([{"layer": "a.q"}], [], reference) == {"a.q"}
