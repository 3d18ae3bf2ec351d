"""Decode graphs of causal LMs (issue 37): one graph for the prompt and each new token, a KV cache of the KV
heads only, the same logits step by step as in one prefill, for Llama, Qwen2 and GPT-2 and both exporters."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from exporters.causal_lm.decoder import DecoderWithCache, python_name, with_named_forward
from exporters.causal_lm.layout import NotDecodable, decoder_layout
from sample_models import tiny_llama
from tests.helpers import assert_clean_error, cli

transformers = pytest.importorskip("transformers")

VOCAB = 96


def _causal_lm(kind: str, **settings):
    """A random tiny transformers causal LM: 4 query heads and 2 KV heads of 16 (GPT-2: 2 heads of 16);
    ``settings`` go to its config."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0, **settings)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, **common)
        return transformers.GPT2LMHeadModel(cfg).eval()
    cls, cfg = {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
        "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig),
    }[kind]
    return cls(
        cfg(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            **common,
        )
    ).eval()


def _feeds(layout, takes_positions, ids, past, start):
    """One step's inputs (graph names): ``ids`` ``[b, s]`` after ``start`` cached positions."""
    b, s = ids.shape
    f = {"input_ids": ids.astype(np.int64), "attention_mask": np.ones((b, start + s), np.int64)}
    if takes_positions:
        f["position_ids"] = np.broadcast_to(np.arange(start, start + s), (b, s)).astype(np.int64)
    f.update(zip(layout.past_names, past))
    return f


def _empty(layout, batch):
    return [np.zeros((batch, layout.num_kv_heads, 0, layout.head_size), np.float32)] * (2 * layout.num_layers)


def run_steps(run, layout, takes_positions, ids, prompt: int):
    """Logits ``[b, n, vocab]`` of ``ids`` ``[b, n]`` from a prefill of ``prompt`` tokens and one decode step
    per later token; ``run(feeds) -> dict``."""
    out = run(_feeds(layout, takes_positions, ids[:, :prompt], _empty(layout, len(ids)), 0))
    logits = [out["logits"]]
    for t in range(prompt, ids.shape[1]):
        past = [out[n] for n in layout.present_names]
        out = run(_feeds(layout, takes_positions, ids[:, t : t + 1], past, t))
        logits.append(out["logits"])
    return np.concatenate(logits, axis=1)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("fused,skip_norm", [(False, False), (True, False), (True, True), (False, True)])
def test_decode_module_equals_the_models_own_logits(kind, fused, skip_norm):
    """Eager: prefill + decode steps through DecoderWithCache give transformers' logits of the whole
    sequence, with and without GroupQueryAttention and the fused residual Add + RMSNorm."""
    lm = _causal_lm(kind)
    dec = with_named_forward(DecoderWithCache(lm, fused=fused, skip_norm=skip_norm))
    assert dec.skip_norm == (skip_norm and kind != "gpt2")  # GPT-2's LayerNorm is not an RMSNorm
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))

    def run(feeds):
        with torch.no_grad():
            out = dec(**{python_name(k): torch.from_numpy(np.ascontiguousarray(v)) for k, v in feeds.items()})
        return {k: v.numpy() for k, v in out.items()}

    got = run_steps(run, dec.layout, dec.takes_positions, ids.numpy(), prompt=5)
    with torch.no_grad():
        ref = lm(input_ids=ids, use_cache=False).logits.numpy()
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=0)


