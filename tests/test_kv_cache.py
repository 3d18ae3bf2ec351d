"""An int8 KV cache (issue 37): onnxruntime's GroupQueryAttention runs it with the arithmetic quantcli's
decode module computes, the scales come from the calibration data, the graph stores int8 codes of the KV
heads only, one prefill equals step-by-step decoding, and verify judges the graph against the model with
the same cache."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from exporters.causal_lm import attention, kv_cache
from exporters.causal_lm.runner import DecodeSession
from sample_models import tiny_llama
from tests.helpers import assert_clean_error, cli

H, KV, D = 4, 2, 32


def _gqa_graph(scale_shape: list[int], quant_type: str) -> onnx.ModelProto:
    """One GroupQueryAttention with an int8 cache and constant scales (``ks``, ``vs``)."""
    cache = [1, KV, None, D]
    inputs = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, None, H * D]),
        helper.make_tensor_value_info("k", TensorProto.FLOAT, [1, None, KV * D]),
        helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, None, KV * D]),
        helper.make_tensor_value_info("pk", TensorProto.INT8, cache),
        helper.make_tensor_value_info("pv", TensorProto.INT8, cache),
        helper.make_tensor_value_info("seqlens", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total", TensorProto.INT32, []),
        helper.make_tensor_value_info("ks", TensorProto.FLOAT, scale_shape),
        helper.make_tensor_value_info("vs", TensorProto.FLOAT, scale_shape),
    ]
    node = helper.make_node(
        "GroupQueryAttention",
        ["q", "k", "v", "pk", "pv", "seqlens", "total", "", "", "", "", "", "ks", "vs"],
        ["out", "present_k", "present_v"],
        domain="com.microsoft",
        num_heads=H,
        kv_num_heads=KV,
        k_quant_type=quant_type,
        v_quant_type=quant_type,
        kv_cache_bit_width=8,
    )
    outputs = [
        helper.make_tensor_value_info("out", TensorProto.FLOAT, None),
        helper.make_tensor_value_info("present_k", TensorProto.INT8, None),
        helper.make_tensor_value_info("present_v", TensorProto.INT8, None),
    ]
    graph = helper.make_graph([node], "gqa_int8_cache", inputs, outputs)
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
        ir_version=10,
    )


@pytest.mark.parametrize("per_channel", [False, True])
def test_onnxruntime_runs_an_int8_cache_as_the_decode_modules_kernel_computes(per_channel):
    """onnxruntime's CPU GroupQueryAttention with an int8 cache: the new keys and values stored as
    clip(round_half_even(x / scale), -128, 127) -- ties to even, beyond +-127.5 scales saturated -- and
    attention over every position dequantized (the new ones included), exactly what the eager kernel of
    quantcli's op computes."""
    rng = np.random.default_rng(0)
    shape = [1, KV, 1, D] if per_channel else [1]
    ks = np.full(shape, 0.25, np.float32) if not per_channel else rng.uniform(0.01, 0.05, shape)
    vs = rng.uniform(0.01, 0.05, shape).astype(np.float32)
    ks = np.asarray(ks, np.float32)
    past, new = 5, 3
    k = rng.standard_normal((1, new, KV * D)).astype(np.float32)
    if not per_channel:  # exact ties (odd multiples of scale / 2) and values beyond the int8 range
        k[0, 0] = (np.arange(KV * D) - KV * D / 2).astype(np.float32) * 0.125
        k[0, 1, :4] = [40.0, -40.0, 31.875, -32.125]
    feeds = {
        "q": rng.standard_normal((1, new, H * D)).astype(np.float32),
        "k": k,
        "v": rng.standard_normal((1, new, KV * D)).astype(np.float32),
        "pk": rng.integers(-128, 128, (1, KV, past, D)).astype(np.int8),
        "pv": rng.integers(-128, 128, (1, KV, past, D)).astype(np.int8),
        "seqlens": np.array([past + new - 1], np.int32),
        "total": np.array(past + new, np.int32),
        "ks": ks,
        "vs": vs,
    }
    sess = ort.InferenceSession(
        _gqa_graph(shape, "PER_CHANNEL" if per_channel else "PER_TENSOR").SerializeToString(),
        providers=["CPUExecutionProvider"],
    )
    out, present_k, present_v = sess.run(None, feeds)
    t = {n: torch.from_numpy(np.asarray(v)) for n, v in feeds.items()}
    with torch.no_grad():
        ref = attention.group_query_attention(
            t["q"], t["k"], t["v"], t["pk"], t["pv"], t["seqlens"], t["total"], None, None, H, KV,
            attention.default_scale(D), t["ks"], t["vs"],
        )  # fmt: skip
    assert present_k.dtype == np.int8 and np.array_equal(present_k, ref[1].numpy())
    assert np.array_equal(present_v, ref[2].numpy())
    # float noise (onnxruntime's exp and sums differ by CPU: 2e-6 on AVX2, 5e-6 with AVX-512); the cached
    # codes, where a wrong scale or rounding would show, are compared exactly above
    np.testing.assert_allclose(out, ref[0].numpy(), atol=1e-5, rtol=0)
    # the codes by hand: numpy's rint rounds half to even, as ONNX QuantizeLinear does
    new_k = k.reshape(1, new, KV, D).transpose(0, 2, 1, 3)
    want = np.clip(np.rint(new_k / np.broadcast_to(ks, (1, KV, 1, D))), -128, 127)
    assert np.array_equal(present_k[:, :, past:], want.astype(np.int8))
    if not per_channel:
        # -4 / .25, -3.875 / .25 = -15.5 and -3.625 / .25 = -14.5: ties to even
        assert present_k[0, 0, past, :4].tolist() == [-16, -16, -15, -14]
        assert present_k[0, 0, past + 1, :4].tolist() == [127, -128, 127, -128]  # saturated


