"""Layers are quantized where the model computes them, their ``forward`` left as written (issue 35).

EfficientNet-PyTorch's ``Conv2dStaticSamePadding`` pads in ``forward``: found by class, its stride-2 layers
lost their right/bottom padding in silence (a 9x9 probe cannot see it) and the others stayed float. Weight
standardisation, LoRA-style subclasses and a weight passed to ``F.linear`` by a plain function were left
float;
``nn.TransformerEncoderLayer`` ran its fused fast path and quantized nothing.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from exporters.onnxruntime.fusion import inspect_fusion, optimized_graph
from quantcli.calibration.calibrate import calibrate
from quantcli.nn.computed import census
from quantcli.nn.config import QuantConfig
from quantcli.nn.modules import QuantConv2d
from quantcli.nn.replace import quantize_model
from quantcli.nn.tensor_quantizer import quantizers
from tests.helpers import cli

EFFICIENTNET = Path(__file__).resolve().parent / "user_models" / "efficientnet_same.py"


def _efficientnet():
    spec = importlib.util.spec_from_file_location("efficientnet_same", EFFICIENTNET)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _quant(x: torch.Tensor, amax: torch.Tensor, bound: int = 127) -> torch.Tensor:
    """Symmetric fake quantization written out (round half to even, clamp to the grid)."""
    scale = amax / bound
    return torch.clamp(torch.round(x / scale), -bound - 1, bound) * scale


def _factory(folder: Path, build: str) -> str:
    """A factory file in ``folder`` whose ``make()`` returns ``build`` (an expression over this module's
    names, evaluated after ``torch.manual_seed(0)``): the MODEL argument of ``quantcli calibrate``."""
    root = str(Path(__file__).resolve().parents[1])
    (folder / "net.py").write_text(
        f"import sys\nsys.path.insert(0, {root!r})\nimport torch\n"
        "from tests import test_computed_layers as t\n"
        f"def make():\n    torch.manual_seed(0)\n    return t.{build}\n"
    )
    return str(folder / "net.py") + ":make"


def _calibrated_all(folder: Path, build: str, data: Path) -> tuple[Path, Path, dict]:
    """``calibrate --placement all --json`` of the factory ``build`` (:func:`_factory`) on ``data``: the
    checkpoint, the path its graph is to be exported to, and the summary."""
    ck, graph = folder / "m.calib.pt", folder / "m.onnx"
    r = cli("calibrate", _factory(folder, build), "--data", data, "--placement", "all", "--out", ck, "--json")
    assert r.exit_code == 0, r.output
    return ck, graph, json.loads(r.stdout)


def _disabled(model):
    for q in quantizers(model).values():
        q.set_mode("disabled")


# ------------------------------------------------------------------------------ EfficientNet "same" padding


def test_same_padding_subclasses_keep_their_padding_and_every_conv_is_quantized():
    E = _efficientnet()
    model, loaded = E.make_short(), E.make_short()
    x = torch.from_numpy(E.samples(8, 3)["inputs"])
    convs = [n for n, m in loaded.named_modules() if isinstance(m, nn.Conv2d)]
    quantize_model(model, "int8", example={"inputs": x})
    report = model.quantcli_report
    assert sorted(n for n in report.layers if n in convs) == sorted(convs)
    assert set(report.computed) == set(convs)  # every one of them is a subclass with a forward of its own
    assert not any(isinstance(m, QuantConv2d) for m in model.modules())
    assert report.float_layers == [] and report.float_check["reverted"] == []
    _disabled(model)
    with torch.no_grad():
        torch.testing.assert_close(model(x), loaded(x), rtol=1e-4, atol=1e-5)  # BatchNorms folded: rounding
        # the stride-2 depthwise layer pads right and bottom only: its output keeps the padded size
        feats = {}
        h = model._blocks[1]._depthwise_conv.register_forward_hook(lambda m, a, o: feats.update(y=o.shape))
        model(x)
        h.remove()
    assert feats["y"][-2:] == (16, 16)


def test_census_sees_the_padded_convolution_and_what_it_returns():
    E = _efficientnet()
    model = E.make_short()
    uses = census(model, {"inputs": torch.from_numpy(E.samples(2, 3)["inputs"])}).by_layer()
    dw = uses["_blocks.1._depthwise_conv"]
    assert [(u.kind, u.params, u.derived, u.caller, u.returns_output) for u in dw] == [
        ("conv", ("weight",), False, "_blocks.1._depthwise_conv", True)
    ]


def _pads(path) -> int:
    return sum(n.op_type == "Pad" for n in onnx.load(str(path)).graph.node)


def _conv_padding(path) -> list[tuple[int, ...]]:
    """Every Conv's spatial padding, (top, left, bottom, right), sorted: its ``pads`` plus those of a zero
    ``Pad`` it reads (the dynamo exporter folds the Pad into the Conv; TorchScript keeps it)."""
    from exporters.fold import constants_to_initializers, fold_pad_amounts

    model = onnx.load(str(path))
    constants_to_initializers(model)
    fold_pad_amounts(model)  # torch's float export computes "same" amounts from the input's shape
    g = model.graph
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer}
    producers = {o: n for n in g.node for o in n.output}
    out = []
    for n in g.node:
        if n.op_type != "Conv":
            continue
        pads = next((list(a.ints) for a in n.attribute if a.name == "pads"), [0, 0, 0, 0])
        src = producers.get(n.input[0])
        if src is not None and src.op_type == "Pad":
            amounts = inits[src.input[1]].tolist()  # N, C, H, W begins then ends
            pads = [pads[0] + amounts[2], pads[1] + amounts[3], pads[2] + amounts[6], pads[3] + amounts[7]]
        out.append(tuple(int(v) for v in pads))
    return sorted(out)


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_efficientnet_same_runs_every_conv_as_qlinearconv_and_every_residual_add_as_qlinearadd(
    tmp_path, exporter
):
    E = _efficientnet()
    np.savez(tmp_path / "calib.npz", **E.samples(32, 1))
    np.savez(tmp_path / "held.npz", **E.samples(16, 2))
    ck, graph = tmp_path / "m.calib.pt", tmp_path / "m.onnx"
    spec = f"{EFFICIENTNET}:make_short"
    r = cli("calibrate", spec, "--data", tmp_path / "calib.npz", "--placement", "all", "--out", ck, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["float_check"]["checked"] and info["float_check"]["reverted"] == []
    assert info["layers"]["float"] == [] and info["not_called"] == []
    # the two residual blocks in a row: the second's skip input (the first one's sum) is quantized although
    # torch.fx cannot trace the block (``if drop_connect_rate``)
    assert info["placement"]["residual_quantized"] == ["_blocks.3.residual_quantizer"]
    assert info["placement"]["residual_untraced"] == {}
    r = cli("export", ck, "--onnx", graph, "--exporter", exporter)
    assert r.exit_code == 0, r.output

    model = E.make_short()
    convs = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    fusion = inspect_fusion(graph)
    assert fusion.load_error is None
    runs = Counter(layer.kernel for layer in fusion.layers)
    assert runs["QLinearConv"] == convs and not fusion.unfused, fusion.to_dict()
    ops = Counter(n.op_type for n in optimized_graph(graph).graph.node)
    assert ops["QLinearConv"] == convs and ops["Conv"] == 0
    residual = sum(b.stride == 1 and b.inp == b.out for b in model._blocks)
    assert ops["QLinearAdd"] == residual == 2 and ops["Add"] == 0
    # every Swish (x * sigmoid(x): the stem's, the head's, each block's expansion, depthwise and
    # squeeze-excitation ones) and every squeeze-excitation gate (sigmoid(s) * x) on codes, and every global
    # pooling (each block's F.adaptive_avg_pool2d, the head's module), as in quantize_static's graph
    sigmoids = 2 + sum((b.expand != 1) + 3 for b in model._blocks)
    assert ops["QLinearSigmoid"] == ops["QLinearMul"] == sigmoids == 17, ops
    assert ops["QLinearGlobalAveragePool"] == len(model._blocks) + 1, ops
    assert ops["Sigmoid"] == ops["Mul"] == ops["GlobalAveragePool"] == ops["ReduceMean"] == 0, ops
    # the padding torch's own export of the float model has: the same Pads (TorchScript: 5, the stem's and
    # the depthwise convolutions'), every Conv padded as there (right/bottom only after stride 2)
    torch.onnx.export(
        model,
        (torch.from_numpy(E.samples(2, 0)["inputs"]),),
        str(tmp_path / "float.onnx"),
        dynamo=exporter == "dynamo",
        input_names=["inputs"],
    )
    assert _pads(graph) == _pads(tmp_path / "float.onnx") == (5 if exporter == "torchscript" else 0)
    padding = _conv_padding(graph)
    assert padding == _conv_padding(tmp_path / "float.onnx") and len(padding) == convs
    assert padding.count((0, 0, 1, 1)) == 2  # the stem's and the stride-2 depthwise convolution's
    r = cli("verify", graph, "--reference", ck, "--data", tmp_path / "held.npz", "--json")
    rep = json.loads(r.stdout)
    assert r.exit_code == 0, [c for c in rep["checks"] if not c["passed"]]
    check = next(c for c in rep["checks"] if c["name"] == "reference.transformations")
    assert check["value"] < 1e-5


# ------------------------------------------------------------------ forwards of their own, plain functions


class StdConv(nn.Conv2d):
    """Weight standardisation (timm's StdConv2d)."""

    def forward(self, x):
        w = (self.weight - self.weight.mean(dim=(1, 2, 3), keepdim=True)) / (
            self.weight.std(dim=(1, 2, 3), keepdim=True) + 1e-5
        )
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


class LoRALinear(nn.Linear):
    """A LoRA-style wrapper: the frozen layer plus a low-rank branch, ``base(x) + B(A(x))``."""

    def __init__(self, i, o, r=2):
        super().__init__(i, o)
        self.A = nn.Linear(i, r, bias=False)
        self.B = nn.Linear(r, o, bias=False)

    def forward(self, x):
        return super().forward(x) + self.B(self.A(x))


def project(x, w, b):
    return F.linear(x, w, b)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x):
        return project(x, self.proj.weight, self.proj.bias)  # proj's own forward never runs


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = StdConv(3, 8, 3, padding=1)
        self.lora = LoRALinear(8, 8)
        self.head = Head()

    def forward(self, x):
        y = F.relu(self.conv(x)).mean((2, 3))
        return self.head(F.relu(self.lora(y)))


