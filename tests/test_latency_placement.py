"""Latency-aware placement for onnxruntime (`calibrate --placement auto|all`,
quantcli.calibration.latency_placement).

Nothing here depends on wall-clock time, because placement does not time anything: the decision is tested on
hand-made costs, the neighbour rule with a stand-in for onnxruntime's fusions, the table lookup on hand-made
rows, and the CLI with a stand-in table where a test needs a layer to be slower.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from exporters.onnxruntime import kernel_costs
from exporters.onnxruntime.fusion import FusionReport, LayerFusion
from exporters.onnxruntime.kernel_costs import CONV, DEPTHWISE, GEMM, STEM, LayerShape, Prediction, Row
from quantcli.calibration import latency_placement
from quantcli.quant import cpu as cpu_kinds
from tests.helpers import assert_clean_error, cli

# ------------------------------------------------------------------------------------------- the decision


def _pred(ratio):
    return Prediction(ratio, Row(LayerShape(CONV, 576, 64, 784), ratio))


def _cost(layer, fused=True, ratio=None, kernel="QLinearConv", na=None):
    return latency_placement.LayerCost(
        layer,
        kernel if fused else "Conv",
        fused,
        None if ratio is None else _pred(ratio),
        [f"{layer}.input_quantizer"],
        na,
    )


def test_decide_unfused_slower_and_within_margin():
    got = {
        d.layer: d
        for d in latency_placement.decide(
            [
                _cost("unfused", fused=False, ratio=0.1),  # unfused: float whatever the table says
                _cost("slower", ratio=1.4),  # 40% slower than float: float
                _cost("close", ratio=1.2),  # within the 25% margin: stays quantized
                _cost("faster", ratio=0.5),
                _cost("no row", ratio=None),
                _cost("fp8", fused=False, na="float8: onnxruntime has no float8 kernel; left as configured"),
            ],
            margin=0.25,
        )
    }
    assert got["unfused"].decision == "float" and "in float between Q/DQ" in got["unfused"].reason
    assert got["slower"].decision == "float"
    assert "1.40x float as measured for conv 576x64" in got["slower"].reason
    assert [got[k].decision for k in ("close", "faster", "no row", "fp8")] == ["quantized"] * 4
    assert got["slower"].to_dict().keys() == {"layer", "kernel", "ratio", "decision", "reason"}


def test_a_prediction_names_the_layers_shape_and_the_row_it_comes_from():
    """The reason quoted the table's nearest row as if it were the layer ("1.96x float as measured for stem
    conv 27x16 at 256 positions" for a 9x16 stem at 64 positions): it names both now."""
    shape = kernel_costs.LayerShape(kernel_costs.STEM, 9, 16, 64)
    pred = kernel_costs.predict("x86-vnni", shape)
    assert pred is not None and pred.shape == shape
    text = pred.describe()
    assert f"this {shape.describe()}" in text and f"the nearest measured: {pred.row.shape.describe()}" in text
    same = kernel_costs.Prediction(pred.ratio, pred.row, pred.row.shape)
    assert same.describe() == f"{pred.ratio:.2f}x float as measured for {pred.row.shape.describe()}"


def _decision(layer, decision, fused=True):
    return latency_placement.LayerDecision(layer, "QLinearConv", 1.0, decision, "why", [f"{layer}.q"], fused)


def test_a_float_layer_that_costs_a_neighbour_its_kernel_goes_back_to_quantized():
    decisions = [
        _decision("a", "quantized"),
        _decision("slow", "float"),  # fused, kept float for speed
        _decision("unfused", "float", fused=False),
    ]
    calls = []

    def loses_a_with(culprit, unless_inputs_kept=False):
        def fused_after(floats, keep_inputs):
            calls.append((set(floats), keep_inputs))
            return {"a": culprit not in floats or (unless_inputs_kept and keep_inputs)}

        return fused_after

    got = latency_placement.keep_neighbours(decisions, loses_a_with("nobody"))
    assert [d.decision for d in got] == ["quantized", "float", "float"]
    assert calls == [({"slow", "unfused"}, False)] and got[1].quantizers == ["slow.q"]
    calls.clear()
    got = latency_placement.keep_neighbours(decisions, loses_a_with("slow"))
    assert [d.decision for d in got] == ["quantized", "quantized", "float"]
    assert [c[0] for c in calls] == [{"slow", "unfused"}, {"slow", "unfused"}, {"unfused"}]
    # the loss was seen with both float: the reason says so (it said "keeping it float too would cost a",
    # as if slow alone did, where a U-Net's stem was blamed for what its transposed convolutions cost)
    assert "keeping slow, unfused float together would cost a" in got[1].reason
    got = latency_placement.keep_neighbours(decisions, loses_a_with("unfused"))
    assert [d.decision for d in got] == ["quantized"] * 3
    # every float choice was tried as one group: the reason names the group, not each layer alone (a
    # depthwise net's fc was said to "cost blocks.0.3 ... their integer kernel(s)", which fc alone did not)
    assert "keeping slow, unfused float together would cost a their integer kernel" in got[2].reason


