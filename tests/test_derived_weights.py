"""A weight operand computed from the parameters in ``forward`` is a constant of the exported graph.

timm's ``StdConv2d`` (BiT, NFNet) standardises its weight with ``F.batch_norm(w, None, None, training=True)``
on every call. Traced as written, the graph repeated it on every run: TorchScript writes a
``BatchNormalization`` in training mode, which onnxruntime does not fold below opset 15, and the weights'
``QuantizeLinear`` then ran per run too, before a ``QLinearConv`` that could not prepack them (nf_resnet26:
5.9x the float model's latency).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch import nn

from exporters.onnx_export import export_onnx
from exporters.onnxruntime.fusion import optimized_graph
from quantcli.calibration.calibrate import calibrate
from quantcli.nn.config import QuantConfig
from quantcli.nn.derived_weights import constant_operands
from quantcli.nn.modes import keep_float
from quantcli.nn.replace import quantize_model
from quantcli.nn.tensor_quantizer import quantizers


def _standardised(w: torch.Tensor) -> torch.Tensor:
    """timm's StdConv2d weight: per output channel, zero mean and unit variance (biased), eps 1e-6."""
    return F.batch_norm(
        w.reshape(1, w.shape[0], -1), None, None, training=True, momentum=0.0, eps=1e-6
    ).reshape_as(w)


class StdConv2d(nn.Conv2d):
    def forward(self, x):
        return F.conv2d(x, _standardised(self.weight), self.bias, self.stride, self.padding)


class SharedStdConv(StdConv2d):
    """One standardised weight applied twice (to the map and to its mirror image)."""

    def forward(self, x):
        return super().forward(x) + super().forward(x.flip(3)).flip(3)


class SplitConv(nn.Conv2d):
    """Two convolutions of two halves of one weight: two derived operands, computed as written."""

    def forward(self, x):
        half = self.out_channels // 2
        a = F.conv2d(x, self.weight[:half] * 0.5, None, self.stride, self.padding)
        b = F.conv2d(x, self.weight[half:] * 0.5, None, self.stride, self.padding)
        return torch.cat([a, b], 1) + self.bias.view(1, -1, 1, 1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = StdConv2d(3, 16, 3, padding=1)
        self.c1 = StdConv2d(16, 32, 3, padding=1, stride=2)
        self.c2 = SharedStdConv(32, 32, 3, padding=1)
        self.split = SplitConv(32, 32, 1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.stem(x))
        x = F.relu(self.c1(x))
        x = F.relu(self.c2(x)) + x
        return self.fc(F.relu(self.split(x)).mean((2, 3)))


def _calibrated(target: str = "onnxruntime"):
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    quantize_model(model, QuantConfig(target=target), example={"x": x[:4]})
    calibrate(model, [{"x": x}], device="cpu")
    qs = quantizers(model)
    for name in ("stem.input_quantizer", "stem.weight_quantizer"):  # a layer placement kept float
        keep_float(qs[name])
    return model, x


def _shape(node, inits) -> tuple[int, ...] | None:
    return inits[node.input[0]].shape if node.input and node.input[0] in inits else None


def _graph_parts(path):
    g = onnx.load(str(path)).graph
    inits = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    producers = {o: n for n in g.node for o in n.output}
    return g, inits, producers


def test_only_weight_quantizers_whose_calls_take_one_computed_value_take_a_constant():
    model, x = _calibrated()
    with constant_operands(model, {"x": x[:4]}) as taken:
        # not split (two different operands) nor fc (its parameter, already an initializer)
        assert sorted(taken) == ["c1.weight_quantizer", "c2.weight_quantizer", "stem.weight_quantizer"]
        assert torch.equal(model.c2.weight_quantizer.constant_input, _standardised(model.c2.weight.detach()))
    assert all(q.constant_input is None for q in quantizers(model).values())


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_standardised_weights_are_stored_as_torch_computed_them(tmp_path, exporter):
    model, x = _calibrated()
    path = tmp_path / "m.onnx"
    export_onnx(model, {"x": x[:4]}, path, exporter=exporter)
    g, inits, producers = _graph_parts(path)
    assert "BatchNormalization" not in {n.op_type for n in g.node}  # nothing computes a weight per run
    for name in ("c1", "c2"):
        layer = getattr(model, name)
        ws = _standardised(layer.weight.detach())
        bound = 2 ** (layer.weight_quantizer.desc.num_bits - 1) - 1  # 7-bit weights where VNNI is not known
        scale = (layer.weight_quantizer.amax.detach().flatten() / bound).view(-1, 1, 1, 1)
        codes = torch.clamp(torch.round(ws / scale), -bound, bound).numpy()
        # the Convs whose weight has this layer's shape (node names differ between the exporters): c2's two
        convs = [
            n for n in g.node if n.op_type == "Conv" and n.input[1] in producers and n.input[1] not in inits
        ]
        dqs = [producers[n.input[1]] for n in convs if _shape(producers[n.input[1]], inits) == ws.shape]
        assert len(dqs) == (2 if name == "c2" else 1), name
        for dq in dqs:
            assert dq.op_type == "DequantizeLinear", name
            stored = inits[dq.input[0]]
            assert stored.dtype == np.int8 and np.array_equal(stored, codes), name
    # the float stem: its standardised weight as an initializer, torch's values bit for bit
    stem = next(n for n in g.node if n.op_type == "Conv" and n.input[0] == g.input[0].name)
    assert stem.input[1] in inits
    assert np.array_equal(inits[stem.input[1]], _standardised(model.stem.weight.detach()).numpy())
    # codes stored for c1, c2 (one weight applied twice), fc, and the two halves of split (sliced and scaled
    # by TorchScript's own constant folding: the two operands of one layer, kept apart; the outputs below
    # would differ with one of them taken for both)
    weight_dqs = [n for n in g.node if n.op_type == "DequantizeLinear" and len(_shape(n, inits) or ()) > 1]
    stored = sorted({n.input[0]: _shape(n, inits) for n in weight_dqs}.values())
    assert stored == [(10, 32), (16, 32, 1, 1), (16, 32, 1, 1), (32, 16, 3, 3), (32, 32, 3, 3)]
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        want = model(x).numpy()
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4)


