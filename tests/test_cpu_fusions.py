"""exporters.onnxruntime.cpu_fusions: Adds that onnxruntime would fuse into its slow CPU
SkipLayerNormalization / BiasGelu kernels are written as Sum; values bit-identical, and onnxruntime's
optimized graph keeps LayerNormalization and Gelu."""

import collections
import json
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from exporters.onnxruntime.cpu_fusions import keep_cpu_kernels
from tests.helpers import cli

HIDDEN, FFN = 16, 32


def _init(name, arr):
    return numpy_helper.from_array(np.asarray(arr), name)


def _gelu(x: str, p: str) -> list[onnx.NodeProto]:
    """GELU as the torch exporter writes it: x * (1 + erf(x / sqrt(2))) * 0.5."""
    return [
        helper.make_node("Div", [x, "sqrt2"], [p + "d"]),
        helper.make_node("Erf", [p + "d"], [p + "e"]),
        helper.make_node("Add", [p + "e", "one"], [p + "e1"]),
        helper.make_node("Mul", [x, p + "e1"], [p + "m"]),
        helper.make_node("Mul", [p + "m", "half"], [p + "out"]),
    ]


def _model() -> onnx.ModelProto:
    """x -> Linear -> residual Add -> LayerNorm -> Linear -> bias Add -> GELU -> Linear (y), and beside it a
    dynamic int8 Linear (MatMulInteger -> Cast -> Mul -> bias Add) into a GELU (z), and a plain Add (w)."""
    rng = np.random.default_rng(0)
    f32 = np.float32
    inits = [
        _init("w1", rng.normal(size=(HIDDEN, HIDDEN)).astype(f32)),
        _init("b1", rng.normal(size=HIDDEN).astype(f32)),
        _init("g", 1 + rng.random(HIDDEN, dtype=f32)),
        _init("beta", rng.normal(size=HIDDEN).astype(f32)),
        _init("w2", rng.normal(size=(HIDDEN, FFN)).astype(f32)),
        _init("b2", rng.normal(size=FFN).astype(f32)),
        _init("w3", rng.normal(size=(FFN, HIDDEN)).astype(f32)),
        _init("w4", rng.integers(-127, 128, size=(HIDDEN, FFN)).astype(np.int8)),
        _init("w4_zp", np.int8(0)),
        _init("w4_scale", f32(0.01)),
        _init("b4", rng.normal(size=FFN).astype(f32)),
        _init("sqrt2", f32(math.sqrt(2))),
        _init("one", f32(1)),
        _init("half", f32(0.5)),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["mm1"]),
        helper.make_node("Add", ["b1", "mm1"], ["h1"]),
        helper.make_node("Add", ["h1", "x"], ["res"]),  # residual -> LayerNorm: SkipLayerNormalization
        helper.make_node("LayerNormalization", ["res", "g", "beta"], ["ln"], axis=-1, epsilon=1e-5),
        # BiasGelu
        helper.make_node("MatMul", ["ln", "w2"], ["mm2"]),
        helper.make_node("Add", ["mm2", "b2"], ["h2"]),
        *_gelu("h2", "g2"),
        helper.make_node("MatMul", ["g2out", "w3"], ["y"]),
        helper.make_node("DynamicQuantizeLinear", ["ln"], ["q", "q_scale", "q_zp"]),
        helper.make_node("MatMulInteger", ["q", "w4", "q_zp", "w4_zp"], ["acc"]),
        helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["q_scale", "w4_scale"], ["s4"]),
        helper.make_node("Mul", ["accf", "s4"], ["mm4"]),
        # stays: onnxruntime folds it into MatMulIntegerToFloat
        helper.make_node("Add", ["mm4", "b4"], ["h4"]),
        *_gelu("h4", "g4"),
        helper.make_node("Identity", ["g4out"], ["z"]),
        helper.make_node("Add", ["y", "x"], ["w"]),  # feeds no LayerNorm or GELU: stays
    ]
    io = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 5, HIDDEN])
    outs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 5, d])
        for n, d in (("y", HIDDEN), ("z", FFN), ("w", HIDDEN))
    ]
    return helper.make_model(
        helper.make_graph(nodes, "m", [io], outs, inits),
        ir_version=8,
        opset_imports=[helper.make_opsetid("", 17)],
    )