def test_a_float_layer_keeps_its_input_quantizer_where_the_layer_before_needs_it():
    decisions = [_decision("a", "quantized"), _decision("up", "float", fused=False)]
    decisions[1].quantizers = ["up.input_quantizer", "up.weight_quantizer"]
    got = latency_placement.keep_neighbours(decisions, lambda floats, keep: {"a": keep})
    assert got[1].decision == "float" and got[1].quantizers == ["up.weight_quantizer"]
    assert latency_placement.INPUT_KEPT in got[1].reason


def test_a_layer_beside_a_chain_on_codes_is_not_kept_float_for_speed():
    decisions = [
        _decision("stem", "float"),  # fused, kept float for speed, beside the SiLU chain
        _decision("head", "float"),  # fused, kept float for speed, beside no chain
        _decision("up", "float", fused=False),  # not fused: float whatever borders it
        _decision("b", "quantized"),
    ]
    groups = [{"quantizers": ["act.sigmoid.q", "act.mul.q"], "layers": ["stem", "up", "b"]}]
    got = latency_placement.keep_chains(decisions, groups)
    assert [d.decision for d in got] == ["quantized", "float", "float", "quantized"]
    assert "sigmoid/multiplication chain beside it" in got[0].reason
    assert latency_placement.keep_chains(decisions, []) == decisions


def test_keep_neighbours_asks_nothing_without_float_layers():
    decisions = [_decision("a", "quantized")]
    assert latency_placement.keep_neighbours(decisions, lambda *a: pytest.fail("exported")) == decisions


# ------------------------------------------------------------------------------------------- the table


def test_predict_reads_the_nearest_row_of_the_same_op(monkeypatch):
    rows = {
        "x86-avx2": [
            Row(LayerShape(DEPTHWISE, 9, 32, 3136), 1.6),
            Row(LayerShape(DEPTHWISE, 9, 512, 49), 0.9),
            Row(LayerShape(CONV, 576, 64, 784), 0.6),
        ],
        "x86-vnni": [Row(LayerShape(DEPTHWISE, 9, 32, 3136), 1.2)],
    }
    monkeypatch.setattr(kernel_costs, "_load", lambda: dict.fromkeys(rows, {}))
    monkeypatch.setattr(kernel_costs, "rows", lambda kind: rows.get(kind, []))
    p = kernel_costs.predict("x86-avx2", LayerShape(DEPTHWISE, 9, 48, 2500))
    assert p.ratio == 1.6 and p.row.shape.outputs == 32
    assert kernel_costs.predict("x86-avx2", LayerShape(DEPTHWISE, 9, 400, 64)).ratio == 0.9
    assert kernel_costs.predict("x86-avx2", LayerShape(GEMM, 64, 64, 1)) is None  # no row of its op
    assert kernel_costs.predict("arm64", LayerShape(CONV, 576, 64, 784)) is None  # no table
    # any: slower for a fleet only where it is slower on every kind measured
    assert kernel_costs.predict("any", LayerShape(DEPTHWISE, 9, 32, 3136)).ratio == 1.2


def test_a_stem_reads_stem_rows_and_conv_rows_only_where_its_table_has_none(monkeypatch):
    """A 3 -> 32 stem's nearest chain row was a 1x1 conv of 32 channels (0.78x on the VNNI table) while it ran
    1.3-2.6x slower quantized: stems have rows of their own, which no other conv reads."""
    rows = {
        "x86-avx2": [Row(LayerShape(CONV, 32, 32, 3136), 0.9), Row(LayerShape(CONV, 72, 8, 3136), 1.9)],
        "x86-vnni": [Row(LayerShape(CONV, 32, 32, 3136), 0.8), Row(LayerShape(STEM, 27, 32, 12544), 2.5)],
    }
    monkeypatch.setattr(kernel_costs, "_load", lambda: dict.fromkeys(rows, {}))
    monkeypatch.setattr(kernel_costs, "rows", lambda kind: rows.get(kind, []))
    assert kernel_costs.predict("x86-vnni", LayerShape(STEM, 27, 16, 3136)).ratio == 2.5
    assert kernel_costs.predict("x86-vnni", LayerShape(CONV, 36, 32, 3136)).ratio == 0.8  # not the stem's row
    assert kernel_costs.predict("x86-avx2", LayerShape(STEM, 27, 32, 3136)).ratio == 0.9  # no stem rows


def test_the_shipped_table_names_its_machine_and_command():
    data = json.loads(kernel_costs.TABLE.read_text())
    assert data, "no CPU kind measured"
    for kind, t in data.items():
        assert kind in cpu_kinds.KINDS
        assert t["command"].startswith("python -m benchmarks.bench_kernel_costs")
        assert t["measured_on"] and t["onnxruntime"]
        ops = {r["op"] for r in t["rows"]}
        assert {CONV, DEPTHWISE, GEMM} <= ops <= {CONV, DEPTHWISE, GEMM, STEM}
        assert all(r["int8_ms"] > 0 and r["float_ms"] > 0 for r in t["rows"])


