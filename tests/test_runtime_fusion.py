"""`quantcli inspect OUT.onnx --runtime onnxruntime`: what onnxruntime runs each quantized layer as, and why
not an integer kernel. Fused graphs are built by hand in the form onnxruntime's QDQ selectors take; the
exported sample graphs are checked against onnxruntime's own optimized graph, whatever their placement."""

import collections
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from exporters.graph import QUANTIZERS_KEY
from exporters.onnxruntime.fusion import INTEGER_KERNELS, inspect_fusion, optimized_graph
from tests.helpers import assert_clean_error, cli

rng = np.random.default_rng(0)
YSHAPE = {"Conv": ["N", 8, 6, 6], "Gemm": ["N", 8], "MatMul": ["N", 5, 8]}


def _init(name, values, dtype):
    return numpy_helper.from_array(np.asarray(values, dtype=dtype), name)


def _layer_graph(op, *, act_type=T.UINT8, out_type=T.UINT8, out_zp=0, relu=True, bias="int32", consumers=1):
    """x -> Q -> DQ -> op(W DQ int8 per channel, bias) [-> Relu] -> Q -> DQ -> y, one layer per consumer."""
    np_act = {T.UINT8: np.uint8, T.INT8: np.int8}
    sx, cout = np.float32(0.02), 8
    inits = [
        _init("sx", sx, np.float32),
        _init("zx", 0, np_act[act_type]),
        _init("so", 0.05, np.float32),
        _init("zo", out_zp, np_act[out_type]),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"], name="x_q"),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"], name="x_dq"),
    ]
    qmap = {"xd": "in.input_quantizer"}
    outs = []
    for k in range(consumers):
        if op == "Conv":
            w, xshape = rng.integers(-127, 128, (cout, 4, 3, 3)), ["N", 4, 6, 6]
        elif op == "Gemm":
            w, xshape = rng.integers(-127, 128, (cout, 16)), ["N", 16]
        else:
            w, xshape = rng.integers(-127, 128, (16, cout)), ["N", 5, 16]
        sw = rng.uniform(0.001, 0.01, cout).astype(np.float32)
        axis = 1 if op == "MatMul" else 0
        inits += [
            _init(f"w{k}", w, np.int8),
            _init(f"sw{k}", sw, np.float32),
            _init(f"zw{k}", np.zeros(cout), np.int8),
        ]
        nodes.append(
            helper.make_node(
                "DequantizeLinear", [f"w{k}", f"sw{k}", f"zw{k}"], [f"wd{k}"], axis=axis, name=f"w{k}_dq"
            )
        )
        qmap[f"wd{k}"] = f"layer{k}.weight_quantizer"
        ins = ["xd", f"wd{k}"]
        if bias == "int32" and op != "MatMul":
            inits += [
                _init(f"b{k}", rng.integers(-1000, 1000, cout), np.int32),
                _init(f"sb{k}", sx * sw, np.float32),
            ]
            nodes.append(
                helper.make_node("DequantizeLinear", [f"b{k}", f"sb{k}"], [f"bd{k}"], axis=0, name=f"b{k}_dq")
            )
            ins.append(f"bd{k}")
        elif bias == "float" and op != "MatMul":
            inits.append(_init(f"b{k}", rng.standard_normal(cout), np.float32))
            ins.append(f"b{k}")
        attrs = {"pads": [1, 1, 1, 1]} if op == "Conv" else {"transB": 1} if op == "Gemm" else {}
        nodes.append(helper.make_node(op, ins, [f"y{k}"], name=f"layer{k}/{op}", **attrs))
        y = f"y{k}"
        if relu:
            nodes.append(helper.make_node("Relu", [y], [f"r{k}"], name=f"relu{k}"))
            y = f"r{k}"
        nodes += [
            helper.make_node("QuantizeLinear", [y, "so", "zo"], [f"yq{k}"], name=f"out{k}_q"),
            helper.make_node("DequantizeLinear", [f"yq{k}", "so", "zo"], [f"out{k}"], name=f"out{k}_dq"),
        ]
        outs.append(helper.make_tensor_value_info(f"out{k}", T.FLOAT, YSHAPE[op]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, xshape)], outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    model.metadata_props.add(key=QUANTIZERS_KEY, value=json.dumps(qmap))
    return model