def _session(model: onnx.ModelProto, level, optimized=None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    if optimized is not None:
        so.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _optimized_ops(model: onnx.ModelProto, tmp_path, name: str) -> collections.Counter:
    path = tmp_path / f"{name}.opt.onnx"
    _session(model, ort.GraphOptimizationLevel.ORT_ENABLE_ALL, path)
    return collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def test_adds_into_layer_norm_and_gelu_become_sum_and_nothing_else_changes():
    m = _model()
    counts = keep_cpu_kernels(m)
    assert counts == {"skip_layer_norm_avoided": 1, "bias_gelu_avoided": 1}
    op_of = {n.output[0]: n.op_type for n in m.graph.node}
    assert op_of["res"] == "Sum" and op_of["h2"] == "Sum"
    assert op_of["h1"] == "Add"  # the bias Add before the residual: not read by the LayerNorm itself
    assert op_of["h4"] == "Add"  # a dynamic layer's bias
    # unrelated, and GELU's own 1 + erf
    assert op_of["w"] == "Add" and op_of["g2e1"] == op_of["g4e1"] == "Add"
    onnx.checker.check_model(m)


@pytest.mark.parametrize(
    "level", [ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC]
)
def test_values_are_bit_identical(level):
    """The graph as written (no level-2 fusions: those are what changes) computes exactly the same values."""
    x = np.random.default_rng(1).normal(size=(3, 5, HIDDEN)).astype(np.float32)
    before = _session(_model(), level).run(None, {"x": x})
    m = _model()
    keep_cpu_kernels(m)
    after = _session(m, level).run(None, {"x": x})
    for a, b in zip(before, after):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_onnxruntime_keeps_layer_norm_and_gelu_kernels(tmp_path):
    plain = _optimized_ops(_model(), tmp_path, "plain")
    # control: without the pass onnxruntime forms both fusions on this graph
    assert plain["SkipLayerNormalization"] == 1 and plain["BiasGelu"] == 1
    m = _model()
    keep_cpu_kernels(m)
    ops = _optimized_ops(m, tmp_path, "kept")
    assert ops["SkipLayerNormalization"] == 0 and ops["BiasGelu"] == 0
    assert ops["LayerNormalization"] == 1 and ops["Gelu"] == 2 and ops["Sum"] == 2
    # the dynamic layer still fuses with its bias (no MatMulInteger, Cast or bias Add left)
    assert ops["MatMulInteger"] == 0 and ops["Cast"] == 0
    assert ops["DynamicQuantizeMatMul"] + ops["MatMulIntegerToFloat"] == 1


def test_text_encoder_export_forms_neither_fusion_and_verifies(calibrated, exported, tmp_path):
    """The default (onnxruntime) target's export: every LayerNorm reads a Sum, onnxruntime's optimized graph
    has no SkipLayerNormalization or BiasGelu, and verify (codes per quantizer, optimizations off) passes."""
    path = exported("text_encoder", "int8")
    g = onnx.load(str(path))
    producers = {o: n for n in g.graph.node for o in n.output}
    norms = [n for n in g.graph.node if n.op_type == "LayerNormalization"]
    assert norms and all(producers[n.input[0]].op_type == "Sum" for n in norms)
    ops = _optimized_ops(g, tmp_path, "te")
    assert ops["SkipLayerNormalization"] == 0 and ops["BiasGelu"] == 0
    assert ops["LayerNormalization"] == len(norms) and ops["Gelu"] == 2 and ops["MatMulIntegerToFloat"] > 0
    r = cli("verify", path, "--reference", calibrated("text_encoder", "int8"), "--json")
    assert r.exit_code == 0, r.output
    quantizers = json.loads(r.stdout)["fidelity"]["quantizers"]
    codes = [q["identical_codes"] for q in quantizers.values() if q["identical_codes"] is not None]
    assert len(codes) >= 13 and min(codes) == 1.0


class _Block(torch.nn.Module):
    """Post-LN transformer block's shape: Linear -> residual Add -> LayerNorm -> Linear -> GELU -> Linear."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm = torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.LayerNorm(HIDDEN)
        self.fc2, self.fc3 = torch.nn.Linear(HIDDEN, FFN), torch.nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        h = self.norm(self.fc1(x) + x)
        return self.fc3(torch.nn.functional.gelu(self.fc2(h)))


def _block(target: str):
    from quantcli import calibrate, quantize_model

    torch.manual_seed(0)
    m = quantize_model(_Block().eval(), {"target": target})
    calibrate(m, [{"x": torch.randn(4, 5, HIDDEN)} for _ in range(2)], "max", device="cpu")
    return m


@pytest.mark.parametrize(
    "target, provider",
    [("onnxruntime", None), ("onnxruntime", "cpu"), ("onnxruntime", "cuda"), ("tensorrt", None)],
)
def test_only_the_onnxruntime_cpu_provider_gets_the_sums(target, provider, tmp_path):
    from exporters import export_onnx

    res = export_onnx(
        _block(target), {"x": torch.randn(2, 5, HIDDEN)}, tmp_path / "b.onnx", provider=provider
    )
    graph = onnx.load(str(tmp_path / "b.onnx"))
    ops = collections.Counter(n.op_type for n in graph.graph.node)
    meta = {p.key: p.value for p in graph.metadata_props}
    if target == "onnxruntime" and provider != "cuda":  # cpu is the default
        assert res.provider == meta["quantcli.provider"] == "cpu"
        assert ops["Sum"] == 2 and res.placement["skip_layer_norm_avoided"] == 1
        assert res.placement["bias_gelu_avoided"] == 1
    else:
        assert ops["Sum"] == 0 and "skip_layer_norm_avoided" not in res.placement
        assert res.provider == meta.get("quantcli.provider") == provider


def test_provider_errors(tmp_path):
    from exporters import export_onnx
    from quantcli.errors import ExportError

    example = {"x": torch.randn(2, 5, HIDDEN)}
    with pytest.raises(
        ExportError, match="applies to the onnxruntime target; this model is calibrated for tensorrt"
    ):
        export_onnx(_block("tensorrt"), example, tmp_path / "t.onnx", provider="cpu")
    with pytest.raises(ExportError, match="unknown provider 'tpu'; choose cpu or cuda"):
        export_onnx(_block("onnxruntime"), example, tmp_path / "t.onnx", provider="tpu")
    assert not list(tmp_path.iterdir())  # checked before anything is written


def test_cli_provider_cuda_keeps_the_adds(calibrated, tmp_path):
    out = tmp_path / "cuda.onnx"
    r = cli("export", calibrated("text_encoder", "int8"), "--onnx", out, "--provider", "cuda", "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["provider"] == "cuda" and "skip_layer_norm_avoided" not in info["placement"]
    # what onnxruntime's CPU provider would then form
    ops = _optimized_ops(onnx.load(str(out)), tmp_path, "cuda")
    assert ops["Sum"] == 0 and ops["SkipLayerNormalization"] == 2 and ops["BiasGelu"] == 2
    text = cli("export", calibrated("text_encoder", "int8"), "--onnx", tmp_path / "cpu.onnx").stdout
    assert "onnxruntime provider" in text and "written as Sum" in text
