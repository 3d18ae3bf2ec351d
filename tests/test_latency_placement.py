"""Latency-aware placement for onnxruntime (`calibrate --placement auto|all`,
quantcli.calibration.latency_placement).

Nothing here depends on wall-clock time: the decision is tested on hand-made costs, the cost attribution on a
hand-built graph, and the CLI with stub timers (tests/conftest.py installs one that makes every node take no
time); only `node_times` runs onnxruntime's profiler, and only its shape is asserted.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from exporters.onnxruntime.fusion import optimized_graph
from exporters.onnxruntime.profile import node_times
from quantcli.calibration import latency_placement
from tests.helpers import assert_clean_error, cli

# ------------------------------------------------------------------------------------------- the decision


def _cost(layer, fused=True, int8=None, flt=None, kernel="QLinearConv", na=None):
    return latency_placement.LayerCost(
        layer, kernel if fused else "Conv", fused, int8, flt, [f"{layer}.input_quantizer"], na
    )


def test_decide_unfused_slower_and_within_margin():
    got = {
        d.layer: d
        for d in latency_placement.decide(
            [
                _cost("unfused", fused=False, int8=1.0, flt=100.0),  # unfused: float whatever the times say
                _cost("slower", int8=130.0, flt=100.0),  # 30% slower than float: float
                _cost("close", int8=115.0, flt=100.0),  # within the 20% margin: stays quantized
                _cost("faster", int8=50.0, flt=100.0),
                _cost(
                    "tiny", int8=4.0, flt=2.5
                ),  # 60% slower but 1.5 us: the profiler's resolution, stays quantized
                _cost("untimed", int8=None, flt=100.0),
                _cost("fp8", fused=False, na="float8: onnxruntime has no float8 kernel; left as configured"),
            ],
            margin=0.2,
        )
    }
    assert got["unfused"].decision == "float" and "in float between Q/DQ" in got["unfused"].reason
    assert (
        got["slower"].decision == "float"
        and "130.0" in got["slower"].reason
        and "100.0" in got["slower"].reason
    )
    assert [got[k].decision for k in ("close", "faster", "tiny", "untimed", "fp8")] == ["quantized"] * 5
    assert got["slower"].to_dict().keys() == {"layer", "kernel", "int8_us", "float_us", "decision", "reason"}


def test_the_whole_graph_decides_between_the_choices():
    decisions = latency_placement.decide(
        [
            _cost("unfused", fused=False, int8=1.0, flt=100.0),
            _cost("slower", int8=130.0, flt=100.0),
            _cost("faster", int8=50.0, flt=100.0),
        ],
        margin=0.2,
    )
    # a tie keeps it
    assert latency_placement.prefer_faster_graph(decisions, measured_ms=2.0, fused_only_ms=2.0) is decisions
    assert latency_placement.prefer_faster_graph(decisions, measured_ms=1.9, fused_only_ms=2.0) is decisions
    got = {
        d.layer: d
        for d in latency_placement.prefer_faster_graph(decisions, measured_ms=2.5, fused_only_ms=2.0)
    }
    assert got["slower"].decision == "quantized" and "2.5 ms" in got["slower"].reason
    assert got["unfused"].decision == "float" and got["faster"].decision == "quantized"


def test_an_int8_graph_slower_than_float_by_more_than_the_noise_keeps_every_layer_float():
    decisions = latency_placement.decide(
        [
            _cost("a", int8=50.0, flt=100.0),
            _cost("b", int8=60.0, flt=100.0),
            _cost("fp8", fused=False, na="float8: onnxruntime has no float8 kernel; left as configured"),
        ]
    )
    assert latency_placement.float_if_slower(decisions, int8_ms=1.0, float_ms=1.0, margin=0.05) is decisions
    # within the band
    assert latency_placement.float_if_slower(decisions, int8_ms=1.04, float_ms=1.0, margin=0.05) is decisions
    got = {
        d.layer: d
        for d in latency_placement.float_if_slower(decisions, int8_ms=1.06, float_ms=1.0, margin=0.05)
    }
    assert got["a"].decision == got["b"].decision == "float" and "1.06 ms vs 1 ms" in got["a"].reason
    assert "5.0% noise band" in got["a"].reason
    assert got["fp8"].decision == "quantized"  # left as configured


def test_the_noise_band_is_the_a_a_spread_at_least_the_floor():
    assert latency_placement.noise_band(1.0, 1.0, floor=0.03) == 0.03
    assert latency_placement.noise_band(1.0, 0.99, floor=0.03) == 0.03
    assert latency_placement.noise_band(1.0, 1.08, floor=0.03) == pytest.approx(0.08)
    assert latency_placement.noise_band(2.0, 1.8, floor=0.03) == pytest.approx(0.1)  # either direction


def test_timing_feeds_repeat_the_example_along_the_batch_dimension():
    x = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    ids = torch.arange(5 * 4).reshape(5, 4)
    got = latency_placement.timing_feeds(
        {"x": x, "ids": ids, "scalar": torch.tensor(2.0), "unused": x}, {"x", "ids", "scalar"}, samples=32
    )
    assert set(got) == {"x", "ids", "scalar"}
    assert got["x"].shape == (32, 3) and (got["x"][8:16] == x.numpy()).all() and got["x"].dtype == np.float32
    assert (
        got["ids"].shape == (32, 4)
        and (got["ids"][30:] == ids.numpy()[:2]).all()
        and got["ids"].dtype == np.int64
    )
    assert got["scalar"].shape == ()
    assert latency_placement.timing_feeds({"x": x}, {"x"}, samples=4)["x"].shape == (8, 3)  # never cut


def test_apply_disables_every_quantizer_of_a_float_layer():
    from quantcli.nn import quantize_model
    from quantcli.nn.config import load_config

    model = quantize_model(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)),
        load_config("int8"),
    )
    names = [n for n, q in latency_placement.quantizers(model).items() if n.startswith("0.") and q.enabled]
    placement = latency_placement.LatencyPlacement(
        "auto",
        True,
        layers=latency_placement.decide(
            [
                latency_placement.LayerCost("0", "QGemm", True, 300.0, 100.0, names),
                latency_placement.LayerCost("2", "QGemm", True, 1.0, 100.0, []),
            ]
        ),
    )
    assert latency_placement.apply(model, placement) == names and len(names) >= 2
    qs = latency_placement.quantizers(model)
    assert not any(qs[n].enabled for n in names) and all(
        q.enabled for n, q in qs.items() if n.startswith("2.")
    )


def test_apply_with_every_layer_float_switches_off_the_quantizers_of_no_layer_too():
    """A residual skip's quantizer serves the QLinearAdd beside quantized Convs; with every layer float it
    would leave a Q/DQ pair in the float graph."""
    from quantcli.nn import quantize_model
    from quantcli.nn.config import load_config
    from quantcli.nn.tensor_quantizer import TensorQuantizer
    from quantcli.quant.descriptor import QuantDescriptor

    model = quantize_model(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)),
        load_config("int8"),
    )
    model.add_module("residual_quantizer", TensorQuantizer(QuantDescriptor(), name="residual_quantizer"))
    qs = latency_placement.quantizers(model)
    assert qs["residual_quantizer"].enabled

    def layer(name):
        return [n for n in qs if n.startswith(name + ".")]

    costs = [latency_placement.LayerCost(n, "QGemm", True, 300.0, 100.0, layer(n)) for n in ("0", "2")]
    placement = latency_placement.LatencyPlacement("auto", True, layers=latency_placement.decide(costs))
    off = latency_placement.apply(model, placement)
    assert "residual_quantizer" in off and not any(q.enabled for q in qs.values())
    # control: one layer kept quantized, the skip's quantizer stays
    model2 = quantize_model(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)),
        load_config("int8"),
    )
    model2.add_module("residual_quantizer", TensorQuantizer(QuantDescriptor(), name="residual_quantizer"))
    costs[1] = latency_placement.LayerCost("2", "QGemm", True, 1.0, 100.0, layer("2"))
    placement = latency_placement.LatencyPlacement("auto", True, layers=latency_placement.decide(costs))
    assert "residual_quantizer" not in latency_placement.apply(model2, placement)
    assert latency_placement.quantizers(model2)["residual_quantizer"].enabled


# ------------------------------------------------------------------------------------------- the costs


def _graph(nodes):
    return helper.make_model(helper.make_graph(nodes, "g", [], []))


def test_int8_cost_counts_the_qdq_that_feed_the_kernel_and_splits_a_shared_q():
    g = _graph(
        [
            helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q"),  # read by k1 and k2
            helper.make_node(
                "DequantizeLinear", ["wq", "s", "z"], ["w"], name="dqw"
            ),  # k1's weight, every run
            helper.make_node("QLinearMatMul", ["xq", "w"], ["y1"], name="k1"),
            helper.make_node("QLinearMatMul", ["xq", "w2"], ["y2"], name="k2"),
            # unfused: Q -> DQ -> float op
            helper.make_node("QuantizeLinear", ["y2", "s", "z"], ["y2q"], name="q3"),
            helper.make_node("DequantizeLinear", ["y2q", "s", "z"], ["y2f"], name="dq3"),
            helper.make_node("Relu", ["y1"], ["r"], name="relu"),
            helper.make_node(
                "MatMul", ["y2f", "r"], ["out"], name="k3"
            ),  # the Relu is not a Q/DQ: not counted
        ]
    )
    times = {
        "q": 10.0,
        "dqw": 4.0,
        "k1": 100.0,
        "k2": 50.0,
        "q3": 6.0,
        "dq3": 2.0,
        "relu": 1000.0,
        "k3": 30.0,
    }
    assert latency_placement.int8_cost(g, "k1", times) == pytest.approx(100 + 10 / 2 + 4)
    assert latency_placement.int8_cost(g, "k2", times) == pytest.approx(50 + 10 / 2)
    assert latency_placement.int8_cost(g, "k3", times) == pytest.approx(30 + 2 + 6)
    assert latency_placement.int8_cost(g, "k1", {"q": 1.0}) is None  # the kernel was not timed


def test_node_times_gives_a_time_to_every_node_onnxruntime_runs(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])
    w = onnx.numpy_helper.from_array(np.ones((8, 8), np.float32), "w")
    g = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
            helper.make_node("Sin", ["m"], ["s"], name="sin"),
            helper.make_node("Cos", ["s"], ["y"], name="cos"),
        ],
        "g",
        [x],
        [y],
        [w],
    )
    path = tmp_path / "tiny.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), path)
    other = tmp_path / "other.onnx"
    g.node[1].op_type = "Cos"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), other)
    times = node_times([path, other], {"x": np.ones((4, 8), np.float32)}, rounds=3)
    assert len(times) == 2  # one dict per graph, in order
    for p, t in zip((path, other), times):
        assert set(t) == {n.name for n in optimized_graph(p).graph.node}
        assert all(isinstance(v, float) and v >= 0 for v in t.values())
    # the profiles went to a temporary folder, removed
    assert sorted(tmp_path.iterdir()) == sorted([path, other])


# ------------------------------------------------------------------------------------------- the CLI


def slow_conv2(paths, feeds, rounds):
    """conv2's integer kernel takes 1 ms, every other node 1 us."""
    return [
        {
            n.name: 1000.0 if n.op_type == "QLinearConv" and n.name.startswith("/conv2/") else 1.0
            for n in optimized_graph(path).graph.node
        }
        for path in paths
    ]