def _net():
    torch.manual_seed(0)
    return Net().eval()


def test_weight_standardisation_lora_and_a_plain_function_are_quantized_and_exact():
    model, loaded = _net(), _net()
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    # tensorrt: symmetric int8 grids, no output quantizers or int32 biases, so the arithmetic is written out
    quantize_model(model, QuantConfig(target="tensorrt"), example={"x": x[:4]})
    report = model.quantcli_report
    assert sorted(report.layers) == ["conv", "head.proj", "lora", "lora.A", "lora.B"]
    assert sorted(report.computed) == ["conv", "head.proj", "lora"] and report.float_layers == []
    assert model.conv.weight_derived and not model.lora.weight_derived
    with torch.no_grad():
        _disabled(model)
        assert torch.equal(model(x), loaded(x))  # quantizers off: the user's model, bit for bit
    for q in quantizers(model).values():
        q.set_mode("quantize")
    summary = calibrate(model, [{"x": x}], device="cpu")
    assert summary.not_called == []
    called = set()
    hooks = [
        q.register_forward_pre_hook(lambda m, a, n=n: called.add(n)) for n, q in quantizers(model).items()
    ]
    with torch.no_grad():
        y = model(x)
    for h in hooks:
        h.remove()
    assert called == set(quantizers(model))
    # the standardised weight is what is quantized: its amax is its own max per output channel
    w = loaded.conv.weight.detach()
    ws = (w - w.mean(dim=(1, 2, 3), keepdim=True)) / (w.std(dim=(1, 2, 3), keepdim=True) + 1e-5)
    conv = model.conv
    torch.testing.assert_close(conv.weight_quantizer.amax.flatten(), ws.abs().amax((1, 2, 3)))
    with torch.no_grad():
        want = F.conv2d(
            _quant(x, conv.input_quantizer.amax),
            _quant(ws, conv.weight_quantizer.amax),
            conv.bias,
            padding=1,
        )
        torch.testing.assert_close(conv(x), want, rtol=0, atol=1e-5)
        # the head computes F.linear(Q(h), Q(W), b) of its function's arguments; the LoRA layer its own
        # F.linear plus its two quantized branch layers
        h = F.relu(model.lora(F.relu(conv(x)).mean((2, 3))))
        p, lo = model.head.proj, model.lora
        want = F.linear(_quant(h, p.input_quantizer.amax), _quant(p.weight, p.weight_quantizer.amax), p.bias)
        torch.testing.assert_close(y, want, rtol=0, atol=1e-5)
        z = F.relu(conv(x)).mean((2, 3))
        base = F.linear(
            _quant(z, lo.input_quantizer.amax), _quant(lo.weight, lo.weight_quantizer.amax), lo.bias
        )
        torch.testing.assert_close(lo(z), base + lo.B(lo.A(z)), rtol=0, atol=1e-5)
        assert not torch.allclose(lo(z), loaded.lora(z), atol=1e-6)  # quantized, not float


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_computed_layers_export_and_verify(tmp_path, exporter):
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).standard_normal((32, 3, 8, 8)).astype(np.float32))
    ck, graph, info = _calibrated_all(tmp_path, "_net()", tmp_path / "d.npz")
    assert info["layers"]["float"] == [] and len(info["layers"]["quantized"]) == 5
    assert cli("export", ck, "--onnx", graph, "--exporter", exporter).exit_code == 0
    r = cli("verify", graph, "--reference", ck, "--data", tmp_path / "d.npz", "--json")
    rep = json.loads(r.stdout)
    assert r.exit_code == 0, [c for c in rep["checks"] if not c["passed"]]
    assert rep["structure"]["problems"] == []


