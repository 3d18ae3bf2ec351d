"""Zero padding in front of a Conv (issue 25): the Conv's input quantizer runs before the padding, and the
exported padding is in the form onnxruntime folds into the Conv.

EfficientNet pads its stride-2 depthwise convolutions with ``nn.ZeroPad2d`` and convolves with
``padding="valid"``. Exported as ``Pad -> Q -> DQ -> Conv(auto_pad=VALID)``, onnxruntime kept each Pad as a
node of its own and, with TorchScript, a Pad whose amounts a ``Slice`` of step -1 computes (its constant
folding skips those). ``Q -> DQ -> Pad(constant amounts) -> Conv(pads=0)`` is what onnxruntime's
``pad_fusion.cc`` folds (before its QDQ fusions): one ``QLinearConv`` with the padding. The judge is
onnxruntime's own optimized graph (no Pad left where the padding is zeros) and verify's exact codes.
"""

import json
import textwrap

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from exporters.fold import explicit_pads, fold_pad_amounts, global_average_pools, unit_global_pools
from exporters.onnxruntime.fusion import optimized_graph
from quantcli import quantize_model
from quantcli.nn.tensor_quantizer import TensorQuantizer
from tests.helpers import cli, load_module, model_folder

PADDED = textwrap.dedent('''
    import torch
    from torch import nn


    class Padded(nn.Module):
        """EfficientNet's stride-2 pattern twice (ZeroPad2d, then a "valid" Conv), a ConstantPad2d(0) before a
        depthwise Conv, and two paddings that must stay where they are: one with value 1, one whose output
        two layers read."""

        def __init__(self):
            super().__init__()
            self.stem_pad = nn.ZeroPad2d((0, 1, 0, 1))
            self.stem = nn.Conv2d(3, 8, 3, stride=2, padding="valid")
            self.act = nn.ReLU()
            self.dw_pad = nn.ConstantPad2d(1, 0.0)
            self.dw = nn.Conv2d(8, 8, 3, groups=8)
            self.ones_pad = nn.ConstantPad2d(1, 1.0)
            self.ones = nn.Conv2d(8, 8, 3)
            self.shared_pad = nn.ZeroPad2d(1)
            self.left = nn.Conv2d(8, 4, 3)
            self.right = nn.Conv2d(8, 4, 3)

        def forward(self, x):
            x = self.act(self.stem(self.stem_pad(x)))
            x = self.act(self.dw(self.dw_pad(x)))
            x = self.act(self.ones(self.ones_pad(x)))
            p = self.shared_pad(x)
            return self.left(p) + self.right(p)


    def make():
        torch.manual_seed(0)
        return Padded().eval()
''')


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    return model_folder(tmp_path_factory.mktemp("padded"), PADDED, (32, 3, 17, 17))


def _module(folder):
    return load_module(folder / "model.py", "padded_model")


def _calibrate(folder, ck):
    spec, data = folder / "model.py:make", folder / "x.npy"
    return cli("calibrate", spec, "--data", data, "--placement", "all", "--out", ck)


