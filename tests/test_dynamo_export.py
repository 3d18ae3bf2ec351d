"""Both torch exporters produce the same Q/DQ graph: node types, scales, zero points, outputs."""

import numpy as np
import onnx
import pytest

from exporters.graph import qdq_pairs
from quantcli import load_calibrated
from quantcli.verify import verify_onnx
from tests.helpers import assert_clean_error, calibrated_file, cli, exported_and_verified
from tests.ort_util import onnx_and_torch, run_model


def _pairs(path):
    return {p.quantizer: p for p in qdq_pairs(onnx.load(str(path)))}


@pytest.mark.parametrize(
    "model, config",
    [
        ("digits_cnn", "int8"),
        ("text_encoder", "int8"),
        ("digits_cnn", "int4-weight-only"),
        ("digits_cnn", "fp8"),
        ("digits_cnn", "uint8-asymmetric"),
    ],
)
def test_same_graph_both_ways(model, config, calibrated, exported, tmp_path):
    ts = exported(model, config)
    dyn = tmp_path / "dynamo.onnx"
    r = cli("export", calibrated(model, config), "--onnx", dyn, "--exporter", "dynamo")
    assert r.exit_code == 0, r.output
    a, b = _pairs(ts), _pairs(dyn)
    assert (
        set(a)
        == set(b)
        == set(load_calibrated(calibrated(model, config)).quantizer_info)
        - {
            n
            for n, q in load_calibrated(calibrated(model, config)).quantizer_info.items()
            if not q["enabled"]
        }
    )
    for name in a:
        pa, pb = a[name], b[name]
        assert (pa.format, pa.stored, pa.axis, pa.block_size) == (
            pb.format,
            pb.stored,
            pb.axis,
            pb.block_size,
        ), name
        assert np.array_equal(pa.scale, pb.scale) and np.array_equal(pa.zero_point, pb.zero_point), name
    ck = load_calibrated(calibrated(model, config))
    feeds = {k: v.numpy() for k, v in ck.example.items()}
    out_a = run_model(onnx.load(str(ts)), feeds)[0]
    out_b = run_model(onnx.load(str(dyn)), feeds)[0]
    assert np.abs(out_a - out_b).max() <= 1e-4 * max(1.0, np.abs(out_a).max())
    rep = verify_onnx(dyn, ck, deployment=False)
    assert rep.passed, (rep.structure["problems"], [c.to_dict() for c in rep.checks])


def test_dynamo_needs_opset_18(calibrated, tmp_path):
    r = cli(
        "export",
        calibrated("digits_cnn"),
        "--onnx",
        tmp_path / "o.onnx",
        "--exporter",
        "dynamo",
        "--opset",
        "13",
    )
    assert_clean_error(r, "dynamo exporter", ">= 18")


def test_dynamo_dynamic_sequence(calibrated, tmp_path):
    out = tmp_path / "t.onnx"
    assert cli("export", calibrated("text_encoder"), "--onnx", out, "--exporter", "dynamo").exit_code == 0
    from sample_models.text_encoder import tokenize

    batch = tokenize(["x = 1", "a much longer line of plain english prose here", "return None"])
    got, want = onnx_and_torch(out, load_calibrated(calibrated("text_encoder")).model, batch)
    assert np.abs(got - want).max() < 1e-3 * max(1.0, np.abs(want).max())


T5_FACTORY = """
import torch
import transformers


class Encoder(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def make():
    torch.manual_seed(0)
    return Encoder(transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)).eval())
"""