def _calibrate(tmp_path, monkeypatch, timer, *args, model="digits_cnn"):
    monkeypatch.setattr(latency_placement, "TIMER", timer)
    out = tmp_path / "m.calib.pt"
    r = cli("calibrate", model, "--out", out, "--json", *args)
    assert r.exit_code == 0, r.output
    return out, json.loads(r.stdout)


def test_a_slower_integer_conv_is_kept_float_in_checkpoint_export_and_verify(tmp_path, monkeypatch):
    ck, info = _calibrate(tmp_path, monkeypatch, slow_conv2)
    latency = info["placement"]["latency"]
    assert latency["mode"] == "auto" and latency["measured"] and latency["kept_float"] == ["conv2"]
    entry = {e["layer"]: e for e in latency["layers"]}["conv2"]
    assert entry["decision"] == "float" and entry["kernel"] == "QLinearConv" and entry["int8_us"] >= 1000
    assert "conv2" not in info["layers"]["quantized"] and "conv1" in info["layers"]["quantized"]
    stored = torch.load(ck, weights_only=True)
    assert stored["calibration"]["placement"]["latency"]["kept_float"] == ["conv2"]
    conv2 = {n: q for n, q in stored["quantizers"].items() if n.startswith("conv2.")}
    assert conv2 and not any(q["enabled"] for q in conv2.values())
    assert stored["quantizers"]["conv1.weight_quantizer"]["enabled"]

    onnx_path = tmp_path / "m.onnx"
    assert cli("export", ck, "--onnx", onnx_path).exit_code == 0
    g = onnx.load(onnx_path).graph
    producers = {o: n for n in g.node for o in n.output}
    conv = next(n for n in g.node if n.name == "/conv2/Conv")
    # its weight is the float initializer, not a DequantizeLinear's output
    assert conv.input[1] not in producers
    assert (
        producers[next(n for n in g.node if n.name == "/conv1/Conv").input[1]].op_type == "DequantizeLinear"
    )
    r = cli("verify", onnx_path, "--reference", ck)
    assert r.exit_code == 0, r.output


