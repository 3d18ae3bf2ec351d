"""`quantcli export --onnx`: standard Q/DQ graphs for every format, checked in onnxruntime."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from exporters import export_onnx
from exporters.graph import PROPAGATED_MARK, qdq_pairs, quantizer_map
from quantcli import load_calibrated, quantize_model
from quantcli.calibration.calibrate import calibrate
from quantcli.nn import quantizers
from quantcli.verify import verify_onnx
from tests.helpers import assert_clean_error, calibrated_file, cli, exported_and_verified
from tests.ort_util import onnx_and_torch

T = onnx.TensorProto
FORMATS = {
    # config: (opset, activation elem type or None, weight elem type, blocked weights) the onnxruntime target
    # (default) stores int8 activation codes as uint8 + 128 (exporters.onnxruntime.placement)
    "int8": (13, T.UINT8, T.INT8, False),
    "int8-per-tensor": (13, T.UINT8, T.INT8, False),
    "uint8-asymmetric": (13, T.UINT8, T.INT8, False),
    "fp8": (19, T.FLOAT8E4M3FN, T.FLOAT8E4M3FN, False),
    "int4-weight-only": (21, None, T.INT4, True),
}


def _opset(m):
    return next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))


def _hand_scales(ck, config: str) -> dict[str, np.ndarray]:
    """Each enabled quantizer's float32 scale by the formula in numpy, not by quantcli's code: a weight's
    amax is max |w| taken here from the weights themselves (per output channel for the per-channel
    presets), an activation's is the calibrated amax (min and max on an asymmetric grid: uint8-asymmetric, and
    the signed activations of int8 on the onnxruntime target); scale = amax / bound in float32."""
    bound = {"int8": 127, "int8-per-tensor": 127, "uint8-asymmetric": 127, "fp8": 448, "int4-weight-only": 7}[
        config
    ]
    params = dict(ck.model.named_parameters())
    out = {}
    for name, q in quantizers(ck.model).items():
        if not q.enabled:
            continue
        if name.endswith("weight_quantizer"):
            w = params[name.rsplit(".", 1)[0] + ".weight"].detach().numpy().astype(np.float32)
            # blocks of 128 along the input dimension (fewer where it is shorter)
            if config == "int4-weight-only":
                a = np.abs(w.reshape(w.shape[0], w.shape[1], -1))
                k = a.shape[1]
                amax = (
                    np.abs(w.reshape(w.shape[0], -1)).max(1)
                    if q.desc.axis == 0
                    else (a.reshape(w.shape[0], -1, min(k, 128), a.shape[2]).max(2).reshape(-1))
                )
            elif config in ("int8-per-tensor", "fp8"):
                amax = np.abs(w).max(keepdims=True).reshape(1)
            else:
                amax = np.abs(w.reshape(w.shape[0], -1)).max(1)
            # integer weights: on the 7-bit grid where the deployment CPU's u8s8 kernels could saturate
            # (quantcli.quant.u8s8; tests/test_saturation.py tests that choice), else the config's
            wbound = bound if config in ("fp8", "int4-weight-only") else 2 ** (q.desc.num_bits - 1) - 1
            out[name] = (amax.astype(np.float32) / np.float32(wbound)).astype(np.float32)
        elif q.desc.asymmetric:  # uint8-asymmetric; signed activations of int8 on the onnxruntime target
            hi = np.maximum(q.amax.detach().numpy().astype(np.float32), np.float32(0))
            lo = np.minimum(q.amin.detach().numpy().astype(np.float32), np.float32(0))
            out[name] = ((hi - lo) / np.float32(255)).astype(np.float32).reshape(-1)
        else:
            # post-ReLU inputs use the unsigned grid [0, 255] under the onnxruntime target
            # (quantcli.nn.placement)
            b = 255 if q.desc.unsigned else bound
            out[name] = (
                (q.amax.detach().numpy().astype(np.float32) / np.float32(b)).astype(np.float32).reshape(-1)
            )
    return out


@pytest.mark.parametrize("config", list(FORMATS))
def test_digits_every_format(config, calibrated, exported):
    opset, act_type, w_type, blocked = FORMATS[config]
    path = exported("digits_cnn", config)
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert _opset(model) == opset
    pairs = {p.quantizer: p for p in qdq_pairs(model)}
    ck = load_calibrated(calibrated("digits_cnn", config))
    if config.startswith(
        "int8"
    ):  # the onnxruntime target: the image input (signed) on uint8 with a zero point
        assert ck.model.conv1.input_quantizer.desc.asymmetric
        assert not ck.model.fc1.input_quantizer.desc.asymmetric  # after a ReLU: the unsigned grid
    scales = _hand_scales(ck, config)
    assert set(scales) == {n for n, q in quantizers(ck.model).items() if q.enabled}
    inits = {t.name: t for t in model.graph.initializer}
    for name, want in scales.items():
        p = pairs[name]
        # MatMulNBits form (exporters.matmul_nbits): a Linear's blocked codes and scales are stored [in, out]
        scale = p.scale.T if p.transposed else p.scale
        assert np.array_equal(scale.reshape(-1).astype(np.float32), want), name
        if name.endswith("weight_quantizer"):
            assert p.stored == "initializer" and inits[p.tensor].data_type == w_type, name
        else:
            assert (
                p.stored == "runtime"
                and p.format == {T.INT8: "int8", T.UINT8: "uint8", T.FLOAT8E4M3FN: "fp8-e4m3"}[act_type]
            )
    zp_types = {
        t.data_type
        for n in model.graph.node
        if n.op_type == "DequantizeLinear"
        for t in model.graph.initializer
        if len(n.input) > 2 and t.name == n.input[2]
    }
    # integer activations: Conv/Gemm biases are int32 DequantizeLinears (onnxruntime's QLinearConv/QGemm add
    # them)
    assert zp_types == ({act_type, w_type} - {None}) | ({T.INT32} if act_type in (T.INT8, T.UINT8) else set())
    if blocked:
        assert any(p.block_size for p in pairs.values())
        assert not any(n.op_type == "QuantizeLinear" for n in model.graph.node)  # weight-only: no runtime Q
    # no float weight is left in the file
    float_weights = [
        t.name
        for t in model.graph.initializer
        if t.name.endswith(".weight") and t.data_type == T.FLOAT and not t.name.startswith("bn")
    ]
    assert float_weights == []
    rep = verify_onnx(path, ck, deployment=False)
    assert rep.structure["passed"], rep.structure["problems"]
    assert all(v["identical_codes"] == 1.0 for v in rep.fidelity["quantizers"].values())
    assert rep.passed


def test_int8_file_is_about_4x_smaller(calibrated, exported, tmp_path):
    small = exported("digits_cnn", "int8")
    big = tmp_path / "qdq.onnx"
    r = cli("export", calibrated("digits_cnn", "int8"), "--onnx", big, "--weights-qdq")
    assert r.exit_code == 0, r.output
    assert big.stat().st_size > 2.5 * small.stat().st_size
    m = onnx.load(str(big))
    # one per quantizer; the copies in front of MaxPool/Flatten are the fc1 input quantizer's
    enabled = [
        n for n, q in load_calibrated(calibrated("digits_cnn", "int8")).quantizer_info.items() if q["enabled"]
    ]
    assert sum(n.op_type == "QuantizeLinear" and PROPAGATED_MARK not in n.name for n in m.graph.node) == len(
        enabled
    )
    assert verify_onnx(big, calibrated("digits_cnn", "int8"), deployment=False).passed


def test_text_encoder_dynamic_batch_and_sequence(calibrated, exported):
    path = exported("text_encoder", "int8")
    ck = load_calibrated(calibrated("text_encoder", "int8"))
    model = onnx.load(str(path))
    dims = {
        i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input
    }
    assert dims == {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"]}
    from sample_models.text_encoder import tokenize

    seen = {b["input_ids"].shape[1] for b in ck.evaluation_batches()} | {ck.example["input_ids"].shape[1]}
    lines = ["def f(x): return x + 1  # a line of code", "A sentence of prose that", "print('hi')"]
    batch = tokenize(lines)
    assert batch["input_ids"].shape[1] not in {ck.example["input_ids"].shape[1]}
    got, want = onnx_and_torch(model, ck.model, batch)
    assert np.abs(got - want).max() < 1e-3 * max(1.0, np.abs(want).max())
    assert len(seen) > 1


def test_static_shapes(calibrated, tmp_path):
    out = tmp_path / "s.onnx"
    assert cli("export", calibrated("digits_cnn"), "--onnx", out, "--static-shapes").exit_code == 0
    dims = [d.dim_value for d in onnx.load(str(out)).graph.input[0].type.tensor_type.shape.dim]
    assert dims == [8, 1, 8, 8]


def test_metadata_and_summary_json(calibrated, tmp_path):
    out = tmp_path / "m.onnx"
    r = cli("export", calibrated("digits_cnn"), "--onnx", out, "--json")
    info = json.loads(r.stdout)
    enabled = [n for n, q in load_calibrated(calibrated("digits_cnn")).quantizer_info.items() if q["enabled"]]
    acts = sum(not n.endswith("weight_quantizer") for n in enabled)
    assert (
        info["pairs_by_format"] == {"int8": 4, "uint8": acts}
        and info["weights_stored_quantized"] == 4
        and info["opset"] == 13
    )
    m = onnx.load(str(out))
    meta = {p.key: p.value for p in m.metadata_props}
    assert meta["quantcli.version"] and json.loads(meta["quantcli.config"])["preset"] == "int8"
    assert set(quantizer_map(m).values()) == set(load_calibrated(calibrated("digits_cnn")).quantizer_info)


def test_inspect_onnx_lists_pairs(exported):
    r = cli("inspect", exported("digits_cnn", "int4-weight-only"), "--json")
    rows = json.loads(r.stdout)
    assert rows["opset"] == 21
    assert {p["quantizer"] for p in rows["pairs"]} == {
        "conv1.weight_quantizer",
        "conv2.weight_quantizer",
        "fc1.weight_quantizer",
        "fc2.weight_quantizer",
    }
    assert {p["format"] for p in rows["pairs"]} == {"int4"}


def test_inspect_onnx_json_has_the_numbers(exported):
    """``--json`` gives every scale and zero point as numbers (not the table's short text) and a stored
    weight's code range, each read back from the graph's own initializers here."""
    from onnx import numpy_helper

    path = exported("digits_cnn")
    rows = json.loads(cli("inspect", path, "--json").stdout)
    m = onnx.load(str(path))
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    dq = {n.output[0]: n for n in m.graph.node if n.op_type == "DequantizeLinear"}
    weights = [p for p in rows["pairs"] if p["stored"] == "initializer"]
    assert len(weights) == 4
    for p in rows["pairs"]:
        node = dq[p["output"]]
        assert p["scale_values"] == inits[node.input[1]].reshape(-1).astype(float).tolist()
        assert p["zero_point_values"] == inits[node.input[2]].reshape(-1).astype(int).tolist()
        if p["stored"] == "initializer":
            codes = inits[node.input[0]]
            assert p["codes"] == [int(codes.min()), int(codes.max())]
        else:
            assert p["codes"] is None
    conv1 = next(p for p in weights if p["quantizer"] == "conv1.weight_quantizer")
    assert len(conv1["scale_values"]) == 16  # per channel, none cut


def test_inspect_onnx_lists_dynamic_layers(exported):
    """A dynamic graph has no Q/DQ pair; inspect lists its DynamicQuantizeLinear -> MatMulInteger layers with
    their quantizers and the weights' scales and codes, as stored."""
    from onnx import numpy_helper

    path = exported("text_encoder", "int8-dynamic")
    rows = json.loads(cli("inspect", path, "--json").stdout)
    m = onnx.load(str(path))
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    mmi = {n.name: n for n in m.graph.node if n.op_type == "MatMulInteger"}
    assert rows["pairs"] == [] and len(rows["dynamic"]) == len(mmi) == 13
    for d in rows["dynamic"]:
        module = d["weight_quantizer"].rsplit(".", 1)[0]
        assert d["input_quantizer"] == f"{module}.input_quantizer"
        codes = inits[mmi[d["node"]].input[1]]
        assert d["codes"] == [int(codes.min()), int(codes.max())] and d["weight_format"] == "int8"
        assert len(d["weight_scale_values"]) == codes.shape[1]  # one per output channel
    assert "13 dynamic layers" in cli("inspect", path).stdout


# ------------------------------------------------------------------------- narrow range, dead channels


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2)

    def forward(self, x):
        return self.b(self.a(x))


