"""Weight-only blocked layers export in the form onnxruntime runs as MatMulNBits (exporters.matmul_nbits).

A model of three Linear layers -- with and without bias, one with 200 input features (the last block of 128 is
partial), one whose input is a single block -- is calibrated with the real CLI, exported with both exporters
for 2-D and 3-D (``[batch, seq, in]``) inputs, and checked against values computed here: the stored codes
against a numpy quantization of the weights, the graph against the fake-quant model in onnxruntime with
optimizations off, and onnxruntime's own optimized graph (``SessionOptions.optimized_model_filepath``) for
MatMulNBits nodes.
"""

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from exporters.graph import consumer_map, initializer_map, qdq_pairs, to_numpy
from exporters.onnxruntime.fusion import inspect_fusion
from quantcli import load_calibrated
from quantcli.verify import verify_onnx
from tests.helpers import cli

MODEL_SOURCE = """
import torch
from torch import nn


class ThreeLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_a = nn.Linear(256, 128)
        self.fc_b = nn.Linear(128, 200, bias=False)  # one block of 128: per output channel
        self.fc_c = nn.Linear(200, 64)  # 200 = 128 + a partial block of 72

    def forward(self, x):
        return self.fc_c(torch.relu(self.fc_b(torch.relu(self.fc_a(x)))))


def build():
    torch.manual_seed(0)
    return ThreeLinear()
"""
T = onnx.TensorProto
LAYERS = ("fc_a", "fc_b", "fc_c")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("nbits")
    (root / "three_linear.py").write_text(MODEL_SOURCE)
    return root


def _calibrate(root, rank: int, config: str = "int4-weight-only"):
    rng = np.random.default_rng(1)
    shape = (8, 256) if rank == 2 else (2, 5, 256)
    data = root / f"x{rank}.npz"
    np.savez(data, x=rng.standard_normal(shape).astype(np.float32))
    out = root / f"r{rank}-{abs(hash(config))}.calib.pt"
    r = cli(
        "calibrate",
        f"{root / 'three_linear.py'}:build",
        "--data",
        data,
        "--config",
        config,
        "--out",
        out,
        "--json",
    )
    assert r.exit_code == 0, r.output
    return out


def _export(root, ck, exporter: str):
    out = root / f"{ck.stem}-{exporter}.onnx"
    r = cli("export", ck, "--onnx", out, "--exporter", exporter, "--json")
    assert r.exit_code == 0, r.output
    return out, json.loads(r.stdout)