def test_onnxruntime_runs_standardised_convs_on_prepacked_codes(tmp_path):
    model, x = _calibrated()
    path = tmp_path / "m.onnx"
    export_onnx(model, {"x": x[:4]}, path)
    opt = optimized_graph(path)
    inits = {i.name for i in opt.graph.initializer}
    qconvs = [n for n in opt.graph.node if n.op_type == "QLinearConv"]
    assert len(qconvs) >= 2
    assert all(n.input[3] in inits for n in qconvs)  # weight codes constant: prepacked once
    assert "BatchNormalization" not in {n.op_type for n in opt.graph.node}


class LegacyNormed(nn.Module):
    """Weights set by forward pre-hooks (torch.nn.utils.weight_norm and spectral_norm, the legacy forms): the
    layers are converted by class, their ``weight`` no parameter."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.utils.spectral_norm(nn.Conv2d(8, 32, 3, padding=1))
        # more than 8192 values: above the dynamo exporter's own constant folding limit
        self.c2 = nn.utils.weight_norm(nn.Conv2d(32, 32, 3, padding=1))
        self.fc = nn.utils.weight_norm(nn.Linear(32, 4))

    def forward(self, x):
        return self.fc(F.relu(self.c2(F.relu(self.c1(x)))).mean((2, 3)))


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_weights_set_by_pre_hooks_are_stored_as_codes(tmp_path, exporter):
    import warnings

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # weight_norm's deprecation
        model = LegacyNormed()
    model.train()
    with torch.no_grad():
        model(torch.randn(2, 8, 8, 8))  # a power iteration of spectral_norm's u and v
    model.eval()
    x = torch.randn(16, 8, 8, 8, generator=torch.Generator().manual_seed(1))
    quantize_model(model, QuantConfig(target="tensorrt"), example={"x": x[:4]})  # symmetric, every layer
    calibrate(model, [{"x": x}], device="cpu")
    path = tmp_path / "m.onnx"
    export_onnx(model, {"x": x[:4]}, path, exporter=exporter)
    g, inits, producers = _graph_parts(path)
    # every weight's codes are stored (int8) and nothing computes a weight: no norm, no power-iteration
    # product (the file held weight_orig, g and v in float, twice where the exporter folded a reshaped copy)
    weight_dqs = [n for n in g.node if n.op_type == "DequantizeLinear" and len(_shape(n, inits) or ()) > 1]
    assert sorted(_shape(n, inits) for n in weight_dqs) == [(4, 32), (32, 8, 3, 3), (32, 32, 3, 3)]
    assert all(inits[n.input[0]].dtype == np.int8 for n in weight_dqs)
    assert not {"ReduceL2", "Div", "MatMul", "LpNormalization"} & {n.op_type for n in g.node}
    assert max(a.size for a in inits.values() if a.dtype == np.float32) <= 32  # biases and scales only
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        want = model(x).numpy()
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
