"""ConvTranspose on onnxruntime's CPU provider (issue 35, item 9): no integer kernel there, so it stays float
under ``--placement auto``; the quantized Conv before it keeps its integer kernel (was: "the Relu after it
feeds ConvTranspose, not a QuantizeLinear", two of a U-Net's Convs in float)."""

import collections
import json

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from exporters.onnxruntime.fusion import CONV_TRANSPOSE, diagnose, optimized_graph
from tests import user_models
from tests.helpers import cli


def test_onnxruntime_runs_a_qdq_conv_transpose_in_float(tmp_path):
    """The fact the placement rests on, read from onnxruntime itself: DQ (input, int8 weight, int32 bias) ->
    ConvTranspose -> Q stays a float ConvTranspose between Q/DQ (QLinearConvTranspose exists only in the NHWC
    domain of the XNNPACK provider). If a release fuses it, this fails and the decision is to be revisited."""
    rng = np.random.default_rng(0)
    w = rng.integers(-127, 128, (8, 4, 2, 2)).astype(np.int8)
    sw = rng.uniform(0.001, 0.01, 4).astype(np.float32)
    inits = [
        numpy_helper.from_array(np.float32(0.02), "sx"),
        numpy_helper.from_array(np.uint8(0), "zx"),
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(sw, "sw"),
        numpy_helper.from_array(np.zeros(4, np.int8), "zw"),
        numpy_helper.from_array(rng.integers(-100, 100, 4).astype(np.int32), "b"),
        numpy_helper.from_array((np.float32(0.02) * sw).astype(np.float32), "sb"),
        numpy_helper.from_array(np.float32(0.05), "so"),
        numpy_helper.from_array(np.uint8(0), "zo"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w", "sw", "zw"], ["wd"], axis=1),
        helper.make_node("DequantizeLinear", ["b", "sb"], ["bd"]),
        helper.make_node("ConvTranspose", ["xd", "wd", "bd"], ["y"], strides=[2, 2]),
        helper.make_node("Relu", ["y"], ["r"]),
        helper.make_node("QuantizeLinear", ["r", "so", "zo"], ["yq"]),
        helper.make_node("DequantizeLinear", ["yq", "so", "zo"], ["out"]),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", T.FLOAT, [1, 8, 8, 8])],
        [helper.make_tensor_value_info("out", T.FLOAT, [1, 4, 16, 16])],
        inits,
    )
    path = tmp_path / "ct.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), str(path))
    kinds = collections.Counter(n.op_type for n in optimized_graph(path).graph.node)
    assert kinds["ConvTranspose"] == 1 and not any(
        "ConvTranspose" in k and k != "ConvTranspose" for k in kinds
    )
    # inspect gives that reason alone: the layer has its output Q, an int32 bias and per-channel weights on
    # ConvTranspose's output axis (1), so "no QuantizeLinear takes its output" or "the weight is not quantized
    # per output channel" would send a user after a remedy that does not exist
    node = next(n for n in onnx.load(path).graph.node if n.op_type == "ConvTranspose")
    assert diagnose(onnx.load(path), node) == [CONV_TRANSPOSE]


def test_a_float_conv_transpose_leaves_the_conv_before_it_fused(tmp_path):
    """The U-Net under --placement auto: up1 and up2 float, their inputs still quantized, and every Conv the
    placement keeps quantized a QLinearConv in the deployed graph, among them mid.1.0 and dec2.1.0, whose only
    readers are the ConvTransposes."""
    calib, _ = user_models.write_data("unet", tmp_path)
    ck, graph = tmp_path / "unet.calib.pt", tmp_path / "unet.onnx"
    r = cli("calibrate", user_models.spec("unet"), "--data", calib, "--out", ck, "--json")
    assert r.exit_code == 0, r.output
    decisions = {d["layer"]: d for d in json.loads(r.stdout)["placement"]["latency"]["layers"]}
    for up in ("up1", "up2"):
        assert decisions[up]["decision"] == "float" and "its input stays quantized" in decisions[up]["reason"]
    quantized = {n for n, d in decisions.items() if d["decision"] == "quantized"}
    assert {"mid.1.0", "dec2.1.0"} <= quantized
    assert cli("export", ck, "--onnx", graph).exit_code == 0
    r = cli("inspect", graph, "--runtime", "onnxruntime", "--json")
    kernels = {x["layer"]: x["kernel"] for x in json.loads(r.stdout)["layers"]}
    assert {n: kernels.get(n) for n in quantized} == dict.fromkeys(quantized, "QLinearConv")
    kinds = collections.Counter(n.op_type for n in optimized_graph(graph).graph.node)
    assert kinds["QLinearConv"] >= len(quantized) and kinds["ConvTranspose"] == 2