def _export_and_compare(model, x, tmp_path, opset=None):
    path = tmp_path / "m.onnx"
    export_onnx(model, {"x": x}, path, opset=opset)
    return (*onnx_and_torch(path, model, {"x": x}), onnx.load(str(path)))


@pytest.mark.parametrize("num_bits", [8, 6, 4])
def test_narrow_range_parity_beyond_amax(num_bits, tmp_path):
    torch.manual_seed(0)
    m = quantize_model(
        Two().eval(), {"rules": [{"pattern": "*", "narrow_range": True, "num_bits": num_bits}]}
    )
    x = torch.randn(64, 4) * 3
    calibrate(m, [{"x": x}], device="cpu")
    # most values lie beyond amax: clipped to -bound, not -bound-1
    m.a.input_quantizer.set_amax(torch.tensor(0.5))
    xt = torch.randn(256, 4) * 3
    got, want, model = _export_and_compare(m, xt, tmp_path)
    assert np.array_equal(got, want) or np.abs(got - want).max() < 1e-5
    ops = [n.op_type for n in model.graph.node]
    assert "Max" in ops and "Min" in ops  # ONNX has no narrow range: an explicit clip keeps parity


def test_dead_channels_export_to_zero(tmp_path):
    torch.manual_seed(0)
    m = quantize_model(Two().eval())
    with torch.no_grad():
        m.a.weight[1] = 0.0  # a dead output channel: weight amax 0
    x = torch.randn(32, 4)
    calibrate(m, [{"x": x}], device="cpu")
    assert m.a.weight_quantizer.amax[1].item() == 0.0
    m.b.input_quantizer.set_amax(torch.tensor(0.0))  # a dead activation
    got, want, model = _export_and_compare(m, x, tmp_path)
    for t in model.graph.initializer:
        if t.data_type == T.FLOAT:
            assert np.all(np.isfinite(onnx.numpy_helper.to_array(t)))
    scales = [p.scale for p in qdq_pairs(model)]
    assert all(np.all(s > 0) and np.all(np.isfinite(s)) for s in scales)
    assert np.abs(got - want).max() < 1e-5


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
def test_fp8_saturates_at_448_in_onnxruntime(per_channel, tmp_path):
    torch.manual_seed(0)
    rules = [{"pattern": "*.weight_quantizer", "axis": 0}] if per_channel else []
    m = quantize_model(Two().eval(), {"preset": "fp8", "rules": rules})
    x = torch.randn(32, 4) * 100
    calibrate(m, [{"x": x}], device="cpu", method="mse")
    amax_in = m.a.input_quantizer.amax.item()
    xt = x * 3
    assert (xt.abs() / (amax_in / 448) > 448).any()  # inputs beyond amax: saturation is exercised
    got, want, model = _export_and_compare(m, xt, tmp_path)
    assert _opset(model) == 19
    assert np.abs(got - want).max() <= 1e-5 * max(1, np.abs(want).max())
    pairs = {p.quantizer: p for p in qdq_pairs(model)}
    w = m.a.weight.detach().numpy()
    want_scale = (np.abs(w).max(1) if per_channel else np.abs(w).max(keepdims=True).reshape(1)) / np.float32(
        448
    )
    got_scale = pairs["a.weight_quantizer"].scale.reshape(-1)
    assert got_scale.shape == ((3,) if per_channel else (1,))
    assert np.array_equal(got_scale, want_scale.astype(np.float32))
    if per_channel:
        assert pairs["a.weight_quantizer"].axis == 0 and len(set(got_scale.tolist())) == 3