# ------------------------------------------------------------------------ nn.TransformerEncoderLayer


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        return self.out(self.layer(self.inp(x)).mean(1))


def test_transformer_encoder_layer_fast_path_is_off_and_its_layers_are_quantized():
    torch.manual_seed(0)
    model = Encoder().eval()
    loaded = copy.deepcopy(model)
    x = torch.randn(16, 5, 6, generator=torch.Generator().manual_seed(1))
    quantize_model(model, "int8", example={"x": x[:4]})
    report = model.quantcli_report
    layers = ["inp", "layer.self_attn", "layer.self_attn.out_proj", "layer.linear1", "layer.linear2", "out"]
    assert report.layers == layers and report.float_layers == []
    assert report.fast_paths_off == ["layer", "layer.self_attn"]
    with torch.inference_mode():  # where PyTorch runs torch._transformer_encoder_layer_fwd
        summary = calibrate(model, [{"x": x}], device="cpu")
    assert summary.not_called == []
    called = set()
    hooks = [
        q.register_forward_pre_hook(lambda m, a, n=n: called.add(n)) for n, q in quantizers(model).items()
    ]
    with torch.inference_mode():
        y = model(x)
    for h in hooks:
        h.remove()
    assert called == set(quantizers(model))
    with torch.inference_mode():
        ref = loaded(x)
    assert float(F.cosine_similarity(y.flatten(), ref.flatten(), 0)) > 0.99
    _disabled(model)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)  # the slow path: the same values


