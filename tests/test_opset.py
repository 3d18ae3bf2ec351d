"""The default opset: the lowest the formats need and the model's ops are best expressed in
(exporters.opset)."""

import json

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from exporters import export_onnx
from exporters.opset import OpProbe, ops_opset
from quantcli import quantize_model
from quantcli.calibration.calibrate import calibrate
from tests.helpers import assert_clean_error, cli
from tests.ort_util import onnx_and_torch


def _opset(m):
    return next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))


def _ops(m):
    return {n.op_type for n in m.graph.node}


class FunctionalNorm(nn.Module):
    """LayerNorm called as F.layer_norm, not as an nn.LayerNorm module."""

    def __init__(self, functional: bool = True):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 4)
        self.gain = nn.Parameter(1 + torch.rand(16))
        self.functional = functional

    def forward(self, x):
        h = self.fc1(x)
        h = F.layer_norm(h + x, (16,), self.gain) if self.functional else torch.relu(h + x)
        return self.fc2(h)


def _calibrated(model, config="int8"):
    torch.manual_seed(0)
    q = quantize_model(model.eval(), config)
    calibrate(q, [{"x": torch.randn(8, 5, 16)} for _ in range(2)], "max", device="cpu")
    return q


def test_probe_sees_functional_and_module_layer_norm():
    probe = OpProbe()
    with probe:
        FunctionalNorm()(torch.randn(2, 3, 16))
    assert probe.layer_norm and ops_opset(FunctionalNorm(), probe)[0] == 17
    probe = OpProbe()
    with probe:
        FunctionalNorm(functional=False)(torch.randn(2, 3, 16))
    assert not probe.layer_norm and ops_opset(FunctionalNorm(False), probe)[0] == 13
    assert ops_opset(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))[0] == 17  # modules: no forward needed


@pytest.mark.parametrize(
    "functional, config, want", [(True, "int8", 17), (False, "int8", 13), (True, "fp8", 19)]
)
def test_default_opset_is_the_highest_of_formats_and_ops(functional, config, want, tmp_path):
    m = _calibrated(FunctionalNorm(functional), config)
    x = torch.randn(3, 7, 16)
    res = export_onnx(m, {"x": x}, tmp_path / "m.onnx")
    graph = onnx.load(str(tmp_path / "m.onnx"))
    assert res.opset == _opset(graph) == want and not res.opset_note
    assert ("LayerNormalization" in _ops(graph)) == functional
    assert "ReduceMean" not in _ops(graph)
    if config == "int8":  # the opset-17 graph computes what the fake-quant model does
        got, ref = onnx_and_torch(graph, m, {"x": x})
        assert np.abs(got - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())


def test_text_encoder_defaults_to_17_and_explicit_13_decomposes_with_a_note(calibrated, exported, tmp_path):
    graph = onnx.load(str(exported("text_encoder", "int8")))
    assert _opset(graph) == 17 and "LayerNormalization" in _ops(graph)
    out = tmp_path / "t13.onnx"
    r = cli("export", calibrated("text_encoder", "int8"), "--onnx", out, "--opset", "13", "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert (
        info["opset"] == 13
        and info["opset_reason"] == "--opset"
        and "SkipLayerNormalization" in info["opset_note"]
    )
    g13 = onnx.load(str(out))
    assert "LayerNormalization" not in _ops(g13) and "ReduceMean" in _ops(g13)
    text = cli("export", calibrated("text_encoder", "int8"), "--onnx", out).stdout
    assert "LayerNorm" in text and "17" in text


def test_explicit_opset_below_the_format_minimum_is_still_an_error(calibrated, tmp_path):
    assert_clean_error(
        cli("export", calibrated("text_encoder", "fp8"), "--onnx", tmp_path / "o.onnx", "--opset", "17"),
        "fp8-e4m3",
        ">= 19",
    )


ATTENTION = '''
import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Self-attention through F.scaled_dot_product_attention, no LayerNorm (as in Llama/Qwen2 decoders)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v)
        return self.out(a.transpose(1, 2).reshape(b, n, d))


def make():
    torch.manual_seed(0)
    return Attention().eval()
'''


def _torch_attention_opset() -> int:
    """The opset torch's TorchScript exporter first translates aten::scaled_dot_product_attention at, read
    from torch's own symbolic_opsetN modules (not from quantcli)."""
    import importlib

    for n in range(9, 22):
        try:
            mod = importlib.import_module(f"torch.onnx._internal.torchscript_exporter.symbolic_opset{n}")
        except ImportError:
            continue
        if hasattr(mod, "scaled_dot_product_attention"):
            return n
    pytest.skip("this torch keeps its TorchScript translations elsewhere")


@pytest.fixture
def attention_checkpoint(tmp_path):
    (tmp_path / "attn.py").write_text(ATTENTION)
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((16, 6, 16)).astype(np.float32))
    ck = tmp_path / "attn.calib.pt"
    r = cli("calibrate", f"{tmp_path / 'attn.py'}:make", "--data", tmp_path / "x.npy", "--out", ck)
    assert r.exit_code == 0, r.output
    return ck, tmp_path / "x.npy"


