"""Q/DQ placement per deployment target.

onnxruntime: per pattern (Conv+BN+ReLU, Conv -> residual Add, Linear with bias, q/k/v sharing an input, Gemm
    and
MatMul) the integer kernels onnxruntime's optimizer makes of the exported graph (read from
``SessionOptions.optimized_model_filepath``), and exact parity of the optimizations-off graph with the
fake-quant
model: every quantizer's DequantizeLinear output equals the PyTorch quantizer's output on the same run.
tensorrt: the placement NVIDIA recommends, checked on the graph's structure (no TensorRT here).
"""

import collections
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from exporters import export_onnx
from exporters.graph import PROPAGATED_MARK, quantizer_map
from exporters.onnxruntime.fusion import inspect_fusion, optimized_graph
from quantcli import load_calibrated, quantize_model
from quantcli.calibration.calibrate import calibrate
from quantcli.nn import quantizers
from tests.helpers import assert_clean_error, cli
from tests.ort_util import onnx_and_torch

T = onnx.TensorProto


# ------------------------------------------------------------------------------------------- models


class ConvBnRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.relu, self.pool = nn.ReLU(), nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.pool(self.relu(self.bn2(self.conv2(x))))
        return self.fc(torch.flatten(x, 1))


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        y = self.conv2(torch.relu(self.conv1(x)))
        return self.head(torch.relu(y + x)).mean((2, 3))


class Mlp(nn.Module):  # Linear with bias on 2-D inputs: Gemm
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Qkv(nn.Module):  # q/k/v read one tensor; 3-D inputs: MatMul
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.norm(x)
        att = torch.softmax(self.q(h) @ self.k(h).transpose(1, 2) / 4.0, -1)
        return att @ self.v(h)


def _batches(shape, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(*shape, generator=g)} for _ in range(n)]


def _with_stats(model):
    """Non-trivial BatchNorm statistics (folding or not, the parity must hold)."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(0.5 + torch.rand(m.num_features, generator=g))
                m.bias.copy_(0.2 * torch.randn(m.num_features, generator=g))
                m.running_mean.copy_(0.2 * torch.randn(m.num_features, generator=g))
                m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=g))
    return model.eval()


def _quantized(model, shape, config="int8", seed=0, example=False):
    """``model`` quantized and calibrated; ``example``: its structure recorded on a batch (as calibrate
    does), else read with torch.fx."""
    torch.manual_seed(seed)
    m = quantize_model(_with_stats(model), config, example=_batches(shape, 1, seed=7)[0] if example else None)
    calibrate(m, _batches(shape), "max", device="cpu")
    return m


def _export(m, shape, tmp_path, name="m.onnx"):
    path = tmp_path / name
    export_onnx(m, _batches(shape, 1, seed=9)[0], path)
    return path


def _kernels(path) -> collections.Counter:
    return collections.Counter(n.op_type for n in optimized_graph(path).graph.node)


def assert_exact(m, path, shape):
    """Optimizations off, every quantizer's DequantizeLinear output == the PyTorch quantizer's output."""
    model = onnx.load(str(path))
    qmap = quantizer_map(model)
    for name in qmap:
        model.graph.output.append(onnx.helper.make_tensor_value_info(name, T.FLOAT, None))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    captured = {}
    qs = quantizers(m)

    def keep(q):
        def hook(_mod, _args, out):
            captured.setdefault(q, out.detach().numpy())

        return hook

    hooks = [qs[q].register_forward_hook(keep(q)) for q in set(qmap.values())]
    batch = _batches(shape, 1, seed=11)[0]
    try:
        with torch.inference_mode():
            want = m(**batch).numpy()
    finally:
        for h in hooks:
            h.remove()
    got = sess.run(None, {"x": batch["x"].numpy()})
    outs = dict(zip([o.name for o in model.graph.output], got))
    for dq, q in qmap.items():
        assert np.array_equal(outs[dq], captured[q]), q
    np.testing.assert_allclose(outs[model.graph.output[0].name], want, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------- onnxruntime


def test_conv_bn_relu_fuses_into_qlinearconv_and_is_exact(tmp_path):
    shape = (4, 3, 8, 8)
    m = _quantized(ConvBnRelu(), shape)
    # post-ReLU inputs use the unsigned grid (uint8, zero point 0): the Relu disappears into the kernel
    assert m.conv2.input_quantizer.desc.unsigned and m.fc.input_quantizer.desc.unsigned
    assert not m.conv1.input_quantizer.desc.unsigned
    path = _export(m, shape, tmp_path)
    k = _kernels(path)
    assert k["QLinearConv"] == 2 and k["QGemm"] == 1 and k["Conv"] == 0 and k["Gemm"] == 0
    assert inspect_fusion(path).unfused == []
    assert_exact(m, path, shape)


def test_maxpool_and_flatten_run_on_codes(tmp_path):
    shape = (4, 3, 8, 8)
    m = ConvBnRelu().eval()
    m.bn1, m.bn2 = nn.Identity(), nn.Identity()  # so conv2 -> relu -> pool -> flatten -> fc.input_quantizer
    m = quantize_model(m, "int8")
    assert not any(hasattr(mod, "output_quantizer") for mod in m.modules())
    calibrate(m, _batches(shape), "max", device="cpu")
    path = _export(m, shape, tmp_path)
    graph = onnx.load(str(path))
    # the fc input quantizer's Q copied in front of Flatten and MaxPool, same scale and zero point
    copies = [n for n in graph.graph.node if n.op_type == "QuantizeLinear" and PROPAGATED_MARK in n.name]
    assert len(copies) == 2
    opt = [n.op_type for n in optimized_graph(path).graph.node]
    assert "Relu" not in opt and "DequantizeLinear" not in opt[: opt.index("QGemm")]
    assert_exact(m, path, shape)


def test_residual_add_runs_as_qlinearadd_with_its_skip_input_quantized(tmp_path):
    shape = (2, 3, 8, 8)
    m = _quantized(Residual(), shape)
    # conv2 feeds the Add, head feeds a mean: QLinearConv needs a Q on their outputs. The Add's skip input
    # (stem's ReLU output) gets a quantizer, on the uint8 grid, so that both of the Add's inputs come from a
    # DQ and onnxruntime runs QLinearAdd (with the Relu after it absorbed); stem and conv1 then feed
    # quantizers only
    have = {n for n, mod in m.named_modules() if hasattr(mod, "output_quantizer")}
    assert have == {"conv2", "head"}
    assert m.quantcli_report.placement.residual_quantized == ["residual_quantizer"]
    assert m.residual_quantizer.desc.unsigned
    path = _export(m, shape, tmp_path)
    k = _kernels(path)
    assert k["QLinearConv"] == 4 and k["QLinearAdd"] == 1 and k["Add"] == 0 and k["Relu"] == 0
    assert inspect_fusion(path).unfused == []
    assert_exact(m, path, shape)


class ResidualPool(nn.Module):
    """A ResNet's last block: the residual Add, a ReLU, global average pooling, the classifier; the shortcut
    is the block's input or a projection Conv; ``norm``: a float LayerNorm between pooling and classifier."""

    def __init__(self, projection: bool = False, norm: bool = False):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.shortcut = nn.Conv2d(8, 8, 1) if projection else nn.Identity()
        self.relu, self.pool = nn.ReLU(), nn.AdaptiveAvgPool2d(1)
        self.norm = nn.LayerNorm(8) if norm else nn.Identity()
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        h = self.relu(self.conv2(torch.relu(self.conv1(x))) + self.shortcut(x))
        return self.fc(self.norm(torch.flatten(self.pool(h), 1)))