def _encoder():
    torch.manual_seed(0)
    return Encoder().eval()


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_transformer_encoder_layer_exports_and_verifies(tmp_path, exporter):
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).standard_normal((32, 5, 6)).astype(np.float32))
    ck, graph = tmp_path / "m.calib.pt", tmp_path / "m.onnx"
    spec = _factory(tmp_path, "_encoder()")
    r = cli("calibrate", spec, "--data", tmp_path / "d.npz", "--placement", "all", "--out", ck, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    # truthful: nothing "never called", nothing "disabled"
    assert info["not_called"] == [] and info["layers"]["float"] == []
    assert len(info["layers"]["quantized"]) == 6
    assert cli("export", ck, "--onnx", graph, "--exporter", exporter).exit_code == 0
    r = cli("verify", graph, "--reference", ck, "--data", tmp_path / "d.npz", "--json")
    rep = json.loads(r.stdout)
    assert r.exit_code == 0, [c for c in rep["checks"] if not c["passed"]]
    assert rep["structure"]["problems"] == []


# ------------------------------------------------------------------------ products quantcli leaves float


class _Einsum3(nn.Module):
    """An einsum with a 3-D weight (heads split in the weight): not a product quantcli quantizes."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 2, 3))

    def forward(self, x):
        return torch.einsum("bi,ihk->bhk", x, self.weight).flatten(1)


class _Bmm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 6))

    def forward(self, x):
        return torch.bmm(x.unsqueeze(1), self.weight.expand(x.shape[0], 6, 6)).squeeze(1)


class _Tensordot(nn.Module):
    """(Its gain makes it more than a Linear in all but name, which a probe of its forward would find.)"""

    def __init__(self):
        super().__init__()
        self.weight, self.gain = nn.Parameter(torch.randn(6, 3)), nn.Parameter(torch.ones(3))

    def forward(self, x):
        return torch.tensordot(x, self.weight, dims=1) * self.gain


class _Products(nn.Module):
    def __init__(self):
        super().__init__()
        self.e, self.b, self.t, self.fc = _Einsum3(), _Bmm(), _Tensordot(), nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(self.t(torch.relu(self.b(torch.relu(self.e(x))))))


def test_a_weight_taken_by_a_product_quantcli_leaves_float_is_named():
    """Layers whose weight went to a product quantcli does not quantize stayed float "because no convolution,
    linear or matmul took its weight": the reason names the operation that did, and what to write instead."""
    torch.manual_seed(0)
    model = quantize_model(_Products().eval(), "int8", example={"x": torch.randn(4, 4)})
    reasons = {f["name"]: f["reason"] for f in model.quantcli_report.float_layers}
    assert reasons.keys() == {"e", "b", "t"}
    # the einsum's reason was "torch.einsum" alone, beside einsums quantcli does quantize: now its equation
    # and what keeps it from a product form
    einsum = 'torch.einsum "bi,ihk->bhk" (a 3-D weight)'
    for name, op in (("e", einsum), ("b", "torch.bmm"), ("t", "torch.tensordot")):
        assert reasons[name].startswith(f"its weight goes to {op}, which quantcli does not quantize"), reasons
    assert "reshape a weight of more axes" in reasons["e"]
    assert "fc" in model.quantcli_report.layers
    assert model.quantcli_report.float_weights == []


class _BmmBesideLinear(nn.Module):
    """One weight to ``torch.bmm`` (float), another to ``F.linear`` (quantized): the layer is quantized."""

    def __init__(self):
        super().__init__()
        self.w, self.lw = nn.Parameter(torch.randn(4, 6, 6) / 3), nn.Parameter(torch.randn(6, 6) / 3)

    def forward(self, x):
        return F.linear(torch.bmm(x.transpose(0, 1), self.w).transpose(0, 1), self.lw)


class _BmmBesideLinearNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blk, self.head = _BmmBesideLinear(), nn.Linear(24, 3)

    def forward(self, x):
        return self.head(torch.relu(self.blk(x)).flatten(1))


def test_a_quantized_layers_weight_taken_by_another_product_is_named(tmp_path):
    """A layer whose ``F.linear`` weight is quantized and whose other weight goes to ``torch.bmm``: the bmm
    weight was named nowhere (not in the summary, --json or inspect), though alone it would be."""
    torch.manual_seed(0)
    model = quantize_model(_BmmBesideLinearNet().eval(), "int8", example={"x": torch.randn(5, 4, 6)})
    report = model.quantcli_report
    assert "blk" in report.layers and report.float_layers == []
    assert [(w["name"], w["layer"]) for w in report.float_weights] == [("blk.w", "blk")]
    reason = report.float_weights[0]["reason"]
    assert reason.startswith("it goes to torch.bmm, which quantcli does not quantize"), reason
    from quantcli.calibration.job import layers_summary

    summary = layers_summary(report, model)
    assert summary["float_weights"] == report.float_weights
    assert "1 weight(s) of quantized layers left float: blk.w (it goes to torch.bmm" in summary["text"]


@pytest.mark.parametrize(
    "equation, weight_first, form",
    [
        ("bnd,de->bne", False, ("matmul", 1)),
        ("...d,ed->...e", False, ("linear", 0)),
        ("bi,oi->bo", False, ("linear", 0)),
        ("b i , i o -> b o", False, ("matmul", 1)),
        ("de,bnd->bne", True, ("matmul", 1)),
        ("ed,...d->...e", True, ("linear", 0)),
        # the weight is not the first operand's subscripts
        ("bnd,de->bne", True, "a 3-D weight"),
        ("bnd,de->ben", False, "a transposed output"),
        ("bdn,de->bne", False, "a contraction of an axis other than the activation's last"),
        ("bnd,nm->bmd", False, "a contraction of an axis other than the activation's last"),
        ("bnd,de->bn", False, "an output of other axes"),  # the weight's other axis is reduced
        ("bnd,dhk->bnhk", False, "a 3-D weight"),
        ("bnd,dd->bnd", False, "the weight's diagonal"),
        ("bnd,de", False, "no explicit output"),
        ("bnd,ne->bde", False, "a contraction of an axis other than the activation's last"),
        ("bnd,dn->bnn", False, "a weight axis shared with the activation"),
        ("bnd,de,ef->bnf", False, "3 operands"),
        ("bnn,ne->bne", False, "a repeated or broadcast axis"),
    ],
)
def test_einsum_product_forms(equation, weight_first, form):
    """Which einsums run as ``torch.matmul`` / ``F.linear`` with their quantizers: the forms are checked
    against the einsum itself on random operands (an independent computation) where one is claimed."""
    from quantcli.nn.computed import einsum_mismatch, einsum_product

    assert einsum_product(equation, weight_first) == (form if isinstance(form, tuple) else None)
    assert einsum_mismatch(equation, weight_first) == (form if isinstance(form, str) else None)
    if isinstance(form, tuple):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, 3, 5, generator=g) if "..." in equation or "n" in equation else torch.randn(3, 5)
        w = torch.randn(*((5, 4) if form[0] == "matmul" else (4, 5)), generator=g)
        want = torch.einsum(equation, w, x) if weight_first else torch.einsum(equation, x, w)
        got = torch.matmul(x, w) if form[0] == "matmul" else F.linear(x, w)
        torch.testing.assert_close(got, want)