# ------------------------------------------------------------------------------------------ bad input


def test_not_a_checkpoint(tmp_path):
    torch.save({"a": torch.zeros(1)}, tmp_path / "x.pt")
    assert_clean_error(
        cli("export", tmp_path / "x.pt", "--onnx", tmp_path / "o.onnx"),
        "not a quantcli calibrated checkpoint",
    )
    (tmp_path / "t.pt").write_text("hello")
    assert_clean_error(
        cli("export", tmp_path / "t.pt", "--onnx", tmp_path / "o.onnx"),
        "not a quantcli calibrated checkpoint",
    )
    assert_clean_error(cli("export", tmp_path / "none.pt", "--onnx", tmp_path / "o.onnx"), "does not exist")
    assert not (tmp_path / "o.onnx").exists()


def test_not_a_checkpoint_says_what_the_file_is(exported, tmp_path):
    """The message used to be torch's unpickler detail ("cannot read it: 174812789", or torch's weights_only
    advice, cut mid-word for an ONNX file passed where the checkpoint goes): say what the file is."""
    (tmp_path / "t.pt").write_text("hello")
    assert_clean_error(
        cli("export", tmp_path / "t.pt", "--onnx", tmp_path / "o.onnx"), "not a file written by torch.save"
    )
    assert_clean_error(
        cli("export", exported("digits_cnn"), "--onnx", tmp_path / "o.onnx"), "looks like an ONNX graph"
    )
    assert_clean_error(
        cli("verify", exported("digits_cnn"), "--reference", exported("digits_cnn")),
        "looks like an ONNX graph",
        ".calib.pt",
    )
    assert not (tmp_path / "o.onnx").exists()


def test_opset_too_low_names_format(calibrated, tmp_path):
    out = tmp_path / "o.onnx"
    assert_clean_error(
        cli("export", calibrated("digits_cnn", "fp8"), "--onnx", out, "--opset", "17"), "fp8-e4m3", ">= 19"
    )
    assert_clean_error(
        cli("export", calibrated("digits_cnn", "int4-weight-only"), "--onnx", out, "--opset", "19"),
        "int4",
        ">= 21",
    )
    assert not out.exists()


def test_unwritable_output(calibrated, tmp_path):
    assert_clean_error(
        cli("export", calibrated("digits_cnn"), "--onnx", tmp_path / "no" / "o.onnx"), "does not exist"
    )
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        import os

        if not os.access(ro, os.W_OK):  # root can write anywhere
            assert_clean_error(
                cli("export", calibrated("digits_cnn"), "--onnx", ro / "o.onnx"), "not writable"
            )
    finally:
        ro.chmod(0o700)
    assert_clean_error(cli("export", calibrated("digits_cnn"), "--onnx", tmp_path / "o.txt"), ".onnx")