def test_layer_shape_of_convolutions_and_linears():
    out = torch.zeros(2, 16, 7, 5)
    assert latency_placement.layer_shape(nn.Conv2d(8, 16, 3), out) == LayerShape(CONV, 72, 16, 35)
    assert latency_placement.layer_shape(nn.Conv2d(16, 16, 5, groups=16), out) == LayerShape(
        DEPTHWISE, 25, 16, 35
    )
    assert latency_placement.layer_shape(nn.Conv2d(8, 16, 3, groups=2), out) == LayerShape(CONV, 36, 16, 35)
    # an image's 3 channels (or a spectrogram's 1): a stem; transposed or grouped: a conv
    assert latency_placement.layer_shape(nn.Conv2d(3, 16, 3), out) == LayerShape(STEM, 27, 16, 35)
    assert latency_placement.layer_shape(nn.Conv2d(1, 16, 5), out) == LayerShape(STEM, 25, 16, 35)
    assert latency_placement.layer_shape(nn.ConvTranspose2d(3, 16, 3), out) == LayerShape(CONV, 27, 16, 35)
    assert latency_placement.layer_shape(nn.Conv2d(4, 16, 3, groups=2), out) == LayerShape(CONV, 18, 16, 35)
    assert latency_placement.layer_shape(nn.Linear(32, 10), torch.zeros(4, 12, 10)) == LayerShape(
        GEMM, 32, 10, 12
    )
    assert latency_placement.layer_shape(nn.Linear(32, 10), torch.zeros(4, 10)) == LayerShape(GEMM, 32, 10, 1)


# ------------------------------------------------------------------------------------------- the CLI


def _conv2_slower(monkeypatch):
    """A stand-in table: conv2's kernel (144 products, 32 outputs, 64 positions) 2x slower than float, every
    other layer 0.5x."""

    def predict(kind, shape):
        ratio = 2.0 if shape == LayerShape(CONV, 144, 32, 64) else 0.5
        return Prediction(ratio, Row(shape, ratio))

    monkeypatch.setattr(kernel_costs, "predict", predict)


def _calibrate(tmp_path, *args, model="digits_cnn"):
    out = tmp_path / "m.calib.pt"
    r = cli("calibrate", model, "--out", out, "--json", *args)
    assert r.exit_code == 0, r.output
    return out, json.loads(r.stdout)