class _GraphConv(nn.Module):
    """A graph convolution as pygcn writes it: ``torch.mm`` of the features and the weight, its forward taking
    the adjacency too (so no probe of its forward alone can find it)."""

    def __init__(self, i, o):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(i, o) / i**0.5)
        self.bias = nn.Parameter(torch.randn(o) / 10)

    def forward(self, x, adj):
        return adj @ torch.mm(x, self.weight) + self.bias


class _AddmmLayer(nn.Module):
    def __init__(self, i, o, method=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(i, o) / i**0.5)
        self.bias = nn.Parameter(torch.randn(o) / 10)
        self.method = method

    def forward(self, x):
        if self.method:
            return self.bias.addmm(x, self.weight)
        return torch.addmm(self.bias, x, self.weight)


class _EinsumLayer(nn.Module):
    """An einsum projection followed by a learned gain (two parameters: not a Linear in all but name)."""

    def __init__(self, i, o, equation, weight_first=False):
        super().__init__()
        self.equation, self.weight_first = equation, weight_first
        linear = equation.replace(" ", "").split("->")[0].split(",")[0 if weight_first else 1][0] != "d"
        self.weight = nn.Parameter(torch.randn(*((o, i) if linear else (i, o))) / i**0.5)
        self.gain = nn.Parameter(torch.full((o,), 1.5))

    def forward(self, x):
        ops = (self.weight, x) if self.weight_first else (x, self.weight)
        return torch.einsum(self.equation, *ops) * self.gain


class _ProductNet(nn.Module):
    """Every product quantcli quantizes where it runs, beside what it cannot: 16 nodes, 12 features."""

    def __init__(self):
        super().__init__()
        self.g1, self.g2 = _GraphConv(12, 32), _GraphConv(32, 32)
        self.a1, self.a2 = _AddmmLayer(32, 32), _AddmmLayer(32, 24, method=True)
        self.e1 = _EinsumLayer(24, 24, "nd,de->ne")
        self.e2 = _EinsumLayer(24, 16, "ed,...d->...e", weight_first=True)
        self.m = nn.Parameter(torch.randn(16, 4) / 4)  # the root's own x.mm(W)

    def forward(self, x):
        n = x.shape[0]
        adj = torch.eye(n) * 0.5 + 0.5 / n
        h = torch.relu(self.g2(torch.relu(self.g1(x, adj)), adj))
        h = torch.relu(self.a2(torch.relu(self.a1(h))))
        h = torch.relu(self.e2(torch.relu(self.e1(h))))
        return h.mm(self.m)


def test_mm_addmm_and_einsum_products_are_quantized_as_they_compute():
    """``torch.mm``, ``torch.addmm``, their Tensor methods and product-form einsums stayed float ("its weight
    goes to torch.mm, which quantcli does not quantize"): a pygcn graph convolution had no layer to quantize.
    Each now computes its own operation on quantized operands (the einsums as the matmul or linear they
    are), and each one's output is that operation written out on fake-quantized operands."""
    torch.manual_seed(0)
    model, loaded = _ProductNet().eval(), copy.deepcopy(_ProductNet().eval())
    loaded.load_state_dict(model.state_dict())
    x = torch.randn(16, 12, generator=torch.Generator().manual_seed(1))
    quantize_model(model, QuantConfig(target="tensorrt"), example={"x": x})
    report = model.quantcli_report
    assert sorted(report.computed) == ["", "a1", "a2", "e1", "e2", "g1", "g2"], report.layers
    assert report.float_layers == []
    kinds = {n: (model.get_submodule(n).op_kind, model.get_submodule(n).weight_axis) for n in report.computed}
    assert kinds == {
        "": ("mm", 1),
        "a1": ("addmm", 1),
        "a2": ("addmm", 1),
        "e1": ("matmul", 1),
        "e2": ("linear", 0),
        "g1": ("mm", 1),
        "g2": ("mm", 1),
    }
    with torch.no_grad():
        _disabled(model)
        torch.testing.assert_close(model(x), loaded(x), rtol=0, atol=1e-6)  # quantizers off: the user's model
    for q in quantizers(model).values():
        q.set_mode("quantize")
    calibrate(model, [{"x": x}], device="cpu")
    adj = torch.eye(16) * 0.5 + 0.5 / 16

    def q_in(m, t):
        return _quant(t, m.input_quantizer.amax)

    def q_w(m):  # per output channel: the weight's last axis for mm/addmm/matmul, its first for linear
        amax = m.weight_quantizer.amax
        assert amax.numel() == m.weight.shape[m.weight_axis]
        return _quant(m.weight, amax)

    with torch.no_grad():
        g1, a1, e1, e2 = model.g1, model.a1, model.e1, model.e2
        # the per-channel amax is the weight's own max per output channel (an independent reduction)
        torch.testing.assert_close(g1.weight_quantizer.amax.flatten(), g1.weight.abs().amax(0))
        torch.testing.assert_close(e2.weight_quantizer.amax.flatten(), e2.weight.abs().amax(1))
        want = adj @ torch.mm(q_in(g1, x), q_w(g1)) + g1.bias
        torch.testing.assert_close(g1(x, adj), want, rtol=0, atol=1e-5)
        h = torch.randn(16, 32)
        torch.testing.assert_close(a1(h), torch.addmm(a1.bias, q_in(a1, h), q_w(a1)), rtol=0, atol=1e-5)
        h = torch.randn(16, 24)
        torch.testing.assert_close(e1(h), (q_in(e1, h) @ q_w(e1)) * e1.gain, rtol=0, atol=1e-5)
        h = torch.randn(16, 24)
        torch.testing.assert_close(e2(h), (q_in(e2, h) @ q_w(e2).T) * e2.gain, rtol=0, atol=1e-5)
        assert not torch.allclose(e2(h), loaded.e2(h), atol=1e-4)  # quantized, not float


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_mm_addmm_and_einsum_products_run_on_integer_kernels_and_verify(tmp_path, exporter):
    """Exported, every product is an integer kernel in onnxruntime: the two graph convolutions' ``torch.mm``
    and the int32-biased ``torch.addmm`` layers as ``QGemm`` or ``MatMulIntegerToFloat``, the einsums as
    ``MatMulIntegerToFloat`` or ``QGemm`` (never an ``Einsum``), and verify passes the graph."""
    np.save(tmp_path / "d.npy", np.random.default_rng(0).standard_normal((16, 12)).astype(np.float32))
    ck, graph, info = _calibrated_all(tmp_path, "_ProductNet().eval()", tmp_path / "d.npy")
    assert sorted(info["layers"]["quantized"]) == ["", "a1", "a2", "e1", "e2", "g1", "g2"], info["layers"]
    assert cli("export", ck, "--onnx", graph, "--exporter", exporter).exit_code == 0
    assert not any(n.op_type == "Einsum" for n in onnx.load(graph).graph.node)
    kernels = {layer.layer: layer.kernel for layer in inspect_fusion(graph).layers}
    assert kernels.keys() == {"", "a1", "a2", "e1", "e2", "g1", "g2"}, kernels
    assert kernels["a1"] == kernels["a2"] == "QGemm", kernels  # the int32 bias: fused with it
    assert all(k in ("QGemm", "MatMulIntegerToFloat", "QLinearMatMul") for k in kernels.values()), kernels
    r = cli("verify", graph, "--reference", ck, "--data", tmp_path / "d.npy", "--json")
    rep = json.loads(r.stdout)
    assert r.exit_code == 0, [c for c in rep["checks"] if not c["passed"]]
    assert rep["structure"]["problems"] == []