def test_directory_as_output_is_refused_before_exporting(calibrated, tmp_path):
    target = tmp_path / "o.onnx"
    target.mkdir()
    assert_clean_error(
        cli("export", calibrated("digits_cnn"), "--onnx", target), "is a directory", "file name"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.onnx"] and not any(target.iterdir())


def test_uncalibrated_quantizers_listed(calibrated, tmp_path):
    """save_calibrated refuses an uncalibrated model before writing anything; a checkpoint whose amax went
    missing afterwards is refused by export, by name."""
    from quantcli.errors import ConfigError
    from quantcli.inputs.checkpoint import save_calibrated
    from quantcli.inputs.loading import load_model

    model, spec = load_model("digits_cnn")
    quantize_model(model)
    with pytest.raises(ConfigError, match="without an amax: conv1.input_quantizer"):
        save_calibrated(tmp_path / "u.calib.pt", model, spec, {"x": torch.zeros(2, 1, 8, 8)})
    assert not (tmp_path / "u.calib.pt").exists()
    data = torch.load(calibrated("digits_cnn"), weights_only=False)
    data["quantizers"]["conv1.input_quantizer"]["amax"] = None
    for key in ("amax", "amin"):
        del data["state_dict"][f"conv1.input_quantizer.{key}"]
    torch.save(data, tmp_path / "u.calib.pt")
    r = cli("export", tmp_path / "u.calib.pt", "--onnx", tmp_path / "o.onnx")
    assert_clean_error(r, "amax missing", "conv1.input_quantizer")
    assert not (tmp_path / "o.onnx").exists()


def test_external_data_for_large_models(calibrated, tmp_path, monkeypatch):
    from exporters import onnx_export

    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 1000)
    out = tmp_path / "big.onnx"
    res = export_onnx(
        load_calibrated(calibrated("digits_cnn")).model,
        load_calibrated(calibrated("digits_cnn")).example,
        out,
    )
    assert res.external_data and (tmp_path / "big.onnx.data").is_file()
    m = onnx.load(str(out))
    onnx.checker.check_model(str(out))
    assert len(m.graph.initializer) > 0
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".quantcli-export")] == []


def test_learned_amax_exports_as_constant(tmp_path):
    torch.manual_seed(0)
    m = quantize_model(Two().eval(), {"rules": [{"pattern": "*", "learn_amax": True, "amax": 2.0}]})
    assert isinstance(m.a.input_quantizer.amax, nn.Parameter)
    x = torch.randn(16, 4)
    got, want, model = _export_and_compare(m, x, tmp_path)
    assert np.abs(got - want).max() < 1e-5
    assert len(qdq_pairs(model)) == 4


def test_checkpoint_exports_after_the_factory_file_is_gone(tmp_path):
    src = tmp_path / "net.py"
    src.write_text(
        "import torch\nfrom torch import nn\ndef make():\n    torch.manual_seed(0)\n    return "
        "nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))\n"
    )
    np.savez(tmp_path / "d.npz", np.random.default_rng(0).standard_normal((32, 4)).astype(np.float32))
    ck = tmp_path / "net.calib.pt"
    assert cli("calibrate", f"{src}:make", "--data", tmp_path / "d.npz", "--out", ck).exit_code == 0
    src.unlink()  # the checkpoint carries the factory's source; running it needs consent (issue 16)
    assert cli("export", ck, "--onnx", tmp_path / "net.onnx").exit_code == 2
    r = cli("export", ck, "--onnx", tmp_path / "net.onnx", "--trust-code")
    assert r.exit_code == 0, r.output
    assert cli("verify", tmp_path / "net.onnx", "--reference", ck, "--trust-code").exit_code == 0


class AllLayers(nn.Module):
    """Every layer type quantcli wraps; transposed convs quantize their weight along axis 1."""

    def __init__(self):
        super().__init__()
        # input-channel counts divisible by the test's int4 block size of 2
        self.c1 = nn.Conv1d(4, 4, 3, padding=1)
        self.t1 = nn.ConvTranspose1d(4, 4, 2, stride=2)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)
        self.t2 = nn.ConvTranspose2d(4, 6, 2, stride=2, groups=2)
        self.c3 = nn.Conv3d(2, 4, 3, padding=1)
        self.t3 = nn.ConvTranspose3d(4, 2, 2, stride=2)
        self.fc = nn.Linear(6 + 4 + 2, 5)

    def forward(self, seq, img, vol):
        a = self.t1(torch.relu(self.c1(seq))).mean(-1)
        b = self.t2(torch.relu(self.c2(img))).mean((-1, -2))
        c = self.t3(torch.relu(self.c3(vol))).mean((-1, -2, -3))
        return self.fc(torch.cat([b, a, c], 1))


#: the weight granularity each preset gives each layer type: conv and linear weights are (out, in, ...), a
#: transposed conv's are (in, out / groups, ...), so their output channels lie along axis 1
WEIGHT_LAYOUT = {
    "int8": {"c1": 0, "c2": 0, "c3": 0, "fc": 0, "t1": 1, "t2": 1, "t3": 1},
    "fp8": dict.fromkeys(("c1", "c2", "c3", "fc", "t1", "t2", "t3")),
    "int4-weight-only": {
        "c1": {1: 2},
        "c2": {1: 2},
        "c3": {1: 2},
        "fc": {-1: 2},
        "t1": {0: 2},
        "t2": {0: 2},
        "t3": {0: 2},
    },
}


@pytest.mark.parametrize("config", ["int8", "fp8", "int4-weight-only"])
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_every_layer_type_exports_per_channel_and_matches_onnxruntime(config, exporter, tmp_path):
    torch.manual_seed(0)
    m = quantize_model(AllLayers().eval(), {"preset": config, "block_size": 2})
    g = torch.Generator().manual_seed(1)

    def batch(n):
        return {
            "seq": torch.randn(n, 4, 8, generator=g),
            "img": torch.randn(n, 4, 6, 6, generator=g),
            "vol": torch.randn(n, 2, 4, 4, 4, generator=g),
        }

    calibrate(m, [batch(8) for _ in range(3)], "max", device="cpu")
    for layer, want in WEIGHT_LAYOUT[config].items():
        d = getattr(m, layer).weight_quantizer.desc
        assert (d.block_sizes if config == "int4-weight-only" else d.axis) == want, layer
    path = tmp_path / "all.onnx"
    export_onnx(m, batch(4), path, exporter=exporter)
    onnx.checker.check_model(str(path), full_check=True)
    graph = onnx.load(str(path))
    pairs = {p.quantizer: p for p in qdq_pairs(graph)}
    for layer, axis in WEIGHT_LAYOUT[config].items():
        if config == "int4-weight-only":
            continue  # blocked scales: test_onnx_parity and test_digits_every_format check their layout
        w = np.abs(getattr(m, layer).weight.detach().numpy())
        # 127, or 63 on the 7-bit grid where the deployment CPU's u8s8 kernels could saturate
        nb = getattr(m, layer).weight_quantizer.desc.num_bits
        bound = np.float32(2 ** (nb - 1) - 1 if config == "int8" else 448)
        amax = w.max() if axis is None else np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1).max(1)
        got = pairs[f"{layer}.weight_quantizer"].scale.reshape(-1)
        # one scale per channel
        assert np.array_equal(got, (np.asarray(amax, np.float32) / bound).reshape(-1)), layer
        assert pairs[f"{layer}.weight_quantizer"].axis == (None if axis is None else axis), layer
    feeds = batch(5)
    got, want = onnx_and_torch(graph, m, feeds)
    # not bit-exact: onnxruntime's convolutions sum in another order than torch's, and a sum that lands next
    # to a rounding boundary of the next quantizer flips that code by one step
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    names = set(pairs)
    from quantcli.nn import quantizers

    assert names == {n for n, q in quantizers(m).items() if q.enabled}


