"""Layers that are a Linear or a Conv in all but name are quantized; what stays float is reported (issue
23)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantcli import quantize_model
from quantcli.calibration.calibrate import calibrate
from quantcli.calibration.job import layers_summary
from quantcli.nn.computed import ComputedLayer
from quantcli.nn.config import QuantConfig
from quantcli.nn.linear_like import linear_layout
from quantcli.nn.modules import QuantConv1d, QuantConv2d, QuantLinear
from quantcli.nn.tensor_quantizer import quantizers

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402


def _quant(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 fake quantization written out: round half to even of x / (amax / 127), clamp to [-128,
    127]."""
    scale = amax / 127.0
    return torch.clamp(torch.round(x / scale), -128, 127) * scale


class TwoConv1D(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Conv1D(12, 6)  # nf=12 outputs, nx=6 inputs: weight [6, 12]
        self.b = Conv1D(5, 12)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _batches(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(4, 7, 6, generator=g)} for _ in range(n)]


def test_conv1d_fake_quant_equals_a_hand_computation_with_the_transposed_weight():
    torch.manual_seed(0)
    m = TwoConv1D().eval()
    with torch.no_grad():
        for layer in (m.a, m.b):
            layer.weight.normal_()
            layer.bias.normal_()
    float_out = m(**_batches(1)[0])
    quantize_model(m, {"preset": "int8", "target": "tensorrt"})
    assert m.quantcli_report.layers == ["a", "b"]
    calibrate(m, _batches(), device="cpu")
    w = m.a.weight.detach()
    # per output channel: the outputs are the weight's columns ([in, out]), so amax is one per column
    assert m.a.weight_quantizer.amax.shape == (1, 12)
    assert torch.equal(m.a.weight_quantizer.amax.flatten(), w.abs().amax(dim=0))
    x = _batches(1, seed=5)[0]["x"]
    expected = (
        torch.matmul(_quant(x, m.a.input_quantizer.amax), _quant(w, m.a.weight_quantizer.amax)) + m.a.bias
    )
    with torch.no_grad():
        got = m.a(x)
    assert torch.allclose(got, expected, rtol=0, atol=1e-5)
    # scales taken per row (the [out, in] convention of nn.Linear) give measurably other values
    per_row = torch.matmul(_quant(x, m.a.input_quantizer.amax), _quant(w, w.abs().amax(dim=1, keepdim=True)))
    assert (per_row + m.a.bias - got).abs().max() > 1e-2
    # the fake-quant model is close to the float one it came from
    with torch.no_grad():
        cos = F.cosine_similarity(m(**_batches(1)[0]).flatten(), float_out.flatten(), dim=0)
    assert cos > 0.99


def test_gpt2_every_projection_quantized_embeddings_reported():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    conv1d = sorted(n for n, m in model.named_modules() if isinstance(m, Conv1D))
    assert len(conv1d) == 8  # c_attn, c_proj, c_fc, mlp.c_proj per block
    quantize_model(model)
    report = model.quantcli_report
    assert sorted(report.layers) == sorted(conv1d + ["lm_head"])
    assert {f["name"]: f["type"] for f in report.float_layers} == {
        "transformer.wte": "Embedding",
        "transformer.wpe": "Embedding",
    }
    assert all("lookup" in f["reason"] for f in report.float_layers)
    layer = model.transformer.h[0].attn.c_attn
    assert isinstance(layer, Conv1D) and layer.weight_quantizer.desc.axis == 1
    assert not layer.int32_bias  # added in float after MatMul, as a 3-D nn.Linear's bias
    summary = layers_summary(report, model)
    assert summary["quantized"] == report.layers and summary["text"].startswith("9 quantized; 2 weighted")


def test_summary_counts_layers_whose_quantizers_are_disabled_as_float():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=30, n_positions=8)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    rules = [{"pattern": "*.mlp.*", "enable": False}]  # the MLP's Conv1D layers keep disabled quantizers
    quantize_model(model, QuantConfig(preset="int8-dynamic", rules=rules))
    summary = layers_summary(model.quantcli_report, model)
    attn = [f"transformer.h.0.attn.{n}" for n in ("c_attn", "c_proj")]
    assert summary["quantized"] == [*attn, "lm_head"]  # int8-dynamic quantizes Conv1D (x @ W + b) too
    disabled = {f["name"]: f["type"] for f in summary["float"] if "disabled" in f["reason"]}
    assert disabled == {f"transformer.h.0.mlp.{n}": "Conv1D" for n in ("c_fc", "c_proj")}