def _texts():
    import argparse
    import textwrap

    return [ln.strip() for m in (argparse, textwrap, json) for ln in m.__doc__.splitlines() if ln.strip()]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A saved random model of each family and token ids to calibrate on."""
    root = tmp_path_factory.mktemp("decode")
    rng = np.random.default_rng(0)
    np.savez(
        root / "ids.npz", input_ids=rng.integers(0, VOCAB, (8, 12)), attention_mask=np.ones((8, 12), np.int64)
    )
    for kind in ("llama", "qwen2", "gpt2"):
        _causal_lm(kind).save_pretrained(str(root / kind))
    return root


def _calibrate(root, kind, config="int4-weight-only"):
    ck = root / f"{kind}-{config}.calib.pt"
    if not ck.exists():
        r = cli(
            "calibrate",
            root / kind,
            "--data",
            root / "ids.npz",
            "--config",
            config,
            "--placement",
            "all",
            "--out",
            ck,
        )
        assert r.exit_code == 0, r.output
    return ck


def _session(path, **options):
    so = ort.SessionOptions()
    for k, v in options.items():
        so.add_session_config_entry(k, v)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize(
    "kind,exporter,contrib",
    [
        ("llama", "torchscript", True),
        ("llama", "dynamo", True),
        ("llama", "torchscript", False),
        ("qwen2", "torchscript", True),
        ("qwen2", "dynamo", False),
        ("gpt2", "torchscript", False),
        ("gpt2", "dynamo", True),
    ],
)
def test_int4_decode_graph_steps_equal_one_prefill_and_cache_holds_kv_heads(
    folders, tmp_path, kind, exporter, contrib
):
    ck = _calibrate(folders, kind)
    path = tmp_path / f"{kind}.onnx"
    r = cli(
        "export",
        ck,
        "--onnx",
        path,
        "--exporter",
        exporter,
        "--contrib-ops" if contrib else "--standard-ops",
        "--json",
    )
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    layout = decoder_layout(_causal_lm(kind))
    fused_norm = ["SkipSimplifiedLayerNormalization"] if kind != "gpt2" else []
    assert res["decode"]["contrib_ops"] == (["GroupQueryAttention", *fused_norm] if contrib else [])
    assert res["output_names"] == ["logits", *layout.present_names]
    assert res["input_names"][-len(layout.past_names) :] == layout.past_names
    takes_positions = "position_ids" in res["input_names"]
    assert takes_positions == (
        not contrib or kind == "gpt2"
    )  # GroupQueryAttention reads positions from the mask

    # the cache holds the KV heads only: [batch, kv_heads, sequence, head_size], read from the graph
    graph = onnx.load(str(path)).graph
    shapes = {
        v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
        for v in [*graph.input, *graph.output]
    }
    for name in [*layout.past_names, *layout.present_names]:
        assert shapes[name][1] == layout.num_kv_heads and shapes[name][3] == layout.head_size, (
            name,
            shapes[name],
        )
        assert isinstance(shapes[name][0], str) and isinstance(
            shapes[name][2], str
        )  # dynamic batch and length
    if kind != "gpt2":
        assert layout.num_kv_heads < layout.num_heads

    # prefill + 4 decode steps == one prefill of the whole sequence, within float noise. MatMulNBits computes
    # in float32 (accuracy level 1): at onnxruntime's default level 4 it quantizes each row of activations to
    # int8, and a 1e-7 difference between the two paths can move a code (2e-3 in the logits), whatever the
    # cache does
    sess = _session(path, **{"session.qdq_matmulnbits_accuracy_level": "1"})
    names = [o.name for o in sess.get_outputs()]

    def run(feeds):
        return dict(zip(names, sess.run(None, feeds)))

    ids = np.random.default_rng(2).integers(0, VOCAB, (1 if contrib else 2, 10))
    stepped = run_steps(run, layout, takes_positions, ids, prompt=6)
    whole = run(_feeds(layout, takes_positions, ids, _empty(layout, len(ids)), 0))["logits"]
    np.testing.assert_allclose(stepped, whole, atol=1e-4, rtol=0)
    # and the graph computes the fake-quant model (float32 MatMulNBits compute: the quantized weights exactly)
    from quantcli import load_calibrated

    fake = load_calibrated(ck).model
    with torch.no_grad():
        ref = fake(input_ids=torch.from_numpy(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long))[
            "logits"
        ]
    np.testing.assert_allclose(whole, ref.numpy(), atol=1e-4, rtol=0)


def _optimized_ops(path, tmp_path) -> list:
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / f"{path.stem}.optimized.onnx")
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return list(onnx.load(so.optimized_model_filepath).graph.node)


def test_int4_decode_graph_runs_every_linear_as_matmul_nbits_in_the_builders_fused_form(folders, tmp_path):
    """onnxruntime's optimized graph: every Linear runs as MatMulNBits, q/k/v as one packed into each
    GroupQueryAttention and gate/up as one before a Split, every residual Add inside a
    SkipSimplifiedLayerNormalization (the form onnxruntime-genai's model builder writes); --standard-ops:
    one MatMulNBits per Linear and no contrib op."""
    ck = _calibrate(folders, "llama")
    path = tmp_path / "llama.onnx"
    r = cli("export", ck, "--onnx", path, "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    fusions = res["decode"]["fusions"]
    assert "q/k/v packed into GroupQueryAttention (2 layers)" in fusions
    assert "gate/up packed (2 layers)" in fusions
    nodes = _optimized_ops(path, tmp_path)
    ops = [n.op_type for n in nodes]
    # per layer: q/k/v, o, gate/up, down; and lm_head
    assert ops.count("MatMulNBits") == 2 * 4 + 1 and ops.count("GroupQueryAttention") == 2
    # the summary counts the graph's layers and stored weights, after packing (it said 15 beside 9 layers)
    assert res["matmul_nbits_layers"] == res["quantized_layers"] == 2 * 4 + 1
    assert res["weights_stored_quantized"] == 2 * 4 + 1
    assert all(n.input[1] == "" and n.input[2] == "" for n in nodes if n.op_type == "GroupQueryAttention")
    assert ops.count("SkipSimplifiedLayerNormalization") == 2 * 2 and ops.count("Split") == 2
    assert "Add" not in ops and "DequantizeLinear" not in ops and "MatMul" not in ops

    std = tmp_path / "standard.onnx"
    r = cli("export", ck, "--onnx", std, "--standard-ops", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["matmul_nbits_layers"] == 2 * 7 + 1
    ops = [n.op_type for n in _optimized_ops(std, tmp_path)]
    assert ops.count("MatMulNBits") == 2 * 7 + 1
    assert not {"GroupQueryAttention", "SkipSimplifiedLayerNormalization", "Split"} & set(ops)


def test_no_kv_cache_keeps_the_prefill_graph_and_static_shapes_are_refused(folders, tmp_path):
    ck = _calibrate(folders, "llama")
    r = cli("export", ck, "--onnx", tmp_path / "p.onnx", "--no-kv-cache", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["output_names"] == ["logits"] and res["decode"] is None
    r = cli("export", ck, "--onnx", tmp_path / "s.onnx", "--static-shapes")
    assert_clean_error(r, "--static-shapes", "--no-kv-cache")
    assert not (tmp_path / "s.onnx").exists()
    r = cli("export", ck, "--onnx", tmp_path / "s.onnx", "--dynamic-dim", "input_ids=1")
    assert_clean_error(r, "--dynamic-dim", "--no-kv-cache")  # was: an internal error, exit 3
    assert not (tmp_path / "s.onnx").exists()
    # options of decode graphs were accepted beside --no-kv-cache and did nothing
    for flag in ("--standard-ops", "--float-kv-cache"):
        r = cli("export", ck, "--onnx", tmp_path / "s.onnx", "--no-kv-cache", flag)
        assert_clean_error(r, flag, "--no-kv-cache writes a prefill graph")
        assert not (tmp_path / "s.onnx").exists()


def test_the_tiny_llama_sample_exports_a_decode_graph_that_equals_its_logits(tmp_path):
    ck = tmp_path / "tl.calib.pt"
    r = cli("calibrate", "tiny_llama", "--config", "int4-weight-only", "--placement", "all", "--out", ck)
    assert r.exit_code == 0, r.output
    path = tmp_path / "tl.onnx"
    r = cli("export", ck, "--onnx", path, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["decode"]["layout"]["num_kv_heads"] == 2
    from quantcli import load_calibrated

    fake = load_calibrated(ck).model  # TinyLlama with int4 fake-quant weights
    layout = decoder_layout(fake)
    sess = _session(path, **{"session.qdq_matmulnbits_accuracy_level": "1"})
    names = [o.name for o in sess.get_outputs()]
    ids = tiny_llama.evaluation_batches()[0]["input_ids"][:1, :40].numpy()
    stepped = run_steps(lambda f: dict(zip(names, sess.run(None, f))), layout, False, ids, prompt=32)
    with torch.no_grad():
        ref = fake(torch.from_numpy(ids)).numpy()
    np.testing.assert_allclose(stepped, ref, atol=1e-4, rtol=0)


def test_models_that_get_no_decode_graph_say_why():
    lm = _causal_lm("llama")
    lm.config.model_type = "gemma"
    with pytest.raises(NotDecodable, match="gemma"):
        decoder_layout(lm)
    lm = _causal_lm("qwen2")
    lm.config.use_sliding_window, lm.config.sliding_window = True, 16
    lm.config.layer_types = ["sliding_attention"] * 2  # what Qwen2Config derives from them
    with pytest.raises(NotDecodable, match="sliding window"):
        decoder_layout(lm)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_every_end_of_sequence_id_stops_generation_and_reaches_genai_config(kind):
    """A config listing several end-of-sequence ids (Llama 3, instruct models): the layout kept the first
    only, so generate ran past the others (transformers stops at any) and genai_config named one; its BOS and
    PAD were the EOS too. Now all of them, and the config's own BOS and PAD."""
    from exporters.causal_lm.export import genai_config
    from exporters.causal_lm.runner import generate

    model = _causal_lm(kind)
    model.config.eos_token_id, model.config.bos_token_id, model.config.pad_token_id = [3, 7], 1, 0
    lo = decoder_layout(model)
    assert (lo.eos_token_id, lo.eos_token_ids, lo.bos_token_id, lo.pad_token_id) == (3, (3, 7), 1, 0)
    layout = dict(lo.__dict__)
    cfg = genai_config({"layout": layout, "inputs": ["input_ids", "attention_mask"]}, "m.onnx")["model"]
    assert (cfg["eos_token_id"], cfg["bos_token_id"], cfg["pad_token_id"]) == ([3, 7], 1, 0)

    class Scripted:
        """A session whose logits pick the scripted tokens in turn."""

        eos_token_ids = frozenset(lo.eos_token_ids)

        def __init__(self, tokens):
            self.tokens = iter(tokens)

        def _logits(self):
            z = np.zeros(VOCAB, np.float32)
            z[next(self.tokens)] = 1
            return z

        def prefill(self, ids):
            return self._logits()[None, None], None

        def step(self, token, cache):
            return self._logits()[None], cache

    got = generate(Scripted([5, 9, 7, 4, 3]), [1, 2], 5)
    assert got.tokens == [5, 9, 7] and got.stopped == "eos"  # the second id stops it


@pytest.mark.parametrize(
    "kind, settings, slides",
    [
        ("mistral", {"sliding_window": 4096}, False),  # longer than the context: never takes effect
        ("mistral", {"sliding_window": 8}, True),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 28}, False),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, True),
    ],
)
def test_only_a_window_that_slides_is_refused(kind, settings, slides):
    """Mistral was refused whenever sliding_window was set, and Qwen2 whenever use_sliding_window was, though
    a window as long as the context, or layers that all attend fully (max_window_layers beyond the model's),
    compute what full attention does."""
    model = _causal_lm(kind, **settings)
    if slides:
        with pytest.raises(NotDecodable, match="sliding window"):
            decoder_layout(model)
    else:
        assert decoder_layout(model).model_type == kind