def _without_output_q(model, op):
    """``model`` with the layer's output Q/DQ pair removed: the float output ``y0`` is the graph's output."""
    g = model.graph
    keep = [n for n in g.node if n.name not in ("out0_q", "out0_dq")]
    del g.node[:]
    g.node.extend(keep)
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("y0", T.FLOAT, YSHAPE[op]))
    return model


def _save(model, tmp_path, name="g.onnx"):
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize(
    "op, kernel", [("Conv", "QLinearConv"), ("Gemm", "QGemm"), ("MatMul", "QLinearMatMul")]
)
def test_a_graph_in_the_fusable_form_is_reported_fused(op, kernel, tmp_path):
    path = _save(_layer_graph(op), tmp_path)
    rep = inspect_fusion(path)
    assert rep.load_error is None
    (layer,) = rep.layers
    assert (layer.layer, layer.op_type, layer.kernel, layer.fused, layer.reasons) == (
        "layer0",
        op,
        kernel,
        True,
        [],
    )
    assert layer.quantizers == ["in.input_quantizer", "layer0.weight_quantizer"]
    kinds = collections.Counter(n.op_type for n in optimized_graph(path).graph.node)
    assert kinds[kernel] == 1 and kinds[op] == 0  # independent look at onnxruntime's graph


def test_matmul_without_output_q_is_matmulintegertofloat(tmp_path):
    m = _without_output_q(_layer_graph("MatMul", relu=False), "MatMul")
    (layer,) = inspect_fusion(_save(m, tmp_path)).layers
    assert (layer.kernel, layer.fused) == ("MatMulIntegerToFloat", True)


@pytest.mark.parametrize("op", ["Conv", "Gemm"])
def test_signed_grid_after_relu_blocks_the_fusion_and_says_why(op, tmp_path):
    rep = inspect_fusion(_save(_layer_graph(op, out_type=T.INT8, out_zp=0), tmp_path))
    (layer,) = rep.layers
    assert layer.fused is False and layer.kernel in (op, "Fused" + op)
    assert any("Relu" in r and "zero point" in r for r in layer.reasons), layer.reasons


def test_float_bias_without_output_q_is_diagnosed(tmp_path):
    # the conv output goes straight to the graph output: no Q, so onnxruntime keeps the float bias
    m = _without_output_q(_layer_graph("Conv", bias="float", relu=False), "Conv")
    (layer,) = inspect_fusion(_save(m, tmp_path)).layers
    assert layer.fused is False
    assert any(r.startswith("float bias") for r in layer.reasons) and any(
        "QLinearConv needs" in r for r in layer.reasons
    )


@pytest.mark.parametrize("relu", [True, False])
def test_a_graph_output_that_is_also_quantized_is_diagnosed(relu, tmp_path):
    """Issue 35 item 10 (a two-input model whose ``proj`` returns its output and feeds the head through a
    Relu): the layer's output is a graph output and also goes to a Q; onnxruntime keeps the Gemm float. Was
    "no known condition explains it"."""
    m = _layer_graph("Gemm", relu=relu)
    m.graph.output.append(helper.make_tensor_value_info("y0", T.FLOAT, YSHAPE["Gemm"]))
    path = _save(m, tmp_path)
    (layer,) = inspect_fusion(path).layers
    assert layer.fused is False and layer.kernel == "Gemm"
    (reason,) = layer.reasons
    assert "'y0' is a graph output and is also quantized" in reason and ("through the Relu" in reason) == relu
    kinds = collections.Counter(n.op_type for n in optimized_graph(path).graph.node)
    assert kinds["QGemm"] == 0 and kinds["Gemm"] == 1  # onnxruntime's own graph