@pytest.mark.parametrize("projection", [False, True], ids=["identity-shortcut", "projection-shortcut"])
def test_residual_add_before_global_pooling_runs_as_qlinearadd(tmp_path, projection):
    """The pooling's input gets a quantizer (uint8 after the ReLU), so the Add has a Q on its output and
    onnxruntime runs QLinearAdd and QLinearGlobalAveragePool (onnxruntime's own quantize_static does the
    same); before, the Add, ReLU and pooling ran in float."""
    shape = (2, 3, 8, 8)
    m = _quantized(ResidualPool(projection), shape)
    assert m.quantcli_report.placement.pool_inputs == {"pool": True}
    assert m.pool.input_quantizer.desc.unsigned and type(m.pool).__name__ == "QuantAdaptiveAvgPool2d"
    path = _export(m, shape, tmp_path)
    k = _kernels(path)
    assert k["QLinearAdd"] == 1 and k["QLinearGlobalAveragePool"] == 1, k
    assert k["Add"] == 0 and k["GlobalAveragePool"] == 0 and k["Relu"] == 0, k
    assert inspect_fusion(path).unfused == []
    assert_exact(m, path, shape)


_FUNCTIONAL_POOLS = {
    "x.mean((2, 3))": lambda h: h.mean((2, 3)),
    "torch.mean(x, dim=[-2, -1])": lambda h: torch.mean(h, dim=[-2, -1]),
    "x.mean((2, 3), keepdim=True)": lambda h: h.mean((2, 3), keepdim=True).flatten(1),
    "F.adaptive_avg_pool2d(x, 1)": lambda h: torch.nn.functional.adaptive_avg_pool2d(h, 1).flatten(1),
}


class FunctionalPoolResidual(ResidualPool):
    """ResidualPool with its global pooling computed in ``forward`` rather than by a pooling module."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form

    def forward(self, x):
        x = torch.relu(self.stem(x))
        h = self.relu(self.conv2(torch.relu(self.conv1(x))) + self.shortcut(x))
        return self.fc(_FUNCTIONAL_POOLS[self.form](h))


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("form", list(_FUNCTIONAL_POOLS))
def test_a_global_pooling_the_forward_computes_lets_the_residual_add_run_as_qlinearadd(
    tmp_path, form, exporter
):
    """A residual block's output pooled by ``x.mean((2, 3))`` (a hand-written ResNet head) or
    ``F.adaptive_avg_pool2d`` kept the Add, ReLU and pooling float between a DQ and a Q where
    ``nn.AdaptiveAvgPool2d`` ran them as QLinearAdd and QLinearGlobalAveragePool: the operation, not the
    module class, is what decides."""
    shape = (2, 3, 8, 8)
    m = _quantized(FunctionalPoolResidual(form), shape, example=True)
    placement = m.quantcli_report.placement
    assert placement.pool_inputs == {} and placement.activation_quantized == ["activation_quantizer"]
    assert m.activation_quantizer.desc.unsigned  # after the ReLU
    path = tmp_path / "m.onnx"
    export_onnx(m, _batches(shape, 1, seed=9)[0], path, exporter=exporter)
    k = _kernels(path)
    assert k["QLinearAdd"] == 1 and k["QLinearGlobalAveragePool"] == 1, k
    assert k["Add"] == 0 and k["GlobalAveragePool"] == 0 and k["ReduceMean"] == 0 and k["Relu"] == 0, k
    assert inspect_fusion(path).unfused == []
    if exporter == "torchscript":
        assert_exact(m, path, shape)


def test_a_mean_over_other_axes_is_no_pooling(tmp_path):
    """A mean over the channels, or over a 3-D tensor's tokens, is left as it was: no quantizer."""

    class Means(ResidualPool):
        def forward(self, x):
            x = torch.relu(self.stem(x))
            h = self.relu(self.conv2(torch.relu(self.conv1(x))) + x)
            return self.fc(h.mean(1).flatten(1)[:, :8] + h.flatten(2).mean(2))

    m = _quantized(Means(), (2, 3, 8, 8), example=True)
    assert m.quantcli_report.placement.activation_quantized == []


class Swish(nn.Module):
    """Swish as EfficientNet-PyTorch exports it: ``x * sigmoid(x)``, a module of the user's own."""

    def forward(self, x):
        return x * torch.sigmoid(x)


class SwishSE(nn.Module):
    """SiLU three ways (a Swish module called twice, ``nn.SiLU``, ``F.silu``), a squeeze-excitation gate
    ``sigmoid(s) * x`` after ``F.adaptive_avg_pool2d(x, 1)``, and a global pooling module before the
    classifier: 5 sigmoids, 5 multiplications, 2 global poolings between quantized layers."""

    def __init__(self):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.se_reduce, self.se_expand = nn.Conv2d(8, 4, 1), nn.Conv2d(4, 8, 1)
        self.proj = nn.Conv2d(8, 8, 1)
        self.swish, self.silu, self.pool = Swish(), nn.SiLU(), nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = self.swish(self.bn(self.stem(x)))
        x = self.silu(self.dw(x))
        s = self.se_expand(
            torch.nn.functional.silu(self.se_reduce(torch.nn.functional.adaptive_avg_pool2d(x, 1)))
        )
        x = self.swish(self.proj(torch.sigmoid(s) * x))
        return self.fc(torch.flatten(self.pool(x), 1))


def _quantized_on(model, shape, config=None):
    """Quantized with the structure recorded on an example batch (as calibrate does), then calibrated."""
    torch.manual_seed(0)
    m = quantize_model(_with_stats(model), config, example=_batches(shape, 1, seed=5)[0])
    calibrate(m, _batches(shape), "max", device="cpu")
    return m