def test_input_quantizer_moves_before_zero_padding_read_by_one_conv_only(padded):
    m = quantize_model(_module(padded).make(), "int8", example={"x": torch.randn(4, 3, 17, 17)})
    p = m.quantcli_report.placement
    assert p.input_before == {"stem": "stem_pad", "dw": "dw_pad"}
    # the stem's input is the raw image, the depthwise Conv's a ReLU's output through zero padding: >= 0
    assert "dw" in p.unsigned_inputs and "stem" not in p.unsigned_inputs
    # the quantizer is the Conv's own (same name, same amax), run by the padding module
    x = torch.randn(4, 3, 17, 17)
    seen = {}
    m.stem.input_quantizer.register_forward_pre_hook(lambda mod, a: seen.update(shape=a[0].shape))
    for q in m.modules():
        if isinstance(q, TensorQuantizer):
            q.mode = "disabled"  # uncalibrated: pass values through
    m(x)
    assert tuple(seen["shape"]) == (4, 3, 17, 17)  # before the padding (18 x 18 after it)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_padding_folds_into_qlinearconv_and_codes_stay_exact(padded, tmp_path, exporter):
    ck, path = tmp_path / "p.calib.pt", tmp_path / "p.onnx"
    r = _calibrate(padded, ck)
    assert r.exit_code == 0, r.stdout
    r = cli("export", ck, "--onnx", path, "--exporter", exporter)
    assert r.exit_code == 0, r.stdout
    graph = onnx.load(str(path)).graph
    pads = [n for n in graph.node if n.op_type == "Pad"]
    inits = {t.name for t in graph.initializer}
    # constant amounts (the dynamo path's onnxscript rewrite folds the two zero paddings itself)
    assert len(pads) == (4 if exporter == "torchscript" else 2) and all(n.input[1] in inits for n in pads)
    kernels = {
        x["layer"]: x["kernel"]
        for x in json.loads(cli("inspect", path, "--runtime", "onnxruntime", "--json").stdout)["layers"]
    }
    assert set(kernels.values()) == {"QLinearConv"}, kernels
    # onnxruntime folded the two zero paddings read by one Conv; the value-1 padding and the shared one stay
    optimized = [n.op_type for n in optimized_graph(path).graph.node]
    assert optimized.count("Pad") == 2, optimized
    v = cli("verify", path, "--reference", ck, "--data", padded / "x.npy", "--json")
    assert v.exit_code == 0, v.stdout
    checks = {c["name"]: c for c in json.loads(v.stdout)["checks"]}
    assert checks["fidelity.codes"]["passed"] and checks["fidelity.codes"]["value"] == 1.0


def test_control_without_the_move_the_padding_stays_a_node(padded, tmp_path, monkeypatch):
    """What the move buys, measured on onnxruntime's graph: without it the two zero paddings stay."""
    import quantcli.nn.placement as placement

    monkeypatch.setattr(placement, "_zero_pad_before", lambda *a: None)
    ck, path = tmp_path / "p.calib.pt", tmp_path / "p.onnx"
    r = _calibrate(padded, ck)
    assert r.exit_code == 0, r.stdout
    assert cli("export", ck, "--onnx", path).exit_code == 0
    optimized = [n.op_type for n in optimized_graph(path).graph.node]
    assert optimized.count("Pad") == 4, optimized