def test_scales_are_the_largest_cached_magnitude_per_channel_head_or_layer():
    amax = torch.tensor([[[1.0, 2.0, 0.0], [4.0, 0.5, 0.25]]])  # [layers 1, kv 2, d 3]
    q = kv_cache.KVCacheQuant.from_amax(amax, amax * 2, "channel")
    assert torch.allclose(q.key_scale[0, 0], torch.tensor([1 / 127, 2 / 127, 1.0]))  # a dead channel: 1
    assert torch.allclose(q.value_scale[0, 1], torch.tensor([8, 1, 0.5]) / 127)
    head = kv_cache.KVCacheQuant.from_amax(amax, amax, "head")
    assert torch.allclose(head.key_scale[0], torch.tensor([[2.0] * 3, [4.0] * 3]) / 127)
    tensor = kv_cache.KVCacheQuant.from_amax(amax, amax, "tensor")
    assert torch.allclose(tensor.key_scale, torch.full((1, 2, 3), 4 / 127))
    assert tensor.layer_scales(0)[0].shape == (1,) and head.layer_scales(0)[0].shape == (1, 2, 1, 3)
    assert q.bytes_per_token() == 2 * 2 * 3 and q.summary()["float32_bytes_per_token"] == 4 * 12


@pytest.fixture(scope="module")
def int8_cache(tmp_path_factory):
    """tiny_llama, int4 weights (RTN, block 32) and an int8 cache calibrated per channel, exported with
    GroupQueryAttention; the same checkpoint exported with a float cache."""
    root = tmp_path_factory.mktemp("kv")
    cfg = root / "int4.json"
    cfg.write_text(json.dumps({"preset": "int4-weight-only", "block_size": 32}))
    ck = root / "kv.calib.pt"
    r = cli(
        "calibrate", "tiny_llama", "--config", cfg, "--placement", "all", "--kv-cache", "int8", "--json",
        "--out", ck,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["kv_cache"]["granularity"] == "channel"
    paths = {}
    for name, extra in (("int8", []), ("float", ["--float-kv-cache"]), ("std", ["--standard-ops"])):
        paths[name] = root / f"{name}.onnx"
        r = cli("export", ck, "--onnx", paths[name], "--json", *extra)
        assert r.exit_code == 0, r.output
    return ck, paths, json.loads(r.stdout)


def _exact(path) -> DecodeSession:
    so = ort.SessionOptions()
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    return DecodeSession(path, so)


def test_the_graph_stores_int8_codes_of_the_kv_heads_with_calibrated_scales(int8_cache):
    ck, paths, _ = int8_cache
    graph = onnx.load(str(paths["int8"])).graph
    for value in [*graph.input, *graph.output]:
        if value.name.startswith(("past_key_values.", "present.")):
            t = value.type.tensor_type
            assert t.elem_type == TensorProto.INT8, value.name
            assert [d.dim_value for d in t.shape.dim][1::2] == [2, 32]  # kv heads, head size
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    gqa = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    attrs = [{a.name: helper.get_attribute_value(a) for a in n.attribute} for n in gqa]
    assert len(gqa) == 2 and all(a["k_quant_type"] == b"PER_CHANNEL" for a in attrs)
    # the scales: amax / 127 of the keys (after RoPE) and values each layer caches over the calibration
    # windows, read here from the float-cache graph's present outputs in onnxruntime
    ref = _exact(paths["float"])
    lo = {"k": np.zeros((2, 2, 32)), "v": np.zeros((2, 2, 32))}
    for batch in tiny_llama.calibration_batches():
        _, cache = ref.prefill(batch["input_ids"].numpy())
        for i in range(2):
            lo["k"][i] = np.maximum(lo["k"][i], np.abs(cache.past[2 * i]).max(axis=(0, 2)))
            lo["v"][i] = np.maximum(lo["v"][i], np.abs(cache.past[2 * i + 1]).max(axis=(0, 2)))
    for i, node in enumerate(gqa):
        ks, vs = inits[node.input[12]], inits[node.input[13]]
        assert ks.shape == (1, 2, 1, 32)
        np.testing.assert_allclose(ks[0, :, 0], lo["k"][i] / 127, rtol=2e-4)
        np.testing.assert_allclose(vs[0, :, 0], lo["v"][i] / 127, rtol=2e-4)


def test_int8_cache_decodes_as_one_prefill_and_as_the_model_with_the_same_cache(int8_cache):
    """Step by step equals one prefill (the cache's codes do not depend on the step), the graph equals the
    fake-quant model with its keys and values quantized as the cache stores them, both for
    GroupQueryAttention and for the standard-ops graph -- and the int8 cache changes the logits (it is
    really used)."""
    ck, paths, std = int8_cache
    assert std["decode"]["contrib_ops"] == [] and std["decode"]["kv_cache"]["bytes_per_token"] == 256
    from quantcli import load_calibrated
    from quantcli.verify.causal_lm import with_quantized_cache

    loaded = load_calibrated(ck)
    ids = tiny_llama.evaluation_batches()[0]["input_ids"][:1, :48].numpy()
    with torch.no_grad():
        ref = with_quantized_cache(loaded.model, loaded.kv_cache)(torch.from_numpy(ids)).numpy()
    for name in ("int8", "std"):
        s = _exact(paths[name])
        assert s.cache_dtype == np.int8
        whole = s.logits(ids)
        np.testing.assert_allclose(s.stepwise_logits(ids, 32), whole, atol=1e-4, rtol=0)
        np.testing.assert_allclose(whole, ref, atol=1e-4, rtol=0)
    float_cache = _exact(paths["float"]).logits(ids)
    assert np.abs(float_cache - whole).max() > 1e-2


def test_verify_judges_the_int8_cache_graph_against_the_model_with_that_cache(int8_cache):
    ck, paths, _ = int8_cache
    r = cli("verify", paths["int8"], "--reference", ck, "--json", "--num-samples", 4, "--decode-steps", 8)
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert all(c["passed"] for c in rep["checks"])
    ppl = rep["perplexity"]
    assert abs(ppl["graph"] - ppl["fake_quant"]) < 0.01 * ppl["fake_quant"]


def test_bad_kv_cache_requests_are_one_line_errors(tmp_path):
    r = cli("calibrate", "tiny_llama", "--kv-cache", "int4", "--out", tmp_path / "x.calib.pt")
    assert_clean_error(r, "--kv-cache", "int8-channel")
    assert not (tmp_path / "x.calib.pt").exists()
    r = cli("calibrate", "digits_cnn", "--kv-cache", "int8", "--out", tmp_path / "d.calib.pt")
    assert_clean_error(r, "--kv-cache", "causal LM")
    assert not (tmp_path / "d.calib.pt").exists()


def test_the_structure_check_compares_the_kv_cache_scales(tmp_path):
    """verify passed a decode graph whose layer-1 value-cache scales were halved (and one whose key scales
    were doubled): the int8 KV cache's scales, stored in the checkpoint, were never compared with the
    graph's."""
    import onnx
    from onnx import numpy_helper

    from exporters.causal_lm.attention import KV_SCALE_INPUT
    from quantcli import load_calibrated
    from quantcli.verify.causal_lm import structure_check
    from tests.helpers import cli

    ck, path = tmp_path / "kv.calib.pt", tmp_path / "kv.onnx"
    r = cli("calibrate", "tiny_llama", "--kv-cache", "int8", "--num-samples", "8", "--out", ck)
    assert r.exit_code == 0, r.output
    assert cli("export", ck, "--onnx", path).exit_code == 0
    graph, ckpt = onnx.load(str(path)), load_calibrated(ck)
    assert structure_check(graph, ckpt).passed
    gqa = next(n for n in graph.graph.node if n.op_type == "GroupQueryAttention" and "layers.1" in n.name)
    scale = next(i for i in graph.graph.initializer if i.name == gqa.input[KV_SCALE_INPUT + 1])
    scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * 0.5, scale.name))
    check = structure_check(graph, ckpt)
    assert not check.passed and "layer 1: the int8 KV cache's value scales differ" in check.detail, check


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_the_structure_check_compares_a_standard_ops_caches_scales(tmp_path, exporter):
    """A --standard-ops decode graph quantizes its cache with plain ops (the new keys and values divided by
    their scale, rounded, clipped, cast to int8; the codes multiplied by it where attention reads them):
    verify compared none of those scales, so a graph whose layer-1 value scale was halved passed."""
    import onnx
    from onnx import numpy_helper

    from quantcli import load_calibrated
    from quantcli.verify.causal_lm import structure_check
    from tests.helpers import cli

    ck, path = tmp_path / "kv.calib.pt", tmp_path / "kv.onnx"
    r = cli("calibrate", "tiny_llama", "--kv-cache", "int8", "--num-samples", "8", "--out", ck)
    assert r.exit_code == 0, r.output
    r = cli("export", ck, "--onnx", path, "--standard-ops", "--exporter", exporter)
    assert r.exit_code == 0, r.output
    graph, ckpt = onnx.load(str(path)), load_calibrated(ck)
    assert structure_check(graph, ckpt).passed
    producer = {o: n for n in graph.graph.node for o in n.output}
    inits = {i.name: i for i in graph.graph.initializer}

    def scale_of(output, op):
        """The initializer the codes of ``output`` are divided by (``Div``) or multiplied by (``Mul``)."""
        if op == "Div":
            stack, seen = [output], set()
            while stack:
                n = producer.get(stack.pop())
                if n is None or n.name in seen:
                    continue
                seen.add(n.name)
                if n.op_type == "Div" and n.input[1] in inits:
                    return inits[n.input[1]]
                stack += list(n.input)
        readers = [n for n in graph.graph.node if n.op_type == "Mul" and any(x in inits for x in n.input)]
        for n in readers:
            src = producer.get(n.input[0])
            while src is not None and src.op_type == "Cast":
                if src.input[0] == output or producer.get(src.input[0]) is producer.get(output):
                    return inits[n.input[1]]
                src = producer.get(src.input[0])
        raise AssertionError(f"no {op} scale for {output}")

    for output, op, factor, said in [
        ("present.1.value", "Div", 0.5, "layer 1: the int8 KV cache's value scales differ"),
        ("present.0.key", "Mul", 2.0, "layer 0: the int8 KV cache's key scales differ"),
    ]:
        mutated = onnx.ModelProto()
        mutated.CopyFrom(graph)
        scale = next(i for i in mutated.graph.initializer if i.name == scale_of(output, op).name)
        scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * factor, scale.name))
        check = structure_check(mutated, ckpt)
        assert not check.passed and said in check.detail, check