def test_graph_inputs_are_named_in_forward_order_whatever_the_batch_key_order(tmp_path):
    import onnxruntime as ort

    class TwoInputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, a, b):
            return self.fc(a) - 10 * b

    model = TwoInputs().eval()
    a, b = torch.randn(2, 4), torch.randn(2, 3)
    path = tmp_path / "two.onnx"
    export_onnx(model, {"b": b, "a": a}, path)  # keys in the other order than forward's
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"a": a.numpy(), "b": b.numpy()})[0]
    np.testing.assert_allclose(got, model(a, b).detach().numpy(), rtol=1e-5, atol=1e-5)


class _KeywordOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.g = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x, *, gate=None):
        y = self.fc(x)
        return y if gate is None else y * torch.sigmoid(self.g(gate))


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_keyword_only_inputs_export(exporter, tmp_path):
    """``forward(self, x, *, gate=None)`` calibrated, but torchscript's export passed ``gate`` by position
    ("takes 2 positional arguments but 3 were given")."""
    torch.manual_seed(0)
    module = _KeywordOnly().eval()
    batch = {"x": torch.randn(16, 6), "gate": torch.randn(16, 6)}
    model = quantize_model(module)
    calibrate(model, [batch], "max", device="cpu")
    path = tmp_path / "m.onnx"
    export_onnx(model, batch, path, exporter=exporter)
    graph = onnx.load(str(path))
    assert [i.name for i in graph.graph.input] == ["x", "gate"]
    got, want = onnx_and_torch(path, model, batch)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


POSITIONAL_ONLY = """
import torch
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x, /, mask=None):
        y = self.fc2(torch.relu(self.fc1(x)))
        return y if mask is None else y * mask


def make():
    torch.manual_seed(0)
    return M()
"""


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_positional_only_inputs_calibrate_export_and_verify(exporter, tmp_path):
    """``forward(self, x, /, mask=None)``: quantcli called every forward with its inputs by name, so calibrate
    failed ("got some positional-only arguments passed as keyword arguments: 'x'")."""
    (tmp_path / "m.py").write_text(POSITIONAL_ONLY)
    rng = np.random.default_rng(0)
    x, mask = rng.standard_normal((64, 8)).astype(np.float32), (rng.random((64, 4)) > 0.2).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, mask=mask)
    ck, path = tmp_path / "m.calib.pt", tmp_path / "m.onnx"
    r = cli("calibrate", f"{tmp_path / 'm.py'}:make", "--data", tmp_path / "d.npz", "--out", ck)
    assert r.exit_code == 0, r.output
    r = cli("export", ck, "--onnx", path, "--exporter", exporter)
    assert r.exit_code == 0, r.output
    assert [i.name for i in onnx.load(str(path)).graph.input] == ["x", "mask"]
    r = cli("verify", path, "--reference", ck, "--data", tmp_path / "d.npz", "--json")
    assert r.exit_code == 0, r.output
    import onnxruntime as ort

    got = ort.InferenceSession(str(path)).run(None, {"x": x[:8], "mask": mask[:8]})[0]
    with torch.no_grad():  # called as its author calls it
        want = load_calibrated(ck).model(torch.from_numpy(x[:8]), mask=torch.from_numpy(mask[:8])).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_torchscript_scopes_of_nested_containers_name_the_module():
    from exporters.graph import scope_module_path

    # torch names a Sequential/ModuleList child "<container scope>.<index>" in node scopes
    assert (
        scope_module_path(["layer2", "layer2.0", "downsample", "downsample.0", "input_quantizer"])
        == "layer2.0.downsample.0.input_quantizer"
    )
    assert scope_module_path(["features", "features.3", "weight_quantizer"]) == "features.3.weight_quantizer"
    assert scope_module_path(["fc1", "input_quantizer"]) == "fc1.input_quantizer"
    # a container inside a container: ModuleList "layers" of Sequentials -> scopes "layers.1", "layers.1.0"
    assert scope_module_path(["layers.1", "layers.1.0"]) == "layers.1.0"
    assert scope_module_path(["a.0", "a.0.1", "a.0.1.2", "fc"]) == "a.0.1.2.fc"