TF_PADDED = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from torch import nn


    class ConvLayer(nn.Module):
        """Hugging Face MobileNetV2's pattern: TensorFlow "same" padding computed from the input's shape in
        ``forward`` and applied with F.pad, then a Conv without padding, then ReLU6."""

        def __init__(self, cin, cout, k, stride=1, groups=1, act=True):
            super().__init__()
            self.convolution = nn.Conv2d(cin, cout, k, stride=stride, groups=groups)
            self.activation = nn.ReLU6() if act else nn.Identity()

        def forward(self, x):
            h, w = int(x.shape[-2]), int(x.shape[-1])
            k, s = self.convolution.kernel_size[0], self.convolution.stride[0]
            ph = max(k - s, 0) if h % s == 0 else max(k - h % s, 0)
            pw = max(k - s, 0) if w % s == 0 else max(k - w % s, 0)
            x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2), "constant", 0.0)
            return self.activation(self.convolution(x))


    class ReadsTwice(ConvLayer):
        """Its input is padded and read again: quantizing it for the Conv would change the rest."""

        def forward(self, x):
            return super().forward(x) + x.mean()


    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.expand = ConvLayer(c, 2 * c, 1)
            self.dw = ConvLayer(2 * c, 2 * c, 3, groups=2 * c)
            self.project = ConvLayer(2 * c, c, 1, act=False)

        def forward(self, x):
            return x + self.project(self.dw(self.expand(x)))


    class TfPadded(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = ConvLayer(3, 8, 3, stride=2)
            self.blocks = nn.Sequential(Block(8), Block(8))
            self.odd = ReadsTwice(8, 8, 3)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(torch.flatten(self.pool(self.blocks(self.odd(self.stem(x)))), 1))


    def make():
        torch.manual_seed(0)
        return TfPadded().eval()
''')


@pytest.fixture(scope="module")
def tf_padded(tmp_path_factory):
    return model_folder(tmp_path_factory.mktemp("tf_padded"), TF_PADDED, (32, 3, 16, 16))


def test_functional_same_padding_quantizes_the_layers_input_before_it(tf_padded, tmp_path):
    """Every ``F.pad`` + Conv module gets its Conv's input quantizer on its own input (a pre-hook), except
    the one that reads its input again; onnxruntime then runs every Conv as QLinearConv with the padding
    folded in, every residual Add as QLinearAdd, and verify finds the codes exact."""
    m = quantize_model(_module(tf_padded).make(), "int8", example={"x": torch.randn(2, 3, 16, 16)})
    p = m.quantcli_report.placement
    layers = ["stem"] + [f"blocks.{b}.{c}" for b in (0, 1) for c in ("expand", "dw", "project")]
    assert p.input_before == {f"{name}.convolution": name for name in layers}
    # the inputs after a ReLU6 (through the padding) are unsigned; no Conv whose output reaches only padded
    # Convs needs an output quantizer
    assert {"blocks.0.dw.convolution", "blocks.1.project.convolution"} <= set(p.unsigned_inputs)
    assert "blocks.0.expand.convolution" not in p.output_quantized
    assert p.pool_inputs == {"pool": False}  # the last Add's output: signed
    ck, path = tmp_path / "p.calib.pt", tmp_path / "p.onnx"
    assert _calibrate(tf_padded, ck).exit_code == 0
    for exporter in ("torchscript", "dynamo"):
        r = cli("export", ck, "--onnx", path, "--exporter", exporter)
        assert r.exit_code == 0, r.stdout
        optimized = [n.op_type for n in optimized_graph(path).graph.node]
        assert optimized.count("Pad") == 1, (exporter, optimized)  # ReadsTwice's
        # the two residual Adds run on codes; ReadsTwice's own Add of a mean stays float
        assert optimized.count("QLinearAdd") == 2 and optimized.count("Add") == 1, (exporter, optimized)
        assert optimized.count("QLinearGlobalAveragePool") == 1, (exporter, optimized)
        v = cli("verify", path, "--reference", ck, "--data", tf_padded / "x.npy", "--json")
        assert v.exit_code == 0, v.stdout
        checks = {c["name"]: c for c in json.loads(v.stdout)["checks"]}
        assert checks["fidelity.codes"]["value"] == 1.0, exporter


def test_method_auto_on_quantizers_before_a_functional_padding(tf_padded, tmp_path):
    """``--method auto`` runs each Conv again on its own (padded) input, quantized by the quantizer that runs
    before the padding: it crashed on Hugging Face's MobileNetV2 (a 3x3 kernel on an unpadded 2x2 map). Every
    moved quantizer gets a choice, and the export's codes are still exact."""
    ck, path = tmp_path / "auto.calib.pt", tmp_path / "auto.onnx"
    spec, data = tf_padded / "model.py:make", tf_padded / "x.npy"
    r = cli(
        "calibrate", spec, "--data", data, "--placement", "all", "--method", "auto", "--out", ck, "--json"
    )
    assert r.exit_code == 0, r.stdout
    auto = json.loads(r.stdout)["auto"]
    moved = [f"{n}.convolution.input_quantizer" for n in ("stem", "blocks.0.dw", "blocks.1.project")]
    for name in moved:
        assert len(set(auto[name]["errors"].values())) > 1, (name, auto[name])
    assert cli("export", ck, "--onnx", path).exit_code == 0
    v = cli("verify", path, "--reference", ck, "--data", data, "--json")
    assert v.exit_code == 0, v.stdout
    checks = {c["name"]: c for c in json.loads(v.stdout)["checks"]}
    assert checks["fidelity.codes"]["value"] == 1.0


# ------------------------------------------------------------------------------------------- graph passes


def _pad_model(pads_from_input: bool, dims=(1, 1, 4, 4), parity: bool = False) -> onnx.ModelProto:
    """Pad amounts as TorchScript writes ``F.pad(x, (0, 1, 2, 3))``: torch's order (last dim first, begin/end
    pairs) reversed by a Slice of step -1, then transposed into ONNX's order (all begins, then all ends).
    ``pads_from_input``: the amounts times the input's dimensions (``dims``, a name for a symbolic one);
    ``parity``: instead, ``F.pad(x, (0, W % 2))`` (the last dimension's end padded to an even size)."""
    torch_order = numpy_helper.from_array(np.array([[0, 1], [2, 3], [0, 0], [0, 0]], np.int64), "torch_pads")
    consts = [
        numpy_helper.from_array(np.array([-1], np.int64), "start"),
        numpy_helper.from_array(np.array([-(2**62)], np.int64), "end"),
        numpy_helper.from_array(np.array([0], np.int64), "axis"),
        numpy_helper.from_array(np.array([-1], np.int64), "step"),
        numpy_helper.from_array(np.array([-1], np.int64), "flat"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
    ]
    nodes = [
        helper.make_node("Slice", ["torch_pads", "start", "end", "axis", "step"], ["reversed"]),
        helper.make_node("Transpose", ["reversed"], ["onnx_order"], perm=[1, 0]),
        helper.make_node("Reshape", ["onnx_order", "flat"], ["amounts"]),
    ]
    if parity:
        consts += [
            numpy_helper.from_array(np.array([3], np.int64), "last"),
            numpy_helper.from_array(np.array(2, np.int64), "two"),
            numpy_helper.from_array(np.zeros(7, np.int64), "zeros7"),
        ]
        nodes = [
            helper.make_node("Shape", ["x"], ["shape"]),
            helper.make_node("Gather", ["shape", "last"], ["width"], axis=0),
            helper.make_node("Mod", ["width", "two"], ["odd"]),
            helper.make_node("Concat", ["zeros7", "odd"], ["pads"], axis=0),
        ]
    elif pads_from_input:  # amounts that depend on the input's shape
        nodes += [  # amounts * shape, shape twice over for the 8 amounts
            helper.make_node("Shape", ["x"], ["shape"]),
            helper.make_node("Concat", ["shape", "shape"], ["shapes"], axis=0),
            helper.make_node("Mul", ["amounts", "shapes"], ["pads"]),
        ]
    else:
        nodes.append(helper.make_node("Identity", ["amounts"], ["pads"]))
    if parity:  # (the torch-order amounts are not read)
        consts = [c for c in consts if c.name in ("zero", "last", "two", "zeros7")]
        torch_order = None
    nodes.append(helper.make_node("Pad", ["x", "pads", "zero"], ["y"], mode="constant"))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(dims))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [t for t in (torch_order, *consts) if t is not None],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def test_pad_amounts_computed_from_constants_become_an_initializer():
    model = _pad_model(pads_from_input=False)
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    before = _run(model, x)
    assert fold_pad_amounts(model) == 1
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    pad = next(n for n in model.graph.node if n.op_type == "Pad")
    # F.pad's (0, 1, 2, 3): W gets 0 before and 1 after, H 2 before and 3 after; ONNX: [begins..., ends...]
    assert inits[pad.input[1]].tolist() == [0, 0, 2, 0, 0, 0, 3, 1]
    assert [n.op_type for n in model.graph.node] == ["Pad"]  # the computation is gone
    np.testing.assert_array_equal(_run(model, x), before)
    assert before.shape == (1, 1, 9, 5)


def test_pad_amounts_that_depend_on_a_symbolic_dimension_are_left_alone():
    model = _pad_model(pads_from_input=True, dims=(1, 1, "height", 4))
    nodes = len(model.graph.node)
    assert fold_pad_amounts(model) == 0
    assert len(model.graph.node) == nodes


def test_a_pad_amount_from_a_parity_of_a_symbolic_dimension_is_left_alone():
    """Swin's PatchMerging pads ``W % 2``: evaluated with the dimension at 1 and at 3 it gave 1 both times and
    was frozen to 1, so the graph failed to run on every even width (a Reshape of 33 columns into 16 x 2)."""
    model = _pad_model(pads_from_input=True, dims=(1, 1, 4, "width"), parity=True)
    nodes = len(model.graph.node)
    assert fold_pad_amounts(model) == 0
    assert len(model.graph.node) == nodes
    for width in (4, 5):  # the amount is still computed per input: an even width gets no pad, an odd one 1
        x = np.zeros((1, 1, 4, width), np.float32)
        assert _run(model, x).shape[-1] == width + width % 2


def test_pad_amounts_computed_from_static_dimensions_are_folded():
    """EfficientNet's "same" padding computed from the input's height and width in ``forward``: TorchScript
    writes ``Shape -> Gather -> ...``; with the batch dimension symbolic, only the static dimensions are read,
    and the amounts become an initializer (issue 35: onnxruntime then folds the Pad into QLinearConv)."""
    model = _pad_model(pads_from_input=True, dims=("batch", 1, 4, 4))
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    before = _run(model, x)
    assert fold_pad_amounts(model) == 1
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    pad = next(n for n in model.graph.node if n.op_type == "Pad")
    # [0, 0, 2, 0, 0, 0, 3, 1] times the shape (1, 1, 4, 4) twice over; the batch dimension multiplies a 0
    assert inits[pad.input[1]].tolist() == [0, 0, 8, 0, 0, 0, 12, 4]
    assert [n.op_type for n in model.graph.node] == ["Pad"]
    np.testing.assert_array_equal(_run(model, x), before)


def test_valid_convolution_gets_explicit_zero_pads_and_computes_the_same():
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((2, 1, 3, 3)).astype(np.float32), "w")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], auto_pad="VALID", strides=[2, 2]),
        helper.make_node("MaxPool", ["c"], ["y"], kernel_shape=[2, 2]),
        helper.make_node("Conv", ["x", "w"], ["same"], auto_pad="SAME_UPPER"),
        # at stride 2 the pads depend on the input's size: left alone
        helper.make_node("Conv", ["x", "w"], ["strided"], auto_pad="SAME_UPPER", strides=[2, 2]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 9, 9])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 3, 3]),
            helper.make_tensor_value_info("same", TensorProto.FLOAT, [1, 2, 9, 9]),
            helper.make_tensor_value_info("strided", TensorProto.FLOAT, [1, 2, 5, 5]),
        ],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    x = rng.standard_normal((1, 1, 9, 9)).astype(np.float32)
    before = _run(model, x)
    assert explicit_pads(model) == 3
    attrs = [{a.name: helper.get_attribute_value(a) for a in n.attribute} for n in model.graph.node]
    assert attrs[0]["pads"] == [0, 0, 0, 0] and "auto_pad" not in attrs[0]
    assert attrs[1]["pads"] == [0, 0, 0, 0]
    assert attrs[2]["pads"] == [1, 1, 1, 1] and "auto_pad" not in attrs[2]
    assert attrs[3]["auto_pad"] == b"SAME_UPPER" and "pads" not in attrs[3]
    onnx.checker.check_model(model)
    np.testing.assert_array_equal(_run(model, x), before)


@pytest.mark.parametrize("kernel,dilation", [(3, 2), (4, 1), (4, 3), (5, 2)])
def test_dilated_same_convolution_gets_the_pads_torch_computes(tmp_path, kernel, dilation):
    """torch writes ``Conv1d(padding="same", dilation=2)`` as ``auto_pad=SAME_UPPER`` with dilations, which
    onnxruntime refuses to run ("Dilation not supported for AutoPadType::SAME_UPPER"); the explicit pads give
    torch's own result (an even span puts the odd pixel at the end)."""
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(2, 3, kernel, padding="same", dilation=dilation).eval()
    x = torch.randn(2, 2, 11)
    path = tmp_path / "c.onnx"
    torch.onnx.export(conv, (x,), str(path), dynamo=False, input_names=["x"], opset_version=13)
    model = onnx.load(str(path))
    assert [helper.get_attribute_value(a) for a in model.graph.node[0].attribute if a.name == "auto_pad"] == [
        b"SAME_UPPER"
    ]
    assert explicit_pads(model) == 1
    with torch.no_grad():
        want = conv(x).numpy()
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x.numpy()}
    )[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_reduce_mean_over_the_spatial_axes_becomes_global_average_pool():
    """What the dynamo exporter makes of ``AdaptiveAvgPool2d(1)`` and TorchScript of ``x.mean((2, 3))``:
    ``ReduceMean``, which onnxruntime does not run on codes. A mean over the last axis of a 3-D tensor (a
    LayerNorm's) stays."""
    rng = np.random.default_rng(0)
    axes = numpy_helper.from_array(np.array([-2, -1], np.int64), "axes")
    last = numpy_helper.from_array(np.array([-1], np.int64), "last")
    nodes = [
        helper.make_node("ReduceMean", ["x", "axes"], ["kept"], keepdims=1),
        helper.make_node("ReduceMean", ["x", "axes"], ["flat"], keepdims=0),
        helper.make_node("ReduceMean", ["t", "last"], ["row"], keepdims=1),
    ]
    outs = {"kept": [2, 3, 1, 1], "flat": [2, 3], "row": [2, 5, 1]}
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 5, 7]),
            helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 5, 6]),
        ],
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in outs.items()],
        [axes, last],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    feeds = {
        "x": rng.standard_normal((2, 3, 5, 7)).astype(np.float32),
        "t": rng.standard_normal((2, 5, 6)).astype(np.float32),
    }

    def run(m):
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
            None, feeds
        )

    before = run(model)
    assert global_average_pools(model) == 2
    assert [n.op_type for n in model.graph.node] == [
        "GlobalAveragePool",
        "GlobalAveragePool",
        "Flatten",
        "ReduceMean",
    ]
    onnx.checker.check_model(model)
    for got, want in zip(run(model), before):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(before[0].reshape(2, 3), feeds["x"].mean((2, 3)), rtol=1e-6)  # independent


def test_a_mean_whose_rank_the_exporter_did_not_record_is_found_by_shape_inference():
    """TorchScript records no shape for intermediate tensors: the rank comes from ONNX shape inference."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("ReduceMean", ["r"], ["y"], axes=[2, 3], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 5, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    assert global_average_pools(model) == 1
    assert [n.op_type for n in model.graph.node] == ["Relu", "GlobalAveragePool", "Flatten"]
    assert not model.graph.value_info  # the inference ran on a copy


def test_a_global_pooling_of_a_1x1_map_is_removed():
    """Mean and max over one element are that element: the pools over [batch, C, 1, 1] and [batch, C, 1] go
    (a pool of such a pool too), their readers read the input; one that is a graph output becomes an
    Identity, as does one a subgraph reads. A 2x1 map, and a map of unknown size, keep their pool."""
    rng = np.random.default_rng(1)
    branch = helper.make_graph(
        [helper.make_node("Relu", ["inner"], ["branch_out"])],
        "branch",
        [],
        [helper.make_tensor_value_info("branch_out", TensorProto.FLOAT, ["batch", 3, 1, 1])],
    )
    nodes = [
        helper.make_node("GlobalAveragePool", ["x"], ["p"]),
        helper.make_node("GlobalMaxPool", ["p"], ["pp"]),
        helper.make_node("Flatten", ["pp"], ["flat"], axis=1),
        helper.make_node("GlobalAveragePool", ["x"], ["kept_out"]),
        helper.make_node("GlobalAveragePool", ["r"], ["q"]),
        helper.make_node("Relu", ["q"], ["row"]),
        helper.make_node("GlobalAveragePool", ["w"], ["wide"]),
        helper.make_node("GlobalAveragePool", ["u"], ["unknown"]),
        helper.make_node("GlobalAveragePool", ["x"], ["inner"]),
        helper.make_node("If", ["cond"], ["branched"], then_branch=branch, else_branch=branch),
    ]
    inputs = {"x": ["batch", 3, 1, 1], "r": ["batch", 4, 1], "w": [2, 3, 2, 1], "u": [2, 3, "h", "w"]}
    outs = {"flat": ["batch", 3], "kept_out": ["batch", 3, 1, 1], "row": ["batch", 4, 1]}
    outs |= {"wide": [2, 3, 1, 1], "unknown": [2, 3, 1, 1], "branched": ["batch", 3, 1, 1]}
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in inputs.items()]
        + [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in outs.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = {"x": (2, 3, 1, 1), "r": (2, 4, 1), "w": (2, 3, 2, 1), "u": (2, 3, 5, 4)}
    feeds = {k: rng.standard_normal(v).astype(np.float32) for k, v in feeds.items()}
    feeds["cond"] = np.array(True)

    def run(m):
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return dict(zip(outs, sess.run(None, feeds)))

    before = run(model)
    assert unit_global_pools(model) == 5
    ops = [(n.op_type, list(n.input)) for n in model.graph.node]
    assert ops == [
        ("Flatten", ["x"]),
        ("Identity", ["x"]),
        ("Relu", ["r"]),
        ("GlobalAveragePool", ["w"]),
        ("GlobalAveragePool", ["u"]),
        ("Identity", ["x"]),
        ("If", ["cond"]),
    ]
    onnx.checker.check_model(model)
    after = run(model)
    for k in outs:
        np.testing.assert_array_equal(after[k], before[k])
    np.testing.assert_array_equal(after["flat"], feeds["x"].reshape(2, 3))  # independent: the element itself
    np.testing.assert_array_equal(after["branched"], np.maximum(feeds["x"], 0))