def test_sigmoid_swish_and_global_pooling_run_on_codes(tmp_path):
    """Issue 35: the Swish/SiLU, the squeeze-excitation gate and both global poolings run as QLinearSigmoid,
    QLinearMul and QLinearGlobalAveragePool (as in onnxruntime's own quantize_static graph), where they ran in
    float between DQ/Q pairs; the graph stays exact against the fake-quant model, quantizer by quantizer."""
    shape = (2, 3, 8, 8)
    torch.manual_seed(0)
    float_model = _with_stats(SwishSE())
    batch = _batches(shape, 1, seed=11)[0]
    with torch.inference_mode():
        want_float = float_model(**batch)
    torch.manual_seed(0)
    m = _quantized_on(SwishSE(), shape)
    p = m.quantcli_report.placement
    assert p.pool_inputs == {"pool": False}
    # the five sigmoids' outputs (uint8: [0, 1]; a SiLU's inside it), and the SiLU output that both the
    # functional pooling and the gate read (one quantizer each, calibrated on the same values: one shared Q)
    acts = {n: quantizers(m)[n] for n in p.activation_quantized}
    assert len(acts) == 7, sorted(acts)
    assert sum(q.desc.unsigned for q in acts.values()) == 5, sorted(acts)
    path = _export(m, shape, tmp_path)
    k = _kernels(path)
    assert k["QLinearSigmoid"] == 5 and k["QLinearMul"] == 5 and k["QLinearGlobalAveragePool"] == 2, k
    assert k["Sigmoid"] == k["Mul"] == k["GlobalAveragePool"] == 0, k
    assert k["QLinearConv"] == 5 and k["QGemm"] == 1, k
    assert inspect_fusion(path).unfused == []
    assert_exact(m, path, shape)
    # quantizers off: the float model's output
    for q in quantizers(m).values():
        q.set_mode("disabled")
    with torch.inference_mode():
        assert torch.allclose(m(**batch), want_float, rtol=0, atol=1e-5)


def test_a_layer_kept_float_takes_the_activation_chains_around_it_float_too(tmp_path):
    """Latency placement keeps ``dw`` float: the chains on codes it bounds (the Swish before it; its SiLU,
    the squeeze-excitation pooling and gate after it) would run in float between Q/DQ pairs that serve no
    integer kernel, so their quantizers go; the chains between quantized layers only (the F.silu inside the
    squeeze-excitation, the last Swish and the pooling before the classifier) stay on codes."""
    from quantcli.calibration import latency_placement as lp

    shape = (2, 3, 8, 8)
    m = _quantized_on(SwishSE(), shape)
    groups = m.quantcli_report.placement.activation_groups
    assert len(groups) == 4 and all(g["layers"] for g in groups), groups
    qs = quantizers(m)
    dw = [n for n in qs if n.startswith("dw.")]
    decisions = [lp.LayerDecision("dw", "QLinearConv", 1.5, lp.FLOAT, "slower", dw)] + [
        lp.LayerDecision(layer, "QLinearConv", 0.5, lp.QUANTIZED, "faster")
        for layer in ("stem", "se_reduce", "se_expand", "proj", "fc")
    ]
    off = lp.apply(m, lp.LatencyPlacement("auto", True, "test", decisions))
    # the model's own quantizers in the order its forward runs them: the pooling's x, F.silu's sigmoid, the
    # gate's sigmoid and x
    chains = {"swish.activation_quantizer", "silu.activation_quantizer"} | {
        f"activation_quantizer{k}" for k in ("", "_2", "_3")
    }
    assert set(off) == set(dw) | chains, sorted(off)
    assert qs["activation_quantizer_1"].enabled and qs["swish.activation_quantizer_1"].enabled
    assert qs["pool.input_quantizer"].enabled
    path = _export(m, shape, tmp_path)
    k = _kernels(path)
    assert k["QLinearSigmoid"] == k["QLinearMul"] == 2 and k["QLinearGlobalAveragePool"] == 1, k
    assert_exact(m, path, shape)


def test_a_sigmoid_feeding_a_float_op_stays_float(tmp_path):
    """A multiplication whose output reaches a float op (the graph output) is not worth a Q: it, and the
    sigmoid that only it reads, stay float."""

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x):
            x = self.conv(x)
            return x * torch.sigmoid(x)

    m = _quantized_on(Head(), (2, 3, 8, 8))
    assert m.quantcli_report.placement.activation_quantized == []


def test_tensorrt_places_nothing_around_sigmoids(tmp_path):
    """The tensorrt target is unchanged: only the layers' inputs and weights are quantized."""
    m = _quantized_on(SwishSE(), (2, 3, 8, 8), {"target": "tensorrt"})
    names = set(quantizers(m))
    assert (
        not any("activation" in n for n in names) and m.quantcli_report.placement.activation_quantized == []
    )
    assert all(n.endswith(("input_quantizer", "weight_quantizer")) for n in names), sorted(names)
    assert type(m.pool) is nn.AdaptiveAvgPool2d


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_global_pooling_of_a_1x1_map_is_removed_and_the_classifier_reads_the_adds_codes(tmp_path, exporter):
    """A 1x1 map (a small image through the network): the pooling is the identity, so the export drops it,
    and onnxruntime runs QLinearAdd straight into QGemm (the DQ -> Flatten -> Q between them has one scale
    and drops out). Kept, its QLinearGlobalAveragePool cost 18% of the zoo's mobilenet_v2. Same codes."""
    shape = (2, 3, 1, 1)
    m = _quantized(ResidualPool(projection=True), shape)
    assert m.quantcli_report.placement.pool_inputs == {"pool": True}
    path = tmp_path / "m.onnx"
    export_onnx(m, _batches(shape, 1, seed=9)[0], path, exporter=exporter)
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert "GlobalAveragePool" not in ops and "ReduceMean" not in ops, ops
    k = _kernels(path)
    assert k["QLinearAdd"] == 1 and k["QGemm"] == 1, k
    assert k["QLinearGlobalAveragePool"] == 0 and k["DequantizeLinear"] == 0 and k["QuantizeLinear"] == 1, k
    assert inspect_fusion(path).unfused == []
    assert_exact(m, path, shape)
    batch = _batches(shape, 1, seed=9)[0]
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {k: v.numpy() for k, v in batch.items()})[0]
    np.testing.assert_allclose(got, m(**batch).detach().numpy(), rtol=1e-5, atol=1e-5)


