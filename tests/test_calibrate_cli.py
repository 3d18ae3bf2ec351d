"""`quantcli calibrate` end to end: sample models, user models, every data format, and bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from quantcli import load_calibrated
from tests.helpers import assert_clean_error, cli, cli_subprocess

TINY = """
import torch
from torch import nn

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.conv = nn.Conv1d(2, 2, 1)

    def forward(self, x, bias=None):
        y = self.fc(x)
        return y if bias is None else y + bias

def make():
    torch.manual_seed(0)
    return Tiny()

def broken():
    raise RuntimeError("no GPU budget today")

def not_a_module():
    return 42
"""


@pytest.fixture
def tiny(tmp_path):
    f = tmp_path / "tiny.py"
    f.write_text(TINY)
    return f


def test_sample_model_needs_nothing_else(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = cli_subprocess("calibrate", "digits_cnn", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "quantizers calibrated" in r.stdout
    ck = tmp_path / "digits_cnn.calib.pt"
    data = torch.load(ck, weights_only=True)
    assert data["format"] == "quantcli.calibrated"
    assert data["inputs"]["names"] == ["x"] and data["inputs"]["dtypes"] == ["float32"]
    assert set(data["quantizers"]) >= {"conv1.input_quantizer", "fc2.weight_quantizer"}


def test_reload_is_bit_identical_to_the_calibrated_model(tmp_path):
    # the README: load_calibrated's outputs are bit-identical to the calibrated model's (the one in memory)
    from quantcli.calibration.calibrate import calibrate
    from quantcli.inputs.checkpoint import save_calibrated
    from quantcli.inputs.loading import load_model
    from quantcli.nn import quantize_model, quantizers
    from sample_models import text_encoder

    model, spec = load_model("text_encoder")
    quantize_model(model, "int8")
    batches = text_encoder.calibration_batches()[:3]
    calibrate(model, batches, "entropy", device="cpu")
    ck = tmp_path / "te.calib.pt"
    save_calibrated(ck, model, spec, batches[0])
    reloaded = load_calibrated(ck).model
    for name, q in quantizers(model).items():
        r = quantizers(reloaded)[name]
        assert r.enabled == q.enabled, name
        assert (q.amax is None and r.amax is None) or torch.equal(r.amax, q.amax), name
    for batch in text_encoder.evaluation_batches()[:3]:
        with torch.inference_mode():
            want = model(**batch)
            assert torch.equal(reloaded(**batch), want)
    # ...and not because quantization is a no-op here: the float model gives other outputs
    float_model, _ = load_model("text_encoder")
    with torch.inference_mode():
        assert not torch.equal(float_model(**batch), want)
    # the weights are quantized with the stored amax, as by hand
    q = reloaded.layers[0].attention.query
    d = q.weight_quantizer.desc  # 8 bits, or the 7-bit grid on a CPU whose u8s8 kernels can saturate
    assert (d.num_bits, d.narrow_range) in ((8, False), (7, True))
    from quantcli import fake_tensor_quant

    assert torch.equal(
        q.weight_quantizer(q.weight),
        fake_tensor_quant(q.weight, q.weight_quantizer.amax, d.num_bits, False, d.narrow_range),
    )


@pytest.mark.parametrize("method", ["max", "entropy", "mse", "percentile"])
def test_methods_json_summary(method, tmp_path):
    out = tmp_path / "d.calib.pt"
    r = cli("calibrate", "digits_cnn", "--method", method, "--out", out, "--json", "--num-samples", "128")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    # 4 layers x (input, weight), plus the output quantizers of Convs that no quantized layer reads directly
    extra = len(info["placement"]["output_quantized"])
    assert (
        info["method"] == method and info["num_samples"] == 128 and info["quantizers_calibrated"] == 8 + extra
    )
    assert out.is_file()


def test_a_method_that_asymmetric_quantizers_ignore_is_reported(tmp_path):
    """Asymmetric activation quantizers calibrate their min and max under ``--method entropy`` (a symmetric
    search): the summary's method row, a warning naming them and ``--json`` say so (the method row said
    ``entropy`` and nothing more), and their range is the data's own minimum and maximum. ``mse`` searches
    their
    range (tests/test_two_sided.py): no warning."""
    out = tmp_path / "a.calib.pt"
    args = ("calibrate", "digits_cnn", "--config", "uint8-asymmetric", "--num-samples", "128", "--out", out)
    r = cli(*args, "--method", "entropy")
    assert r.exit_code == 0, r.output
    flat = lambda text: " ".join(text.replace("│", " ").split())  # noqa: E731 (a wrapped table cell, one line)
    assert "asymmetric activation quantizer(s) from their min and max" in flat(r.stdout)
    assert "warning: --method entropy applies to symmetric grids only" in flat(r.stderr)
    info = json.loads(cli(*args, "--method", "entropy", "--json").stdout)
    inputs = sorted(n for n in info["calibrated"] if n.endswith("input_quantizer"))
    assert inputs and sorted(info["min_max"]) == inputs
    from sample_models import digits_cnn

    seen = []
    ref = digits_cnn.build().eval()
    ref.fc2.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        ref(**digits_cnn.calibration_batches(128)[0])  # the 128 samples calibrate took
    q = load_calibrated(out).model.fc2.input_quantizer
    x = torch.cat(seen)
    assert float(q.amax) == pytest.approx(float(x.max()), rel=1e-6)
    assert float(q.amin) == pytest.approx(float(x.min()), rel=1e-6)
    r = cli(*args, "--method", "max")
    assert r.exit_code == 0 and "warning: --method" not in r.stderr
    r = cli(*args, "--method", "mse", "--json")
    assert r.exit_code == 0 and "warning: --method" not in r.stderr and json.loads(r.stdout)["min_max"] == []
    q = load_calibrated(out).model.fc2.input_quantizer
    assert float(q.amax) < float(x.max()) or float(q.amin) > float(x.min())


def test_text_encoder_varying_lengths_and_integer_inputs(calibrated):
    ck = load_calibrated(calibrated("text_encoder"))
    assert ck.input_names == ["input_ids", "attention_mask"]
    assert ck.data["inputs"]["dtypes"] == ["int64", "int64"]
    from sample_models import text_encoder

    lengths = {b["input_ids"].shape[1] for b in text_encoder.calibration_batches()}
    assert len(lengths) > 3


def _write_data(tmp_path, kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 6, generator=g)
    if kind == "npz-named":
        p = tmp_path / "d.npz"
        np.savez(p, x=x.numpy().astype(np.float64))
    elif kind == "npz-positional":
        p = tmp_path / "d.npz"
        np.savez(p, x.numpy())
    elif kind == "npy":
        p = tmp_path / "d.npy"
        np.save(p, x.numpy())
    elif kind == "pt-tensor":
        p = tmp_path / "d.pt"
        torch.save(x, p)
    elif kind == "pt-dict":
        p = tmp_path / "d.pt"
        torch.save({"x": x, "bias": torch.zeros(40, 3)}, p)
    elif kind == "pt-list":
        p = tmp_path / "d.pt"
        torch.save([{"x": x[:10]}, {"x": x[10:25]}], p)
    else:
        p = tmp_path / "batches"
        p.mkdir()
        np.savez(p / "000.npz", x=x[:7].numpy())
        torch.save({"x": x[7:20]}, p / "001.pt")
        np.save(p / "002.npy", x[20:].numpy())
    return p


@pytest.mark.parametrize(
    "kind", ["npz-named", "npz-positional", "npy", "pt-tensor", "pt-dict", "pt-list", "dir"]
)
def test_user_model_every_data_format(tiny, tmp_path, kind):
    data = _write_data(tmp_path, kind)
    out = tmp_path / "tiny.calib.pt"
    rebatch = [] if kind == "dir" else ["--batch-size", "16"]  # batch files are used as they are
    r = cli("calibrate", f"{tiny}:make", "--data", data, "--out", out, "--json", *rebatch)
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["num_samples"] == (25 if kind == "pt-list" else 40)
    assert "fc.input_quantizer" in info["calibrated"]
    # the conv1d never runs: it is reported and left unquantized, also after reloading
    assert info["not_called"] == ["conv.input_quantizer", "conv.weight_quantizer"]
    ck = load_calibrated(out)
    assert not ck.model.conv.input_quantizer.enabled and ck.model.fc.input_quantizer.enabled


def test_weights_safetensors_and_pt(tiny, tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(1)
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_mod", tiny)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    m = mod.Tiny()
    save_file(m.state_dict(), str(tmp_path / "w.safetensors"))
    torch.save(m.state_dict(), tmp_path / "w.pt")
    data = _write_data(tmp_path, "npz-named")
    for w in ("w.safetensors", "w.pt"):
        out = tmp_path / f"{w}.calib.pt"
        r = cli(
            "calibrate", f"{tiny}:make", "--weights", tmp_path / w, "--data", data, "--out", out, "--json"
        )
        assert r.exit_code == 0, r.output
        ck = load_calibrated(out)
        assert torch.equal(ck.model.fc.weight, m.fc.weight)


def test_module_spec_form(tmp_path):
    out = tmp_path / "m.calib.pt"
    r = cli("calibrate", "sample_models.digits_cnn:build", "--data", tmp_path / "missing.npz", "--out", out)
    assert_clean_error(r, "missing.npz", "does not exist")
    np.savez(tmp_path / "x.npz", x=np.random.default_rng(0).random((16, 1, 8, 8), dtype=np.float32))
    r = cli(
        "calibrate", "sample_models.digits_cnn:build", "--data", tmp_path / "x.npz", "--out", out, "--json"
    )
    assert r.exit_code == 0, r.output


def test_bert_encoder_through_factory_file(tmp_path):
    pytest.importorskip("transformers")
    f = tmp_path / "bert.py"
    f.write_text(
        "import torch\nfrom transformers import BertConfig, BertModel\ndef make():\n    "
        "torch.manual_seed(0)\n    cfg = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, "
        "num_attention_heads=2,\n                     intermediate_size=64, max_position_embeddings=64)\n   "
        " return BertModel(cfg).eval()\n"
    )
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 120, (24, 12)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[:, 9:] = 0
    np.savez(tmp_path / "tok.npz", input_ids=ids, attention_mask=mask)
    out = tmp_path / "bert.calib.pt"
    r = cli(
        "calibrate",
        f"{f}:make",
        "--data",
        tmp_path / "tok.npz",
        "--out",
        out,
        "--json",
        "--method",
        "percentile",
    )
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert any(n.startswith("encoder.layer.1.attention.self.query") for n in info["calibrated"])
    ck = load_calibrated(out)
    assert ck.data["inputs"]["dtypes"] == ["int64", "int64"]


# ------------------------------------------------------------------------------------------ bad input


def _assert_no_output(tmp_path):
    assert not list(tmp_path.glob("*.calib.pt")), list(tmp_path.iterdir())
    assert not list(tmp_path.glob(".*.tmp"))


def test_bad_model_specs(tiny, tmp_path):
    out = tmp_path / "o.calib.pt"
    assert_clean_error(cli("calibrate", "no_such_model", "--out", out), "no_such_model", "factory")
    assert_clean_error(cli("calibrate", "nowhere/m.py:make", "--out", out), "does not exist")
    assert_clean_error(cli("calibrate", "no.such.pkg:make", "--out", out), "cannot import")
    assert_clean_error(
        cli("calibrate", f"{tiny}:broken", "--out", out), "raised RuntimeError", "no GPU budget"
    )
    assert_clean_error(cli("calibrate", f"{tiny}:not_a_module", "--out", out), "int", "not a torch.nn.Module")
    assert_clean_error(cli("calibrate", f"{tiny}:missing", "--out", out), "no callable")
    assert_clean_error(cli("calibrate", f"{tiny}:make", "--out", out), "--data")
    _assert_no_output(tmp_path)


def test_bad_weights(tiny, tmp_path):
    data = _write_data(tmp_path, "npz-named")
    out = tmp_path / "o.calib.pt"
    torch.save(
        {"fc.weight": torch.zeros(3, 7), "fc.bias": torch.zeros(3), "extra": torch.zeros(1)},
        tmp_path / "w.pt",
    )
    r = cli("calibrate", f"{tiny}:make", "--weights", tmp_path / "w.pt", "--data", data, "--out", out)
    assert_clean_error(r, "conv.weight", "extra", "fc.weight (3, 7) vs model (3, 6)")
    torch.save(torch.nn.Linear(2, 2), tmp_path / "module.pt")
    r = cli("calibrate", f"{tiny}:make", "--weights", tmp_path / "module.pt", "--data", data, "--out", out)
    assert_clean_error(r, "--trust-pickle")
    assert_clean_error(
        cli("calibrate", f"{tiny}:make", "--weights", tmp_path / "nope.pt", "--data", data, "--out", out),
        "does not exist",
    )
    (tmp_path / "w.txt").write_text("hi")
    assert_clean_error(
        cli("calibrate", f"{tiny}:make", "--weights", tmp_path / "w.txt", "--data", data, "--out", out),
        ".txt",
    )
    _assert_no_output(tmp_path)


def test_trust_pickle_reads_whole_module(tiny, tmp_path, monkeypatch):
    import importlib

    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("tiny")
    torch.save(mod.Tiny(), tmp_path / "whole.pt")
    data = _write_data(tmp_path, "npz-named")
    r = cli(
        "calibrate",
        f"{tiny}:make",
        "--weights",
        tmp_path / "whole.pt",
        "--trust-pickle",
        "--data",
        data,
        "--out",
        tmp_path / "o.calib.pt",
        "--json",
    )
    assert r.exit_code == 0, r.output


def test_bad_data(tiny, tmp_path):
    out = tmp_path / "o.calib.pt"
    np.savez(tmp_path / "wrongname.npz", y=np.zeros((4, 6), np.float32))
    assert_clean_error(
        cli("calibrate", f"{tiny}:make", "--data", tmp_path / "wrongname.npz", "--out", out),
        "'y'",
        "forward(x, bias)",
    )
    np.savez(tmp_path / "shape.npz", x=np.zeros((4, 5), np.float32))
    assert_clean_error(
        cli("calibrate", f"{tiny}:make", "--data", tmp_path / "shape.npz", "--out", out), "x: float32[4, 5]"
    )
    np.savez(tmp_path / "empty.npz", x=np.zeros((0, 6), np.float32))
    assert_clean_error(
        cli("calibrate", f"{tiny}:make", "--data", tmp_path / "empty.npz", "--out", out), "no samples"
    )
    x = np.ones((4, 6), np.float32)
    x[2, 3] = np.nan
    np.savez(tmp_path / "nan.npz", x=x)
    assert_clean_error(
        cli("calibrate", f"{tiny}:make", "--data", tmp_path / "nan.npz", "--out", out),
        "fc.input_quantizer",
        "NaN",
    )
    (tmp_path / "d.csv").write_text("1,2")
    assert_clean_error(cli("calibrate", f"{tiny}:make", "--data", tmp_path / "d.csv", "--out", out), ".csv")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    assert_clean_error(
        cli("calibrate", f"{tiny}:make", "--data", tmp_path / "junk.npz", "--out", out), "cannot read"
    )
    _assert_no_output(tmp_path)


def test_bad_options(tmp_path):
    out = tmp_path / "o.calib.pt"
    r = cli("calibrate", "digits_cnn", "--method", "median", "--out", out)
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert_clean_error(cli("calibrate", "digits_cnn", "--config", "int3", "--out", out), "int3")
    (tmp_path / "c.yaml").write_text("rules:\n  - {pattern: '*', colour: red}\n")
    assert_clean_error(
        cli("calibrate", "digits_cnn", "--config", tmp_path / "c.yaml", "--out", out), "colour"
    )
    if not torch.cuda.is_available():
        assert_clean_error(cli("calibrate", "digits_cnn", "--device", "cuda", "--out", out), "no CUDA GPU")
    assert_clean_error(
        cli("calibrate", "digits_cnn", "--out", tmp_path / "no" / "dir" / "o.calib.pt"), "does not exist"
    )
    _assert_no_output(tmp_path)


@pytest.mark.cuda
def test_calibrate_on_cuda(tmp_path):
    out = tmp_path / "c.calib.pt"
    r = cli("calibrate", "digits_cnn", "--device", "cuda", "--method", "entropy", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["device"].startswith("cuda")
    cpu = tmp_path / "p.calib.pt"
    assert (
        cli(
            "calibrate", "digits_cnn", "--device", "cpu", "--method", "entropy", "--out", cpu, "--json"
        ).exit_code
        == 0
    )
    a, b = load_calibrated(out), load_calibrated(cpu)
    for (n, qa), qb in zip(a.quantizer_info.items(), b.quantizer_info.values()):
        assert torch.allclose(qa["amax"], qb["amax"], rtol=1e-5), n


def test_inspect_checkpoint(calibrated):
    r = cli("inspect", calibrated("digits_cnn", "int4-weight-only"), "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    rows = {q["name"]: q for q in info["quantizers"]}
    # JSON keys are strings
    assert rows["fc1.weight_quantizer"]["format"] == "int4" and rows["fc1.weight_quantizer"][
        "block_sizes"
    ] == {"-1": 128}
    assert not rows["fc1.input_quantizer"]["enabled"]
    assert info["inputs"]["names"] == ["x"]
    table = cli("inspect", calibrated("digits_cnn"))
    assert table.exit_code == 0 and "conv1.weight_quantizer" in table.output


def test_usage_errors_are_one_line_from_the_real_cli(tmp_path):
    for args, fragment in (
        (["export", "x.calib.pt"], "Missing option '--onnx'"),
        (["calibrate", "digits_cnn", "--method", "median"], "'median' is not one of"),
        (["nosuch"], "No such command"),
        (["calibrate", "digits_cnn", "--out", str(tmp_path)], "is a directory"),
    ):
        r = cli_subprocess(*args, cwd=tmp_path)
        assert_clean_error(r, fragment)
    ok = cli_subprocess("--help")
    assert ok.returncode == 0 and "calibrate" in ok.stdout
    assert cli_subprocess("--version").stdout.startswith("quantcli ")


def test_console_script_imports_a_model_module_from_the_working_directory(tmp_path):
    """README: `python -m quantcli` works as well as `quantcli`. The console script's sys.path[0] is its bin/
    folder, so `quantcli calibrate mymodel:make` in the folder holding mymodel.py failed ("No module named
    'mymodel'") where `python -m quantcli` worked."""
    script = Path(sys.executable).parent / "quantcli"
    assert script.exists(), script
    (tmp_path / "mymodel_qa.py").write_text(
        "import torch\n\ndef make():\n    torch.manual_seed(0)\n    return "
        "torch.nn.Sequential(torch.nn.Linear(4, 3))\n"
    )
    np.savez(tmp_path / "d.npz", np.random.default_rng(0).random((8, 4), dtype=np.float32))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    r = subprocess.run(
        [str(script), "calibrate", "mymodel_qa:make", "--data", "d.npz", "--out", "o.pt", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "o.pt").is_file()


def test_data_file_that_is_not_its_format_says_so(tmp_path):
    """A text file named .pt/.npz/.npy used to give the reader's internals ("cannot read junk.pt: 174812789",
    numpy's allow_pickle advice): the message says the file is not the format its suffix names."""
    out = tmp_path / "o.pt"
    for suffix, kind in ((".pt", "torch.save"), (".npz", ".npz archive"), (".npy", ".npy array")):
        (tmp_path / f"junk{suffix}").write_text("this is not data\n")
        assert_clean_error(
            cli("calibrate", "digits_cnn", "--data", tmp_path / f"junk{suffix}", "--out", out),
            f"junk{suffix}: it is not",
            kind,
        )
    assert not out.exists()


def test_method_choices_come_from_the_registry():
    """--method offers exactly calibrators.methods.CALIBRATION_METHODS, in its order, and refuses anything
    else."""
    from calibrators.methods import CALIBRATION_METHODS

    assert f"<{'|'.join(CALIBRATION_METHODS)}>" in cli("calibrate", "--help").stdout
    bad = cli("calibrate", "digits_cnn", "--method", "minmax")
    assert bad.exit_code == 2 and "minmax" in bad.stderr


MLP = """
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def make():
    torch.manual_seed(0)
    return MLP()
"""


def test_activations_that_saw_only_zeros_are_named(tmp_path):
    """All-zero calibration data gave fc1's input an amax of 0 without a word (its inputs then quantize to 0,
    and verify passes the graph, since the graph computes what the checkpoint does). fc2's input, the ReLU of
    fc1's bias, is not zero and is not named."""
    (tmp_path / "mlp.py").write_text(MLP)
    np.save(tmp_path / "zeros.npy", np.zeros((32, 16), np.float32))
    model = f"{tmp_path / 'mlp.py'}:make"
    r = cli("calibrate", model, "--data", tmp_path / "zeros.npy", "--out", tmp_path / "z.calib.pt")
    assert r.exit_code == 0, r.output
    assert "1 activation quantizer(s) saw only zeros" in r.stderr and "fc1.input_quantizer" in r.stderr
    assert "fc2.input_quantizer" not in r.stderr
    r = cli("calibrate", model, "--data", tmp_path / "zeros.npy", "--out", tmp_path / "j.calib.pt", "--json")
    assert json.loads(r.stdout)["zero_amax"] == ["fc1.input_quantizer"]
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32))
    r = cli("calibrate", model, "--data", tmp_path / "x.npy", "--out", tmp_path / "x.calib.pt")
    assert r.exit_code == 0 and "saw only zeros" not in r.stderr