class _LeftMatmul(nn.Module):
    """A weight multiplied from the left (``W @ x``), beside a layer that quantcli quantizes."""

    def __init__(self):
        super().__init__()
        self.W = nn.Parameter(torch.randn(16, 8) / 8**0.5)
        self.fc = nn.Linear(16, 3)

    def forward(self, x):  # x: (N, 8, L)
        return self.fc(torch.relu(self.W @ x).mean(2))


def test_a_weight_on_the_left_of_a_matmul_is_named_as_left_float():
    """``self.W @ x`` stayed float and unreported: the census read the weight as matmul's second operand."""
    torch.manual_seed(0)
    model = quantize_model(_LeftMatmul().eval(), "int8", example={"x": torch.randn(4, 8, 5)})
    reasons = {f["name"]: f["reason"] for f in model.quantcli_report.float_layers}
    assert reasons.keys() == {""}, reasons
    assert reasons[""].startswith("its weight goes to a matmul with the weight on the left (W @ x)"), reasons
    assert model.quantcli_report.layers == ["fc"]


class _FixedProjection(nn.Module):
    """A fixed weight held as a buffer (``F.linear(h, self.frozen)``) or, as its reason advises, as a
    parameter that needs no gradient; a positional buffer added to the input is not a weight."""

    def __init__(self, as_parameter: bool):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        frozen = torch.randn(4, 16) / 4
        if as_parameter:
            self.frozen = nn.Parameter(frozen, requires_grad=False)
        else:
            self.register_buffer("frozen", frozen)
        self.register_buffer("pe", torch.randn(8))

    def forward(self, x):
        return F.linear(torch.relu(self.fc(x + self.pe)), self.frozen)


def test_a_weight_held_as_a_buffer_is_named_as_left_float_and_quantized_as_a_parameter():
    """``F.linear(h, self.frozen)`` with a registered buffer stayed float and unreported."""
    torch.manual_seed(0)
    example = {"x": torch.randn(4, 8)}
    model = quantize_model(_FixedProjection(as_parameter=False).eval(), "int8", example=example)
    reasons = {f["name"]: f["reason"] for f in model.quantcli_report.float_layers}
    assert reasons.keys() == {""}, reasons
    assert reasons[""].startswith("its weight frozen is a buffer (register_buffer)"), reasons
    assert model.quantcli_report.layers == ["fc"]
    model = quantize_model(_FixedProjection(as_parameter=True).eval(), "int8", example=example)
    assert model.quantcli_report.float_layers == []
    assert sorted(model.quantcli_report.layers) == ["", "fc"]


class _TiedAutoencoder(nn.Module):
    """A decoder computing with the encoder's weight transposed, as tied autoencoders do; ``alias`` also
    registers that weight on the root module (``self.w = self.enc.weight``)."""

    def __init__(self, alias: bool):
        super().__init__()
        self.enc, self.head = nn.Linear(16, 8), nn.Linear(16, 4)
        self.dec_bias = nn.Parameter(torch.zeros(16))
        self.alias = alias
        if alias:
            self.w = self.enc.weight

    def forward(self, x):
        h = torch.relu(self.enc(x))
        w = self.w if self.alias else self.enc.weight
        return self.head(torch.relu(F.linear(h, w.t(), self.dec_bias)))