class MyLinear(nn.Module):
    """Linear in all but name, [out, in] weight."""

    def __init__(self, i, o):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, i))
        self.bias = nn.Parameter(torch.randn(o))

    def forward(self, x):
        return x @ self.weight.t() + self.bias


class LinearGelu(MyLinear):
    def forward(self, x):
        return F.gelu(super().forward(x))


class NoBias(MyLinear):
    def forward(self, x):  # owns a bias it never adds: not F.linear(x, W, b)
        return x @ self.weight.t()


class StdConv(nn.Conv2d):
    """Weight standardisation (timm's StdConv2d): a Conv2d subclass computing something else."""

    def forward(self, x):
        w = (self.weight - self.weight.mean(dim=(1, 2, 3), keepdim=True)) / (
            self.weight.std(dim=(1, 2, 3), keepdim=True) + 1e-5
        )
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


class LoggingConv(nn.Conv2d):
    def forward(self, x):
        self.calls = getattr(self, "calls", 0) + 1
        return super().forward(x)


def test_modules_are_found_by_what_they_compute():
    assert linear_layout(MyLinear(6, 4)) == 0
    assert linear_layout(Conv1D(4, 6)) == 1
    assert linear_layout(Conv1D(6, 6)) == 1  # square: the layout is told apart by the values
    assert linear_layout(LinearGelu(6, 4)) is None
    assert linear_layout(NoBias(6, 4)) is None
    m = nn.ModuleDict(
        {
            "lin": MyLinear(6, 4),
            "gelu": LinearGelu(6, 4),
            "nobias": NoBias(6, 4),
            "std": StdConv(3, 4, 3),
            "log": LoggingConv(3, 4, 3),
            "emb": nn.Embedding(10, 4),
            "sub": nn.modules.linear.NonDynamicallyQuantizableLinear(4, 4),
        }
    )
    quantize_model(m)
    report = m.quantcli_report
    # a torch layer's subclass with a forward of its own (and the attention's out_proj class) is quantized
    # where its convolution runs, its forward kept (issue 35): without an example batch too
    assert sorted(report.layers) == ["lin", "log", "std", "sub"]
    assert sorted(report.computed) == ["log", "std", "sub"]
    assert isinstance(m["log"], ComputedLayer) and isinstance(m["log"], LoggingConv)
    assert not isinstance(m["log"], QuantConv2d)  # not nn.Conv2d's forward: its own, which counts calls
    assert isinstance(m["lin"], MyLinear) and m["lin"].weight_quantizer.desc.axis == 0
    floats = {f["name"]: f["reason"] for f in report.float_layers}
    assert set(floats) == {"gelu", "nobias", "emb"}
    assert "lookup" in floats["emb"] and "no example batch" in floats["gelu"]


def test_converted_subclass_and_probe_layer_compute_as_before_with_quantizers_off():
    torch.manual_seed(0)
    m = nn.Sequential(MyLinear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    x = torch.randn(4, 6)
    ref = m(x)
    quantize_model(m)
    for q in quantizers(m).values():
        q.set_mode("disabled")
    assert torch.allclose(m(x), ref, atol=1e-6)
    assert isinstance(m[2], QuantLinear)


def _weight_normed():
    """wav2vec2's positional convolution: a grouped Conv1d under weight_norm (dim=2)."""
    conv = nn.utils.parametrizations.weight_norm(
        nn.Conv1d(8, 8, 5, padding=2, groups=4), name="weight", dim=2
    )
    return nn.Sequential(nn.Conv1d(3, 8, 3), nn.GELU(), conv)


def test_weight_normed_conv_is_resolved_and_quantized():
    torch.manual_seed(0)
    m = _weight_normed()
    assert type(m[2]).__name__ == "ParametrizedConv1d"
    x = torch.randn(2, 3, 20)
    ref = m(x)
    before = _weight_normed()
    quantize_model(m)
    report = m.quantcli_report
    assert report.layers == ["0", "2"] and report.resolved_parametrizations == ["2"]
    assert type(m[2]) is QuantConv1d and m[2].weight_quantizer.desc.axis == 0
    for q in quantizers(m).values():
        q.set_mode("disabled")
    assert torch.equal(m(x), ref)  # the stored weight is the value weight_norm computed
    # a model rebuilt the same way takes the stored state dict (as load_calibrated does)
    quantize_model(before)
    before.load_state_dict(m.state_dict(), strict=True)


def test_weight_normed_conv_before_a_batchnorm_folds_into_the_stored_weight():
    torch.manual_seed(0)
    conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 6, 3, padding=1), name="weight", dim=0)
    bn = nn.BatchNorm1d(6)
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.normal_()
    m = nn.Sequential(conv, bn).eval()
    x = torch.randn(2, 4, 16)
    ref = m(x)
    quantize_model(m)
    report = m.quantcli_report
    assert report.resolved_parametrizations == ["0"] and len(report.batchnorm.folded) == 1
    assert isinstance(m[0], QuantConv1d) and isinstance(m[1], nn.Identity)
    for q in quantizers(m).values():
        q.set_mode("disabled")
    assert torch.allclose(m(x), ref, atol=1e-5)