def test_a_checker_failure_is_quoted_whole_on_one_line_with_the_other_exporter():
    """onnx's checker names the node on its second line; the error was cut after "of node:" (issue 35,
    item 5)."""
    import onnx
    from onnx import TensorProto, helper

    from exporters.onnx_export import _checked
    from quantcli.errors import ExportError

    g = helper.make_graph(
        [helper.make_node("Relu", ["missing"], ["y"], name="/tables.0/Gather")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    with pytest.raises(ExportError) as e:
        _checked(m, "torchscript")
    msg = str(e.value)
    assert "\n" not in msg
    assert "name: /tables.0/Gather OpType: Relu is not output of any previous nodes" in msg
    assert msg.endswith("(try --exporter dynamo)")
    with pytest.raises(ExportError, match=r"try --exporter torchscript\)$"):
        _checked(onnx.ModelProto.FromString(m.SerializeToString()), "dynamo")


def test_foreign_messages_become_one_line_without_colour_codes():
    from quantcli.errors import whole_line

    e = RuntimeError("Failed to decompose.\x1b[96m This is step 2/3\x1b[0m of exporting\n  next:  steps")
    assert whole_line(e) == "Failed to decompose. This is step 2/3 of exporting next: steps"
    assert whole_line(RuntimeError("x" * 50), 20) == "x" * 16 + " ..."


NESTED = """
import torch
from torch import nn


class Inner(nn.Module):  # a container with no forward: never called itself
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.head = Inner(), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.inner.fc(x).relu())


def make():
    torch.manual_seed(0)
    return Outer()
"""


def test_a_layer_reached_through_a_parent_never_called_is_named_and_verified(tmp_path):
    """TorchScript's scopes name only the modules called, so ``inner.fc``'s Q/DQ nodes were
    ``/fc/input_quantizer/...``: export left them unnamed and verify failed the correct graph ("Q/DQ pair
    missing"); the bundled tiny_llama's --no-kv-cache graph (its forward loops over ``self.model.layers``)
    failed so. They are now matched to the one known quantizer whose name ends with that path."""
    import json

    import numpy as np
    import onnx

    (tmp_path / "nest.py").write_text(NESTED)
    data = tmp_path / "x.npy"
    np.save(data, np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32))
    ck, out = tmp_path / "nest.calib.pt", tmp_path / "nest.onnx"
    r = cli("calibrate", f"{tmp_path / 'nest.py'}:make", "--data", data, "--out", ck, "--placement", "all")
    assert r.exit_code == 0, r.output
    r = cli("export", ck, "--onnx", out)
    assert r.exit_code == 0, r.output
    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    named = set(json.loads(meta["quantcli.quantizers"]).values())
    assert {"inner.fc.input_quantizer", "inner.fc.weight_quantizer"} <= named, named
    r = cli("verify", out, "--reference", ck, "--data", data)
    assert r.exit_code == 0, r.output


class _SharedBlock(nn.Module):
    """One block applied four times (a loop, as ALBERT shares its layers)."""

    def __init__(self):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 4)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for _ in range(4):
            h = torch.relu(self.block(h)) + h
        return self.out(h)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_module_called_several_times_stores_its_weight_once(exporter, tmp_path):
    """Each call of a shared module wrote its own copy of the same weight codes: four 64x64 initializers
    for one block, a graph 1.5x the size it needs."""
    torch.manual_seed(0)
    model = quantize_model(_SharedBlock().eval(), "int8")
    batches = [{"x": torch.randn(32, 16)}]
    calibrate(model, batches, device="cpu")
    res = export_onnx(model, batches[0], tmp_path / "m.onnx", exporter=exporter)
    g = onnx.load(str(tmp_path / "m.onnx")).graph
    weights = [t for t in g.initializer if list(t.dims) == [64, 64]]
    assert len(weights) == 1, [t.name for t in weights]
    assert res.shared_initializer_bytes >= 3 * 64 * 64
    readers = [n for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] == weights[0].name]
    assert len(readers) == 4 if exporter == "torchscript" else len(readers) >= 1
    ckpt = tmp_path / "m.calib.pt"
    from quantcli.inputs.checkpoint import save_calibrated
    from quantcli.inputs.loading import parse_spec

    (tmp_path / "net.py").write_text(
        f"import sys\nsys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
        "from tests.test_export import _SharedBlock\n"
        "def make():\n    return _SharedBlock()\n"
    )
    save_calibrated(ckpt, model, parse_spec(f"{tmp_path / 'net.py'}:make"), batches[0])
    assert verify_onnx(tmp_path / "m.onnx", load_calibrated(ckpt, trust_code=True), batches).passed


def test_a_graph_onnxruntime_cannot_load_at_all_is_no_export(tmp_path):
    """A Falcon with ALiBi exported through dynamo (a complex128 Cast it cannot type) exited 0, the file
    written and its only sign a summary row ("does not load with default options"); verify then exited 2.
    A graph for onnxruntime that loads with no optimization level is removed and export fails, naming the
    error and the other exporter. (Here the last node is an op onnxruntime has no kernel for.)"""
    from onnx import helper

    from quantcli.errors import ExportError

    model = nn.Sequential(nn.Linear(8, 8)).eval()
    batch = {"input": torch.randn(16, 8)}
    model = quantize_model(model, "int8", example=batch)
    calibrate(model, [batch], device="cpu")

    def unknown_op_last(g):
        out = g.graph.output[0].name
        for n in g.graph.node:
            n.output[:] = [o + "_pre" if o == out else o for o in n.output]
        g.graph.node.append(helper.make_node("Frobnicate", [out + "_pre"], [out], domain="com.example"))
        g.opset_import.append(helper.make_opsetid("com.example", 1))

    path = tmp_path / "m.onnx"
    path.write_bytes(b"an older file of the same name")
    with pytest.raises(ExportError, match="cannot load the exported graph.*Frobnicate.*--exporter"):
        export_onnx(model, batch, path, edit_graph=unknown_op_last)
    assert not path.exists()
    assert export_onnx(model, batch, path).fusion_error is None and path.exists()  # as exported


TOKEN_ATTENTION = """
import torch
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.pos = nn.Embedding(17, 32), nn.Parameter(torch.randn(64, 32) * 0.02)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 10)

    def forward(self, input_ids):
        x = self.emb(input_ids) + self.pos[: input_ids.shape[1]]
        a, _ = self.attn(x, x, x, need_weights=False)
        return self.head(a.mean(1))


def make():
    torch.manual_seed(0)
    return M()
"""


