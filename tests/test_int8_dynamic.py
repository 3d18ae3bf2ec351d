"""``--config int8-dynamic``: activations quantized at run time exactly as ONNX ``DynamicQuantizeLinear``
(uint8, per tensor), Linear layers exported as ``DynamicQuantizeLinear -> MatMulInteger``, which
onnxruntime runs as its dynamic integer kernels. Reference values come from onnxruntime itself and from
hand-worked cases."""

import collections
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto as T
from onnx import helper

from exporters.dynamic_linear import dynamic_layers
from exporters.onnxruntime.fusion import inspect_fusion, optimized_graph
from quantcli.errors import ExportError
from quantcli.inputs.checkpoint import load_calibrated
from quantcli.nn.tensor_quantizer import TensorQuantizer
from quantcli.quant import arithmetic
from quantcli.quant.descriptor import QuantDescriptor
from quantcli.verify import verify_onnx
from tests.helpers import assert_clean_error, cli

U = 2.0**-24  # float32 unit roundoff


def _ort_dql(x: np.ndarray):
    """onnxruntime's DynamicQuantizeLinear on ``x``: (codes, scale, zero point)."""
    g = helper.make_graph(
        [helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])],
        "dql",
        [helper.make_tensor_value_info("x", T.FLOAT, list(x.shape))],
        [
            helper.make_tensor_value_info("y", T.UINT8, list(x.shape)),
            helper.make_tensor_value_info("s", T.FLOAT, []),
            helper.make_tensor_value_info("z", T.UINT8, []),
        ],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def _quantizer():
    q = TensorQuantizer(QuantDescriptor(num_bits=8, asymmetric=True, dynamic=True), name="x")
    assert q.dynamic_uint8
    return q