DENORMAL = """
import torch
from torch import nn


class Denormal(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        with torch.no_grad():  # fc2's input: 2.5e-39, a float32 denormal (a random-init MobileViT's conv)
            self.fc1.weight.zero_()
            self.fc1.bias.fill_(2.5e-39)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def make():
    torch.manual_seed(0)
    return Denormal()
"""


def test_a_denormal_activation_range_is_taken_as_zero(tmp_path):
    """An input range of 2.5e-39 gave a scale whose product with the weight's underflowed to 0: calibrate
    ended in an internal error ("fc2: its int32 bias still saturates after widening its weight range"), and
    where the bias was 0, verify did ("cannot convert float NaN to integer"). It is named as a quantizer that
    saw only zeros, and the graph exports and verifies."""
    (tmp_path / "den.py").write_text(DENORMAL)
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((32, 8)).astype(np.float32))
    model, ck, graph = f"{tmp_path / 'den.py'}:make", tmp_path / "d.calib.pt", tmp_path / "d.onnx"
    r = cli("calibrate", model, "--data", tmp_path / "x.npy", "--placement", "all", "--out", ck, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["zero_amax"] == ["fc2.input_quantizer"]
    assert float(torch.load(ck, weights_only=True)["state_dict"]["fc2.input_quantizer.amax"]) == 0
    assert cli("export", ck, "--onnx", graph).exit_code == 0
    r = cli("verify", graph, "--reference", ck, "--data", tmp_path / "x.npy")
    assert r.exit_code == 0, r.output


NEGATIVE = """
import torch
import torch.nn.functional as F
from torch import nn


class NegIn(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(-F.softplus(self.fc1(x)))


def make():
    torch.manual_seed(0)
    return NegIn()
"""


def test_an_asymmetric_range_below_zero_did_not_see_only_zeros(tmp_path):
    """fc2's inputs are all negative: its asymmetric range is [min, 0], amax 0 and amin below it. It was named
    as having seen only zeros (amax alone was read)."""
    (tmp_path / "neg.py").write_text(NEGATIVE)
    np.save(tmp_path / "x.npy", np.random.default_rng(2).standard_normal((64, 6)).astype(np.float32))
    model, out = f"{tmp_path / 'neg.py'}:make", tmp_path / "n.calib.pt"
    r = cli("calibrate", model, "--data", tmp_path / "x.npy", "--placement", "all", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    assert "saw only zeros" not in r.stderr and json.loads(r.stdout)["zero_amax"] == []
    sd = torch.load(out, weights_only=True)["state_dict"]
    assert float(sd["fc2.input_quantizer.amax"]) == 0 and float(sd["fc2.input_quantizer.amin"]) < -1


def test_the_method_row_names_its_settings(tmp_path):
    """``method: percentile (int8)`` did not say which percentile (the checkpoint stored it)."""
    r = cli(
        "calibrate",
        "digits_cnn",
        "--method",
        "percentile",
        "--percentile",
        "99.9",
        "--num-bins",
        "1024",
        "--out",
        tmp_path / "p.calib.pt",
    )
    assert r.exit_code == 0, r.output
    (row,) = [ln for ln in r.stdout.splitlines() if "│ method" in ln]
    assert "percentile 99.9, 1024 bins (int8)" in row
    assert "unused" not in row and "changed nothing" not in r.stderr


@pytest.mark.parametrize("config", ["int4-weight-only", "int8-dynamic"])
def test_a_method_that_chooses_no_range_says_so(tmp_path, config):
    """``--method percentile --percentile 99.9`` under a config that calibrates no activation (weights only,
    or every activation quantized at run time) changed nothing, and the method row named the percentile as if
    it had been used."""
    r = cli(
        "calibrate",
        "tiny_llama",
        "--config",
        config,
        "--method",
        "percentile",
        "--percentile",
        "99.9",
        "--out",
        tmp_path / "p.calib.pt",
    )
    assert r.exit_code == 0, r.output
    assert "--method percentile chooses activation ranges" in r.stderr and "changed nothing" in r.stderr
    (row,) = [ln for ln in r.stdout.splitlines() if "│ method" in ln]
    assert "unused: no activation range to choose" in row
    r = cli(
        "calibrate",
        "tiny_llama",
        "--config",
        config,
        "--method",
        "mse",
        "--out",
        tmp_path / "m.calib.pt",
        "--json",
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["calibrated_by_method"] == 0
    r = cli("calibrate", "tiny_llama", "--method", "percentile", "--out", tmp_path / "a.calib.pt", "--json")
    assert r.exit_code == 0, r.output
    assert "changed nothing" not in r.stderr and json.loads(r.stdout)["calibrated_by_method"] > 0


@pytest.mark.parametrize("method", ["percentile", "mse", "auto"])
def test_a_num_bins_the_asymmetric_search_cannot_take_is_refused_up_front(tmp_path, method):
    """``--num-bins 1000`` with mse/percentile/auto on the default int8 config (signed activations on uint8
    with a zero point) ended in an internal error, exit 3: "num_bins must be a power of two >= 2". It is
    refused before calibrating, exit 2, with the powers of two around it."""
    out = tmp_path / "t.calib.pt"
    r = cli("calibrate", "text_encoder", "--method", method, "--num-bins", "1000", "--out", out)
    assert_clean_error(r, "--num-bins 1000", "power of two", "512 or 1024", "asymmetric_activations: false")
    assert not out.exists()
    cfg = tmp_path / "sym.yaml"
    cfg.write_text("preset: int8\nasymmetric_activations: false\n")
    r = cli(
        "calibrate", "text_encoder", "--method", method, "--num-bins", "1000", "--config", cfg, "--out", out
    )
    assert r.exit_code == 0, r.output


def test_inspect_shows_an_asymmetric_quantizers_minimum(tmp_path):
    """An asymmetric quantizer's range is [amin, amax]; inspect showed only amax, so the grid the graph
    runs (its zero point) could not be read from the table or --json. The minimum is what load_calibrated
    rebuilds the quantizer with."""
    from quantcli.inputs.checkpoint import load_calibrated
    from quantcli.nn import quantizers

    ck = tmp_path / "te.calib.pt"
    assert cli("calibrate", "text_encoder", "--num-samples", "16", "--out", ck).exit_code == 0
    r = cli("inspect", ck, "--json")
    assert r.exit_code == 0, r.output
    rows = {q["name"]: q for q in json.loads(r.stdout)["quantizers"]}
    model = load_calibrated(ck).model
    asym = [n for n, q in quantizers(model).items() if q.enabled and q.desc.asymmetric]
    assert asym
    for n in asym:
        want = float(quantizers(model)[n].amin)
        assert want < 0 and rows[n]["amin_values"] == [pytest.approx(want)]
    sym = next(n for n, q in quantizers(model).items() if q.enabled and not q.desc.asymmetric)
    assert rows[sym]["amin"] is None
    table = cli("inspect", ck).output
    line = next(ln for ln in table.splitlines() if asym[0] in ln)
    assert f"{float(quantizers(model)[asym[0]].amin):.5g}"[:5] in line
