"""A model's inputs and outputs as the graph names them: nested tuples and dicts flattened in order,
``None`` left out, an input the model also returns kept an input of its own name, one tensor returned twice
written twice (a copy the second time: it was refused, where calibrate and analyze took the model), non-tensor
defaults kept out of the inputs. Each graph output is checked against the tensor of that
name, computed here from the model's own layers."""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

from exporters import export_onnx
from quantcli import calibrate, quantize_model

Pair = namedtuple("Pair", ["logits", "hidden"])


class _Outputs(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.a, self.b = nn.Linear(8, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        y = self.b(h)
        if self.kind == "none":
            return {"logits": y, "aux": None, "h": h}
        if self.kind == "nested":
            return {"cls": y, "reg": (h.sum(-1), (h * 2,))}
        if self.kind == "passthrough":
            return {"logits": y, "x_back": x}
        if self.kind == "namedtuple":  # its field names, not output_0 and output_1
            return Pair(y, h)
        return y, y, h  # "twice"


WANT = {
    "none": lambda y, h, x: {"logits": y, "h": h},
    "nested": lambda y, h, x: {"cls": y, "reg.0": h.sum(-1), "reg.1.0": h * 2},
    "passthrough": lambda y, h, x: {"logits": y, "x_back": x},
    "namedtuple": lambda y, h, x: {"logits": y, "hidden": h},
    "twice": lambda y, h, x: {"output_0": y, "output_1": y, "output_2": h},
}


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("kind", list(WANT))
def test_graph_outputs_are_the_models_tensors_by_name(kind, exporter, tmp_path):
    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 8)}
    model = quantize_model(_Outputs(kind).eval())
    calibrate(model, [batch], "max", device="cpu")
    res = export_onnx(model, batch, tmp_path / "m.onnx", exporter=exporter)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["x"]
    names = [o.name for o in sess.get_outputs()]
    with torch.no_grad():
        h = torch.relu(model.a(batch["x"]))
        want = {k: v.numpy() for k, v in WANT[kind](model.b(h), h, batch["x"]).items()}
    assert names == list(want) == res.output_names
    for name, got in zip(names, sess.run(None, {"x": batch["x"].numpy()})):
        np.testing.assert_allclose(got, want[name], rtol=1e-5, atol=1e-5, err_msg=name)


class _WithDefaults(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)

    def forward(self, x, scale: float = 2.0, mask=None, flag: bool = True):
        y = self.a(x) * scale
        return y if mask is None or not flag else y * mask


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_non_tensor_defaults_are_constants_not_graph_inputs(exporter, tmp_path):
    """A forward's later parameters with defaults (a float scale, None, a bool): the graph's inputs are the
    batch's alone (TorchScript once made ``scale`` a double input), and the defaults apply."""
    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 8)}
    model = quantize_model(_WithDefaults().eval())
    calibrate(model, [batch], "max", device="cpu")
    export_onnx(model, batch, tmp_path / "m.onnx", exporter=exporter)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["x"]
    with torch.no_grad():
        want = (model.a(batch["x"]) * 2.0).numpy()
    np.testing.assert_allclose(sess.run(None, {"x": batch["x"].numpy()})[0], want, rtol=1e-5, atol=1e-5)
    assert "forward" not in model.__dict__  # the export's view of forward is gone


class _TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)


class _KeywordsOnly(_TwoLinears):
    def forward(self, **kw):
        return self.a(kw["x"]) - self.b(kw["z"])


class _NamedAndKeywords(_TwoLinears):
    def forward(self, x, **kw):
        return self.a(x) - self.b(kw["z"])


class _SkippedDefault(_TwoLinears):
    """An optional parameter whose default is not None, skipped between two given inputs."""

    def forward(self, x, gain: float = 3.0, z=None):
        return self.a(x) * gain - self.b(z)


_FORWARDS = {
    "kwargs_only": _KeywordsOnly,
    "named_and_kwargs": _NamedAndKeywords,
    "skipped": _SkippedDefault,
}


@pytest.mark.parametrize("kind", ["kwargs_only", "named_and_kwargs", "skipped"])
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_inputs_forward_reads_by_keyword_reach_the_graph(kind, exporter, tmp_path):
    """``forward(**kw)`` stopped the TorchScript export with "torch.onnx.export failed: 'x'" (its trailing
    dict of keyword inputs is matched to named parameters only), and a skipped optional parameter was passed
    as None instead of its default."""
    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 8), "z": torch.randn(4, 8)}
    torch.manual_seed(0)
    model = quantize_model(_FORWARDS[kind]().eval())
    calibrate(model, [batch], "max", device="cpu")
    export_onnx(model, batch, tmp_path / "m.onnx", exporter=exporter)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["x", "z"]
    gain = 3.0 if kind == "skipped" else 1.0
    with torch.no_grad():
        want = (model.a(batch["x"]) * gain - model.b(batch["z"])).numpy()
    got = sess.run(None, {k: v.numpy() for k, v in batch.items()})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
