"""FP8 and INT4 graphs in onnxruntime with default session options: they load, and compute what the graph
computes with optimizations off (which is what the fake-quant model computes)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from exporters import export_onnx
from exporters.onnxruntime.compat import (
    FP8_UNSAFE_OPTIMIZERS,
    fp8_exposure,
    guard_fp8,
    is_guard,
    session_needs,
    unguard_fp8,
)
from quantcli import load_calibrated, quantize_model
from quantcli.calibration.calibrate import calibrate
from quantcli.verify import verify_onnx


def _session(path_or_bytes, optimize=True, needs=None):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    kwargs = {}
    if needs is not None:
        needs.configure(so)
        kwargs = needs.session_kwargs()
    return ort.InferenceSession(path_or_bytes, so, providers=["CPUExecutionProvider"], **kwargs)


def _feeds(ck):
    return [{k: v.numpy() for k, v in b.items()} for b in (ck.evaluation_batches() or [ck.example])[:2]]


def _unguard(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph as it was before guard_fp8 (a copy)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    assert unguard_fp8(m) == sum(is_guard(n) for n in model.graph.node) > 0
    assert not any(is_guard(n) for n in m.graph.node)
    return m


@pytest.mark.parametrize("model", ["digits_cnn", "text_encoder"])
def test_fp8_sample_graphs_load_with_default_options_and_match_exactly(model, calibrated, exported):
    path = exported(model, "fp8")
    ck = load_calibrated(calibrated(model, "fp8"))
    graph = onnx.load(str(path))
    assert sum(is_guard(n) for n in graph.graph.node) > 0
    assert not fp8_exposure(graph) and not session_needs(graph, exact=True)
    default = ort.InferenceSession(str(path))  # what a user types: default options, default providers
    off = _session(str(path), optimize=False)
    for f in _feeds(ck):
        got, want = default.run(None, f)[0], off.run(None, f)[0]
        assert np.array_equal(got, want)  # bit for bit: nothing the optimizer did changes a value
    # and the optimizations-off graph gives the fake-quant model's codes at every quantizer
    rep = verify_onnx(path, ck, (ck.evaluation_batches() or [ck.example])[:2], deployment=False)
    assert rep.structure["passed"], rep.structure["problems"]
    assert all(v["identical_codes"] == 1.0 for v in rep.fidelity["quantizers"].values())


@pytest.mark.parametrize("model", ["digits_cnn", "text_encoder"])
def test_unguarded_fp8_graph_is_exact_with_the_session_needs(model, exported, calibrated):
    guarded = onnx.load(str(exported(model, "fp8")))
    raw = _unguard(guarded)
    exp = fp8_exposure(raw)
    assert exp.dq_feeding_ops  # every activation DQ feeds an op directly again
    needs = session_needs(raw)
    assert needs.disabled_optimizers == FP8_UNSAFE_OPTIMIZERS and needs.reasons
    relu_outputs = {n.output[0] for n in raw.graph.node if n.op_type == "Relu"}
    relu_qs = {n.name for n in raw.graph.node if n.op_type == "QuantizeLinear" and n.input[0] in relu_outputs}
    assert set(exp.relu_into_q) == relu_qs and (len(relu_qs) >= 2) == (model == "digits_cnn")
    off = _session(raw.SerializeToString(), optimize=False)
    loaded = _session(raw.SerializeToString(), needs=needs)
    ref = _session(guarded.SerializeToString(), optimize=False)
    for f in _feeds(load_calibrated(calibrated(model, "fp8"))):
        want = off.run(None, f)[0]
        assert np.array_equal(loaded.run(None, f)[0], want)
        assert np.array_equal(ref.run(None, f)[0], want)  # the guards change no value


@pytest.mark.parametrize("model", ["digits_cnn", "text_encoder"])
def test_int4_sample_graphs_load_with_default_options(model, calibrated, exported):
    path = exported(model, "int4-weight-only")
    ck = load_calibrated(calibrated(model, "int4-weight-only"))
    graph = onnx.load(str(path))
    assert not session_needs(graph).disabled_optimizers
    default = ort.InferenceSession(str(path))
    needs = session_needs(graph, exact=True)
    exact = _session(str(path), needs=needs)
    off = _session(str(path), optimize=False)
    if model == "text_encoder":  # its MatMuls become MatMulNBits: accuracy level 1 keeps float32 activations
        assert dict(needs.config_entries) == {"session.qdq_matmulnbits_accuracy_level": "1"}
    for f in _feeds(ck):
        want = off.run(None, f)[0]
        scale = np.abs(want).max()
        assert np.abs(default.run(None, f)[0] - want).max() <= 0.02 * scale
        assert np.abs(exact.run(None, f)[0] - want).max() <= 1e-5 * scale


class _Fp8Shapes(nn.Module):
    """Every pattern onnxruntime mis-handles: Conv -> Relu -> Q, Linear without bias (Gemm with two DQ
    inputs), Linear on a 3-D input (MatMul), a Transpose before a Q, ConvTranspose."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.up = nn.ConvTranspose2d(4, 2, 2, stride=2)
        self.nobias = nn.Linear(2 * 8 * 8, 16, bias=False)
        self.seq = nn.Linear(4, 6)
        self.head = nn.Linear(16 + 6 * 6, 3)

    def forward(self, x, s):
        a = self.up(torch.relu(self.conv(x)))
        a = torch.relu(self.nobias(a.flatten(1)))
        b = self.seq(s.transpose(1, 2)).flatten(1)  # (N, 6 positions, 4) -> (N, 6, 6)
        return self.head(torch.cat([a, b], 1))