def test_a_causal_lm_written_as_a_prefill_graph_says_why_in_export_and_generate(tmp_path):
    """A family with no decode graph (Gemma) was exported as a prefill graph with one table row to say so;
    generate then told the user to export "without --no-kv-cache", which they had not passed. Export now says
    it on stderr, and generate gives export's reason."""
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "ids.npz", input_ids=rng.integers(0, VOCAB, (4, 12)), attention_mask=np.ones((4, 12), int)
    )
    torch.manual_seed(0)
    cfg = transformers.GemmaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )
    transformers.GemmaForCausalLM(cfg).eval().save_pretrained(str(tmp_path / "gemma"))
    ck, path = tmp_path / "g.calib.pt", tmp_path / "g.onnx"
    r = cli("calibrate", tmp_path / "gemma", "--data", tmp_path / "ids.npz", "--out", ck)
    assert r.exit_code == 0, r.output
    r = cli("export", ck, "--onnx", path)
    assert r.exit_code == 0 and "warning: prefill graph, no KV cache: model_type 'gemma'" in r.stderr, (
        r.output
    )
    r = cli("generate", path, "--prompt", "x", "--tokenizer", "bytes")
    assert_clean_error(r, "not a decode graph: export wrote a prefill graph, no KV cache: model_type 'gemma'")
    assert "--no-kv-cache" not in r.stderr
    # --standard-ops was dropped in silence there (exit 0, the same prefill graph), where --genai-config and
    # --embeddings were refused
    r = cli("export", ck, "--onnx", tmp_path / "s.onnx", "--standard-ops")
    assert_clean_error(r, "--standard-ops applies to decode graphs, and this model gets none", "'gemma'")
    assert not (tmp_path / "s.onnx").exists()