@pytest.mark.parametrize("config", ["int8", "int8-per-tensor"])
@pytest.mark.parametrize("alias", [False, True], ids=["transposed", "aliased"])
def test_a_weight_tied_in_two_layouts_stays_float_with_its_reason_and_the_rest_calibrates(config, alias):
    """Before: one per-channel weight quantizer saw (8, 16) and (16, 8) and calibration stopped with "the
    per-axis dimensions changed between batches" (one batch), and per-tensor ended in an internal error (its
    weight taken for the other use's operand). Now the tied weight stays float, saying why, and the rest of
    the model is quantized and computes as before within the quantization error."""
    torch.manual_seed(0)
    model = _TiedAutoencoder(alias).eval()
    x = torch.randn(32, 16)
    with torch.no_grad():
        want = model(x)
    q = quantize_model(model, config, example={"x": x[:4]})
    reasons = {f["name"]: f["reason"] for f in q.quantcli_report.float_layers}
    if alias:
        assert "its weight is also the weight of enc" in reasons[""], reasons
    else:
        assert "its weight is used in 2 layouts ((8, 16) and (16, 8)" in reasons["enc"], reasons
    assert "head" in q.quantcli_report.layers
    calibrate(q, [{"x": x}], "max", device="cpu")
    with torch.no_grad():
        got = q(x)
    assert F.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.999


class _PaddingModes(nn.Module):
    """Convolutions that pad themselves (``padding_mode`` reflect, circular, replicate), as torch runs them:
    ``F.pad`` and then ``F.conv2d`` with padding 0."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1, padding_mode="reflect")
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, padding_mode="circular")
        self.c3 = nn.Conv1d(8, 8, 3, padding=1, padding_mode="replicate")
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = F.relu(self.c2(F.relu(self.c1(x))))
        return self.fc(F.relu(self.c3(x.flatten(2))).mean(2))


def test_convolutions_that_pad_themselves_run_as_qlinearconv(tmp_path):
    """Converted as classes, their input quantizer ran before torch's own padding: the graph was
    ``DequantizeLinear -> Pad -> Conv`` (``Slice/Concat`` for circular), which onnxruntime runs in float, and
    placement kept all three float. Quantized where the convolution runs, the pair reads the padded tensor:
    every one is a QLinearConv, and the graph computes the model's padding (verify passes)."""
    np.save(tmp_path / "d.npy", np.random.default_rng(0).standard_normal((16, 3, 10, 10)).astype(np.float32))
    ck, graph = tmp_path / "m.calib.pt", tmp_path / "m.onnx"
    r = cli(
        "calibrate",
        _factory(tmp_path, "_PaddingModes().eval()"),
        "--data",
        tmp_path / "d.npy",
        "--out",
        ck,
        "--json",
    )
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert {"c1", "c2", "c3"} <= set(info["layers"]["quantized"]), info["layers"]
    assert cli("export", ck, "--onnx", graph).exit_code == 0
    fusion = inspect_fusion(graph)
    kernels = {layer.layer: layer.kernel for layer in fusion.layers}
    assert all(kernels.get(n) == "QLinearConv" for n in ("c1", "c2", "c3")), fusion.to_dict()
    r = cli("verify", graph, "--reference", ck, "--data", tmp_path / "d.npy")
    assert r.exit_code == 0, r.output


class _RootProjection(nn.Module):
    """The model's own forward computes a weighted matmul (``h.matmul(self.P)``): the root module, ""."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.P = nn.Parameter(torch.randn(32, 8) / 6)

    def forward(self, x):
        return torch.tanh(torch.relu(self.fc(x)).matmul(self.P))


def test_a_layer_of_the_root_module_is_placed_and_its_weight_codes_are_checked(tmp_path):
    """The root module's quantizers have no prefix (``weight_quantizer``), and every place that took a
    quantizer's module as the name before its last dot missed them: latency placement named the layer after
    its graph node ("/MatMul": "not mapped to a module of the model") and would have switched off none of its
    quantizers; verify's structure check never compared its stored weight codes, so a graph with a wrong root
    weight passed it."""
    from quantcli.calibration.latency_placement import _layer_quantizers

    np.save(tmp_path / "d.npy", np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32))
    ck, graph = tmp_path / "m.calib.pt", tmp_path / "m.onnx"
    r = cli(
        "calibrate",
        _factory(tmp_path, "_RootProjection().eval()"),
        "--data",
        tmp_path / "d.npy",
        "--out",
        ck,
        "--json",
    )
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert sorted(info["layers"]["quantized"]) == ["", "fc"]
    decided = {d["layer"]: d for d in info["placement"]["latency"]["layers"]}
    assert decided.keys() == {"", "fc"}, decided
    assert decided[""]["kernel"] == "MatMulIntegerToFloat" and decided[""]["ratio"] is not None, decided
    model = _RootProjection()
    quantize_model(model, "int8", example={"x": torch.randn(2, 16)})
    assert sorted(_layer_quantizers(model, "")) == ["input_quantizer", "weight_quantizer"]
    assert sorted(_layer_quantizers(model, "fc")) == ["fc.input_quantizer", "fc.weight_quantizer"]

    assert cli("export", ck, "--onnx", graph).exit_code == 0
    assert {lf.layer for lf in inspect_fusion(graph).layers} == {"", "fc"}
    r = cli("verify", graph, "--reference", ck, "--data", tmp_path / "d.npy", "--json", "--per-layer")
    rep = json.loads(r.stdout)
    assert r.exit_code == 0, [c for c in rep["checks"] if not c["passed"]]
    rows = {row["quantizer"]: row for row in rep["layers"]}
    assert rows["weight_quantizer"]["module"] == "" and rows["weight_quantizer"]["identical_codes"] == 1.0
    assert rows["input_quantizer"]["module"] == ""

    m = onnx.load(graph)  # one stored code of the root's weight moved by one step
    dq = next(n for n in m.graph.node if n.op_type == "DequantizeLinear" and n.name.startswith("/weight_q"))
    init = next(t for t in m.graph.initializer if t.name == dq.input[0])
    codes = onnx.numpy_helper.to_array(init).copy()
    codes.flat[0] = codes.flat[0] - 1 if codes.flat[0] > -127 else codes.flat[0] + 1
    init.CopyFrom(onnx.numpy_helper.from_array(codes, init.name))
    onnx.save(m, tmp_path / "edited.onnx")
    r = cli("verify", tmp_path / "edited.onnx", "--reference", ck, "--data", tmp_path / "d.npy", "--json")
    rep = json.loads(r.stdout)
    assert r.exit_code == 1 and not rep["structure"]["passed"], rep["structure"]
    assert any(p.startswith("weight_quantizer") for p in rep["structure"]["problems"]), rep["structure"]


class _LatentQuery(nn.Module):
    """A Perceiver's cross-attention: learned latent queries through a Linear, against keys of the input."""

    def __init__(self):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(4, 6))
        self.q, self.k, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(4, 3)

    def forward(self, x):
        scores = self.q(self.latents) @ self.k(x).transpose(1, 2)  # (batch, latents, tokens)
        return self.head(scores.mean(-1))