@pytest.mark.parametrize("static", [False, True])
def test_dynamo_exports_attention_whose_output_is_viewed_after_transpose(tmp_path, static):
    """transformers' T5 (and Swin): scaled_dot_product_attention with a learned bias in its mask, then
    ``.transpose(1, 2).contiguous()`` and a view. torch's decomposition re-traces the attention through
    another kernel whose output has another layout, drops the ``contiguous`` and failed with "Cannot view a
    tensor with shape ..." (pytorch#136543); exporters.dynamo.AttentionLayout keeps one layout."""
    pytest.importorskip("transformers")
    (tmp_path / "t5.py").write_text(T5_FACTORY)
    rng = np.random.default_rng(0)
    mask = np.ones((8, 12), dtype=np.int64)  # one batch: the static graph takes 8
    mask[1::2, 9:] = 0
    np.savez(tmp_path / "ids.npz", input_ids=rng.integers(0, 64, (8, 12)), attention_mask=mask)
    ck = tmp_path / "t5.calib.pt"
    r = cli("calibrate", f"{tmp_path / 't5.py'}:make", "--data", tmp_path / "ids.npz", "--out", ck)
    assert r.exit_code == 0, r.output
    out = tmp_path / "t5.onnx"
    r = cli("export", ck, "--onnx", out, "--exporter", "dynamo", *(["--static-shapes"] if static else []))
    assert r.exit_code == 0, r.output
    r = cli("verify", out, "--reference", ck, "--data", tmp_path / "ids.npz", "--json")
    assert r.exit_code == 0, r.output


CLASHING_NAMES = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.meta = nn.Linear(4, 8)  # a metadata branch, named as users name it
        self.graph = nn.Linear(8, 8)  # and a graph-features one
        self.head = nn.Linear(16, 3)

    def forward(self, x, meta):
        return self.head(torch.cat([torch.relu(self.graph(x)), torch.relu(self.meta(meta))], dim=1))


def make():
    torch.manual_seed(0)
    return Net().eval()
"""


def test_dynamo_exports_children_named_like_graph_module_attributes(tmp_path):
    """torch.export's GraphModule has attributes ``meta``, ``graph``, ...: a top-level child of that name was
    shadowed and the export failed with "Node meta_weight target meta.weight references nonexistent attribute
    weight of meta" (cut, with the exporter's colour codes). exporters.dynamo exports such a model one level
    down and removes that level from the recorded module paths, so the quantizers are named as without it."""
    (tmp_path / "net.py").write_text(CLASHING_NAMES)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((16, 8)), meta=rng.standard_normal((16, 4)))
    ck, out = tmp_path / "net.calib.pt", tmp_path / "net.onnx"
    r = cli(
        "calibrate",
        f"{tmp_path / 'net.py'}:make",
        "--data",
        tmp_path / "d.npz",
        "--out",
        ck,
        "--placement",
        "all",
    )
    assert r.exit_code == 0, r.output
    r = cli("export", ck, "--onnx", out, "--exporter", "dynamo")
    assert r.exit_code == 0, r.output
    assert {q for q in _pairs(out) if q} >= {"meta.weight_quantizer", "graph.weight_quantizer"}
    r = cli("verify", out, "--reference", ck, "--data", tmp_path / "d.npz", "--json")
    assert r.exit_code == 0, r.output


_UINT8_IMAGES = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4, 2)

    def forward(self, img):
        x = img.float() / 255.0
        return self.fc(self.conv(x).mean((2, 3)))


def make():
    torch.manual_seed(0)
    return Net().eval()
"""


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_uint8_image_input_has_no_sequence_axis(tmp_path, exporter):
    """A uint8 image (batch, 3, H, W) got its channel axis marked dynamic as 'sequence' (the rule for token
    ids), and the dynamo exporter refused the model ("Received user-specified dim hint Dim.DYNAMIC ... static
    shape of 3")."""
    import onnx

    imgs = np.random.default_rng(0).integers(0, 256, (16, 3, 8, 8), dtype=np.uint8)
    ck, data = calibrated_file(tmp_path, _UINT8_IMAGES, {"img": imgs})
    graph = exported_and_verified(ck, data, tmp_path / "m.onnx", "--exporter", exporter)
    dims = onnx.load(str(graph)).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["batch", 3, 8, 8]