def slow_integer_kernels(paths, feeds, rounds):
    """Every integer kernel takes 1 ms, every other node 1 us: the latency placement keeps every layer
    float."""
    return [
        {
            n.name: 1000.0 if n.op_type.startswith(("QLinear", "QGemm", "MatMulInteger")) else 1.0
            for n in optimized_graph(path).graph.node
        }
        for path in paths
    ]


def test_a_graph_with_every_layer_kept_float_passes_verify(tmp_path, monkeypatch):
    """No layer quantized: no quantization error to measure fidelity in, and onnxruntime's float kernels still
    round otherwise than PyTorch's; verify measures against a floor of the output's RMS (it was inf: FAIL)."""
    ck, info = _calibrate(tmp_path, monkeypatch, slow_integer_kernels)
    assert sorted(info["placement"]["latency"]["kept_float"]) == ["conv1", "conv2", "fc1", "fc2"]
    onnx_path = tmp_path / "m.onnx"
    assert cli("export", ck, "--onnx", onnx_path).exit_code == 0
    r = cli("verify", onnx_path, "--reference", ck, "--json")
    assert r.exit_code == 0, r.output
    checks = {c["name"]: c["value"] for c in json.loads(r.stdout)["checks"]}
    assert checks["fidelity.rms_ratio"] < 0.1 and checks["fidelity.replay_outputs"] < 0.1