def test_attention_and_lstm_layers_are_weighed_by_what_they_are():
    """nn.MultiheadAttention returns a tuple and has no .weight, and its out_proj is never called as a module:
    neither got a shape ("no kernel-cost table row for it"). An LSTM's layers were called weight-only."""

    class Att(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.lstm = nn.LSTM(16, 8)

        def forward(self, x):
            return self.attn(x, x, x, need_weights=False)[0]

    m = Att().eval()
    shapes = latency_placement.layer_shapes(m, {"x": torch.randn(3, 10, 16)}, ["attn", "attn.out_proj"])
    assert shapes == {"attn": LayerShape(GEMM, 16, 48, 10), "attn.out_proj": LayerShape(GEMM, 16, 16, 10)}
    modules = dict(m.named_modules())
    for layer in ("lstm", "lstm.l0"):
        assert latency_placement._not_applicable(modules, layer) == latency_placement.RECURRENT


def test_digits_cnn_conv2_shape_is_what_the_stand_in_table_slows():
    from sample_models import digits_cnn as dc

    m = dc.build().eval()
    shapes = latency_placement.layer_shapes(m, dc.calibration_batches()[0], ["conv2"])
    assert shapes == {"conv2": LayerShape(CONV, 144, 32, 64)}


def test_a_slower_conv_between_quantized_neighbours_stays_quantized(tmp_path, monkeypatch):
    """fc1 (2x slower quantized in a stand-in table) sits between conv2's output Q (the pool's) and fc2's
    input Q. It used to be kept float with its input quantizer on, so that conv2 kept its QLinearConv;
    onnxruntime then quantized the float layer itself with per-tensor int8 weights (WeightBiasQuantization):
    no float kernel, coarser weights, and on a MobileNet-like model verify's deployment check failed the
    graph. Now placement reads that in the graph onnxruntime runs and keeps it quantized. (conv2 itself,
    before the MaxPool, is kept quantized by keep_pools before any second export.)"""
    exported = _slower(monkeypatch, LayerShape(GEMM, 512, 64, 1))
    ck, info = _calibrate(tmp_path)
    latency = info["placement"]["latency"]
    assert latency["measured"] and latency["kept_float"] == [] and latency["quantizers_disabled"] == []
    entry = {e["layer"]: e for e in latency["layers"]}["fc1"]
    assert entry["decision"] == "quantized" and entry["ratio"] == 2.0
    assert "quantized all the same" in entry["reason"]
    assert exported == ["int8", "float1", "float2"]  # without its input (conv2 loses), with it (requantized)
    stored = torch.load(ck, weights_only=True)
    assert all(q["enabled"] for n, q in stored["quantizers"].items() if n.startswith("fc1."))


def test_a_float_layer_before_a_quantized_maxpool_stays_quantized(tmp_path, monkeypatch):
    """conv2 -> ReLU -> MaxPool -> fc1's Q: kept float, onnxruntime moves fc1's Q above the MaxPool, which
    then runs on uint8 in NCHW layout (on an AVX-512 VNNI CPU a stem kept float so made its graph 5.3x float,
    2.2x with it quantized). conv2 stays quantized, and no second export is needed to find out; with fc1 float
    too, no Q follows the pool and the rule does not apply."""
    exported = _slower(monkeypatch, LayerShape(CONV, 144, 32, 64))
    _, info = _calibrate(tmp_path)
    latency = info["placement"]["latency"]
    entry = {e["layer"]: e for e in latency["layers"]}["conv2"]
    assert latency["kept_float"] == [] and exported == ["int8"]
    assert entry["decision"] == "quantized" and "MaxPool after it on uint8 codes" in entry["reason"]

    def predict(kind, shape):
        ratio = 2.0 if shape in (LayerShape(CONV, 144, 32, 64), LayerShape(GEMM, 512, 64, 1)) else 0.5
        return Prediction(ratio, Row(shape, ratio))

    monkeypatch.setattr(kernel_costs, "predict", predict)
    _, info = _calibrate(tmp_path)  # (then conv1 would lose its output Q: the neighbours decide)
    entry = {e["layer"]: e for e in info["placement"]["latency"]["layers"]}["conv2"]
    assert "MaxPool" not in entry["reason"], entry


def test_a_float_layer_onnxruntime_quantizes_itself_is_reported(tmp_path):
    """A user's rule keeping conv2's weight float leaves it between conv1's output DQ and the next Q:
    onnxruntime runs it as QLinearConv on its own per-tensor weights. inspect --runtime used to list only
    quantcli's quantized layers ("0 of 3 in float") and said nothing of it."""
    (tmp_path / "cfg.yaml").write_text(
        "preset: int8\nrules:\n  - pattern: conv2.weight_quantizer\n    enable: false\n"
    )
    out, _ = _calibrate(tmp_path, "--config", tmp_path / "cfg.yaml", "--placement", "all")
    graph = tmp_path / "m.onnx"
    assert cli("export", out, "--onnx", graph).exit_code == 0
    rep = json.loads(cli("inspect", graph, "--runtime", "onnxruntime", "--json").stdout)
    assert [(r["layer"], r["kernel"], r["fused"]) for r in rep["runtime_quantized"]] == [
        ("conv2", "QLinearConv", True)
    ]
    assert "conv2" not in {r["layer"] for r in rep["layers"]}
    text = cli("inspect", graph, "--runtime", "onnxruntime").stdout
    assert "onnxruntime quantizes itself" in text and "conv2" in text


def _slower(monkeypatch, slow: LayerShape) -> list[str]:
    """A stand-in table with ``slow`` 2x slower than float and every other shape 0.5x; returns the names of
    the graphs placement exports (``int8``, then ``float1``... for each check of the neighbours)."""

    def predict(kind, shape):
        ratio = 2.0 if shape == slow else 0.5
        return Prediction(ratio, Row(shape, ratio))

    monkeypatch.setattr(kernel_costs, "predict", predict)
    exported, real = [], latency_placement._fusion

    def fusion(model, example, workdir, name, exporters):
        exported.append(name)
        return real(model, example, workdir, name, exporters)

    monkeypatch.setattr(latency_placement, "_fusion", fusion)
    return exported


def test_a_stem_kept_float_is_not_exported_again_and_costs_no_neighbour(tmp_path, monkeypatch):
    # conv1 reads the graph input and its quantizers feed it alone: kept float, it takes no Q or DQ from any
    # other node, so its neighbours' kernels need no second export to check
    exported = _slower(monkeypatch, LayerShape(STEM, 9, 16, 64))
    ck, info = _calibrate(tmp_path)
    latency = info["placement"]["latency"]
    assert latency["kept_float"] == ["conv1"] and exported == ["int8"]
    stored = torch.load(ck, weights_only=True)
    conv1 = {n: q["enabled"] for n, q in stored["quantizers"].items() if n.startswith("conv1.")}
    assert conv1 == {"conv1.input_quantizer": False, "conv1.weight_quantizer": False}  # (it has no output q)
    onnx_path = tmp_path / "m.onnx"
    assert cli("export", ck, "--onnx", onnx_path).exit_code == 0
    r = cli("inspect", onnx_path, "--runtime", "onnxruntime", "--json")
    fused = {row["layer"]: row["fused"] for row in json.loads(r.stdout)["layers"]}
    assert "conv1" not in fused and all(fused.values()) and len(fused) == 3, fused
    assert cli("verify", onnx_path, "--reference", ck).exit_code == 0


def _stem_graph(shared_input: bool) -> onnx.ModelProto:
    """x -> Q -> DQ -> Conv (weight DQ) -> Q -> DQ -> Sigmoid, the Q/DQ named as the exporter's quantizer map
    names them; ``shared_input``: the input DQ also feeds a second Conv."""
    from onnx import TensorProto, helper

    from exporters.graph import QUANTIZERS_KEY

    s, z = (
        helper.make_tensor("s", TensorProto.FLOAT, [], [0.1]),
        helper.make_tensor("z", TensorProto.INT8, [], [0]),
    )
    w = helper.make_tensor("w", TensorProto.INT8, [2, 1, 1, 1], [1, 2])
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q_in"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq_in"),
        helper.make_node("DequantizeLinear", ["w", "s", "z"], ["wd"], name="dq_w"),
        helper.make_node("Conv", ["xd", "wd"], ["y"], name="stem"),
        helper.make_node("QuantizeLinear", ["y", "s", "z"], ["yq"], name="q_out"),
        helper.make_node("DequantizeLinear", ["yq", "s", "z"], ["yd"], name="dq_out"),
        helper.make_node("Sigmoid", ["yd"], ["out"], name="act"),
    ]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)]
    if shared_input:
        nodes.append(helper.make_node("Conv", ["xd", "wd"], ["y2"], name="other"))
        outputs.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])], outputs, [s, z, w]
    )
    model = helper.make_model(graph)
    qmap = {"xd": "stem.input_quantizer", "wd": "stem.weight_quantizer", "yd": "stem.output_quantizer"}
    model.metadata_props.add(key=QUANTIZERS_KEY, value=json.dumps(qmap))
    return model