def test_export_says_when_a_dynamic_size_is_fixed_inside_the_graph(tmp_path):
    """TorchScript writes nn.MultiheadAttention's head split as a Reshape to the traced length: the graph's
    input said ``['batch', 'sequence']``, export said nothing, and the graph failed at any other length the
    model runs at. Export now runs the graph at another size of each named dynamic size and says which it
    cannot vary; the dynamo export varies both."""
    (tmp_path / "m.py").write_text(TOKEN_ATTENTION)
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, 17, (32, 64)))
    ck = tmp_path / "m.calib.pt"
    r = cli("calibrate", f"{tmp_path / 'm.py'}:make", "--data", tmp_path / "ids.npy", "--out", ck)
    assert r.exit_code == 0, r.output
    r = cli("export", ck, "--onnx", tmp_path / "t.onnx", "--json")
    assert r.exit_code == 0, r.output
    (fixed,) = json.loads(r.stdout)["graph_agreement"]["fixed_sizes"]
    assert fixed["dim"] == "sequence" and fixed["axes"] == ["input_ids[1]"] and fixed["traced"] == 64
    assert "Reshape node" in fixed["error"]
    r = cli("export", ck, "--onnx", tmp_path / "t.onnx")
    assert (
        "warning: sequence (input_ids[1]) is dynamic in the graph's inputs, but the graph runs at" in r.stderr
    )
    r = cli("export", ck, "--onnx", tmp_path / "d.onnx", "--exporter", "dynamo", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["graph_agreement"]["fixed_sizes"] == []


def test_export_names_a_dynamic_dim_the_model_itself_cannot_vary(calibrated, tmp_path):
    """``--dynamic-dim x=1`` (digits_cnn's channels) was accepted without a word; verify then called such an
    axis one the weights fix. Export names it; a fully convolutional net's image axes are not named."""
    ck = calibrated("digits_cnn")
    r = cli("export", ck, "--onnx", tmp_path / "c.onnx", "--dynamic-dim", "x=1", "--json")
    assert r.exit_code == 0, r.output
    (fixed,) = json.loads(r.stdout)["graph_agreement"]["fixed_sizes"]
    assert fixed["axes"] == ["x[1]"] and not fixed["model_runs"] and "channels" in fixed["error"]
    r = cli("export", ck, "--onnx", tmp_path / "c.onnx", "--dynamic-dim", "x=1")
    assert (
        "the model itself does not run at 2 there" in r.stderr and "Leave it out of --dynamic-dim" in r.stderr
    )


MASKED = """
import torch
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x, mask):
        assert mask.shape[1] == x.shape[1], "mask and x differ in length"
        h = torch.relu(self.proj(x)) * mask.unsqueeze(-1)
        return self.head(h.sum(1))


def make():
    torch.manual_seed(0)
    return M()
"""


def test_a_model_that_asserts_on_its_inputs_exports_and_refuses_bad_data(tmp_path):
    """A float input of fixed length beside an integer mask of dynamic ``sequence``: export's size probe cut
    the mask alone, the model's own ``assert`` (torch's ``_assert`` in nn.TransformerEncoder) raised
    AssertionError, and export stopped with an internal error (exit 3). A forward's AssertionError is the
    input's problem, as its RuntimeError is."""
    (tmp_path / "m.py").write_text(MASKED)
    rng = np.random.default_rng(0)
    x, mask = rng.standard_normal((32, 10, 8)).astype(np.float32), rng.integers(0, 2, (32, 10))
    np.savez(tmp_path / "d.npz", x=x, mask=mask)
    ck = tmp_path / "m.calib.pt"
    r = cli("calibrate", f"{tmp_path / 'm.py'}:make", "--data", tmp_path / "d.npz", "--out", ck)
    assert r.exit_code == 0, r.output
    r = cli("export", ck, "--onnx", tmp_path / "m.onnx", "--json")
    assert r.exit_code == 0, r.output
    np.savez(tmp_path / "bad.npz", x=x, mask=mask[:, :9])
    r = cli("verify", tmp_path / "m.onnx", "--reference", ck, "--data", tmp_path / "bad.npz")
    assert r.exit_code == 2 and "mask and x differ in length" in r.stderr, r.output


UNREAD = """
import torch
from torch import nn


class Unread(nn.Module):
    # DeBERTa-v3 (type_vocab_size 0) takes token_type_ids and never reads them
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x, token_type_ids=None):
        return self.fc2(torch.relu(self.fc1(x)))


def make():
    torch.manual_seed(0)
    return Unread()
"""


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_an_input_forward_never_reads_is_said_and_verify_takes_the_graph(tmp_path, exporter):
    """The exporter leaves out of the graph an input forward never reads; export's summary listed it as an
    input all the same, and verify refused the graph export had just written ("the ONNX inputs ['x'] do not
    match the checkpoint's inputs ['x', 'token_type_ids']"): no DeBERTa-v3 could be verified."""
    (tmp_path / "m.py").write_text(UNREAD)
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "d.npz",
        x=rng.standard_normal((32, 8)).astype(np.float32),
        token_type_ids=np.zeros((32, 8), np.int64),
    )
    ck, graph = tmp_path / "u.calib.pt", tmp_path / "u.onnx"
    r = cli("calibrate", f"{tmp_path / 'm.py'}:make", "--data", tmp_path / "d.npz", "--out", ck)
    assert r.exit_code == 0, r.output
    r = cli("export", ck, "--onnx", graph, "--exporter", exporter, "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    # (the dynamo exporter keeps the input, unread, in the graph)
    both = ["x", "token_type_ids"]
    names, unread = (["x"], ["token_type_ids"]) if exporter == "torchscript" else (both, [])
    assert res["input_names"] == names and res["unread_inputs"] == unread
    assert [i.name for i in onnx.load(graph).graph.input] == names
    r = cli("verify", graph, "--reference", ck, "--data", tmp_path / "d.npz")
    assert r.exit_code == 0, r.output


def _mlp_returning(value: str, header: str = "") -> str:
    """A model file: two Linear layers whose ``forward`` returns ``value`` (of ``h``, the hidden ReLU output,
    and ``self.fc2(h)``), after ``header`` (imports, classes)."""
    return (
        "import torch\nfrom torch import nn\n" + header + "\n\nclass Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)\n\n"
        "    def forward(self, x):\n        h = torch.relu(self.fc1(x))\n"
        f"        return {value}\n\n\ndef make():\n    torch.manual_seed(0)\n    return Net().eval()\n"
    )


_DATACLASS_OUTPUT = _mlp_returning(
    "Out(self.fc2(h), h)",
    "from dataclasses import dataclass\n\n\n@dataclass\nclass Out:\n    logits: torch.Tensor\n"
    "    features: torch.Tensor\n    loss: torch.Tensor | None = None\n",
)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_model_returning_a_dataclass_exports_its_fields(tmp_path, exporter):
    """A model whose forward returns its own dataclass: calibrate and analyze saw no output (cosines null,
    --min-cosine "NOT met" keeping a layer float for nothing) and both exporters said "the model's forward
    returns no tensor". Its fields are its outputs, by name, None fields left out, as a ModelOutput's."""
    import onnxruntime as ort

    x = np.random.default_rng(0).standard_normal((32, 8)).astype(np.float32)
    args = ("--batch-size", "8", "--min-cosine", "0.99")
    ck, data = calibrated_file(tmp_path, _DATACLASS_OUTPUT, {"x": x}, *args)
    graph = exported_and_verified(ck, data, tmp_path / "m.onnx", "--exporter", exporter)
    sess = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    assert [o.name for o in sess.get_outputs()] == ["logits", "features"]
    logits, features = sess.run(None, {"x": x})
    model = load_calibrated(ck).model
    with torch.inference_mode():
        want = model(torch.from_numpy(x))
    np.testing.assert_allclose(logits, want.logits.numpy(), atol=1e-5)
    np.testing.assert_allclose(features, want.features.numpy(), atol=1e-5)


_RETURNS_ITS_INPUT = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, other: bool = False):
        super().__init__()
        self.fc, self.other = nn.Linear(8, 4), other

    def forward(self, x, mask):
        out = self.fc(x) * mask
        return {"logits": out, "mask": mask * 2 if self.other else mask}