def _cases():
    r = np.random.default_rng(0)
    return {
        "normal": r.standard_normal((4, 7, 33)).astype(np.float32) * 3,
        "all_positive": r.uniform(0.5, 9.0, (64,)).astype(np.float32),
        "all_negative": -r.uniform(0.5, 9.0, (64,)).astype(np.float32),
        "all_zero": np.zeros((3, 5), np.float32),
        "one_value": np.full((6,), 2.75, np.float32),
        # range [0, 255]: scale exactly 1, so k + 0.5 are ties of x / scale
        "ties": np.array([0.0, 255.0, 0.5, 1.5, 2.5, 3.5, 254.5, 127.5], np.float32),
        # range [-2.5, 252.5]: scale 1, and -min / scale = 2.5 is a tie of the zero point itself
        "zero_point_tie": np.array([-2.5, 252.5, -1.5, -0.5, 0.5, 100.5], np.float32),
        "outliers": np.concatenate([r.standard_normal(500), [80.0, -3.0]]).astype(np.float32),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_codes_scale_and_zero_point_equal_onnxruntime(case):
    x = _cases()[case]
    codes, scale, zp = _ort_dql(x)
    s, z = arithmetic.dynamic_qparams(torch.from_numpy(x))
    assert np.float32(s) == scale and float(z) == float(zp), (float(s), scale, float(z), zp)
    mine = arithmetic.quantize_linear(torch.from_numpy(x), s, z, 0, 255).numpy()
    np.testing.assert_array_equal(mine, codes.astype(np.float32))
    # the fake-quant quantizer returns exactly (codes - zero point) * scale
    with torch.no_grad():
        fq = _quantizer()(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(
        fq, ((codes.astype(np.float32) - np.float32(zp)) * np.float32(scale)).astype(np.float32)
    )


def test_hand_worked_cases():
    """Independent of onnxruntime: the ONNX definition worked by hand."""
    s, z = arithmetic.dynamic_qparams(torch.tensor([0.0, 255.0, 0.5, 1.5, 2.5]))
    assert (float(s), float(z)) == (1.0, 0.0)
    codes = arithmetic.quantize_linear(torch.tensor([0.5, 1.5, 2.5, 254.5]), s, z, 0, 255)
    assert codes.tolist() == [0.0, 2.0, 2.0, 254.0]  # ties to even
    s, z = arithmetic.dynamic_qparams(torch.tensor([-2.5, 252.5]))
    assert (float(s), float(z)) == (1.0, 2.0)  # zero point 2.5 rounds to even
    s, z = arithmetic.dynamic_qparams(torch.zeros(4))
    assert (float(s), float(z)) == (1.0, 0.0)  # all zero: scale 1 (the formula would give 0)
    s, z = arithmetic.dynamic_qparams(torch.tensor([-5.1, -2.0]))  # all negative: the range is [-5.1, 0]
    assert float(s) == np.float32(np.float32(5.1) / np.float32(255)) and float(z) == 255.0
    s, z = arithmetic.dynamic_qparams(torch.tensor([1.0, 3.0]))  # all positive: the range is [0, 3]
    assert float(s) == np.float32(np.float32(3.0) / np.float32(255)) and float(z) == 0.0


def test_only_uint8():
    with pytest.raises(ValueError, match="uint8 only"):
        QuantDescriptor(num_bits=4, asymmetric=True, dynamic=True)


# ------------------------------------------------------------------------------------------- exported graphs


def _layer_tensors(path, batch):
    """onnxruntime (optimizations off): per dynamic layer, its input, codes, scale, zero point and output."""
    model = onnx.load(str(path))
    layers = dynamic_layers(model)
    names = []
    for d in layers:
        for t, elem in (
            (d.input, T.FLOAT),
            (d.codes, T.UINT8),
            (d.scale, T.FLOAT),
            (d.zero_point, T.UINT8),
            (d.output, T.FLOAT),
        ):
            if t not in {o.name for o in model.graph.output}:
                model.graph.output.append(helper.make_tensor_value_info(t, elem, None))
            names.append(t)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = {i.name: batch[i.name].numpy() for i in sess.get_inputs()}
    outs = dict(zip(names, sess.run(names, feeds)))
    return layers, outs


def _check_layers_against_pytorch(path, model, batch):
    """Per layer, on onnxruntime's own input: identical codes, scale and zero point, and the output within the
    float-accumulation bound.

    The graph sums the integer products exactly (int32) and rounds about 4 times (cast, scale product, scale
    multiply, bias add); PyTorch rounds each dequantized factor and each of the K products and partial sums.
    With ``a_k = xs (q_k - zp)`` and ``b_kn = ws_n w_kn`` both are within ``gamma_{K+2} S_n`` and
    ``gamma_4 (S_n + |bias_n|)`` of the exact value, ``S_n = xs ws_n sum_k |q_k - zp| |w_kn|``
    (Higham, Accuracy and Stability of Numerical Algorithms, 3.1: any summation order), so
    ``|pytorch - graph| <= gamma_{K+6} (S_n + |bias_n|)`` with ``gamma_m = m u / (1 - m u)``.
    """
    layers, outs = _layer_tensors(path, batch)
    modules = dict(model.named_modules())
    assert layers
    for d in layers:
        layer = modules[d.input_quantizer.rsplit(".", 1)[0]]
        x = torch.from_numpy(outs[d.input])
        s, z = arithmetic.dynamic_qparams(x)
        assert float(s) == outs[d.scale] and float(z) == float(outs[d.zero_point]), d.input_quantizer
        codes = arithmetic.quantize_linear(x, s, z, 0, 255)
        np.testing.assert_array_equal(
            codes.numpy(), outs[d.codes].astype(np.float32), err_msg=d.input_quantizer
        )
        with torch.no_grad():
            mine = layer(x).numpy().astype(np.float64)
        wq = layer.weight_quantizer
        ws = arithmetic.symmetric_scale(wq.amax, arithmetic.symmetric_bound(8)).reshape(-1).double()
        w_codes = torch.round(layer.weight.detach().double() / ws.reshape(-1, 1))
        k = layer.in_features
        s_n = (float(s) * ws) * ((codes.double() - float(z)).abs() @ w_codes.abs().T)
        bias = layer.bias.detach().double().abs() if layer.bias is not None else 0.0
        gamma = (k + 6) * U / (1 - (k + 6) * U)
        bound = gamma * (s_n + bias)
        diff = np.abs(mine - outs[d.output].astype(np.float64))
        assert (diff <= bound.numpy()).all(), (d.input_quantizer, float(diff.max()), float(bound.max()))


@pytest.fixture(scope="module")
def text_dynamic(calibrated, exported):
    ck = calibrated("text_encoder", "int8-dynamic")
    return ck, exported("text_encoder", "int8-dynamic")


def test_calibrate_says_activations_need_no_calibration(calibrated):
    r = cli(
        "calibrate",
        "text_encoder",
        "--config",
        "int8-dynamic",
        "--num-samples",
        "64",
        "--out",
        str(calibrated("text_encoder", "int8-dynamic")) + ".again.pt",
    )
    assert r.exit_code == 0, r.output
    assert "13 quantized at run time" in r.output and "nothing to calibrate" in r.output
    data = torch.load(calibrated("text_encoder", "int8-dynamic"), weights_only=True)
    summary = data["calibration"]
    assert len(summary["dynamic"]) == 13 and all(n.endswith("input_quantizer") for n in summary["dynamic"])
    assert summary["quantizers_calibrated"] == 13  # the weights
    assert all(data["quantizers"][n]["amax"] is None for n in summary["dynamic"])


def test_text_encoder_layers_match_onnxruntime(text_dynamic):
    ck, onnx_path = text_dynamic
    from sample_models import text_encoder

    model = load_calibrated(ck).model
    for batch in text_encoder.evaluation_batches()[:2]:
        _check_layers_against_pytorch(onnx_path, model, batch)


def test_text_encoder_graph_is_the_fusable_pattern(text_dynamic):
    _, onnx_path = text_dynamic
    m = onnx.load(str(onnx_path))
    ops = collections.Counter(n.op_type for n in m.graph.node)
    assert ops["DynamicQuantizeLinear"] == 13 and ops["MatMulInteger"] == 13
    assert ops["QuantizeLinear"] == 0 and ops["DequantizeLinear"] == 0
    inits = {t.name: t for t in m.graph.initializer}
    for d in dynamic_layers(m):
        assert inits[d.weight].data_type == T.INT8  # weight codes stored, (in, out)
        assert d.weight_scale is not None and d.weight_scale.size == inits[d.weight].dims[1]
    qmap = json.loads(next(p.value for p in m.metadata_props if p.key == "quantcli.quantizers"))
    assert sum(v.endswith("input_quantizer") for v in qmap.values()) == 13


def test_onnxruntime_runs_dynamic_integer_kernels(text_dynamic):
    _, onnx_path = text_dynamic
    ops = collections.Counter(n.op_type for n in optimized_graph(onnx_path).graph.node)
    assert ops["DynamicQuantizeMatMul"] + ops["MatMulIntegerToFloat"] == 13, ops
    assert ops["MatMulInteger"] == 0 and ops["MatMul"] == 2  # the two attention products stay float
    rep = inspect_fusion(onnx_path)
    assert len(rep.layers) == 13 and not rep.unfused
    assert {r.kernel for r in rep.layers} <= {"DynamicQuantizeMatMul", "MatMulIntegerToFloat"}


def test_verify_checks_dynamic_quantizers(text_dynamic):
    ck, onnx_path = text_dynamic
    rep = verify_onnx(onnx_path, ck, provider="cpu")
    assert rep.passed, rep.structure
    assert rep.structure["quantizers_found"] == rep.structure["quantizers_expected"] == 26
    codes = rep.fidelity["quantizers"]
    dyn = [n for n in codes if n.endswith("input_quantizer")]
    assert len(dyn) == 13 and all(codes[n]["identical_codes"] == 1.0 for n in dyn)
    assert rep.quality["outputs"]["output_0"]["cosine"] > 0.9999


def test_dynamo_exports_the_same_pattern(text_dynamic, tmp_path):
    ck, _ = text_dynamic
    out = tmp_path / "dyn.onnx"
    r = cli("export", ck, "--onnx", out, "--exporter", "dynamo", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert (
        res["dynamic_layers"] == 13 and res["weights_stored_quantized"] == 13 and res["unfused_layers"] == 0
    )
    from sample_models import text_encoder

    _check_layers_against_pytorch(out, load_calibrated(ck).model, text_encoder.evaluation_batches()[0])


def test_convolutions_stay_float(calibrated, exported):
    from sample_models import digits_cnn

    ck = calibrated("digits_cnn", "int8-dynamic")
    data = torch.load(ck, weights_only=True)
    kinds = {n: type(m) for n, m in digits_cnn.build().named_modules()}
    conv = {n: v for n, v in data["quantizers"].items() if kinds[n.rsplit(".", 1)[0]] is torch.nn.Conv2d}
    assert len(conv) == 4 and not any(v["enabled"] for v in conv.values())
    lin = {n: v for n, v in data["quantizers"].items() if kinds[n.rsplit(".", 1)[0]] is torch.nn.Linear}
    assert len(lin) == 4 and all(v["enabled"] for v in lin.values())
    path = exported("digits_cnn", "int8-dynamic")
    m = onnx.load(str(path))
    ops = collections.Counter(n.op_type for n in m.graph.node)
    assert ops["Conv"] >= 1 and ops["ConvInteger"] == 0 and ops["MatMulInteger"] == len(lin) // 2
    assert verify_onnx(path, ck, provider="cpu").passed


def test_unexportable_dynamic_layer_is_a_clear_error(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "preset: int8-dynamic\nrules:\n  - pattern: classifier.weight_quantizer\n    enable: false\n"
    )
    ck = tmp_path / "text_encoder.calib.pt"
    r = cli("calibrate", "text_encoder", "--config", cfg, "--num-samples", "32", "--out", ck)
    assert r.exit_code == 0, r.output
    out = tmp_path / "text_encoder.onnx"
    assert_clean_error(
        cli("export", ck, "--onnx", out), "classifier.input_quantizer", "weight quantizer is disabled"
    )
    assert not out.exists()


def test_deep_encoder_layers_match(tmp_path):
    pytest.importorskip("transformers")
    from exporters import export_onnx
    from quantcli import calibrate, quantize_model
    from sample_models.structured import deep_encoder, deep_encoder_batches

    model = quantize_model(deep_encoder(layers=2), "int8-dynamic")
    batches = deep_encoder_batches("calib", 8)
    summary = calibrate(model, batches, device="cpu")
    assert len(summary.dynamic) == 2 * 6 + 1  # and the pooler, which runs (its output is unused)
    path = tmp_path / "deep.onnx"
    export_onnx(model, batches[0], path)
    _check_layers_against_pytorch(path, model, deep_encoder_batches("eval", 8)[0])
    ops = collections.Counter(n.op_type for n in optimized_graph(path).graph.node)
    assert ops["DynamicQuantizeMatMul"] + ops["MatMulIntegerToFloat"] == 12, ops


class _Nested(torch.nn.Module):
    """Linears inside Sequentials inside a ModuleList: TorchScript scopes them "/layers.1/layers.1.0/..."."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(2)]
        )

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_dynamic_layers_in_nested_containers_are_mapped(tmp_path, exporter):
    from exporters import export_onnx
    from exporters.graph import quantizer_map
    from quantcli import calibrate, quantize_model

    torch.manual_seed(0)
    model = quantize_model(_Nested(), "int8-dynamic")
    batch = {"x": torch.randn(4, 8)}
    calibrate(model, [batch], device="cpu")
    path = tmp_path / "nested.onnx"
    export_onnx(model, batch, path, exporter=exporter)
    graph = onnx.load(path)
    layers = dynamic_layers(graph)
    qmap = quantizer_map(graph)
    assert sorted(qmap[d.codes] for d in layers) == [
        "layers.0.0.input_quantizer",
        "layers.1.0.input_quantizer",
    ]
    assert sorted(qmap[d.weight] for d in layers) == [
        "layers.0.0.weight_quantizer",
        "layers.1.0.weight_quantizer",
    ]


def test_dynamic_quantizer_outside_a_linear_does_not_export():
    q = _quantizer()
    with pytest.raises(ExportError, match="input of a Linear"):
        torch.onnx.export(q, (torch.randn(3),), "/dev/null", dynamo=False)


class _Unused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(8, 4)
        self.head = torch.nn.Linear(4, 2)  # never called

    def forward(self, x):
        return self.used(x)


def test_a_dynamic_layer_that_never_runs_is_left_out():
    from quantcli import calibrate, quantize_model

    torch.manual_seed(0)
    model = quantize_model(_Unused(), "int8-dynamic")
    summary = calibrate(model, [{"x": torch.randn(4, 8)}], device="cpu")
    assert summary.not_called == ["head.input_quantizer", "head.weight_quantizer"]
    assert summary.dynamic == ["used.input_quantizer"]
    assert not model.head.input_quantizer.enabled and model.used.input_quantizer.enabled


def test_checkpoint_reload_is_bit_identical(text_dynamic):
    ck, _ = text_dynamic
    from quantcli import calibrate, quantize_model
    from sample_models import text_encoder

    model = quantize_model(text_encoder.build(), "int8-dynamic")
    calibrate(model, text_encoder.calibration_batches(), device="cpu")
    batch = text_encoder.evaluation_batches()[0]
    with torch.no_grad():
        assert torch.equal(model(**batch), load_calibrated(ck).model(**batch))


class _FunctionalLinear(torch.nn.Module):
    """Not an nn.Linear: its forward calls F.linear on its own (out, in) weight."""

    def __init__(self, i, o):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(o, i) / i**0.5)
        self.bias = torch.nn.Parameter(torch.randn(o) * 0.1)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias)


class _HalvedLinear(torch.nn.Linear):
    """An nn.Linear subclass with a forward of its own (quantized where its F.linear runs)."""

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias) * 0.5


class _LinearKinds(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.f = _FunctionalLinear(16, 32)
        self.h = _HalvedLinear(32, 32)
        self.out = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.out(torch.relu(self.h(torch.relu(self.f(x)))))


def _dynamic_graph_is_the_model(model, batch, path, exporter, dynamic_dims=None):
    """Calibrate ``model`` (int8-dynamic, quantized), export it, and check that every dynamic quantizer is a
    MatMulInteger pattern of the graph and that onnxruntime's output (optimizations off) is the fake-quant
    model's. Returns the dynamic quantizers' names and the graph's output."""
    from exporters import export_onnx
    from exporters.graph import quantizer_map
    from quantcli import calibrate

    summary = calibrate(model, [batch], device="cpu")
    export_onnx(model, batch, path, exporter=exporter, dynamic_dims=dynamic_dims)
    graph = onnx.load(path)
    qmap = quantizer_map(graph)
    assert sorted(qmap[d.codes] for d in dynamic_layers(graph)) == sorted(summary.dynamic)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    feeds = {k: v.numpy() for k, v in batch.items()}
    got = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    with torch.no_grad():
        want = model(**batch).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))
    return sorted(summary.dynamic), got


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_every_layer_computing_f_linear_is_dynamic_whatever_its_class(tmp_path, exporter):
    """int8-dynamic quantizes a module computing F.linear on its own weight and a Linear subclass with its own
    forward as it does nn.Linear (before, both stayed float), and both exporters write the MatMulInteger
    pattern for each, equal to the fake-quant model's layers."""
    from quantcli import quantize_model

    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 5, 16)}
    model = quantize_model(_LinearKinds(), "int8-dynamic", example=batch)
    dynamic, _ = _dynamic_graph_is_the_model(model, batch, tmp_path / "kinds.onnx", exporter)
    assert dynamic == ["f.input_quantizer", "h.input_quantizer", "out.input_quantizer"]