def _hand_codes(w: np.ndarray, bits: int, block: int = 128, unsigned: bool = False) -> np.ndarray:
    """Symmetric blocked codes of an ``[out, in]`` weight along ``in``, by numpy: the last block padded with
    zeros for its max, scale = amax / bound in float32, round half to even (unsigned: the grid [0, 2**bits -
    1])."""
    n, k = w.shape
    blocks = -(-k // block)
    padded = np.zeros((n, blocks * block), np.float32)
    padded[:, :k] = w
    amax = np.abs(padded.reshape(n, blocks, block)).max(-1).astype(np.float32)
    bound = np.float32(2**bits - 1 if unsigned else 2 ** (bits - 1) - 1)
    scale = np.repeat(amax / bound, block, axis=1)[:, :k]
    return np.clip(np.round(w / scale), 0 if unsigned else -bound - 1, bound)


def _optimized(path, tmp_path, config: dict | None = None) -> onnx.ModelProto:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    for k, v in (config or {}).items():
        so.add_session_config_entry(k, v)
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return onnx.load(str(tmp_path / "optimized.onnx"))


def _check_form(graph: onnx.ModelProto, ck, bits: int, unsigned: bool = False) -> None:
    inits, consumers = initializer_map(graph.graph), consumer_map(graph)
    assert not [n.op_type for n in graph.graph.node if n.op_type in ("Gemm", "Transpose")]
    pairs = {p.quantizer: p for p in qdq_pairs(graph)}
    for layer in LAYERS:
        p = pairs[f"{layer}.weight_quantizer"]
        dq = next(n for n in graph.graph.node if n.output[0] == p.output)
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in dq.attribute}
        assert attrs == {"axis": 0, "block_size": 128}, layer
        readers = consumers[p.output]
        assert [(r.op_type, list(r.input).index(p.output)) for r in readers] == [("MatMul", 1)], layer
        w = dict(ck.model.named_parameters())[f"{layer}.weight"].detach().numpy()
        codes = inits[p.tensor]
        elem = {(4, False): T.INT4, (8, False): T.INT8, (4, True): T.UINT4}[(bits, unsigned)]
        assert codes.data_type == elem and list(codes.dims) == [w.shape[1], w.shape[0]]
        assert list(inits[dq.input[1]].dims) == [-(-w.shape[1] // 128), w.shape[0]]
        assert np.array_equal(
            to_numpy(codes).T.astype(np.float32), _hand_codes(w, bits, unsigned=unsigned)
        ), layer


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("rank", [2, 3])
def test_int4_layers_export_as_matmul_nbits(model_file, exporter, rank, tmp_path):
    ck_path = _calibrate(model_file, rank)
    path, res = _export(model_file, ck_path, exporter)
    assert res["matmul_nbits_layers"] == 3 and res["quantized_layers"] == 3 and res["unfused_layers"] == 0
    graph = onnx.load(str(path))
    ck = load_calibrated(ck_path)
    _check_form(graph, ck, bits=4)

    # exact: the graph with onnxruntime's optimizations off computes the fake-quant model
    x = ck.example["x"].numpy()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    got = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    with torch.no_grad():
        want = ck.model(torch.from_numpy(x)).numpy()
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-5 * np.abs(want).max()

    # deployed: onnxruntime's optimized graph runs every layer as MatMulNBits, no DequantizeLinear left
    ops = [n.op_type for n in _optimized(path, tmp_path).graph.node]
    assert ops.count("MatMulNBits") == 3 and "DequantizeLinear" not in ops
    rep = inspect_fusion(path)
    assert [(r.layer, r.kernel, r.fused) for r in rep.layers] == [(n, "MatMulNBits", True) for n in LAYERS]

    report = verify_onnx(path, ck, deployment=False, per_layer=True)
    assert report.structure["passed"], report.structure["problems"]
    rows = {r["quantizer"]: r for r in report.layers if r["kind"] == "weight"}
    assert set(rows) == {f"{n}.weight_quantizer" for n in LAYERS}
    assert all(r["identical_codes"] == 1.0 for r in rows.values())
    assert report.passed


def test_the_session_not_the_graph_sets_the_accuracy_level(model_file, tmp_path):
    """docs/int4.md and benchmarks/bench_int4_shapes.py read their latencies on this: onnxruntime's fusion of
    the exported DequantizeLinear -> MatMul gives every MatMulNBits the session's
    ``session.qdq_matmulnbits_accuracy_level``, 4 (int8 compute) unless set, whatever the graph holds."""
    path, _ = _export(model_file, _calibrate(model_file, 3), "torchscript")

    def levels(config):
        nodes = [n for n in _optimized(path, tmp_path, config).graph.node if n.op_type == "MatMulNBits"]
        return [
            {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}.get("accuracy_level")
            for n in nodes
        ]

    assert levels(None) == [4, 4, 4]
    assert levels({"session.qdq_matmulnbits_accuracy_level": "1"}) == [1, 1, 1]


@pytest.mark.parametrize("bits, unsigned", [(8, False)], ids=["int8"])
def test_8bit_and_uint4_weight_only_blocked_are_matmul_nbits_too(model_file, tmp_path, bits, unsigned):
    config = model_file / f"w{bits}{unsigned}.json"
    config.write_text(
        json.dumps(
            {
                "preset": "int4-weight-only",
                "rules": [{"pattern": "*.weight_quantizer", "num_bits": bits, "unsigned": unsigned}],
            }
        )
    )
    ck_path = _calibrate(model_file, 3, str(config))
    path, res = _export(model_file, ck_path, "torchscript")
    assert res["matmul_nbits_layers"] == 3 and res["unfused_layers"] == 0
    # named for export's warning: onnxruntime's default accuracy level quantizes their activations too
    assert res["matmul_nbits_8bit"] == sorted(f"{n}.weight_quantizer" for n in LAYERS)
    _check_form(onnx.load(str(path)), load_calibrated(ck_path), bits=bits, unsigned=unsigned)
    assert [n.op_type for n in _optimized(path, tmp_path).graph.node].count("MatMulNBits") == 3
    assert verify_onnx(path, load_calibrated(ck_path), deployment=False).passed


def test_a_stored_code_changed_after_the_rewrite_fails_verify(model_file, tmp_path):
    """The structure check reads the transposed codes back in the quantizer's layout: one flipped code is
    caught."""
    ck_path = _calibrate(model_file, 2)
    path, _ = _export(model_file, ck_path, "torchscript")
    graph = onnx.load(str(path))
    p = next(p for p in qdq_pairs(graph) if p.quantizer == "fc_c.weight_quantizer")
    t = initializer_map(graph.graph)[p.tensor]
    codes = to_numpy(t).astype(np.int64)
    codes[199, 3] = 7 if codes[199, 3] != 7 else 6  # in the partial last block
    t.CopyFrom(onnx.helper.make_tensor(t.name, t.data_type, list(t.dims), codes.flatten().tolist()))
    bad = tmp_path / "bad.onnx"
    onnx.save(graph, str(bad))
    report = verify_onnx(bad, load_calibrated(ck_path), deployment=False)
    assert not report.structure["passed"]
    assert any(
        "fc_c.weight_quantizer" in p and "1 stored weight code" in p for p in report.structure["problems"]
    )


@pytest.mark.parametrize(
    "n, blocks, want",
    [(200, 2, 128), (256, 2, 128), (300, 3, 128), (130, 2, 128), (12, 4, 3), (64, 1, 64), (6, 3, 2)],
)
def test_a_blocked_amax_shape_reads_as_the_power_of_two_block_that_fits(n, blocks, want):
    from quantcli.quant.granularity import block_of, granularity_of

    assert block_of(n, blocks) == want
    assert -(-n // want) == blocks
    if blocks > 1:
        assert granularity_of((4, blocks), (4, n)).block_size == want


def test_partial_last_block_calibrates_with_zero_padding_and_refuses_ambiguous_sizes():
    from quantcli.errors import ConfigError
    from quantcli.nn import quantize_model

    torch.manual_seed(0)
    model = quantize_model(torch.nn.Sequential(torch.nn.Linear(200, 8)), {"preset": "int4-weight-only"})
    q = model[0].weight_quantizer
    q.start_calibration("max")
    q.collect(model[0].weight.detach())
    q.load_calib_amax("max")
    w = model[0].weight.detach().numpy()
    want = np.stack([np.abs(w[:, :128]).max(1), np.abs(w[:, 128:]).max(1)], 1)  # the last block: 72 channels
    assert np.array_equal(q.amax.numpy(), want)
    # blocks of 100 over 300 channels would read back as blocks of 128 (3 blocks either way): refused
    odd = quantize_model(
        torch.nn.Sequential(torch.nn.Linear(300, 8)), {"preset": "int4-weight-only", "block_size": 100}
    )
    odd[0].weight_quantizer.start_calibration("max")
    with pytest.raises(ConfigError, match="power-of-two"):
        odd[0].weight_quantizer.collect(odd[0].weight.detach())


@pytest.mark.parametrize("op", ["Gemm", "TransposeMatMul"])
def test_uint4_with_zero_points_rewrites_to_the_same_function(op, rng, tmp_path):
    """The pass on a hand-built graph: uint4 codes with non-zero zero points, K = 200 (a partial block): the
    rewritten graph computes what the original computes (optimizations off) and onnxruntime fuses it."""
    from onnx import helper, numpy_helper

    from exporters.fold import make_initializer
    from exporters.matmul_nbits import to_matmul_nbits

    n, k = 24, 200
    codes = rng.integers(0, 16, size=(n, k))
    zp = rng.integers(0, 16, size=(n, 2))
    scale = (rng.random((n, 2)) * 0.1 + 0.01).astype(np.float32)
    inits = [
        make_initializer("w", codes, T.UINT4),
        make_initializer("zp", zp, T.UINT4),
        numpy_helper.from_array(scale, "s"),
        numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "b"),
    ]
    nodes = [
        helper.make_node("DequantizeLinear", ["w", "s", "zp"], ["wd"], axis=1, block_size=128, name="dq")
    ]
    if op == "Gemm":
        nodes.append(helper.make_node("Gemm", ["x", "wd", "b"], ["y"], transB=1, name="fc"))
        x_shape, y_shape = ["batch", k], ["batch", n]
    else:
        nodes += [
            helper.make_node("Transpose", ["wd"], ["wt"], perm=[1, 0]),
            helper.make_node("MatMul", ["x", "wt"], ["m"], name="fc"),
            helper.make_node("Add", ["m", "b"], ["y"]),
        ]
        x_shape, y_shape = ["batch", 5, k], ["batch", 5, n]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", T.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", T.FLOAT, y_shape)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    before = tmp_path / "before.onnx"
    onnx.save(model, str(before))
    assert to_matmul_nbits(model) == ["wd"]
    onnx.checker.check_model(model, full_check=True)
    after = tmp_path / "after.onnx"
    onnx.save(model, str(after))
    dq = next(nd for nd in model.graph.node if nd.op_type == "DequantizeLinear")
    assert len(dq.input) == 3  # a zero point that is not all zero stays
    assert np.array_equal(to_numpy(initializer_map(model.graph)[dq.input[2]]), zp.T)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    x = rng.standard_normal([2] + x_shape[1:]).astype(np.float32)
    want = ort.InferenceSession(str(before), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(after), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert [nd.op_type for nd in _optimized(after, tmp_path).graph.node].count("MatMulNBits") == 1


class _UnusedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(32, 32), nn.Linear(32, 4)
        self.head = nn.Linear(32, 3)  # never called

    def forward(self, x):
        return self.out(torch.relu(self.fc(x)))


def test_a_weight_only_layer_that_never_runs_is_left_out(tmp_path):
    """Weight-only layers observe nothing (their input quantizer is off) and their weights are calibrated from
    the parameter: a layer that never ran kept its weight quantizer, export left it out of the graph, and
    verify failed the correct graph ("Q/DQ pair missing"). It is now left out as under int8."""
    from quantcli import calibrate, quantize_model

    torch.manual_seed(0)
    model = quantize_model(_UnusedHead(), "int4-weight-only")
    summary = calibrate(model, [{"x": torch.randn(8, 32)}], device="cpu")
    assert summary.not_called == ["head.weight_quantizer"] and summary.dynamic == []
    assert not model.head.weight_quantizer.enabled and model.fc.weight_quantizer.enabled

    torch.save(_UnusedHead().state_dict(), tmp_path / "w.pt")
    (tmp_path / "net.py").write_text(
        f"import sys\nsys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
        "from tests.test_matmul_nbits import _UnusedHead\ndef make():\n    return _UnusedHead()\n"
    )
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32))
    ck, graph = tmp_path / "m.calib.pt", tmp_path / "m.onnx"
    net, data = f"{tmp_path / 'net.py'}:make", tmp_path / "x.npy"
    r = cli(
        "calibrate", net, "--weights", tmp_path / "w.pt", "--data", data, "--config", "int4-weight-only",
        "--out", ck,
    )  # fmt: skip
    assert r.exit_code == 0 and "never called during calibration" in r.output, r.output
    # (its summary said "int32 biases, 2 signed activations on uint8 with a zero point": all of them off)
    assert "weight-only: activations stay float" in r.output and "int32 biases" not in r.output, r.output
    assert cli("export", ck, "--onnx", graph).exit_code == 0
    r = cli("verify", graph, "--reference", ck, "--data", data)
    assert r.exit_code == 0, r.output