def test_a_whole_graph_slower_with_the_layer_float_keeps_it_quantized(tmp_path, monkeypatch):
    """conv2's kernel is slower quantized, but the stub says the whole graph is faster with it quantized
    (the Q/DQ and layout changes around a float layer): conv2 stays quantized, and the report has the graph
    times."""

    # graphs by file name: float, chosen (conv2 float), other (conv2 quantized); the float graph's second
    # session (A/A) gets the float time
    def by_name(ms):
        return lambda paths, feeds, rounds: [ms[Path(p).stem] for p in paths]

    chosen_slower = by_name({"float": 3.0, "chosen": 2.5, "other": 2.0})
    int8_slower = by_name({"float": 1.0, "chosen": 2.5, "other": 2.0})  # both int8 graphs slower than float

    monkeypatch.setattr(latency_placement, "GRAPH_TIMER", chosen_slower)
    _, info = _calibrate(tmp_path, monkeypatch, slow_conv2)
    latency = info["placement"]["latency"]
    assert latency["kept_float"] == []
    assert "conv2" in info["layers"]["quantized"]
    assert latency["graph_ms"] == {"float": 3.0, "chosen": 2.0, "other": 2.5, "float A/A": 3.0}
    assert (
        "0.67x the float graph's time" in latency["text"]
        and latency["noise"] == latency_placement.GRAPH_NOISE_FLOOR
    )

    monkeypatch.setattr(latency_placement, "GRAPH_TIMER", int8_slower)
    _, info = _calibrate(tmp_path, monkeypatch, slow_conv2)
    latency = info["placement"]["latency"]
    assert sorted(latency["kept_float"]) == ["conv1", "conv2", "fc1", "fc2"]
    assert latency["graph_ms"] == {"float": 1.0, "chosen": 1.0, "other": 2.5, "int8": 2.0, "float A/A": 1.0}
    assert "every layer kept float" in latency["text"]