def test_a_quantized_layers_output_reaching_another_product_is_not_its_weight_left_float():
    """q's weight is quantized (its Linear runs on the latents); its output, computed from parameters
    alone, goes to a matmul with the keys. float_weights said q.weight and q.bias were "left float: it goes to
    a matmul with the weight on the left (W @ x)" while the graph stored q.weight as int8."""
    torch.manual_seed(0)
    model = quantize_model(_LatentQuery().eval(), "int8", example={"x": torch.randn(2, 5, 6)})
    report = model.quantcli_report
    assert {"q", "k", "head"} <= set(report.layers)
    assert report.float_weights == []


class _NormsOverFeatureMaps(nn.Module):
    """LayerNorm over [C, H, W] (a 3-D gain), GroupNorm, InstanceNorm with affine gains."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.ln, self.gn, self.inorm = (
            nn.LayerNorm([4, 6, 6]),
            nn.GroupNorm(2, 4),
            nn.InstanceNorm2d(4, affine=True),
        )
        self.fc = nn.Linear(4 * 36, 3)

    def forward(self, x):
        return self.fc(self.inorm(self.gn(self.ln(self.conv(x)))).flatten(1))


def test_a_normalizations_gain_is_not_a_weighted_layer_left_float():
    """LayerNorm([32, 4, 4])'s 3-D gain made it "a weighted module left float: no convolution, linear or
    matmul took its weight"; a normalization's gain is no weight of a product."""
    torch.manual_seed(0)
    model = quantize_model(_NormsOverFeatureMaps().eval(), "int8", example={"x": torch.randn(2, 1, 6, 6)})
    assert model.quantcli_report.float_layers == []
    assert set(model.quantcli_report.layers) == {"conv", "fc"}


class ScaledStdConv(nn.Conv2d):
    """timm's ScaledStdConv2d (NF-ResNet, NFNet): the weight standardised through ``F.batch_norm`` of its
    ``(1, out, K)`` reshape, then reshaped back."""

    def __init__(self, cin, cout, k, stride=1, padding=0):
        super().__init__(cin, cout, k, stride, padding)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, cout).reshape(cout, 1, 1, 1))
        self.scale = (cin * k * k) ** -0.5

    def forward(self, x):
        w = F.batch_norm(
            self.weight.reshape(1, self.out_channels, -1),
            None,
            None,
            weight=(self.gain * self.scale).view(-1),
            training=True,
            momentum=0.0,
            eps=1e-6,
        ).reshape_as(self.weight)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


def test_a_per_channel_weight_computed_through_a_reshape_exports_a_graph_onnxruntime_loads(tmp_path):
    """The computed weight's per-channel Q (axis 0, 16 scales) was copied back across the Reshape onto the
    ``(1, 16, K)`` batch-norm output, where axis 0 has size 1: onnxruntime refused the graph ("scale ...
    broadcast_dim") and export said nothing. Only per-tensor Qs are copied across such ops."""
    import onnxruntime as ort

    from exporters import export_onnx
    from quantcli.calibration.calibrate import calibrate

    class NF(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = ScaledStdConv(3, 16, 3, 2, 1), ScaledStdConv(16, 32, 3, 1, 1)
            self.fc = nn.Linear(32, 10)

        def forward(self, x):
            return self.fc(F.relu(self.c2(F.relu(self.c1(x)))).mean((2, 3)))

    torch.manual_seed(0)
    model = NF().eval()
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    quantize_model(model, {"preset": "int8", "cpu": "x86-vnni"}, example={"x": x[:4]})
    assert "c2" in model.quantcli_report.computed
    calibrate(model, [{"x": x}], device="cpu")
    path = tmp_path / "nf.onnx"
    export_onnx(model, {"x": x[:4]}, path)
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        so = ort.SessionOptions()
        so.graph_optimization_level = level
        got = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(
            None, {"x": x.numpy()}
        )
        with torch.no_grad():
            want = model(x).numpy()
        assert np.abs(got[0] - want).max() < 0.05 * np.abs(want).max()
