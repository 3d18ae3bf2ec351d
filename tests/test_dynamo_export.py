"""Both torch exporters produce the same Q/DQ graph: node types, scales, zero points, outputs."""

import numpy as np
import onnx
import pytest

from exporters.graph import qdq_pairs
from quantcli import load_calibrated
from quantcli.verify import verify_onnx
from tests.helpers import assert_clean_error, cli
from tests.ort_util import onnx_and_torch, run_model


def _pairs(path):
    return {p.quantizer: p for p in qdq_pairs(onnx.load(str(path)))}


@pytest.mark.parametrize("model, config", [("digits_cnn", "int8"), ("text_encoder", "int8"),
                                           ("digits_cnn", "int4-weight-only"), ("digits_cnn", "fp8"),
                                           ("digits_cnn", "uint8-asymmetric")])
def test_same_graph_both_ways(model, config, calibrated, exported, tmp_path):
    ts = exported(model, config)
    dyn = tmp_path / "dynamo.onnx"
    r = cli("export", calibrated(model, config), "--onnx", dyn, "--exporter", "dynamo")
    assert r.exit_code == 0, r.output
    a, b = _pairs(ts), _pairs(dyn)
    assert set(a) == set(b) == set(load_calibrated(calibrated(model, config)).quantizer_info) - {
        n for n, q in load_calibrated(calibrated(model, config)).quantizer_info.items() if not q["enabled"]}
    for name in a:
        pa, pb = a[name], b[name]
        assert (pa.format, pa.stored, pa.axis, pa.block_size) == (pb.format, pb.stored, pb.axis, pb.block_size), name
        assert np.array_equal(pa.scale, pb.scale) and np.array_equal(pa.zero_point, pb.zero_point), name
    ck = load_calibrated(calibrated(model, config))
    feeds = {k: v.numpy() for k, v in ck.example.items()}
    out_a = run_model(onnx.load(str(ts)), feeds)[0]
    out_b = run_model(onnx.load(str(dyn)), feeds)[0]
    assert np.abs(out_a - out_b).max() <= 1e-4 * max(1.0, np.abs(out_a).max())
    rep = verify_onnx(dyn, ck, deployment=False)
    assert rep.passed, (rep.structure["problems"], [c.to_dict() for c in rep.checks])


def test_dynamo_needs_opset_18(calibrated, tmp_path):
    r = cli("export", calibrated("digits_cnn"), "--onnx", tmp_path / "o.onnx", "--exporter", "dynamo", "--opset", "13")
    assert_clean_error(r, "dynamo exporter", ">= 18")


def test_dynamo_dynamic_sequence(calibrated, tmp_path):
    out = tmp_path / "t.onnx"
    assert cli("export", calibrated("text_encoder"), "--onnx", out, "--exporter", "dynamo").exit_code == 0
    from sample_models.text_encoder import tokenize

    batch = tokenize(["x = 1", "a much longer line of plain english prose here", "return None"])
    got, want = onnx_and_torch(out, load_calibrated(calibrated("text_encoder")).model, batch)
    assert np.abs(got - want).max() < 1e-3 * max(1.0, np.abs(want).max())