def test_an_int8_graph_slower_by_less_than_the_measured_a_a_spread_stays_quantized(tmp_path, monkeypatch):
    """The float graph's second session ran 10% slower than its first: an int8 graph 8% slower than float is
    within that noise and stays quantized; one 12% slower is not."""

    def timer(int8_ms):
        return lambda paths, feeds, rounds: [
            {"float": 1.0, "chosen": int8_ms}.get(Path(p).stem, 1.0) if i < 2 else 1.1
            for i, p in enumerate(paths)
        ]

    monkeypatch.setattr(latency_placement, "GRAPH_TIMER", timer(1.08))
    _, info = _calibrate(tmp_path, monkeypatch, latency_placement.TIMER)
    latency = info["placement"]["latency"]
    assert latency["kept_float"] == [] and latency["noise"] == pytest.approx(0.1)
    assert latency["graph_ms"]["float A/A"] == 1.1 and "noise band 10.0%" in latency["text"]
    monkeypatch.setattr(latency_placement, "GRAPH_TIMER", timer(1.12))
    _, info = _calibrate(tmp_path, monkeypatch, latency_placement.TIMER)
    assert sorted(info["placement"]["latency"]["kept_float"]) == ["conv1", "conv2", "fc1", "fc2"]


def test_placement_all_keeps_every_layer_quantized(tmp_path, monkeypatch):
    ck, info = _calibrate(tmp_path, monkeypatch, slow_conv2, "--placement", "all")
    assert info["placement"]["latency"]["mode"] == "all" and info["placement"]["latency"]["kept_float"] == []
    assert {"conv1", "conv2", "fc1", "fc2"} <= set(info["layers"]["quantized"])
    assert all(
        q["enabled"]
        for n, q in torch.load(ck, weights_only=True)["quantizers"].items()
        if n.split(".")[0] in ("conv1", "conv2") and not n.endswith("output_quantizer")
    )


def test_the_summary_table_has_one_latency_line(tmp_path, monkeypatch):
    monkeypatch.setattr(latency_placement, "TIMER", slow_conv2)
    r = cli("calibrate", "digits_cnn", "--out", tmp_path / "m.calib.pt")
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.stdout.splitlines() if "latency placement" in ln)
    assert "1 of 4 layers kept float" in line and "conv2" in line


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
    _, info = _calibrate(
        tmp_path, monkeypatch, latency_placement.TIMER, "--data", tmp_path / "x.npy", model=model
    )
    layers = {e["layer"]: e for e in info["placement"]["latency"]["layers"]}
    assert layers["2"]["decision"] == "float" and "in float between Q/DQ" in layers["2"]["reason"]
    assert layers["0"]["decision"] == "quantized"
    assert "2" not in info["layers"]["quantized"]
    _, info = _calibrate(
        tmp_path,
        monkeypatch,
        latency_placement.TIMER,
        "--data",
        tmp_path / "x.npy",
        "--placement",
        "all",
        model=model,
    )
    assert "2" in info["layers"]["quantized"]


def test_a_model_that_does_not_export_is_calibrated_and_not_measured(tmp_path, monkeypatch):
    def fail(*a, **k):
        raise RuntimeError("no translation for aten::frobnicate")

    monkeypatch.setattr(latency_placement, "export_onnx", fail)
    _, info = _calibrate(tmp_path, monkeypatch, latency_placement.TIMER)
    latency = info["placement"]["latency"]
    assert not latency["measured"] and "aten::frobnicate" in latency["note"] and latency["kept_float"] == []


def test_tensorrt_target_is_not_placed_for_onnxruntime(tmp_path, monkeypatch):
    _, info = _calibrate(tmp_path, monkeypatch, slow_conv2, "--target", "tensorrt")
    latency = info["placement"]["latency"]
    assert not latency["measured"] and "not applicable" in latency["note"] and latency["kept_float"] == []


def test_bad_placement_is_a_one_line_error(tmp_path):
    r = cli("calibrate", "digits_cnn", "--out", tmp_path / "m.calib.pt", "--placement", "fastest")
    assert_clean_error(r, "--placement", "auto or all")