def test_pooling_feeding_a_float_op_gets_no_quantizer(tmp_path):
    """Control: with a LayerNorm between the pooling and the classifier, a Q on the pooling's input would buy
    nothing (the Add's output would be dequantized for the float LayerNorm path anyway): none is placed."""
    shape = (2, 3, 8, 8)
    m = _quantized(ResidualPool(norm=True), shape)
    assert m.quantcli_report.placement.pool_inputs == {}
    assert not hasattr(m.pool, "input_quantizer")
    k = _kernels(_export(m, shape, tmp_path))
    assert k["QLinearAdd"] == 0 and k["GlobalAveragePool"] == 1, k


class ConvPoolMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(4, 8, 3, padding=1), nn.BatchNorm1d(8), nn.ReLU(), nn.MaxPool1d(2)
        )
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.features(x).mean(-1))


def test_conv_relu_pool_before_a_float_op_quantizes_after_the_pool(tmp_path):
    shape = (4, 4, 16)
    m = _quantized(ConvPoolMean(), shape)
    # the mean reads the Conv's output: its output quantizer goes after ReLU and MaxPool, on the uint8 grid
    assert m.quantcli_report.placement.output_after == {"features.0": ("features.3", True)}
    assert m.features[0].output_quantizer.desc.unsigned
    path = _export(m, shape, tmp_path)
    ops = [n.op_type for n in optimized_graph(path).graph.node]
    assert "Relu" not in ops and "QLinearConv" in ops and "MaxPool" not in ops  # the pool runs on the codes
    assert ops.index("DequantizeLinear") > ops.index("QLinearConv")
    assert_exact(m, path, shape)
    # a deep copy quantizes with its own quantizer (the float reference disables the copy's quantizers)
    import copy

    f = copy.deepcopy(m)
    for q in quantizers(f).values():
        q.set_mode("disabled")
    x = _batches(shape, 1, seed=4)[0]["x"]
    with torch.inference_mode():
        assert torch.equal(
            f.features(x),
            f.features[3](
                f.features[2](
                    f.features[1](
                        torch.nn.functional.conv1d(x, f.features[0].weight, f.features[0].bias, padding=1)
                    )
                )
            ),
        )
        assert not torch.equal(m.features(x), f.features(x))


class ConcatHead(nn.Module):
    """Two Linear -> ReLU branches and a float feature concatenated before the head (the pattern of the second
    zoo's two_inputs and DLRM). ``signed``: the float feature can be negative (DLRM's embedding bags), so the
    head's input grid has a zero point above 0."""

    def __init__(self, signed: bool = False):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(12, 8), nn.Linear(12, 6), nn.Linear(8 + 6 + 4, 3)
        self.signed = signed

    def forward(self, x):
        extra = x[:, :4] * 3.0 if self.signed else torch.abs(x[:, :4])
        return self.head(torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x)), extra], 1))


def _concat_copies(graph: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The Q copies the export put in front of Concats."""
    concat_inputs = {x for n in graph.graph.node if n.op_type == "Concat" for x in n.input}
    return [
        n
        for n in graph.graph.node
        if n.op_type == "DequantizeLinear" and PROPAGATED_MARK in n.name and n.output[0] in concat_inputs
    ]


def test_linear_relu_concat_fuses_and_the_concat_runs_on_one_grid(tmp_path):
    """The head's input quantizer (after the Concat) is copied onto each Concat input, as onnxruntime's
    quantize_static quantizes every Concat input: a and b then have a Q after their Relu and fuse into QGemm
    (the Relu absorbed: the grid is >= 0, zero point 0), the Concat runs as QLinearConcat on codes of one
    scale. Before, both ran as float FusedGemm (Gemm + Relu) and the Concat in float."""
    shape = (6, 12)
    m = _quantized(ConcatHead(), shape)
    path = _export(m, shape, tmp_path)
    graph = onnx.load(str(path))
    copies = _concat_copies(graph)
    assert len(copies) == 3
    k = _kernels(path)
    assert k["QGemm"] == 3 and k["QLinearConcat"] == 1, k
    assert k["Gemm"] == k["FusedGemm"] == k["Relu"] == k["Concat"] == 0, k
    assert inspect_fusion(path).unfused == []
    # QLinearConcat of one grid: every input's scale and zero point is the output's (a copy of codes)
    opt = optimized_graph(path)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in opt.graph.initializer}
    (qc,) = [n for n in opt.graph.node if n.op_type == "QLinearConcat"]
    out_grid = (inits[qc.input[0]].item(), inits[qc.input[1]].item())
    in_grids = [
        (inits[qc.input[i]].item(), inits[qc.input[i + 1]].item()) for i in range(3, len(qc.input), 3)
    ]
    assert in_grids == [out_grid] * 3 and out_grid[1] == 0
    assert_exact(m, path, shape)
    # the Concat of the copies' codes is the head's input codes, element for element (optimizations off)
    head_dq = next(d for d, q in quantizer_map(graph).items() if q == "head.input_quantizer")
    for name in [c.output[0] for c in copies] + [head_dq]:
        graph.graph.output.append(onnx.helper.make_tensor_value_info(name, T.FLOAT, None))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(graph.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = _batches(shape, 1, seed=5)[0]["x"].numpy()
    outs = dict(zip([o.name for o in graph.graph.output], sess.run(None, {"x": x})))
    (concat,) = [n for n in graph.graph.node if n.op_type == "Concat"]
    assert np.array_equal(outs[head_dq], np.concatenate([outs[i] for i in concat.input], axis=1))


class SignedConcat(nn.Module):
    """DLRM's pattern: a bottom MLP (ReLU modules) concatenated with a feature that can be negative (its
    embedding bags) before the top layer; ``three_d``: on 3-D inputs (the Linear is a MatMul)."""

    def __init__(self, three_d: bool = False):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU())
        self.top = nn.Linear(8 + 4, 3)
        self.three_d = three_d

    def forward(self, x):
        if self.three_d:
            x = x.unsqueeze(1)
        return self.top(torch.cat([self.bottom(x), x[..., :4] * 3.0], -1))


def test_linear_relu_into_a_signed_concat_gets_an_unsigned_output_quantizer(tmp_path):
    """The top layer's input grid has a zero point above 0 (the concatenated feature is negative too), so a
    copy of its Q after bottom.2's Relu would not let onnxruntime absorb the Relu (Gemm + Relu stayed a float
    FusedGemm). bottom.2 gets an output quantizer of its own after the ReLU module, on the uint8 grid, as
    quantize_static quantizes a Gemm -> Relu output: QGemm. The Concat's other input is no layer's output,
    so the export copies no Q onto it (nothing more would fuse): the Concat reads a DQ and that float
    feature, and the top layer's Q stays after it."""
    shape = (6, 12)
    m = _quantized(SignedConcat(), shape, example=True)
    p = m.quantcli_report.placement
    assert p.output_quantized == ["bottom.2"] and p.output_after == {"bottom.2": ("bottom.3", True)}
    assert m.bottom[2].output_quantizer.desc.unsigned and not m.top.input_quantizer.desc.unsigned
    path = _export(m, shape, tmp_path)
    assert _concat_copies(onnx.load(str(path))) == []
    k = _kernels(path)
    assert k["QGemm"] == 3 and k["Concat"] == 1, k
    assert k["Gemm"] == k["FusedGemm"] == k["Relu"] == k["QLinearConcat"] == 0, k
    assert inspect_fusion(path).unfused == []
    assert_exact(m, path, shape)