def _pool_graph() -> onnx.ModelProto:
    """conv -> Relu -> Q -> DQ -> MaxPool -> Q -> DQ (fc's input quantizer) -> Flatten -> Gemm (fc)."""
    from onnx import TensorProto, helper

    from exporters.graph import QUANTIZERS_KEY

    s, z = (
        helper.make_tensor("s", TensorProto.FLOAT, [], [0.1]),
        helper.make_tensor("z", TensorProto.UINT8, [], [0]),
    )
    w = helper.make_tensor("w", TensorProto.FLOAT, [2, 1, 1, 1], [1.0, 2.0])
    fw = helper.make_tensor("fw", TensorProto.FLOAT, [8, 2], [0.5] * 16)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("QuantizeLinear", ["r", "s", "z"], ["rq"], name="q_copy"),
        helper.make_node("DequantizeLinear", ["rq", "s", "z"], ["rd"], name="dq_copy"),
        helper.make_node("MaxPool", ["rd"], ["p"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
        helper.make_node("QuantizeLinear", ["p", "s", "z"], ["pq"], name="q_fc"),
        helper.make_node("DequantizeLinear", ["pq", "s", "z"], ["pd"], name="dq_fc"),
        helper.make_node("Flatten", ["pd"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fw"], ["out"], name="fc"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        [s, z, w, fw],
    )
    model = helper.make_model(graph)
    model.metadata_props.add(key=QUANTIZERS_KEY, value=json.dumps({"pd": "fc.input_quantizer"}))
    return model


def test_keep_pools_quantizes_again_a_fast_float_choice_before_a_quantized_pool_only(tmp_path):
    """The MaxPool rule is for layers kept float for speed (fused): an unfused one runs in float whatever is
    decided, and its pool on codes with it; with the pool's reader (fc) float too, no Q follows the pool."""
    path = tmp_path / "g.onnx"
    onnx.save(_pool_graph(), path)
    report = FusionReport(str(path), "CPUExecutionProvider")
    report.layers = [LayerFusion("conv", "conv", "Conv", [], "QLinearConv", True)]
    assert latency_placement.maxpool_readers(onnx.load(path), "conv") == {"fc"}

    def decided(fused: bool, fc: str):
        decisions = [
            latency_placement.LayerDecision("conv", "QLinearConv", 2.0, "float", "slower", [], fused),
            latency_placement.LayerDecision("fc", "QGemm", 2.0, fc, "slower", [], True),
        ]
        return {d.layer: d.decision for d in latency_placement.keep_pools(decisions, report)}

    assert decided(True, "quantized") == {"conv": "quantized", "fc": "quantized"}
    assert decided(False, "quantized") == {"conv": "float", "fc": "quantized"}  # unfused: float anyway
    assert decided(True, "float") == {"conv": "float", "fc": "float"}


def test_a_stem_keeps_its_output_quantizer_and_a_shared_input_is_no_stem(tmp_path):
    qs = ["stem.input_quantizer", "stem.weight_quantizer", "stem.output_quantizer"]
    decisions = [latency_placement.LayerDecision("stem", "QLinearConv", 2.0, "float", "slower", qs, True)]
    for shared in (False, True):
        path = tmp_path / f"g{shared}.onnx"
        onnx.save(_stem_graph(shared), path)
        report = FusionReport(str(path), "CPUExecutionProvider")
        report.layers = [LayerFusion("stem", "stem", "Conv", qs, "QLinearConv", True)]
        got = latency_placement.as_stems(decisions, report)
        assert latency_placement.is_stem(onnx.load(path), "stem", qs) is (not shared)
        if shared:
            assert got is None  # the second Conv would lose its input DQ: the neighbours are checked
        else:
            assert got[0].quantizers == qs[:2] and latency_placement.OUTPUT_KEPT in got[0].reason


def test_a_layer_between_two_is_checked_by_a_second_export(tmp_path, monkeypatch):
    exported = _slower(monkeypatch, LayerShape(GEMM, 512, 64, 1))  # fc1: between the pool's Q and fc2's
    _, info = _calibrate(tmp_path)
    assert info["placement"]["latency"]["kept_float"] == [] and exported[:2] == ["int8", "float1"]


def test_repeated_calibrations_decide_the_same(tmp_path):
    """The decision reads a table, not a clock: five calibrations of the same model, the same decisions."""
    seen = set()
    for _ in range(5):
        _, info = _calibrate(tmp_path, "--num-samples", "64")
        seen.add(json.dumps([(d["layer"], d["decision"]) for d in info["placement"]["latency"]["layers"]]))
    assert len(seen) == 1


def test_every_layer_kept_float_is_said_and_the_graph_passes_verify(tmp_path, monkeypatch):
    """No layer quantized: a warning on stderr and quantized_layers 0; export and verify say the graph holds
    no quantizer, and verify passes (no quantization error to measure fidelity in: it measures against a
    floor of the output's RMS)."""
    monkeypatch.setattr(kernel_costs, "predict", lambda kind, shape: Prediction(3.0, Row(shape, 3.0)))
    ck, info = _calibrate(tmp_path)
    assert sorted(info["placement"]["latency"]["kept_float"]) == ["conv1", "conv2", "fc1", "fc2"]
    assert info["quantized_layers"] == 0
    r = cli("calibrate", "digits_cnn", "--out", tmp_path / "n.calib.pt")
    assert "warning: no layer is quantized" in r.stderr
    # with --json too, as targets.md says (the warning was dropped; stdout holds the document alone)
    r = cli("calibrate", "digits_cnn", "--out", tmp_path / "j.calib.pt", "--json")
    assert "warning: no layer is quantized" in r.stderr and json.loads(r.stdout)["quantized_layers"] == 0
    # its target row said "weight-only: activations stay float ..." of a model with no weight quantized
    assert json.loads(r.stdout)["placement"]["text"].startswith("nothing quantized: every layer stays float")
    onnx_path = tmp_path / "m.onnx"
    r = cli("export", ck, "--onnx", onnx_path)
    assert r.exit_code == 0 and "warning: the graph holds no quantizer" in r.stderr
    assert "the graph is float (no quantizer enabled)" in r.stdout.replace("\n", " ")
    r = cli("verify", onnx_path, "--reference", ck, "--json")
    assert r.exit_code == 0, r.output
    checks = {c["name"]: c["value"] for c in json.loads(r.stdout)["checks"]}
    assert checks["fidelity.rms_ratio"] < 0.1 and checks["fidelity.replay_outputs"] < 0.1
    r = cli("verify", onnx_path, "--reference", ck)
    assert "warning: the graph holds no quantizer" in r.stderr


def test_weight_only_int4_is_not_exported_for_placement(tmp_path, monkeypatch):
    monkeypatch.setattr(latency_placement, "export_onnx", lambda *a, **k: pytest.fail("exported"))
    _, info = _calibrate(tmp_path, "--config", "int4-weight-only", model="tiny_lm")
    latency = info["placement"]["latency"]
    assert not latency["measured"] and latency["note"].startswith("nothing to decide")
    assert latency["seconds"] == 0


def test_placement_all_keeps_every_layer_quantized(tmp_path, monkeypatch):
    _conv2_slower(monkeypatch)
    ck, info = _calibrate(tmp_path, "--placement", "all")
    assert info["placement"]["latency"]["mode"] == "all" and info["placement"]["latency"]["kept_float"] == []
    assert {"conv1", "conv2", "fc1", "fc2"} <= set(info["layers"]["quantized"])
    assert all(
        q["enabled"]
        for n, q in torch.load(ck, weights_only=True)["quantizers"].items()
        if n.split(".")[0] in ("conv1", "conv2") and not n.endswith("output_quantizer")
    )


def test_the_summary_table_has_one_latency_line(tmp_path, monkeypatch):
    _slower(monkeypatch, LayerShape(STEM, 9, 16, 64))  # conv1, a stem: kept float
    r = cli("calibrate", "digits_cnn", "--out", tmp_path / "m.calib.pt")
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.stdout.splitlines() if "latency placement" in ln)
    assert "1 of 4 layers kept float" in line and "conv1" in line


_UPSAMPLER = """
import torch
from torch import nn


def make():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.ConvTranspose2d(8, 4, 2, stride=2))
"""


def test_a_conv_transpose_onnxruntime_cannot_fuse_stays_float_under_auto(tmp_path, monkeypatch):
    (tmp_path / "up.py").write_text(_UPSAMPLER)
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((16, 3, 8, 8)).astype(np.float32))
    model = f"{tmp_path / 'up.py'}:make"
    _, info = _calibrate(tmp_path, "--data", tmp_path / "x.npy", model=model)
    layers = {e["layer"]: e for e in info["placement"]["latency"]["layers"]}
    assert layers["2"]["decision"] == "float" and "in float between Q/DQ" in layers["2"]["reason"]
    assert layers["0"]["decision"] == "quantized"
    assert "2" not in info["layers"]["quantized"]
    _, info = _calibrate(tmp_path, "--data", tmp_path / "x.npy", "--placement", "all", model=model)
    assert "2" in info["layers"]["quantized"]


def test_a_module_called_several_times_is_decided_as_one(tmp_path):
    """Its nodes are named by node in the fusion report ("/block/Gemm", "/block_1/Gemm", ...): placement used
    to leave them quantized as "not mapped to a module" although onnxruntime ran every call in float between
    their Q/DQ (FusedGemm), a graph twice as slow as float at batch 1. The model: tests/test_export.py's
    block applied four times, each Relu feeding the residual Add, not a Q."""
    (tmp_path / "looped.py").write_text(
        f"import sys\nsys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
        "import torch\nfrom tests.test_export import _SharedBlock\n"
        "def make():\n    torch.manual_seed(0)\n    return _SharedBlock()\n"
    )
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32))
    _, info = _calibrate(tmp_path, "--data", tmp_path / "x.npy", model=f"{tmp_path / 'looped.py'}:make")
    latency = info["placement"]["latency"]
    layers = {e["layer"]: e for e in latency["layers"]}
    assert sorted(layers) == ["block", "inp", "out"]
    assert layers["block"]["decision"] == "float" and "(4 of 4 calls)" in layers["block"]["reason"]
    assert latency["quantizers_disabled"] == ["block.input_quantizer", "block.weight_quantizer"]
    assert layers["inp"]["decision"] == layers["out"]["decision"] == "quantized"