def test_a_byte_tokenizer_for_a_graph_of_more_than_256_tokens_is_refused(tmp_path):
    """``generate --tokenizer bytes`` on a graph of 512 tokens ended in an internal error (exit 3, "bytes must
    be in range(0, 256)") as soon as the graph generated an id past 255."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=300, n_layer=1, n_embd=32, n_head=2, n_positions=64)
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(str(tmp_path / "g"))
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "ids.npz", input_ids=rng.integers(0, 300, (4, 12)), attention_mask=np.ones((4, 12), int)
    )
    ck, path = tmp_path / "g.calib.pt", tmp_path / "g.onnx"
    assert cli("calibrate", tmp_path / "g", "--data", tmp_path / "ids.npz", "--out", ck).exit_code == 0
    assert cli("export", ck, "--onnx", path).exit_code == 0
    r = cli("generate", path, "--prompt", "hello", "--tokenizer", "bytes", "--max-new-tokens", "8")
    assert_clean_error(r, "has one token per byte, but the graph's vocabulary has 300 tokens", "--tokenizer")


def test_a_tensorrt_decode_graph_holds_standard_ops_only(tmp_path):
    """``calibrate --target tensorrt`` then ``export``: the decode graph had onnxruntime's com.microsoft
    GroupQueryAttention and SkipSimplifiedLayerNormalization, which TensorRT does not run."""
    ck, path = tmp_path / "t.calib.pt", tmp_path / "t.onnx"
    r = cli("calibrate", "tiny_llama", "--target", "tensorrt", "--num-samples", "8", "--out", ck)
    assert r.exit_code == 0, r.output
    r = cli("export", ck, "--onnx", path, "--json")
    assert r.exit_code == 0, r.output
    graph = onnx.load(str(path))
    assert json.loads(r.stdout)["decode"] is not None  # still a decode graph with a KV cache
    assert [n.op_type for n in graph.graph.node if n.domain not in ("", "ai.onnx")] == []
    assert any(i.name.startswith("past_key_values") for i in graph.graph.input)


def test_the_structure_check_reads_packed_weights_as_their_members(tmp_path):
    """q/k/v and gate/up packed into one weight had no pair of their own, so the structure check skipped them
    ("structure >= 15, measured 5, pass") and verify passed a graph whose v_proj scales were 1.5x: now the
    packed codes and scales are cut back into each member's columns and compared with the checkpoint."""
    from exporters.causal_lm.packing import PACKED_KEY
    from exporters.fold import make_initializer
    from exporters.graph import initializer_map, to_numpy
    from quantcli import load_calibrated
    from quantcli.verify.causal_lm import structure_check

    ck, path = tmp_path / "t.calib.pt", tmp_path / "t.onnx"
    r = cli("calibrate", "tiny_llama", "--config", "int4-weight-only", "--num-samples", "8", "--out", ck)
    assert r.exit_code == 0, r.output
    assert cli("export", ck, "--onnx", path).exit_code == 0
    graph, ckpt = onnx.load(str(path)), load_calibrated(ck)
    check = structure_check(graph, ckpt)
    n_weights = sum(1 for n in ckpt.quantizer_info if n.endswith("weight_quantizer"))
    assert check.passed and check.value == n_weights >= 10, check
    group = json.loads(next(p.value for p in graph.metadata_props if p.key == PACKED_KEY))[0]
    v = group["quantizers"].index(next(q for q in group["quantizers"] if ".v_proj." in q))
    start, width = sum(group["columns"][:v]), group["columns"][v]
    dq = next(n for n in graph.graph.node if n.output[0] == group["output"])
    scale = initializer_map(graph.graph)[dq.input[1]]
    values = to_numpy(scale).copy()
    values[..., start : start + width] *= 1.5
    scale.CopyFrom(make_initializer(scale.name, values, scale.data_type))
    check = structure_check(graph, ckpt)
    assert not check.passed and group["quantizers"][v] in check.detail, check


