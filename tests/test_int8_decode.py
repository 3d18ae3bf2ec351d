"""int8 decode graphs (issue 37) that keep decode parity.

* int8 weights in MatMulNBits form (``int4-weight-only`` with 8-bit weights): onnxruntime's kernel
  (``accuracy_level`` 4, its default) quantizes each row of activations to int8 at run time, one scale per
  token and block, so a token's logits do not depend on the tokens computed with it: step-by-step decoding
  equals one prefill but where float noise moves a code. ``int8-dynamic``'s DynamicQuantizeLinear takes one
  scale over all tokens of a step, so every decode step differs from the prefill.
* static int8 with SmoothQuant: constant activation scales, the same logits either way.
"""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from exporters.causal_lm.runner import DecodeSession
from sample_models import tiny_llama
from tests.helpers import cli

INT8_WEIGHTS = {
    "preset": "int4-weight-only",
    "block_size": 32,
    "reduce_range": False,  # MatMulNBits' int8 kernel does not saturate on AVX2 (its own 8-bit path)
    "rules": [{"pattern": "*.weight_quantizer", "num_bits": 8}],
}


def _export(root, name: str, config, *calibrate_args) -> tuple:
    if isinstance(config, dict):
        (root / f"{name}.json").write_text(json.dumps(config))
        config = root / f"{name}.json"
    ck, path = root / f"{name}.calib.pt", root / f"{name}.onnx"
    r = cli(
        "calibrate", "tiny_llama", "--config", config, "--placement", "all", "--out", ck, "--json",
        *calibrate_args,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    r = cli("export", ck, "--onnx", path)
    assert r.exit_code == 0, r.output
    return ck, path, info


def _steps_off_the_prefill(path, rows=4, length=96) -> float:
    """The fraction of decode steps (deployed session: default options) whose logits differ from one prefill
    of the whole sequence by more than float noise (1e-4 of the largest logit)."""
    s = DecodeSession(path)
    seqs = [r.numpy()[None, :length] for b in tiny_llama.evaluation_batches() for r in b["input_ids"]][:rows]
    off = total = 0
    for ids in seqs:
        half = length // 2
        a, b = s.stepwise_logits(ids, half)[0, half:], s.logits(ids)[0, half:]
        d = np.abs(a - b).max(-1) / np.abs(b).max()
        off, total = off + int((d > 1e-4).sum()), total + len(d)
    return off / total


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    root = tmp_path_factory.mktemp("int8")
    return {
        "per_token": _export(root, "w8", INT8_WEIGHTS),
        "dynamic": _export(root, "dyn", "int8-dynamic"),
    }


def test_int8_weights_run_as_matmul_nbits_with_per_token_activation_scales(graphs, tmp_path):
    ck, path, _ = graphs["per_token"]
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    nodes = [n for n in onnx.load(so.optimized_model_filepath).graph.node if n.op_type == "MatMulNBits"]
    attrs = [{a.name: helper.get_attribute_value(a) for a in n.attribute} for n in nodes]
    assert len(nodes) == 2 * 4 + 1 and all(a["bits"] == 8 and a["accuracy_level"] == 4 for a in attrs)
    # deployed: decode steps equal the prefill but where float noise moved a code; int8-dynamic: none does
    assert _steps_off_the_prefill(path) < 0.1
    assert _steps_off_the_prefill(graphs["dynamic"][1]) > 0.9
    r = cli("verify", path, "--reference", ck, "--json", "--num-samples", 4, "--decode-steps", 8)
    assert r.exit_code == 0, r.output
    checks = {c["name"]: c["value"] for c in json.loads(r.stdout)["checks"]}
    assert checks["lm.decode_parity"] < 1e-5 and checks["lm.perplexity_increase"] < 0.02


def test_static_int8_with_smoothquant_decodes_exactly_as_it_prefills(tmp_path):
    ck, path, info = _export(tmp_path, "sq", "int8", "--smoothquant", "0.5", "--smoothquant-min-gain", "0")
    assert len(info["smoothquant"]["groups"]) >= 6  # q/k/v, gate/up, down... inputs of both layers smoothed
    graph = onnx.load(str(path)).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("QuantizeLinear") >= 15 and "GroupQueryAttention" in ops  # static Q/DQ, fused attention
    s = DecodeSession(path)  # default options: onnxruntime's integer kernels
    ids = tiny_llama.evaluation_batches()[0]["input_ids"][:2, :80].numpy()
    for row in ids:  # GroupQueryAttention decodes one row at a time with a cache
        np.testing.assert_array_equal(s.stepwise_logits(row[None], 40), s.logits(row[None]))
    r = cli("verify", path, "--reference", ck, "--json", "--num-samples", 4, "--decode-steps", 8)
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    checks = {c["name"]: c["value"] for c in rep["checks"]}
    assert checks["lm.decode_parity"] == 0.0 and checks["lm.perplexity_increase"] < 0.05
    ppl = rep["perplexity"]
    assert abs(ppl["graph"] - ppl["fake_quant"]) < 0.01 * ppl["fake_quant"]


def test_verify_of_a_decode_graph_checks_its_structure(calibrated, tmp_path):
    """Decode graphs get the structure check too: one activation scale in the graph made 1.3x (what a graph
    of another calibration looks like) fails it, naming the quantizer; a checkpoint of another model (a text
    encoder) fails it instead of stopping with an internal error; the graph as exported passes."""
    from exporters.graph import QUANTIZERS_KEY

    ck, path, _ = _export(tmp_path, "static", "int8", "--num-samples", "8")  # static activation scales
    m = onnx.load(str(path))
    names = json.loads(next(p.value for p in m.metadata_props if p.key == QUANTIZERS_KEY))
    inits = {t.name: t for t in m.graph.initializer}
    dq = next(
        n
        for n in m.graph.node
        if n.op_type == "DequantizeLinear" and names.get(n.output[0], "").endswith("input_quantizer")
    )
    scale = inits[dq.input[1]]
    wider = onnx.numpy_helper.to_array(scale) * np.float32(1.3)
    scale.CopyFrom(onnx.numpy_helper.from_array(wider, scale.name))
    tampered = tmp_path / "tampered.onnx"
    onnx.save(m, str(tampered))
    for graph, reference, failing in (
        (tampered, ck, names[dq.output[0]]),
        (path, calibrated("text_encoder"), "classifier"),
    ):
        r = cli("verify", graph, "--reference", reference, "--json", "--num-samples", 2, "--decode-steps", 4)
        assert r.exit_code == 1, r.output
        checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
        assert not checks["structure"]["passed"] and failing in checks["structure"]["detail"]


def test_verify_of_a_decode_graph_fails_a_graph_that_computes_other_logits(tmp_path):
    """A decode graph whose final RMSNorm weight was scaled by 0.7 (its logits scaled by 0.7) passed verify:
    perplexity stayed within its 50%, the argmax (token agreement) and the cache (decode parity) did not
    change, and nothing compared the graph's logits with the calibrated model's. lm.rms_ratio does, in the
    unit of fidelity.rms_ratio: the graph as exported is within it, the scaled one far beyond while the other
    three checks still pass."""
    ck, path, _ = _export(tmp_path, "static", "int8", "--num-samples", "8")
    args = ("--reference", ck, "--json", "--num-samples", 4, "--decode-steps", 4)
    r = cli("verify", path, *args)
    assert r.exit_code == 0, r.output
    good = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert good["lm.rms_ratio"]["value"] < 0.5, good["lm.rms_ratio"]
    m = onnx.load(str(path))
    norm = next(t for t in m.graph.initializer if t.name == "model.norm.weight")
    norm.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(norm) * np.float32(0.7), norm.name))
    scaled = tmp_path / "scaled.onnx"
    onnx.save(m, str(scaled))
    r = cli("verify", scaled, *args)
    assert r.exit_code == 1, r.output
    bad = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert not bad["lm.rms_ratio"]["passed"] and bad["lm.rms_ratio"]["value"] > 5, bad["lm.rms_ratio"]
    assert all(bad[n]["passed"] for n in ("structure", "lm.token_agreement", "lm.decode_parity")), bad
