"""``calibrate --smoothquant [ALPHA]``: per-channel smoothing factors moved from Linear inputs into their
weights.

The float model must compute the same outputs after smoothing (to float rounding, with a bound a wrong fold
exceeds by orders of magnitude), the folds go where they are exact, a checkpoint reloads bit for bit, the
export verifies, and per-tensor int8 on ``deep_encoder`` (outlier channels) gets better."""

import copy
import json
import math

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from quantcli import calibrate, quantize_model
from quantcli.calibration.smoothquant import _apply, smooth_quant, smoothing_scales
from quantcli.cli.entry import optional_values
from quantcli.errors import CalibrationError
from quantcli.inputs.checkpoint import load_calibrated, save_calibrated
from quantcli.inputs.model_spec import ModelSpec
from quantcli.nn.modes import quantizer_modes
from quantcli.nn.smooth import SmoothMul, smoothed_layers
from tests.helpers import assert_clean_error, cli, cli_subprocess

U = 2.0**-24  # float32 unit roundoff


def _rounding_bound(y: torch.Tensor, depth: int, k: int) -> float:
    """Float32 rounding a rescale may add to outputs of magnitude max|y|: each of ``depth`` smoothed layers
    rounds W * s and x / s once per element (relative U), and a length-``k`` dot product of such independently
    rounded terms moves by about sqrt(k) * U relative; 8x for the tail of the sum."""
    return 8 * depth * math.sqrt(k) * U * float(y.abs().max())


def test_scales_hand_computed():
    act = torch.tensor([4.0, 0.0, 9.0, 16.0])
    w = torch.tensor([1.0, 2.0, 0.0, 4.0])
    # alpha 0.5: sqrt(4)/sqrt(1) = 2; dead activation -> 1; zero weight column -> 1; 4/2 = 2
    assert smoothing_scales(act, w, 0.5).tolist() == [2.0, 1.0, 1.0, 2.0]
    # alpha 1: s = act (all migrated); alpha 0: s = 1 / w
    assert smoothing_scales(act, w, 1.0).tolist() == [4.0, 1.0, 1.0, 16.0]
    assert smoothing_scales(act, w, 0.0).tolist() == [1.0, 1.0, 1.0, 0.25]


# -- deep_encoder (post-LN BERT): q/k/v and FFN inputs are LayerNorm outputs that also feed the residual
# -------


@pytest.fixture(scope="module")
def deep():
    pytest.importorskip("transformers")
    from sample_models.structured import deep_encoder, deep_encoder_batches

    calib = deep_encoder_batches("calib", 16)
    evals = deep_encoder_batches("eval", 32)
    float_model = deep_encoder(layers=2)
    with torch.no_grad():
        reference = [float_model(**b) for b in evals]
    # 8-bit weights (a CPU with VNNI): what smoothing gains in the fake-quant model; on the 7-bit grid a CPU
    # without VNNI needs, the smoothed weights' wider range costs more (docs/performance.md, u8s8 saturation)
    plain = quantize_model(copy.deepcopy(float_model), {"preset": "int8", "cpu": "x86-vnni"})
    smoothed = quantize_model(copy.deepcopy(float_model), {"preset": "int8", "cpu": "x86-vnni"})
    report = smooth_quant(smoothed, calib, 0.5, device="cpu", min_gain=0.0)
    return dict(
        calib=calib,
        evals=evals,
        reference=reference,
        plain=plain,
        smoothed=smoothed,
        report=report,
        float_model=float_model,
    )


def _float_outputs(model, batches):
    with quantizer_modes(model, "disabled"), torch.no_grad():
        return [model(**b) for b in batches]


def test_float_model_unchanged_by_smoothing(deep):
    out = _float_outputs(deep["smoothed"], deep["evals"])
    for y, ref in zip(out, deep["reference"]):
        assert (y - ref).abs().max() <= _rounding_bound(ref, depth=2, k=1536)