def test_module_calls_groups_nodes_by_the_owner_of_their_quantizers():
    def call(layer, fused, owner="block"):
        return LayerFusion(
            layer,
            layer,
            "Gemm",
            [f"{owner}.input_quantizer", f"{owner}.weight_quantizer"],
            "QGemm" if fused else "Gemm",
            fused,
        )

    modules = {"block": nn.Linear(2, 2), "head": nn.Linear(2, 2)}
    grouped = latency_placement.module_calls(
        [call("/block/Gemm", True), call("head", True, "head"), call("/block_1/Gemm", False)], modules
    )
    assert [(m.layer, len(m.calls)) for m in grouped] == [("block", 2), ("head", 1)]
    assert grouped[0].fused is False and grouped[0].kernel == "QGemm, Gemm"  # half the calls in float
    three = latency_placement.module_calls(
        [call("/block/Gemm", True), call("/block_1/Gemm", True), call("/block_2/Gemm", False)], modules
    )
    assert three[0].fused is True and three[0].unfused_calls == "1 of 3 calls"
    # quantizers of no module (or of two) keep the node's name
    odd = latency_placement.module_calls([call("/x/Gemm", True, "gone")], modules)
    assert odd[0].layer == "/x/Gemm"


_CONSTANT_INPUT = """
import torch
from torch import nn


class RelativePositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.rel = nn.Parameter(torch.randn(1, 32, 64))  # DeBERTa's rel_embeddings: no graph input behind it
        self.pos_proj, self.query = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        return self.query(x) @ self.pos_proj(self.rel)[0].t()


def make():
    torch.manual_seed(0)
    return RelativePositions()
"""