def make():
    torch.manual_seed(0)
    return Net().eval()


def make_other():
    torch.manual_seed(0)
    return Net(other=True).eval()
"""


def test_an_input_returned_under_its_own_name_keeps_its_name(tmp_path):
    """A model returning an input under that input's name (``{"attention_mask": attention_mask}``, as Hugging
    Face outputs do): TorchScript renamed the graph input ``mask.1``, export said "exported" and listed mask
    as an input the model never reads, and a deployment feeding ``mask`` failed. The input keeps its name and
    the output is the input itself; another value under an input's name is refused, naming the key."""
    import onnxruntime as ort

    (tmp_path / "net.py").write_text(_RETURNS_ITS_INPUT)
    rng = np.random.default_rng(0)
    x, mask = rng.standard_normal((32, 8)).astype(np.float32), np.ones((32, 4), np.float32)
    np.savez(tmp_path / "d.npz", x=x, mask=mask)
    ck, graph = tmp_path / "m.calib.pt", tmp_path / "m.onnx"
    spec = f"{tmp_path / 'net.py'}"
    r = cli("calibrate", f"{spec}:make", "--data", tmp_path / "d.npz", "--placement", "all", "--out", ck)
    assert r.exit_code == 0, r.output
    r = cli("export", ck, "--onnx", graph, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["unread_inputs"] == []
    sess = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["x", "mask"]
    assert [o.name for o in sess.get_outputs()] == ["logits", "mask"]
    np.testing.assert_array_equal(sess.run(["mask"], {"x": x, "mask": mask})[0], mask)
    assert cli("verify", graph, "--reference", ck, "--data", tmp_path / "d.npz").exit_code == 0
    other = tmp_path / "o.calib.pt"
    r = cli(
        "calibrate", f"{spec}:make_other", "--data", tmp_path / "d.npz", "--placement", "all", "--out", other
    )
    assert r.exit_code == 0, r.output
    r = cli("export", other, "--onnx", tmp_path / "o.onnx")
    assert_clean_error(r, "output named 'mask'", "rename that output")
    assert not (tmp_path / "o.onnx").exists()


_NON_TENSOR_OUTPUTS = _mlp_returning('h, 3, "hello", self.fc2(h)')


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_values_that_are_no_tensor_are_left_out_of_the_graph(tmp_path, exporter):
    """``return a, 3, "hello", b``: TorchScript failed ("did not have observable data dependence ... try
    --exporter dynamo") and dynamo too ("'int' object has no attribute 'name' ... try --exporter
    torchscript"), each pointing to the other, where named_outputs says non-tensor values are left out."""
    import onnxruntime as ort

    x = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    ck, data = calibrated_file(tmp_path, _NON_TENSOR_OUTPUTS, {"x": x})
    graph = exported_and_verified(ck, data, tmp_path / "m.onnx", "--exporter", exporter)
    sess = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    assert [o.name for o in sess.get_outputs()] == ["output_0", "output_3"]


def test_a_graph_onnxruntime_cannot_run_is_said_by_export(calibrated, tmp_path, monkeypatch):
    """export checks its graph against the model in onnxruntime; where onnxruntime could not load or run the
    graph (a timm Swin's frozen Pad, an NF-ResNet's misplaced per-channel Q) the check was skipped in silence:
    no row, no warning, export exit 0, "0 of N layers run in float". The check says why it could not run."""
    from quantcli.verify import export_check

    ck = calibrated("digits_cnn", "int8", "max")
    graph = tmp_path / "d.onnx"
    assert cli("export", ck, "--onnx", graph).exit_code == 0
    broken = onnx.load(str(graph))
    conv = next(n for n in broken.graph.node if n.op_type == "Conv")
    conv.attribute.append(onnx.helper.make_attribute("group", 7))  # no longer a valid graph
    onnx.save(broken, str(tmp_path / "broken.onnx"))
    agreement = export_check.graph_agreement(tmp_path / "broken.onnx", load_calibrated(ck).model, {"x": None})
    assert agreement is not None and not agreement.passed and "cannot load" in agreement.error
    # through the command: the export of the same checkpoint, its check pointed at the broken file
    real = export_check.graph_agreement
    monkeypatch.setattr(
        export_check, "graph_agreement", lambda path, *a, **k: real(tmp_path / "broken.onnx", *a, **k)
    )
    r = cli("export", ck, "--onnx", tmp_path / "again.onnx")
    assert r.exit_code == 0, r.output
    assert "onnxruntime cannot run the exported graph" in r.stderr
    assert "onnxruntime cannot run the graph" in r.stdout


HRNET_HEAD = """
import torch
from torch import nn


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        branch = [nn.Sequential(nn.Conv2d(3, 8, 3, s, 1), nn.ReLU()) for s in (1, 2)]
        self.incre = nn.ModuleList(branch)
        self.down = nn.ModuleList([nn.Sequential(nn.Conv2d(8, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU())])
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        y = self.incre[0](x)
        y = self.incre[1](x) + self.down[0].forward(y)  # .forward, as timm's HRNet head calls it
        return self.fc(y.mean((2, 3)))


def make():
    torch.manual_seed(0)
    return Head().eval()
"""


def test_a_container_called_through_forward_keeps_its_quantizers_named(tmp_path):
    """``self.down[0].forward(y)`` records no TorchScript scope for the Sequential, so the output quantizer
    of its Conv was written ``/output_quantizer/DequantizeLinear``, mapped to no quantizer: verify failed
    the graph ("down.0.0.output_quantizer: Q/DQ pair missing") with the pair in it."""
    from exporters.graph import quantizer_map

    x = np.random.default_rng(0).standard_normal((16, 3, 8, 8)).astype(np.float32)
    ck, data = calibrated_file(tmp_path, HRNET_HEAD, {"x": x})
    graph = exported_and_verified(ck, data, tmp_path / "h.onnx")
    assert "down.0.0.output_quantizer" in set(quantizer_map(onnx.load(str(graph))).values())