def test_folds_go_where_they_are_exact(deep):
    folds = {tuple(g.consumers): (g.fold, g.into) for g in deep["report"].groups}
    for i in range(2):
        p = f"bert.encoder.layer.{i}"
        qkv = tuple(f"{p}.attention.self.{n}" for n in ("query", "key", "value"))
        # one s for the three readers of one tensor; post-LN: the LayerNorm's output is also the residual, so
        # folding 1/s into it would change the model: an explicit Mul
        assert folds[qkv] == ("mul", None)
        # context = softmax(.) @ V is linear in V's channels: 1/s goes into V's output rows
        assert folds[(f"{p}.attention.output.dense",)] == ("linear", f"{p}.attention.self.value")
        assert folds[(f"{p}.intermediate.dense",)] == ("mul", None)  # LayerNorm output + residual again
        assert folds[(f"{p}.output.dense",)] == ("mul", None)  # after GELU
    muls = smoothed_layers(deep["smoothed"])
    assert (
        "bert.encoder.layer.0.output.dense" in muls
        and "bert.encoder.layer.0.attention.output.dense" not in muls
    )
    assert deep["report"].groups[0].scale_max > 2.0  # the planted outliers are really being moved


def test_a_wrong_fold_breaks_the_bound(deep):
    """The bound above is tight enough to catch a fold through GELU (down-projection into the
    up-projection)."""
    model = quantize_model(copy.deepcopy(deep["float_model"]), "int8")
    layers = {n: m for n, m in model.named_modules() if n.endswith("output.dense") and "attention" not in n}
    down = "bert.encoder.layer.0.output.dense"
    s = torch.linspace(0.5, 2.0, 1536)
    with torch.no_grad():
        _apply(model, layers, [down], "linear", "bert.encoder.layer.0.intermediate.dense", s, explicit=True)
    out = _float_outputs(model, deep["evals"][:1])[0]
    ref = deep["reference"][0]
    assert (out - ref).abs().max() > 100 * _rounding_bound(ref, depth=2, k=1536)


def test_smoothing_improves_per_tensor_int8(deep):
    """Measured (layers=2, 16 calibration / 32 held-out lines, seeds 0-2): cosine 0.982 -> 0.997, 0.916 ->
    0.993, 0.977 -> 0.999 (6 layers, 64 lines: 0.972 -> 0.996). Asserted: a gain of at least 0.005 (seed 0:
    0.015)."""

    def cosine(model):
        calibrate(model, deep["calib"], device="cpu")
        with torch.no_grad():
            out = torch.cat([model(**b) for b in deep["evals"]])
        return float(torch.nn.functional.cosine_similarity(out, torch.cat(deep["reference"]), dim=-1).mean())

    plain, smoothed = cosine(deep["plain"]), cosine(deep["smoothed"])
    assert smoothed >= plain + 0.005 and smoothed > 0.99, (plain, smoothed)


def test_smoothing_twice_is_refused(deep):
    with pytest.raises(CalibrationError, match="already smoothed"):
        smooth_quant(deep["smoothed"], deep["calib"][:1], device="cpu", min_gain=0.0)


# -- a pre-LN block: the LayerNorm's output is read by Linear layers only ------------------------------------


class PreLN(nn.Module):
    """x + fc3(gelu(fc2(relu(fc1(ln(x)))))) + q(ln(x)) * k(ln(x)): ln feeds q, k and fc1 only."""

    def __init__(self, d=16, h=32):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.q, self.k, self.fc1 = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, h)
        self.fc2, self.fc3 = nn.Linear(h, h), nn.Linear(h, d)

    def forward(self, x):
        y = self.ln(x)
        return (
            x + self.fc3(torch.nn.functional.gelu(self.fc2(torch.relu(self.fc1(y))))) + self.q(y) * self.k(y)
        )


def test_pre_ln_folds_into_layernorm_and_linear():
    torch.manual_seed(0)
    model = PreLN()
    with torch.no_grad():
        model.ln.weight.uniform_(0.5, 1.5)
        model.ln.weight[3] = 12.0  # an outlier channel
        model.ln.bias.normal_()
    x = torch.randn(64, 10, 16)
    with torch.no_grad():
        ref = model(x)
        ln_before = model.ln.weight.clone()
    quantize_model(model, "int8")
    report = smooth_quant(model, [{"x": x[:32]}, {"x": x[32:]}], 0.5, device="cpu", min_gain=0.0)
    folds = {tuple(g.consumers): (g.fold, g.into) for g in report.groups}
    # the three readers of ln's output form one group (call order), and 1/s goes into ln
    assert folds[("fc1", "q", "k")] == ("layernorm", "ln")
    # relu is positively homogeneous (relu(x / s) = relu(x) / s for s > 0): fc2's 1/s goes into fc1's rows
    assert folds[("fc2",)] == ("linear", "fc1")
    assert folds[("fc3",)] == ("mul", None)  # gelu is not
    assert smoothed_layers(model) == ["fc3"]
    assert model.ln.weight[3] < ln_before[3] / 2  # the outlier channel's gain went into the readers' weights
    out = _float_outputs(model, [{"x": x}])[0]
    assert (out - ref).abs().max() <= _rounding_bound(ref, depth=3, k=32)