def test_a_gpt2_graphs_int8_kv_cache_scales_are_found_and_compared(folders, tmp_path):
    """GPT-2 names its blocks ``h.0``, not ``layers.0``: verify looked for each GroupQueryAttention's layer in
    its node name, found none, and failed every correct GPT-2 graph with an int8 KV cache ("layer 0: the int8
    KV cache's key scales are not found in the graph"). The layer is the cache it writes (present.{i}.key);
    a halved scale is still caught."""
    from onnx import numpy_helper

    from exporters.causal_lm.attention import KV_SCALE_INPUT
    from quantcli import load_calibrated
    from quantcli.verify.causal_lm import structure_check

    ck, path = tmp_path / "g.calib.pt", tmp_path / "g.onnx"
    r = cli("calibrate", folders / "gpt2", "--data", folders / "ids.npz", "--kv-cache", "int8", "--out", ck)
    assert r.exit_code == 0, r.output
    assert cli("export", ck, "--onnx", path).exit_code == 0
    graph, ckpt = onnx.load(str(path)), load_calibrated(ck)
    gqa = [n for n in graph.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and "h.1" in gqa[1].name
    check = structure_check(graph, ckpt)
    assert check.passed, check.detail
    scale = next(i for i in graph.graph.initializer if i.name == gqa[1].input[KV_SCALE_INPUT])
    scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * 0.5, scale.name))
    check = structure_check(graph, ckpt)
    assert not check.passed and "layer 1: the int8 KV cache's key scales differ" in check.detail, check