def test_int8_activation_shared_by_two_layers_is_diagnosed_on_x86(tmp_path):
    import platform

    if platform.machine().lower() in ("arm64", "aarch64"):
        pytest.skip("onnxruntime fuses int8 activations on ARM")
    rep = inspect_fusion(
        _save(_layer_graph("Conv", act_type=T.INT8, out_type=T.INT8, out_zp=-128, consumers=2), tmp_path)
    )
    assert [r.fused for r in rep.layers] == [False, False]
    for layer in rep.layers:
        assert any("quantized once for 2 consumers" in r for r in layer.reasons), layer.reasons
    # the same layer alone (one consumer): onnxruntime converts the int8 pair to uint8 and fuses it
    alone = inspect_fusion(
        _save(_layer_graph("Conv", act_type=T.INT8, out_type=T.INT8, out_zp=-128), tmp_path, "alone.onnx")
    )
    assert [r.fused for r in alone.layers] == [True]


@pytest.mark.parametrize(
    "model, config",
    [
        ("digits_cnn", "int8"),
        ("text_encoder", "int8"),
        ("digits_cnn", "int4-weight-only"),
        ("text_encoder", "fp8"),
    ],
)
def test_sample_graphs_report_what_onnxruntime_runs(model, config, exported):
    path = exported(model, config)
    r = cli("inspect", path, "--runtime", "onnxruntime", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["load_error"] is None and rep["quantized_layers"] == len(rep["layers"]) > 0
    graph = onnx.load(str(path))
    layer_ops = {n.name for n in graph.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")}
    assert {r["node"] for r in rep["layers"]} <= layer_ops
    optimized = collections.Counter(n.op_type for n in optimized_graph(path).graph.node)
    fused = [r for r in rep["layers"] if r["fused"]]
    # every integer kernel is one of our layers
    assert len(fused) == sum(optimized[k] for k in INTEGER_KERNELS)
    assert rep["unfused_layers"] == len(rep["layers"]) - len(fused)
    for r in rep["layers"]:
        assert r["fused"] == (r["kernel"] in INTEGER_KERNELS)
        assert bool(r["reasons"]) == (not r["fused"]), r
    if model == "digits_cnn" and config == "int8":  # the onnxruntime target's placement: every layer fused
        assert rep["unfused_layers"] == 0 and {r["kernel"] for r in rep["layers"]} == {"QLinearConv", "QGemm"}
    if config == "fp8":
        assert all(r["reasons"][0].startswith("float8") for r in rep["layers"])
    if config == "int4-weight-only":
        # convs have no weight-only kernel; the Linear layers are written in the MatMulNBits form
        assert {
            r["op_type"]: (r["fused"], r["kernel"]) for r in rep["layers"] if r["op_type"] == "MatMul"
        } == {"MatMul": (True, "MatMulNBits")}
        assert all(r["fused"] == (r["op_type"] == "MatMul") for r in rep["layers"])
        assert sum(r["op_type"] == "MatMul" for r in rep["layers"]) == 2  # fc1, fc2


def test_export_reports_the_unfused_count(calibrated, tmp_path):
    out = tmp_path / "d.onnx"
    r = cli("export", calibrated("digits_cnn", "int8"), "--onnx", out, "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    rep = inspect_fusion(out)
    assert res["quantized_layers"] == len(rep.layers) == 4
    assert res["unfused_layers"] == len(rep.unfused) == 0
    text = cli("export", calibrated("digits_cnn", "int8"), "--onnx", out).stdout
    assert f"{res['unfused_layers']} of 4 quantized layers run in float" in text


def test_an_unguarded_fp8_graph_reports_the_load_failure_and_the_options(exported, tmp_path):
    from tests.test_ort_compat import _unguard

    raw = _unguard(onnx.load(str(exported("digits_cnn", "fp8"))))
    path = _save(raw, tmp_path, "raw.onnx")
    rep = inspect_fusion(path)
    try:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        loads = True
    except Exception:
        loads = False
    assert (rep.load_error is None) == loads
    assert rep.needs.disabled_optimizers and rep.needs.reasons
    text = cli("inspect", path, "--runtime", "onnxruntime").stdout
    assert "disabled_optimizers" in text


def test_runtime_needs_an_onnx_file(calibrated):
    assert_clean_error(cli("inspect", calibrated("digits_cnn", "int8"), "--runtime", "onnxruntime"), "ONNX")


def test_layers_without_a_clear_quantizer_name_are_counted_and_named_by_node(tmp_path):
    m = _layer_graph("Conv", consumers=3)
    # ambiguous for two layers, none for the third
    qmap = {"wd0": "a.weight_quantizer", "wd1": "a.weight_quantizer"}
    del m.metadata_props[:]
    m.metadata_props.add(key=QUANTIZERS_KEY, value=json.dumps(qmap))
    rep = inspect_fusion(_save(m, tmp_path))
    # two nodes of one module's quantizers: its calls (a module called twice); none: the node
    assert [r.layer for r in rep.layers] == ["a (call 1)", "a (call 2)", "layer2/Conv"]
    shown = " ".join(cli("inspect", tmp_path / "g.onnx", "--runtime", "onnxruntime").stdout.split())
    assert "of 3 quantized layers in float (2 modules, some called more than once)" in shown
    assert [r.fused for r in rep.layers] == [True, True, True]


class _TwoHeads(torch.nn.Module):
    """fc1's output is a graph output and fc2's input: onnxruntime keeps fc1 a float Gemm."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        h = self.fc1(x)
        return h, self.fc2(h)


def test_a_dynamo_layer_is_not_reported_as_the_fused_kernel_of_the_next_one(tmp_path):
    """The dynamo exporter names the two Gemms ``node_linear`` and ``node_linear_1``; a fusion named after a
    layer (``X_...``) matched the second one's ``QGemm`` for the first, so inspect and export's unfused count
    said fc1 ran as QGemm where onnxruntime ran it as a float Gemm. Each layer is now what onnxruntime's own
    optimized graph runs (counted there, independently)."""
    from exporters import export_onnx
    from quantcli import calibrate, quantize_model

    torch.manual_seed(0)
    batch = {"x": torch.randn(16, 32)}
    model = quantize_model(_TwoHeads().eval(), "int8", example=batch)
    calibrate(model, [batch], device="cpu")
    path = tmp_path / "two.onnx"
    export_onnx(model, batch, path, exporter="dynamo")
    assert sorted(n.name for n in onnx.load(path).graph.node if n.op_type == "Gemm") == [
        "node_linear",
        "node_linear_1",
    ]
    kernels = {layer.layer: (layer.kernel, layer.fused) for layer in inspect_fusion(path).layers}
    assert kernels == {"fc1": ("Gemm", False), "fc2": ("QGemm", True)}, kernels
    kinds = collections.Counter(n.op_type for n in optimized_graph(path).graph.node)
    assert kinds["QGemm"] == 1 and kinds["Gemm"] == 1  # onnxruntime's own graph


def test_a_fusion_named_after_a_longer_layer_name_is_that_layers():
    """The same across a fusion's own name: onnxruntime names a QLinearConv ``node_conv2d_6_token_18``
    after the dynamo graph's ``node_conv2d_6``; it was taken for ``node_conv2d``'s (which ran as a float
    FusedConv), so inspect and export said every layer ran on an integer kernel."""
    from onnx import helper

    from exporters.onnxruntime.fusion import _find

    def graph(*nodes):
        return helper.make_model(helper.make_graph(list(nodes), "g", [], []))

    stem = helper.make_node("Conv", ["x", "w"], ["y"], name="node_conv2d")
    optimized = graph(
        helper.make_node(
            "QLinearConv", ["a"] * 8, ["q"], name="node_conv2d_6_token_18", domain="com.microsoft"
        ),
        helper.make_node("FusedConv", ["x", "w"], ["y"], name="node_conv2d", domain="com.microsoft"),
    )
    others = frozenset({"node_conv2d_6"})
    assert _find(optimized, stem, others).op_type == "FusedConv"
    # and a fusion named after the layer itself is still found
    fused = graph(helper.make_node("QLinearConv", ["a"] * 8, ["q"], name="node_conv2d_token_3"))
    assert _find(fused, stem, others).name == "node_conv2d_token_3"