class ArgmaxPreLN(PreLN):
    def forward(self, x):
        return super().forward(x).argmax(-1)


def test_without_float_outputs_only_muls():
    """Integer outputs cannot show a fold exact: every group gets an explicit Mul, and the outputs stay
    equal."""
    torch.manual_seed(0)
    model = ArgmaxPreLN()
    x = torch.randn(16, 10, 16)
    with torch.no_grad():
        ref = PreLN.forward(model, x)  # the float values behind the argmax
    quantize_model(model, "int8")
    report = smooth_quant(model, [{"x": x}], 0.5, device="cpu", min_gain=0.0)
    assert {g.fold for g in report.groups} == {"mul"}
    with quantizer_modes(model, "disabled"), torch.no_grad():
        out = PreLN.forward(model, x)
    assert (out - ref).abs().max() <= _rounding_bound(ref, depth=3, k=32)


def test_scale_of_a_shared_input_uses_every_reader():
    """s[j] = max|X_j|^a / max(|W_q[:, j]|, |W_k[:, j]|, |W_fc1[:, j]|)^(1-a), computed by hand."""
    torch.manual_seed(1)
    model = PreLN()
    x = torch.randn(8, 5, 16)
    with torch.no_grad():
        y = model.ln(x)
        act = y.abs().reshape(-1, 16).amax(0)
        w = torch.stack([m.weight.abs().amax(0) for m in (model.q, model.k, model.fc1)]).amax(0)
        q_before = model.q.weight.clone()
    expected = act.sqrt() / w.sqrt()
    quantize_model(model, "int8")
    smooth_quant(model, [{"x": x}], 0.5, device="cpu", min_gain=0.0)
    torch.testing.assert_close(model.q.weight, q_before * expected, rtol=4 * U, atol=0)


# -- checkpoint, export, CLI ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoothed_text(tmp_path_factory):
    from sample_models import text_encoder

    model = quantize_model(text_encoder.build(), "int8")
    batches = text_encoder.calibration_batches()[:2]
    report = smooth_quant(model, batches, 0.5, device="cpu", min_gain=0.0)
    calibrate(model, batches, device="cpu")
    path = tmp_path_factory.mktemp("sq") / "text_encoder.calib.pt"
    save_calibrated(
        path, model, ModelSpec("sample", "text_encoder"), batches[0], {"smoothquant": report.to_dict()}
    )
    return model, path, report


def test_reload_is_bit_identical(smoothed_text):
    model, path, _ = smoothed_text
    from sample_models import text_encoder

    loaded = load_calibrated(path).model
    assert smoothed_layers(loaded) == smoothed_layers(model) != []
    for b in text_encoder.evaluation_batches()[:2]:
        with torch.no_grad():
            assert torch.equal(model(**b), loaded(**b))
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_explicit_mul_exports_as_a_mul(smoothed_text, tmp_path):
    from exporters import export_onnx

    model, _, _ = smoothed_text
    from sample_models import text_encoder

    path = tmp_path / "text_encoder.onnx"
    export_onnx(model, text_encoder.calibration_batches()[0], path)
    g = onnx.load(str(path)).graph
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in g.initializer}
    mul_constants = [inits[n] for node in g.node if node.op_type == "Mul" for n in node.input if n in inits]
    wanted = [m.factor.numpy() for m in model.modules() if isinstance(m, SmoothMul)]
    # per layer: q, k, v (one Mul each, one factor), FFN up and down; and the classifier
    assert len(wanted) == 2 * 5 + 1
    for f in wanted:
        assert sum(np.array_equal(f, c) for c in mul_constants) >= 1


