"""The token embedding as onnxruntime's GatherBlockQuantized (issue 37): tied to an int4 lm_head, the lookup
reads lm_head's own codes (the file holds the table once); untied or at other bits, its own round-to-nearest
table; either way the graph computes the model with that table and onnxruntime runs the lookup quantized."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

from exporters.graph import to_numpy
from quantcli import load_calibrated
from quantcli.verify.causal_lm import as_deployed
from sample_models import tiny_llama
from tests.helpers import assert_clean_error, cli

transformers = pytest.importorskip("transformers")


def _optimized(path, tmp_path) -> list:
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / f"{path.stem}.optimized.onnx")
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return list(onnx.load(so.optimized_model_filepath).graph.node)


def _exact_logits(path, ids) -> np.ndarray:
    from exporters.causal_lm.runner import DecodeSession

    so = ort.SessionOptions()
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    return DecodeSession(path, so).logits(ids)


@pytest.fixture(scope="module")
def tiny_int4(tmp_path_factory):
    root = tmp_path_factory.mktemp("emb")
    cfg = root / "int4.json"
    cfg.write_text(json.dumps({"preset": "int4-weight-only", "block_size": 32}))
    ck = root / "tl.calib.pt"
    r = cli("calibrate", "tiny_llama", "--config", cfg, "--placement", "all", "--out", ck)
    assert r.exit_code == 0, r.output
    return ck


def test_tied_int4_embedding_reads_lm_heads_codes(tiny_int4, tmp_path):
    ck = tiny_int4
    plain, quant = tmp_path / "plain.onnx", tmp_path / "emb.onnx"
    assert cli("export", ck, "--onnx", plain).exit_code == 0
    r = cli("export", ck, "--onnx", quant, "--embeddings", "int4", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["decode"]["embeddings"]["shared_with_lm_head"] and res["unfused_layers"] == 0
    assert "GatherBlockQuantized" in res["decode"]["contrib_ops"]
    # onnxruntime runs the lookup quantized and lm_head still as MatMulNBits
    ops = [n.op_type for n in _optimized(quant, tmp_path)]
    assert ops.count("GatherBlockQuantized") == 1 and "Gather" not in ops
    assert ops.count("MatMulNBits") == 2 * 4 + 1 and "DequantizeLinear" not in ops
    # the file holds no float table and no second copy: the lookup reads lm_head's [hidden 128, vocab 256]
    # codes (through a Transpose onnxruntime folds at load)
    model = onnx.load(str(quant))
    inits = {t.name: t for t in model.graph.initializer}
    assert not [
        t for t in inits.values() if t.data_type == onnx.TensorProto.FLOAT and sorted(t.dims) == [128, 256]
    ]
    producers = {o: n for n in model.graph.node for o in n.output}
    gbq = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    lm_head = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and "lm_head" in n.name)
    assert producers[gbq.input[0]].input[0] == lm_head.input[0]
    assert producers[gbq.input[2]].input[0] == lm_head.input[1]
    tables = [inits[lm_head.input[0]]]
    assert list(tables[0].dims) == [128, 256] and tables[0].data_type == onnx.TensorProto.INT4
    assert res["file_bytes"] < json.loads(cli("export", ck, "--onnx", plain, "--json").stdout)["file_bytes"]
    # every row the lookup returns is lm_head's dequantized weight (its stored codes times scales, read from
    # the graph), and the graph computes the fake-quant model with that table
    loaded = load_calibrated(ck)
    codes = to_numpy(tables[0]).astype(np.float32)  # [hidden, vocab]
    scale_name = next(
        n.input[1]
        for n in model.graph.node
        if n.op_type == "DequantizeLinear" and n.input[0] == tables[0].name
    )
    scale = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == scale_name))
    table = (codes * np.repeat(scale, 32, axis=0)).T
    ref = as_deployed(loaded.model, None, res["decode"]["embeddings"])
    assert np.array_equal(ref.decoder.embedding_table.numpy(), table)
    ids = tiny_llama.evaluation_batches()[0]["input_ids"][:1, :48].numpy()
    with torch.no_grad():
        want = ref(torch.from_numpy(ids)).numpy()
    np.testing.assert_allclose(_exact_logits(quant, ids), want, atol=1e-4, rtol=0)
    assert np.abs(_exact_logits(plain, ids) - want).max() > 1e-3  # the float table differs
    r = cli("verify", quant, "--reference", ck, "--json", "--num-samples", 2, "--decode-steps", 4)
    assert r.exit_code == 0, r.output
    ppl = json.loads(r.stdout)["perplexity"]
    assert abs(ppl["graph"] - ppl["fake_quant"]) < 0.01 * ppl["fake_quant"]


def test_untied_int8_embedding_has_its_own_round_to_nearest_table(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    lm = transformers.LlamaForCausalLM(cfg).eval()
    lm.save_pretrained(str(tmp_path / "llama"))
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "ids.npz", input_ids=rng.integers(0, 96, (4, 12)))
    ck = tmp_path / "l.calib.pt"
    r = cli(
        "calibrate", tmp_path / "llama", "--data", tmp_path / "ids.npz", "--config", "int4-weight-only",
        "--placement", "all", "--out", ck,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    path = tmp_path / "l.onnx"
    r = cli("export", ck, "--onnx", path, "--embeddings", "int8", "--json")
    assert r.exit_code == 0, r.output
    emb = json.loads(r.stdout)["decode"]["embeddings"]
    assert not emb["shared_with_lm_head"] and emb["table_bytes"] == 96 * 64
    # the table by hand: per block of 32 along hidden, scale max|w| / 127, codes rounded half to even
    w = lm.model.embed_tokens.weight.detach().numpy().reshape(96, 2, 32)
    scale = np.abs(w).max(-1) / 127
    codes = np.clip(np.rint(w / scale[..., None]), -128, 127)
    model = onnx.load(str(path))
    node = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    stored = inits[node.input[0]].astype(np.int64) - 128  # uint8, onnxruntime's default zero point 128
    assert np.array_equal(stored, codes.reshape(96, 64)) and np.allclose(inits[node.input[2]], scale)
    ids = rng.integers(0, 96, (1, 10))
    ref = as_deployed(load_calibrated(ck).model, None, emb)
    with torch.no_grad():
        want = ref(torch.from_numpy(ids)).numpy()
    np.testing.assert_allclose(_exact_logits(path, ids), want, atol=1e-4, rtol=0)


def test_bad_embedding_requests_are_one_line_errors(tiny_int4, tmp_path):
    assert_clean_error(
        cli("export", tiny_int4, "--onnx", tmp_path / "a.onnx", "--embeddings", "int3"),
        "--embeddings",
        "int4",
    )
    r = cli("export", tiny_int4, "--onnx", tmp_path / "b.onnx", "--embeddings", "int4", "--no-kv-cache")
    assert_clean_error(r, "--embeddings", "decode graphs")
    assert not (tmp_path / "a.onnx").exists() and not (tmp_path / "b.onnx").exists()