def test_attention_without_opset_exports_at_the_opset_torch_translates_it_and_verifies(
    attention_checkpoint, tmp_path
):
    want = _torch_attention_opset()
    assert want == 14  # torch 2.x: symbolic_opset14.scaled_dot_product_attention
    ck, data = attention_checkpoint
    out = tmp_path / "a.onnx"
    r = cli("export", ck, "--onnx", out, "--json")  # the default exporter (torchscript), no --opset
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["exporter"] == "torchscript" and info["opset"] == _opset(onnx.load(str(out))) == want
    assert "scaled_dot_product_attention" in info["opset_reason"]
    r = cli("verify", out, "--reference", ck, "--data", data)
    assert r.exit_code == 0, r.output


def test_attention_with_a_too_old_explicit_opset_is_a_clean_error_naming_the_op(
    attention_checkpoint, tmp_path
):
    ck, _ = attention_checkpoint
    r = cli("export", ck, "--onnx", tmp_path / "a.onnx", "--opset", "13")
    assert_clean_error(
        r, "aten::scaled_dot_product_attention", "opset 13", f"--opset {_torch_attention_opset()}"
    )
    assert not (tmp_path / "a.onnx").exists()
    # an explicit opset is kept
    r = cli("export", ck, "--onnx", tmp_path / "a.onnx", "--opset", "15", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["opset"] == 15, r.output


MHA = '''
import torch
from torch import nn


class MHANet(nn.Module):
    """nn.MultiheadAttention with need_weights=False (as nn.TransformerEncoderLayer calls it), no LayerNorm:
    torch computes it with scaled_dot_product_attention inside multi_head_attention_forward."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 32)
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
        self.out = nn.Linear(32, 3)

    def forward(self, x):
        h = self.inp(x)
        a, _ = self.mha(h, h, h, need_weights=False)
        return self.out((h + a).mean(1))


def make():
    torch.manual_seed(0)
    return MHANet().eval()
'''


@pytest.mark.parametrize("need_weights", [False, True])
def test_the_probe_sees_attention_inside_multihead_attention_without_weights(need_weights):
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    probe = OpProbe()
    with probe, torch.no_grad():
        mha(x, x, x, need_weights=need_weights)
    assert probe.attention is (not need_weights)
    probe = OpProbe()  # passed by position, as a direct caller may
    args = (x, x, x, 8, 2, mha.in_proj_weight, mha.in_proj_bias, None, None, False, 0.0)
    args += (mha.out_proj.weight, mha.out_proj.bias, False, None, need_weights)
    with probe, torch.no_grad():
        F.multi_head_attention_forward(*args)
    assert probe.attention is (not need_weights)


def test_multihead_attention_without_weights_calibrates_places_exports_and_verifies(tmp_path):
    (tmp_path / "mha.py").write_text(MHA)
    data = tmp_path / "x.npy"
    np.save(data, np.random.default_rng(0).standard_normal((16, 10, 12)).astype(np.float32))
    ck, out = tmp_path / "mha.calib.pt", tmp_path / "mha.onnx"
    r = cli("calibrate", f"{tmp_path / 'mha.py'}:make", "--data", data, "--out", ck, "--json")
    assert r.exit_code == 0, r.output
    assert "not decided" not in r.stdout  # latency placement exported the model to decide
    r = cli("export", ck, "--onnx", out, "--json")  # default exporter and opset
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["opset"] == _opset(onnx.load(str(out))) == _torch_attention_opset()
    assert "scaled_dot_product_attention" in info["opset_reason"]
    r = cli("verify", out, "--reference", ck, "--data", data)
    assert r.exit_code == 0, r.output


class HardSwishNet(nn.Module):
    """MobileNetV3-style blocks: a hard swish after each convolution (as a module, then called directly)."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.c3 = (
            nn.Conv2d(3, 8, 3, padding=1),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.Conv2d(8, 4, 1),
        )
        self.act = nn.Hardswish()

    def forward(self, x):
        return self.c3(F.hardswish(self.c2(self.act(self.c1(x)))))


def test_a_hard_swish_exports_as_one_hardswish_node_from_opset_14(tmp_path):
    probe = OpProbe()
    with probe:
        HardSwishNet()(torch.randn(1, 3, 8, 8))
    assert probe.hard_swish
    torch.manual_seed(0)
    m = quantize_model(HardSwishNet().eval(), "int8")
    calibrate(m, [{"x": torch.randn(8, 3, 8, 8)}], "max", device="cpu")
    x = torch.randn(2, 3, 8, 8)
    res = export_onnx(m, {"x": x}, tmp_path / "m.onnx")
    graph = onnx.load(str(tmp_path / "m.onnx"))
    # below 14 TorchScript writes HardSigmoid and Mul, which onnxruntime fuses neither into the Conv before
    # them nor into one node
    assert res.opset == _opset(graph) == 14 and "hard swish" in res.opset_reason
    assert [n.op_type for n in graph.graph.node].count("HardSwish") == 2
    assert "HardSigmoid" not in _ops(graph)
    got, ref = onnx_and_torch(graph, m, {"x": x})
    assert np.abs(got - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())
    res = export_onnx(m, {"x": x}, tmp_path / "m13.onnx", opset=13)  # asked for: still written
    assert res.opset == 13 and "HardSigmoid" in _ops(onnx.load(str(tmp_path / "m13.onnx")))