class _NoBiasAttribute(torch.nn.Module):
    """F.linear on its own weight in a module with no ``bias`` attribute at all, then a gain."""

    def __init__(self, i, o):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(o, i) / i**0.5)
        self.gain = torch.nn.Parameter(torch.full((o,), 1.5))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight) * self.gain


class _BiasAddedAfter(torch.nn.Module):
    """F.linear without a bias, the module's ``bias`` added after a scale: the product adds no bias."""

    def __init__(self, i, o):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(o, i) / i**0.5)
        self.bias = torch.nn.Parameter(torch.randn(o))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight) * 0.5 + self.bias


class _BiasKinds(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.out = _NoBiasAttribute(16, 32), _BiasAddedAfter(32, 32), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.out(torch.relu(self.b(torch.relu(self.a(x)))))


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_dynamic_layer_exports_the_bias_its_f_linear_adds(tmp_path, exporter):
    """The dynamic export wrote ``F.linear(x, W, module.bias)`` whatever the call added: a module without a
    ``bias`` attribute failed to export (AttributeError), and one adding its bias after ``F.linear(x, W)``
    exported it twice (torchscript refused it, dynamo's graph added it inside the MatMulInteger pattern as
    well). The graph now adds the call's own bias: onnxruntime's output is the model's."""
    from quantcli import quantize_model

    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 5, 16)}
    model = quantize_model(_BiasKinds(), "int8-dynamic", example=batch)
    dynamic, _ = _dynamic_graph_is_the_model(model, batch, tmp_path / "bias.onnx", exporter)
    assert dynamic == ["a.input_quantizer", "b.input_quantizer", "out.input_quantizer"]


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_mm_and_addmm_layers_are_dynamic_like_onnxruntimes_quantize_dynamic(tmp_path, exporter):
    """A pygcn graph convolution (``torch.mm(x, self.weight)``, the weight ``(in, out)``) and an ``addmm``
    classifier: onnxruntime's ``quantize_dynamic`` quantizes their MatMul/Gemm, int8-dynamic left them float
    ("its quantizers are disabled (preset ...)"). Each is now the MatMulInteger pattern, the addmm's bias
    added once, and onnxruntime's output is the fake-quant model's."""
    from quantcli import quantize_model
    from tests import user_models

    gcn = user_models.module("graph_convolution")
    batch = {k: torch.from_numpy(v) for k, v in gcn.samples(16, 0).items()}
    model = quantize_model(gcn.make(), "int8-dynamic", example=batch)
    path = tmp_path / "gcn.onnx"
    # the nodes are on both axes of the adjacency
    dynamic, got = _dynamic_graph_is_the_model(model, batch, path, exporter, dynamic_dims={"adj": [1]})
    assert dynamic == ["classifier.input_quantizer", "gc1.input_quantizer", "gc2.input_quantizer"]
    with torch.no_grad():
        float_out = gcn.make()(**batch).numpy()
    assert not np.allclose(got, float_out, atol=1e-6)  # quantized, not float


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_gpt2_conv1d_layers_are_dynamic_like_onnxruntimes_quantize_dynamic(tmp_path, exporter):
    """GPT-2's projections are transformers' ``Conv1D`` (``x @ W + b``, ``W`` is ``(in, out)``): int8-dynamic
    left all of them float and quantized lm_head alone, where onnxruntime's ``quantize_dynamic`` of the same
    model quantizes every MatMul. Each Conv1D is now ``DynamicQuantizeLinear -> MatMulInteger`` on its own
    ``(K, N)`` weight (no transpose), the codes those of ``round(W / (amax / bound))`` per output column,
    worked out here from the weights; the graph is at least as close to the float model as
    quantize_dynamic's."""
    transformers = pytest.importorskip("transformers")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from exporters import aten_symbolics, export_onnx
    from exporters.graph import initializer_map, quantizer_map, to_numpy
    from quantcli import calibrate, quantize_model

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    gpt2 = transformers.GPT2LMHeadModel(cfg).eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = gpt2

        def forward(self, input_ids):
            return self.lm(input_ids=input_ids, use_cache=False).logits

    ids = torch.randint(0, 64, (8, 12))
    batch = {"input_ids": ids}
    with torch.no_grad():
        ref = Logits()(**batch).numpy()
    aten_symbolics.register()  # transformers' masks call torch.diff, which torch does not translate
    torch.onnx.export(
        Logits(), (ids,), str(tmp_path / "f.onnx"), dynamo=False, input_names=["input_ids"], opset_version=17
    )
    quantize_dynamic(
        tmp_path / "f.onnx", tmp_path / "ort.onnx", weight_type=QuantType.QInt8, per_channel=True
    )

    model = quantize_model(Logits(), "int8-dynamic", example=batch)
    summary = calibrate(model, [batch], device="cpu")
    conv1d = [n for n, m in model.named_modules() if type(m).__name__ == "QuantConv1D"]
    assert len(conv1d) == 8 and all(f"{n}.input_quantizer" in summary.dynamic for n in conv1d)
    path = tmp_path / "q.onnx"
    export_onnx(model, batch, path, exporter=exporter)
    graph = onnx.load(path)
    qmap, inits = quantizer_map(graph), initializer_map(graph.graph)
    layers = {qmap[d.codes].rsplit(".", 1)[0]: d for d in dynamic_layers(graph)}
    assert sorted(layers) == sorted([*conv1d, "lm.lm_head"])
    for name in conv1d:
        layer = model.get_submodule(name)
        w = layer.weight.detach().numpy()  # (in, out) = MatMulInteger's (K, N)
        bound = 2 ** (layer.weight_quantizer.desc.num_bits - 1) - 1  # 63 where u8s8 kernels can saturate
        scale = np.abs(w).max(axis=0, keepdims=True).astype(np.float32) / np.float32(bound)
        codes = np.clip(np.rint(w / scale), -bound - 1, bound)
        np.testing.assert_array_equal(to_numpy(inits[layers[name].weight]), codes, err_msg=name)

    def cosine(path):
        got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
            None, {"input_ids": ids.numpy()}
        )
        return float(np.dot(got[0].ravel(), ref.ravel()) / np.linalg.norm(got[0]) / np.linalg.norm(ref))

    ours, theirs = cosine(path), cosine(tmp_path / "ort.onnx")
    assert ours > 0.999 and ours >= theirs - 1e-4, (ours, theirs)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_multihead_attentions_projections_are_dynamic_like_onnxruntimes_quantize_dynamic(tmp_path, exporter):
    """int8-dynamic left nn.MultiheadAttention's packed input projection float ("its quantizers are
    disabled (preset ...)") where onnxruntime's quantize_dynamic quantizes its MatMul; and the dynamo graph,
    which scopes out_proj's product to the attention module (out_proj is never called), failed verify's
    structure check ("attn.out_proj.input_quantizer: Q/DQ pair missing"). Both projections are MatMulInteger
    patterns now,
    mapped to their own quantizers, and the graph computes what the fake-quant model does."""
    from exporters.graph import quantizer_map
    from quantcli import quantize_model
    from tests import user_models

    mha = user_models.module("multihead_attention")
    batch = {k: torch.from_numpy(v) for k, v in mha.samples(6, 0).items()}
    model = quantize_model(mha.make(), "int8-dynamic", example=batch)
    dynamic, _ = _dynamic_graph_is_the_model(model, batch, tmp_path / "attn.onnx", exporter)
    assert dynamic == [
        "attn.input_quantizer",
        "attn.out_proj.input_quantizer",
        "embed.input_quantizer",
        "head.input_quantizer",
    ]
    graph = onnx.load(tmp_path / "attn.onnx")
    qmap = quantizer_map(graph)
    shapes = {qmap[i.name]: tuple(i.dims) for i in graph.graph.initializer if i.name in qmap}
    assert shapes["attn.weight_quantizer"] == (32, 96) and shapes["attn.out_proj.weight_quantizer"] == (
        32,
        32,
    )