def test_cli_smoothquant_export_verify(tmp_path):
    ck, onnx_path = tmp_path / "text_encoder.calib.pt", tmp_path / "text_encoder.onnx"
    # a bare --smoothquant at the end of the line takes alpha 0.5 (subprocess: the real entry point)
    r = cli_subprocess(
        "calibrate",
        "text_encoder",
        "--num-samples",
        "64",
        "--out",
        ck,
        "--json",
        "--smoothquant-min-gain",
        "0",  # every layer: the folds are what is tested (test_smoothing_gain.py tests the choice)
        "--smoothquant",
    )
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)["smoothquant"]
    assert info["alpha"] == 0.5 and info["counts"] == {"layernorm": 0, "linear": 2, "mul": 7}
    assert load_calibrated(ck).data["calibration"]["smoothquant"]["alpha"] == 0.5
    r = cli("export", ck, "--onnx", onnx_path, "--json")
    assert r.exit_code == 0, r.output
    r = cli("verify", onnx_path, "--reference", ck, "--num-samples", "64", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["passed"] is True


def test_cli_alpha_out_of_range(tmp_path):
    out = tmp_path / "x.calib.pt"
    assert_clean_error(
        cli("calibrate", "text_encoder", "--smoothquant", "1.5", "--out", out), "--smoothquant", "[0, 1]"
    )
    assert not out.exists()


def test_optional_value_expansion():
    assert optional_values(["calibrate", "m", "--smoothquant"]) == ["calibrate", "m", "--smoothquant", "0.5"]
    assert optional_values(["calibrate", "--smoothquant", "m"]) == ["calibrate", "--smoothquant", "0.5", "m"]
    assert optional_values(["--smoothquant", "--json"]) == ["--smoothquant", "0.5", "--json"]
    assert optional_values(["--smoothquant", "0.8", "m"]) == ["--smoothquant", "0.8", "m"]
    assert optional_values(["--smoothquant=0.3"]) == ["--smoothquant=0.3"]


def test_dynamo_export_verifies(smoothed_text, tmp_path):
    from exporters import export_onnx
    from quantcli.verify import verify_onnx
    from sample_models import text_encoder

    model, ck, _ = smoothed_text
    path = tmp_path / "te-dynamo.onnx"
    export_onnx(model, text_encoder.calibration_batches()[0], path, exporter="dynamo")
    report = verify_onnx(path, ck, text_encoder.evaluation_batches()[:2], provider="cpu")
    assert report.passed, report.to_dict()


def test_a_fold_is_judged_on_the_readers_own_output_not_only_the_models():
    """SegFormer's MixFFN (Linear -> depthwise conv -> GELU -> Linear) beside a residual stream that dominates
    the model's output: folding 1/s into the first Linear moved the model's outputs by less than the bound
    (1e-4 of their largest magnitude), so the fold was taken, and the second Linear's output moved by 19%:
    calibrate stopped with "SmoothQuant changed what the float model computes ... please report this", and
    smooth_quant itself changed the float model. The trial now also compares each reader's own output."""
    from quantcli.calibration.smoothquant import smooth_quant

    class MixFFN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
            self.dw = torch.nn.Conv1d(16, 16, 3, padding=1, groups=16)
            self.skip = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.dw(self.fc1(x).transpose(1, 2)).transpose(1, 2)
            return self.skip(x) * 1e4 + self.fc2(torch.nn.functional.gelu(h))

    torch.manual_seed(0)
    net = MixFFN().eval()
    x = torch.randn(8, 12, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = net.fc2(torch.nn.functional.gelu(net.dw(net.fc1(x).transpose(1, 2)).transpose(1, 2)))
    model = quantize_model(net, {"preset": "int8", "cpu": "x86-vnni"}, example={"x": x[:2]})
    report = smooth_quant(model, [{"x": x}], 0.5, device="cpu", min_gain=0.0)
    fold = {tuple(g.consumers): (g.fold, g.into) for g in report.groups}
    assert fold[("fc2",)] == ("mul", None)  # not "linear" into fc1: GELU and the conv's bias lie between
    seen = {}
    h = model.fc2.register_forward_hook(lambda m, a, o: seen.setdefault("fc2", o.detach()))
    with quantizer_modes(model, "disabled"), torch.no_grad():
        model(x)
    h.remove()
    assert torch.allclose(seen["fc2"], want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