def test_a_layer_of_a_constant_input_is_kept_float(tmp_path):
    """onnxruntime folds a constant input's Q/DQ away and runs the layer as weight-only MatMulNBits on float
    activations: on DeBERTa-v2 the four relative-position projections made the int8 graph 1.25x its float
    graph at batch 1, while inspect called them integer kernels. Kept float, the product folds to a
    constant."""
    (tmp_path / "rel.py").write_text(_CONSTANT_INPUT)
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((16, 8, 64)).astype(np.float32))
    model = f"{tmp_path / 'rel.py'}:make"
    out, info = _calibrate(tmp_path, "--data", tmp_path / "x.npy", "--placement", "all", model=model)
    graph = tmp_path / "all.onnx"
    assert cli("export", out, "--onnx", graph).exit_code == 0
    rows = {
        r["layer"]: r
        for r in json.loads(cli("inspect", graph, "--runtime", "onnxruntime", "--json").stdout)["layers"]
    }
    assert rows["pos_proj"]["kernel"] == "MatMulNBits" and rows["pos_proj"]["fused"] is False
    assert "its input is a constant" in rows["pos_proj"]["reasons"][0]
    assert rows["query"]["fused"] is True
    _, info = _calibrate(tmp_path, "--data", tmp_path / "x.npy", model=model)
    layers = {e["layer"]: e for e in info["placement"]["latency"]["layers"]}
    assert layers["pos_proj"]["decision"] == "float" and layers["query"]["decision"] == "quantized"


def test_a_model_that_does_not_export_is_calibrated_and_not_measured(tmp_path, monkeypatch):
    def fail(*a, **k):
        raise RuntimeError("no translation for aten::frobnicate")

    monkeypatch.setattr(latency_placement, "export_onnx", fail)
    _, info = _calibrate(tmp_path)
    latency = info["placement"]["latency"]
    assert not latency["measured"] and "aten::frobnicate" in latency["note"] and latency["kept_float"] == []
    # in a terminal, a warning says so (it was one table row, cut off, with the run exiting 0 as if decided)
    r = cli("calibrate", "digits_cnn", "--out", tmp_path / "m2.calib.pt")
    assert r.exit_code == 0
    (warning,) = [ln for ln in r.stderr.splitlines() if "latency placement" in ln]
    assert "aten::frobnicate" in warning and "every layer stays quantized" in warning


class _RMSNormMLP(nn.Module):
    """nn.RMSNorm: torch has no TorchScript ONNX translation for aten::rms_norm (the dynamo exporter has)."""

    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(64, 256), nn.RMSNorm(256), nn.Linear(256, 64)

    def forward(self, x):
        return self.down(torch.relu(self.norm(self.up(x))))