def test_smoothquant_folds_conv1d_inputs_into_the_layernorms_before_them():
    from quantcli.calibration.smoothquant import smooth_quant

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    quantize_model(model)
    ids = torch.randint(0, 50, (4, 10), generator=torch.Generator().manual_seed(1))
    for q in quantizers(model).values():
        q.set_mode("disabled")
    ref = model(input_ids=ids).logits
    before = model.transformer.h[0].attn.c_attn.weight.detach().clone()
    report = smooth_quant(model, [{"input_ids": ids}], 0.5, device="cpu", min_gain=0.0)
    folds = {g.consumers[0]: (g.fold, g.into) for g in report.groups}
    for i in range(2):  # [in, out] weights: row j scaled by s[j], its LayerNorm's channel j divided by it
        assert folds[f"transformer.h.{i}.attn.c_attn"] == ("layernorm", f"transformer.h.{i}.ln_1")
        assert folds[f"transformer.h.{i}.mlp.c_fc"] == ("layernorm", f"transformer.h.{i}.ln_2")
    ratio = model.transformer.h[0].attn.c_attn.weight.detach() / before
    assert torch.allclose(ratio, ratio[:, :1].expand_as(ratio), rtol=1e-5)  # one factor per input row
    assert not torch.allclose(ratio[:, 0], ratio[0, 0].expand(ratio.shape[0]))
    # tied to the token embedding: scaling it would change the embedding too (it did, before)
    assert "lm_head" not in folds and "tied" in report.skipped["lm_head"]
    assert torch.allclose(model(input_ids=ids).logits, ref, atol=1e-4)


class _FuncLinear(nn.Module):
    """A leaf module computing F.linear with its own parameters (not an nn.Linear)."""

    def __init__(self, i: int, o: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, i) / i**0.5)
        self.bias = nn.Parameter(torch.randn(o) * 0.1)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class _PooledHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 8, 3, padding=1), _FuncLinear(8, 4)

    def forward(self, x):
        return self.head(F.relu(self.conv(x)).mean((2, 3)))


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_linear_like_head_on_2d_features_takes_an_int32_bias_and_runs_as_qgemm(tmp_path, exporter):
    """An nn.Linear head on pooled features runs as QGemm (its bias int32 codes); the same computation in a
    module of the user's own kept a float bias, so onnxruntime ran its Gemm in float and latency placement
    kept it float. The bias now gets the int32 codes QGemm adds: x_scale * w_scale per output channel."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from exporters import export_onnx
    from exporters.onnxruntime.fusion import inspect_fusion

    torch.manual_seed(0)
    model = _PooledHead().eval()
    batches = [{"x": torch.randn(8, 3, 6, 6)} for _ in range(2)]
    q = quantize_model(model, "int8", example=batches[0])
    assert q.head.takes_int32_bias and q.head.int32_bias
    calibrate(q, batches, "max", device="cpu")
    path = tmp_path / "m.onnx"
    export_onnx(q, batches[0], path, exporter=exporter)
    kernels = {f.layer: f.kernel for f in inspect_fusion(path).layers}
    assert kernels == {"conv": "QLinearConv", "head": "QGemm"}, kernels
    graph = onnx.load(str(path)).graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    made_by = {o: n for n in graph.node for o in n.output}
    (gemm,) = [n for n in graph.node if n.op_type == "Gemm"]
    x_dq, w_dq, b_dq = (made_by[i] for i in gemm.input)  # each operand through a DequantizeLinear
    assert {x_dq.op_type, w_dq.op_type, b_dq.op_type} == {"DequantizeLinear"}
    codes, b_scale = inits[b_dq.input[0]], inits[b_dq.input[1]]
    assert codes.dtype == "int32" and codes.any()
    # QGemm's bias: int32 codes on the grid x_scale * w_scale (per output channel), the float bias rounded
    np.testing.assert_allclose(b_scale, inits[x_dq.input[1]] * inits[w_dq.input[1]], rtol=1e-6)
    bias = q.head.bias.detach().numpy()
    assert np.abs(codes * b_scale - bias).max() <= 0.5 * b_scale.max() * (1 + 1e-6)