def test_fp8_guards_every_pattern_exactly(tmp_path):
    torch.manual_seed(0)
    m = quantize_model(_Fp8Shapes().eval(), "fp8")
    g = torch.Generator().manual_seed(1)

    def batch(n):
        return {"x": torch.randn(n, 2, 4, 4, generator=g), "s": torch.randn(n, 4, 6, generator=g)}

    calibrate(m, [batch(8) for _ in range(3)], "max", device="cpu")
    path = tmp_path / "fp8.onnx"
    res = export_onnx(m, batch(2), path)
    assert res.fp8_guards > 0 and res.fusion_error is None
    graph = onnx.load(str(path))
    assert not fp8_exposure(graph)
    assert guard_fp8(graph) == 0  # idempotent
    feeds = {k: v.numpy() for k, v in batch(5).items()}
    got = ort.InferenceSession(str(path)).run(None, feeds)[0]
    off = _session(str(path), optimize=False).run(None, feeds)[0]
    assert np.array_equal(got, off)
    with torch.inference_mode():
        want = m(**{k: torch.from_numpy(v) for k, v in feeds.items()}).numpy()
    assert np.abs(off - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    raw = _unguard(graph)
    loaded = _session(raw.SerializeToString(), needs=session_needs(raw)).run(None, feeds)[0]
    assert np.array_equal(loaded, off)


def test_other_targets_keep_fp8_unguarded_and_export_names_the_session_options(tmp_path):
    from types import SimpleNamespace

    torch.manual_seed(0)
    m = quantize_model(_Fp8Shapes().eval(), "fp8")
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(4, 2, 4, 4, generator=g), "s": torch.randn(4, 4, 6, generator=g)}
    calibrate(m, [batch], "max", device="cpu")
    m.quantcli_config = SimpleNamespace(target="tensorrt")  # TensorRT fuses DQ -> op directly: no guards
    res = export_onnx(m, batch, tmp_path / "trt.onnx")
    assert res.fp8_guards == 0 and res.quantized_layers is None
    assert tuple(res.onnxruntime_disabled_optimizers) == FP8_UNSAFE_OPTIMIZERS
    assert not any(is_guard(n) for n in onnx.load(str(tmp_path / "trt.onnx")).graph.node)