def test_a_model_only_dynamo_exports_is_placed_from_its_dynamo_graphs(tmp_path):
    """Placement exported with TorchScript alone: for a model with nn.RMSNorm or nn.Bilinear it was "not
    decided" (its note cut off, advising an option calibrate has not), every layer quantized and the run
    silent about it. It now decides from graphs the dynamo exporter writes, and says so."""
    from exporters import export_onnx
    from quantcli.errors import ExportError

    torch.manual_seed(0)
    model = _RMSNormMLP().eval()
    x = torch.randn(64, 64)
    with pytest.raises(ExportError, match="rms_norm"):
        export_onnx(model, {"x": x}, tmp_path / "ts.onnx")  # TorchScript, as placement exported before
    root = str(Path(__file__).resolve().parents[1])
    (tmp_path / "net.py").write_text(
        f"import sys\nsys.path.insert(0, {root!r})\nimport torch\n"
        "from tests.test_latency_placement import _RMSNormMLP\n"
        "def make():\n    torch.manual_seed(0)\n    return _RMSNormMLP().eval()\n"
    )
    np.save(tmp_path / "x.npy", x.numpy())
    _, info = _calibrate(tmp_path, "--data", tmp_path / "x.npy", model=f"{tmp_path / 'net.py'}:make")
    latency = info["placement"]["latency"]
    assert latency["measured"], latency["note"]
    assert "exported with dynamo: torchscript cannot export the model" in latency["note"]
    assert {d["layer"] for d in latency["layers"]} == {"up", "down"}
    assert all(d["kernel"] in ("QGemm", "MatMulIntegerToFloat") for d in latency["layers"]), latency["layers"]


def test_tensorrt_target_is_not_placed_for_onnxruntime(tmp_path, monkeypatch):
    _, info = _calibrate(tmp_path, "--target", "tensorrt")
    latency = info["placement"]["latency"]
    assert not latency["measured"] and "not applicable" in latency["note"] and latency["kept_float"] == []


def test_bad_placement_is_a_one_line_error(tmp_path):
    r = cli("calibrate", "digits_cnn", "--out", tmp_path / "m.calib.pt", "--placement", "fastest")
    assert_clean_error(r, "--placement", "auto or all")


def test_dynamic_activations_kept_float_are_not_counted_as_quantized_at_run_time(tmp_path, monkeypatch):
    """int8-dynamic: the summary said "13 quantized at run time" while placement had kept layers float, so
    the graph quantized fewer. The count is the layers' that stay dynamic."""
    monkeypatch.setattr(kernel_costs, "predict", lambda kind, shape: Prediction(3.0, Row(shape, 3.0)))
    args = ("calibrate", "text_encoder", "--config", "int8-dynamic", "--out", tmp_path / "t.calib.pt")
    r = cli(*args, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["quantized_layers"] == 0 and info["dynamic"] == []
    r = cli(*args)
    assert r.exit_code == 0 and "quantized at run time" not in r.stdout
    r = cli(*args, "--placement", "all", "--json")
    assert len(json.loads(r.stdout)["dynamic"]) == json.loads(r.stdout)["quantized_layers"] == 13


def test_a_float_stem_gives_back_its_input_quantizer_beside_a_float_layer_that_keeps_its_own(monkeypatch):
    """The neighbours' check kept every float layer's input quantizer when one of them needed it (a float
    Linear after a quantized one), the stem's too, "the layer before it needs that Q", where the stem reads
    the graph input and its DQ feeds it alone: a Q/DQ on the image for nothing (a helper's NormCNN)."""
    qs = {n: [f"{n}.input_quantizer", f"{n}.weight_quantizer", f"{n}.output_quantizer"] for n in ("c1", "fc")}
    before = [
        latency_placement.LayerDecision(n, "QLinearConv", 2.0, "float", "slower", qs[n], True) for n in qs
    ]
    kept = [
        latency_placement._chosen(d, frozenset(qs), True, "") for d in before
    ]  # as keep_neighbours returns them with inputs kept
    assert all(d.reason.endswith(latency_placement.INPUT_KEPT) for d in kept)
    monkeypatch.setattr(latency_placement, "stem_layers", lambda decisions, report: {"c1"})
    got = {d.layer: d for d in latency_placement.stems_alone(kept, before, report=None)}
    assert got["c1"].quantizers[0] == "c1.input_quantizer" and got["c1"].reason == "slower"
    assert "fc.input_quantizer" not in got["fc"].quantizers
    assert got["fc"].reason.endswith(latency_placement.INPUT_KEPT)


def test_a_layer_run_from_its_parents_forward_has_the_shape_of_the_operand_it_took():
    """A stem written as ``F.conv2d(x, self.conv.weight[:k], ...)`` in the parent: the layer's own forward
    never runs, so it had no shape, no prediction, and stayed quantized where the same stem as an
    ``nn.Conv2d`` is kept float (2x slower than float at batch 1, helper-43). Its shape is the operation's: 32
    of the weight's 64 output channels, 3 input channels (a stem)."""
    from quantcli import quantize_model
    from quantcli.nn.tensor_quantizer import quantizers

    class Sliced(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 64, 3, padding=1)
            self.mix = nn.Conv2d(64, 64, 1)

        def forward(self, image):
            y = torch.relu(
                torch.nn.functional.conv2d(image, self.conv.weight[:32], self.conv.bias[:32], padding=1)
            )
            return torch.nn.functional.conv2d(torch.cat([y, y], 1), self.mix.weight[:, :64, :, :] * 0.5).mean(
                (2, 3)
            )

    torch.manual_seed(0)
    image = {"image": torch.randn(2, 3, 8, 8)}
    m = quantize_model(Sliced().eval(), "int8", example=image)
    for q in quantizers(m).values():
        q.set_mode("disabled")  # not calibrated: the shapes need no amax
    shapes = latency_placement.layer_shapes(m, image, ["conv", "mix"])
    assert shapes == {"conv": LayerShape(STEM, 27, 32, 64), "mix": LayerShape(CONV, 64, 64, 64)}