class ResidualBlock(nn.Module):
    """``h + relu(fc(h))``: the ReLU feeds the residual Add alone, not a Q."""

    def __init__(self, relu_module: bool):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.act = nn.ReLU() if relu_module else None

    def forward(self, h):
        return h + (self.act(self.fc(h)) if self.act is not None else torch.relu(self.fc(h)))


class ResidualMLP(nn.Module):
    def __init__(self, relu_module: bool):
        super().__init__()
        self.inp = nn.Linear(12, 32)
        self.blocks = nn.ModuleList(ResidualBlock(relu_module) for _ in range(2))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.inp(x))  # read by blocks.0.fc and by the first Add: a Gemm that fuses on its own
        for block in self.blocks:
            h = block(h)
        return self.head(h)


@pytest.mark.parametrize("relu_module", [True, False], ids=["nn.ReLU", "torch.relu"])
def test_linear_relu_into_a_residual_add_gets_an_output_quantizer(tmp_path, relu_module):
    """Without a Q after the ReLU, onnxruntime ran each block's Gemm + Relu as one float FusedGemm between its
    Q/DQ (and latency placement kept the blocks float); with an output quantizer (after a ReLU module:
    unsigned, the ReLU absorbed) each block runs as QGemm, as in quantize_static's graphs."""
    shape = (6, 12)
    m = _quantized(ResidualMLP(relu_module), shape, example=True)
    p = m.quantcli_report.placement
    assert p.output_quantized == ["blocks.0.fc", "blocks.1.fc"]
    if relu_module:  # after the ReLU module: unsigned; after torch.relu no module to hook: after the Gemm
        assert p.output_after == {
            "blocks.0.fc": ("blocks.0.act", True),
            "blocks.1.fc": ("blocks.1.act", True),
        }
    path = _export(m, shape, tmp_path)
    k = _kernels(path)
    assert k["QGemm"] == 4 and k["FusedGemm"] == k["Gemm"] == 0, k
    assert inspect_fusion(path).unfused == []
    assert_exact(m, path, shape)


def test_a_checkpoint_without_a_quantizer_this_version_places_loads_it_off(tmp_path):
    """A checkpoint written before the residual rule above has no blocks.*.fc.output_quantizer: loading it
    used to leave those quantizers on and uncalibrated, so export refused a file that exported before."""
    from quantcli.inputs.checkpoint import save_calibrated
    from quantcli.inputs.loading import parse_spec

    (tmp_path / "res.py").write_text(
        "from tests.test_placement import ResidualMLP\n\ndef make():\n    return ResidualMLP(True)\n"
    )
    shape = (6, 12)
    m = _quantized(ResidualMLP(True), shape, example=True)
    ck = tmp_path / "old.calib.pt"
    save_calibrated(ck, m, parse_spec(f"{tmp_path / 'res.py'}:make"), _batches(shape, 1)[0])
    data = torch.load(ck, weights_only=False)
    for name in [n for n in data["quantizers"] if n.endswith("fc.output_quantizer")]:
        del data["quantizers"][name]
        data["state_dict"] = {k: v for k, v in data["state_dict"].items() if not k.startswith(name + ".")}
    torch.save(data, ck)
    loaded = load_calibrated(ck, trust_code=True)
    assert not loaded.model.blocks[0].fc.output_quantizer.enabled
    r = cli("export", ck, "--onnx", tmp_path / "old.onnx", "--trust-code")
    assert r.exit_code == 0, r.output


def test_a_3d_linear_before_a_signed_concat_gets_no_output_quantizer(tmp_path):
    """Control: on 3-D inputs the Linear is a MatMul, which onnxruntime fuses without a Q on its output."""
    m = _quantized(SignedConcat(three_d=True), (6, 12), example=True)
    assert m.quantcli_report.placement.output_quantized == []
    assert not hasattr(m.bottom[2], "output_quantizer")


class ReluConcat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(12, 8), nn.Linear(12, 6), nn.Linear(14, 3)

    def forward(self, x):
        return self.head(torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], 1))


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "fx"])
def test_a_concat_of_relu_outputs_is_quantized_unsigned(recorded):
    """A Concat of tensors that are >= 0 by construction is >= 0: the next layer's input is on the uint8 grid
    with zero point 0, so the Q copied onto the Concat's inputs lets onnxruntime absorb both Relus."""
    shape = (6, 12)
    m = _quantized(ReluConcat(), shape, example=recorded)
    assert "head" in m.quantcli_report.placement.unsigned_inputs
    assert m.head.input_quantizer.desc.unsigned


def _activation_grid(q) -> tuple[np.float32, int]:
    """(scale, uint8 zero point) of an 8-bit activation quantizer, by the formulas in numpy: symmetric int8
    codes are stored as uint8 + 128 with scale amax / 127; an asymmetric grid (the onnxruntime target's
    default for signed activations) has scale (max - min) / 255 and zero point round(-min / scale)."""
    hi = np.float32(q.amax.item())
    if not q.desc.asymmetric:
        return hi / np.float32(127), 128
    lo = np.float32(min(q.amin.item(), 0.0))
    scale = (hi - lo) / np.float32(255)
    return scale, int(np.round(-lo / scale))


def test_linear_with_bias_is_qgemm_with_an_int32_bias(tmp_path):
    shape = (6, 12)
    m = _quantized(Mlp(), shape)
    path = _export(m, shape, tmp_path)
    assert _kernels(path)["QGemm"] == 2
    graph = onnx.load(str(path))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in graph.graph.initializer}
    gemm = next(n for n in graph.graph.node if n.op_type == "Gemm" and "fc1" in n.name)
    bias_dq = next(n for n in graph.graph.node if n.output[0] == gemm.input[2])
    codes, scale = inits[bias_dq.input[0]], inits[bias_dq.input[1]]
    assert codes.dtype == np.int32
    # independent: x_scale * w_scale per output channel, numpy's round-half-even of bias / scale
    sx = _activation_grid(m.fc1.input_quantizer)[0]
    bound = np.float32(2 ** (m.fc1.weight_quantizer.desc.num_bits - 1) - 1)  # 127, or 63 on the 7-bit grid
    sw = m.fc1.weight_quantizer.amax.numpy().reshape(-1).astype(np.float32) / bound
    want_scale = (sx * sw).astype(np.float32)
    assert np.array_equal(scale, want_scale)
    assert np.array_equal(codes, np.round(m.fc1.bias.detach().numpy() / want_scale).astype(np.int32))
    # the fake-quant layer adds exactly that bias
    x = _batches(shape, 1, seed=5)[0]["x"]
    with torch.inference_mode():
        xq = m.fc1.input_quantizer(x)
        wq = m.fc1.weight_quantizer(m.fc1.weight)
        want = xq @ wq.T + torch.from_numpy(codes.astype(np.float32) * want_scale)
        assert torch.equal(m.fc1(x), want)
    assert_exact(m, path, shape)


def test_qkv_share_one_quantizelinear_and_matmul_fuses(tmp_path):
    shape = (2, 5, 16)
    m = _quantized(Qkv(), shape)
    path = _export(m, shape, tmp_path)
    graph = onnx.load(str(path))
    qs = [n for n in graph.graph.node if n.op_type == "QuantizeLinear"]
    # one Q of the LayerNorm output; three DequantizeLinear, one per projection's quantizer
    assert len(qs) == 1
    assert sorted(quantizer_map(graph).values()).count("q.input_quantizer") == 1
    zp = {t.name: t for t in graph.graph.initializer}[qs[0].input[2]]
    assert m.q.input_quantizer.desc.asymmetric  # the onnxruntime target's grid for a LayerNorm output
    assert (
        zp.data_type == T.UINT8 and onnx.numpy_helper.to_array(zp) == _activation_grid(m.q.input_quantizer)[1]
    )
    k = _kernels(path)
    assert k["MatMulIntegerToFloat"] == 3 and inspect_fusion(path).unfused == []
    assert_exact(m, path, shape)


def test_untraceable_model_keeps_the_per_layer_placement(tmp_path):
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            h = torch.relu(self.a(x))
            if h.sum() > 0:  # data-dependent control flow: torch.fx cannot trace it
                h = h * 2
            return self.b(h)

    m = quantize_model(Branchy().eval(), "int8")
    p = m.quantcli_report.placement
    assert not p.analysed and "torch.fx" in p.note and p.unsigned_inputs == []
    assert not m.b.input_quantizer.desc.unsigned


# ------------------------------------------------------------------------------------------- tensorrt


def test_tensorrt_quantizes_the_skip_input_and_no_outputs(tmp_path):
    from sample_models.structured import resnet_batches, resnet_cnn

    m = quantize_model(resnet_cnn(), {"target": "tensorrt"})
    p = m.quantcli_report.placement
    assert p.residual_quantized == [f"layer{i}.{j}.residual_quantizer" for i in (1, 2) for j in (0, 1)]
    assert not any(hasattr(mod, "output_quantizer") for mod in m.modules())
    assert not any(q.desc.unsigned for q in quantizers(m).values())  # TensorRT's int8 is symmetric, signed
    calibrate(m, resnet_batches(64, 32), "max", device="cpu")
    path = tmp_path / "trt.onnx"
    export_onnx(m, resnet_batches(8, 8)[0], path)
    g = onnx.load(str(path)).graph
    producers = {o: n for n in g.node for o in n.output}
    qmap = quantizer_map(onnx.load(str(path)))
    adds = [n for n in g.node if n.op_type == "Add"]
    assert len(adds) == 4
    for add in adds:  # one operand from a Conv (through BatchNormalization), the other a DequantizeLinear
        kinds = sorted(producers[i].op_type for i in add.input)
        assert kinds == ["BatchNormalization", "DequantizeLinear"] or kinds == ["Conv", "DequantizeLinear"], (
            kinds
        )
        dq = next(producers[i] for i in add.input if producers[i].op_type == "DequantizeLinear")
        assert qmap[dq.output[0]].endswith("residual_quantizer")
    for conv in (n for n in g.node if n.op_type == "Conv"):  # no Q on a Conv output, a DQ on both inputs
        assert all(producers[i].op_type == "DequantizeLinear" for i in conv.input[:2])
    for n in g.node:  # MaxPool left to TensorRT: it reads float, no Q/DQ copies around it
        if n.op_type == "MaxPool":
            assert producers[n.input[0]].op_type != "DequantizeLinear"
    zps = {
        t.data_type
        for t in g.initializer
        if any(t.name == n.input[2] for n in g.node if n.op_type in ("QuantizeLinear", "DequantizeLinear"))
    }
    assert zps == {T.INT8}  # no uint8 activations and no int32 biases for TensorRT
    # the inserted quantizers survive a checkpoint round trip and the graph stays exact
    got, want = onnx_and_torch(path, m, resnet_batches(8, 8, split="eval")[0])
    # exact but for codes a float rounding flips (onnxruntime's float Conv adds in another order than torch's:
    # on an AVX2 CPU one code of one sample flips, and the flip travels to that sample's logits); a missing or
    # misplaced quantizer moves every sample by about a quantization error
    close = np.abs(got - want) <= 1e-4
    assert close.all(axis=1).mean() >= 0.75 and np.abs(got - want).max() < 0.01 * np.abs(want).max()


# ------------------------------------------------------------------------------------------- CLI


def test_cli_target_is_stored_exported_and_shown(tmp_path):
    ck = tmp_path / "trt.calib.pt"
    r = cli(
        "calibrate",
        "sample_models.structured:resnet_cnn",
        "--data",
        _npz(tmp_path),
        "--target",
        "tensorrt",
        "--out",
        ck,
        "--json",
    )
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["target"] == "tensorrt" and len(info["placement"]["residual_quantized"]) == 4
    loaded = load_calibrated(ck)
    assert loaded.config.target == "tensorrt"
    assert sum(n.endswith("residual_quantizer") for n in loaded.quantizer_info) == 4
    assert all(quantizers(loaded.model)[n].amax is not None for n in loaded.quantizer_info)
    out = tmp_path / "trt.onnx"
    r = cli("export", ck, "--onnx", out, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["target"] == "tensorrt"
    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert meta["quantcli.target"] == "tensorrt"
    r = cli("inspect", ck, "--json")
    assert json.loads(r.stdout)["target"] == "tensorrt"
    r = cli("verify", out, "--reference", ck, "--data", _npz(tmp_path), "--json")
    assert r.exit_code == 0, r.output


def test_cli_default_target_is_onnxruntime_and_fully_fused(calibrated, tmp_path):
    ck = calibrated("digits_cnn", "int8")
    assert load_calibrated(ck).config.target == "onnxruntime"
    r = cli("export", ck, "--onnx", tmp_path / "d.onnx", "--json")
    info = json.loads(r.stdout)
    assert info["target"] == "onnxruntime" and info["unfused_layers"] == 0 and info["quantized_layers"] == 4


def test_cli_bad_target(tmp_path):
    assert_clean_error(
        cli("calibrate", "digits_cnn", "--target", "coreml", "--out", tmp_path / "x.pt"),
        "unknown target",
        "onnxruntime, tensorrt",
    )
    assert not (tmp_path / "x.pt").exists()
    cfg = tmp_path / "c.yaml"
    cfg.write_text("target: tflite\n")
    assert_clean_error(
        cli("calibrate", "digits_cnn", "--config", cfg, "--out", tmp_path / "x.pt"), "unknown target"
    )


def _npz(tmp_path):
    path = tmp_path / "imgs.npz"
    if not path.exists():
        from sample_models.structured import resnet_batches

        np.savez(path, x=torch.cat([b["x"] for b in resnet_batches(64, 32)]).numpy())
    return path


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_a_checkpoint_from_before_targets_keeps_its_placement(tmp_path):
    # digits_cnn under the tensorrt target has the per-layer placement every checkpoint had before targets
    # existed
    ck = tmp_path / "t.calib.pt"
    assert cli("calibrate", "digits_cnn", "--target", "tensorrt", "--out", ck, "--json").exit_code == 0
    raw = torch.load(ck, weights_only=True)
    del raw["quant_config"]["target"], raw["quant_config"]["cpu"]  # neither existed then
    raw["quant_config"]["reduce_range"] = False
    old = tmp_path / "old.calib.pt"
    torch.save(raw, old)
    a, b = load_calibrated(ck), load_calibrated(old)
    assert b.config.target == "onnxruntime"
    assert not any(
        hasattr(m, "output_quantizer") or getattr(m, "int32_bias", False) for m in b.model.modules()
    )
    assert not any(q.desc.unsigned for q in quantizers(b.model).values())
    batch = b.evaluation_batches()[0]
    with torch.inference_mode():
        assert torch.equal(a.model(**batch), b.model(**batch))
    out = tmp_path / "old.onnx"
    assert cli("export", old, "--onnx", out).exit_code == 0
    assert cli("verify", out, "--reference", old).exit_code == 0


_SWISH_FILE = """
import torch
from torch import nn


class Swish(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.conv = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.swish, self.pool, self.fc = Swish(), nn.AdaptiveAvgPool2d(1), nn.Linear(8, 5)

    def forward(self, x):
        x = self.swish(self.conv(self.swish(self.stem(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


def make():
    torch.manual_seed(0)
    return Net().eval()
"""


def _calibrated_file(tmp_path, source: str) -> tuple[Path, dict]:
    """``source`` (a file with a factory ``make``) calibrated through the CLI on random 8x8 images
    (``d.npz``), ``--placement all``: the checkpoint's path and its contents."""
    spec = tmp_path / "net.py"
    spec.write_text(source)
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).standard_normal((16, 3, 8, 8)).astype(np.float32))
    ck = tmp_path / "new.calib.pt"
    r = cli("calibrate", f"{spec}:make", "--data", tmp_path / "d.npz", "--placement", "all", "--out", ck)
    assert r.exit_code == 0, r.output
    return ck, torch.load(ck, weights_only=True)


def _written_before(raw: dict, added: set[str], path: Path) -> Path:
    """``raw`` as the same calibration wrote it before the ``added`` quantizers existed, saved at ``path``."""
    raw["state_dict"] = {k: v for k, v in raw["state_dict"].items() if k.rsplit(".", 1)[0] not in added}
    raw["quantizers"] = {k: v for k, v in raw["quantizers"].items() if k not in added}
    torch.save(raw, path)
    return path


def _exported_kernels(path: Path, tmp_path) -> collections.Counter:
    """The kernels onnxruntime runs for checkpoint ``path`` exported by the CLI; verify passed on it."""
    out = path.with_suffix(".onnx")
    assert cli("export", path, "--onnx", out).exit_code == 0
    assert cli("verify", out, "--reference", path, "--data", tmp_path / "d.npz").exit_code == 0
    return _kernels(out)


def test_a_checkpoint_from_before_activation_quantizers_keeps_its_placement(tmp_path):
    """A checkpoint calibrated before sigmoids, multiplications and poolings were quantized (its state dict
    has none of those quantizers) loads, exports and verifies with the placement it was calibrated with."""
    ck, raw = _calibrated_file(tmp_path, _SWISH_FILE)
    added = set(raw["calibration"]["placement"]["activation_quantized"]) | {"pool.input_quantizer"}
    assert {"swish.activation_quantizer", "swish.activation_quantizer_1"} <= added
    # no such report keys either
    for key in ("activation_quantized", "activation_groups"):
        del raw["calibration"]["placement"][key]
    raw["calibration"]["placement"]["pool_inputs"] = {}
    old = _written_before(raw, added, tmp_path / "old.calib.pt")
    b = load_calibrated(old)
    assert (
        not any("activation" in n for n in quantizers(b.model)) and type(b.model.pool) is nn.AdaptiveAvgPool2d
    )
    assert _exported_kernels(ck, tmp_path)["QLinearSigmoid"] == 2
    assert _exported_kernels(old, tmp_path)["QLinearSigmoid"] == 0


_MEAN_HEAD_FILE = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv1, self.conv2 = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        return self.fc(torch.relu(self.conv2(torch.relu(self.conv1(x))) + x).mean((2, 3)))


def make():
    torch.manual_seed(0)
    return Net().eval()
"""


def test_a_checkpoint_from_before_functional_poolings_keeps_its_placement(tmp_path):
    """A checkpoint calibrated before ``x.mean((2, 3))`` was read as a global pooling (no quantizer on the
    residual Add's skip nor on the mean's operand, no ``functional_pools`` key) loads, exports and verifies
    with the placement it was calibrated with; the new one runs the Add as QLinearAdd."""
    ck, raw = _calibrated_file(tmp_path, _MEAN_HEAD_FILE)
    placement = raw["calibration"]["placement"]
    added = set(placement["activation_quantized"]) | set(placement["residual_quantized"])
    assert added == {"activation_quantizer", "residual_quantizer"} and placement["functional_pools"] is True
    del placement["functional_pools"]
    placement["activation_quantized"], placement["residual_quantized"] = [], []
    old = _written_before(raw, added, tmp_path / "old.calib.pt")
    assert not set(quantizers(load_calibrated(old).model)) & added
    assert _exported_kernels(ck, tmp_path)["QLinearAdd"] == 1
    assert _exported_kernels(old, tmp_path)["QLinearAdd"] == 0


class TwoReaders(nn.Module):
    """conv_a's output feeds a mean (float) and conv_b: conv_a gets an output quantizer, so conv_b reads a
    DequantizeLinear output whether or not it is quantized itself."""

    def __init__(self):
        super().__init__()
        self.conv_a = nn.Conv2d(3, 8, 3, padding=1)
        self.conv_b = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv_a(x)
        return self.conv_b(y).mean((2, 3)) + y.mean((1, 2, 3)).unsqueeze(1)


def test_a_float_layer_reading_a_quantized_tensor_is_not_a_quantized_layer(tmp_path):
    """A layer kept float (latency placement, --min-cosine) whose input is another layer's output Q runs as a
    float Conv after a DQ: inspect must not count it as a quantized layer onnxruntime failed to fuse."""
    from quantcli.nn.modes import keep_float

    shape = (2, 3, 8, 8)
    m = _quantized(TwoReaders(), shape)
    assert hasattr(m.conv_a, "output_quantizer")
    for q in (m.conv_b.input_quantizer, m.conv_b.weight_quantizer, m.conv_b.output_quantizer):
        keep_float(q)  # as latency placement does
    path = _export(m, shape, tmp_path)
    report = inspect_fusion(path)
    assert [lf.layer for lf in report.layers] == ["conv_a"] and report.unfused == []
    k = _kernels(path)  # conv_b: a float convolution reading conv_a's DQ
    assert k["QLinearConv"] == 1 and k["QLinearGlobalAveragePool"] == 0, k


class StemTwoReaders(nn.Module):
    """An Inception block's input: the stem's ReLU output read by a 1x1 Conv and by a MaxPool before
    another."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.b1 = nn.Conv2d(8, 4, 1)
        self.pool = nn.MaxPool2d(3, 1, 1)
        self.bp = nn.Conv2d(8, 4, 1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        h = torch.cat([torch.relu(self.b1(x)), torch.relu(self.bp(self.pool(x)))], 1)
        return self.fc(h.mean((2, 3)))


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_stem_read_by_a_conv_and_a_maxpool_keeps_one_quantizelinear_and_fuses(tmp_path, exporter):
    """The MaxPool's copy of bp's input quantizer (the same amax as b1's: a MaxPool keeps the max) was a
    second QuantizeLinear of one scale and zero point on the stem's output, and onnxruntime then ran the stem
    as a float FusedConv (an Inception stem). The copy now reads b1's Q; verify's replay still takes the
    MaxPool's DQ for a copy (it failed bp's quantizer by half a step when the Qs were merged after the
    fact)."""
    from quantcli.inputs.checkpoint import save_calibrated
    from quantcli.inputs.loading import parse_spec
    from quantcli.verify import verify_onnx

    shape = (4, 3, 8, 8)
    m = _quantized(StemTwoReaders(), shape)
    assert m.b1.input_quantizer.amax == m.bp.input_quantizer.amax
    path = tmp_path / "m.onnx"
    export_onnx(m, _batches(shape, 1, seed=9)[0], path, exporter=exporter)
    g = onnx.load(str(path)).graph
    relu = next(n for n in g.node if n.op_type == "Relu").output[0]
    assert [n.op_type for n in g.node if relu in n.input] == ["QuantizeLinear"]
    assert inspect_fusion(path).unfused == []
    assert _kernels(path)["QLinearConv"] == 3
    assert_exact(m, path, shape)
    (tmp_path / "net.py").write_text(
        f"import sys\nsys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
        "from tests.test_placement import StemTwoReaders\n"
        "def make():\n    return StemTwoReaders()\n"
    )
    ckpt = tmp_path / "m.calib.pt"
    batches = _batches(shape, 2, seed=13)
    save_calibrated(ckpt, m, parse_spec(f"{tmp_path / 'net.py'}:make"), batches[0])
    report = verify_onnx(path, load_calibrated(ckpt, trust_code=True), batches, provider="cpu")
    assert report.passed, [c for c in report.to_dict()["checks"] if not c["passed"]]


def _cbr(cin, cout, stride=1, relu=True):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU() if relu else nn.Identity(),
    )


class _Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1, self.c2 = _cbr(c, c), _cbr(c, c, relu=False)

    def forward(self, x):
        return F.relu(x + self.c2(self.c1(x)))


class _EncoderDecoder(nn.Module):
    """Two residual stages (the second after a strided conv), a decoder upsampling the second and
    concatenating the first: a U-Net's skip."""

    def __init__(self):
        super().__init__()
        self.stem = _cbr(3, 8)
        self.s1 = nn.Sequential(_Block(8), _Block(8))
        self.down = _cbr(8, 16, 2)
        self.s2 = nn.Sequential(_Block(16), _Block(16))
        self.dec = _cbr(24, 8)
        self.out = nn.Conv2d(8, 1, 3, padding=1)

    def forward(self, x):
        f1 = self.s1(self.stem(x))
        f2 = F.interpolate(self.s2(self.down(f1)), scale_factor=2, mode="bilinear", align_corners=False)
        return self.out(self.dec(torch.cat([f2, f1], 1)))


def test_an_encoder_stage_feeding_a_decoder_keeps_qlinearadd_before_its_last_block(tmp_path):
    """Each stage's last block feeds the decoder (torch.cat, F.interpolate), so its Add cannot run as
    QLinearAdd. Judged one Add at a time, that cost the block before it its QLinearAdd too (its output is the
    last block's skip, read in float), and so on up the stage: 0 of 4, where quantize_static fuses them. The
    skip operand of the last block is quantized now, for the Add before it to fuse (helper-45's depth model:
    0 -> 4 of 8)."""
    shape = (2, 3, 16, 16)
    m = _quantized(_EncoderDecoder(), shape, example=True)
    assert m.quantcli_report.placement.residual_quantized == [
        "s1.0.residual_quantizer",
        "s1.1.residual_quantizer",
        "s2.0.residual_quantizer",
        "s2.1.residual_quantizer",
    ]
    path = _export(m, shape, tmp_path)
    k = _kernels(path)
    assert k["QLinearAdd"] == 2 and k["Add"] == 2, k  # s1.0 and s2.0; s1.1 and s2.1 feed the decoder
    assert_exact(m, path, shape)
