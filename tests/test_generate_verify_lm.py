"""``quantcli generate`` and verify's checks of a decode graph (issue 37): the float export generates the
float model's greedy tokens, and verify judges generation -- exit 0 on a good graph, 1 on a graph whose KV
cache is off by one position."""

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

from sample_models import tiny_llama
from tests.helpers import assert_clean_error, cli

FLOAT = {"preset": "int4-weight-only", "rules": [{"pattern": "*", "enable": False}]}


@pytest.fixture(scope="module")
def float_graph(tmp_path_factory):
    """tiny_llama calibrated with every quantizer off, exported as a decode graph: the float model in
    onnxruntime."""
    root = tmp_path_factory.mktemp("lm")
    cfg = root / "float.json"
    cfg.write_text(json.dumps(FLOAT))
    ck = root / "tl.calib.pt"
    r = cli("calibrate", "tiny_llama", "--config", cfg, "--placement", "all", "--out", ck)
    assert r.exit_code == 0, r.output
    path = root / "tl.onnx"
    r = cli("export", ck, "--onnx", path)
    assert r.exit_code == 0, r.output
    return ck, path


def _greedy(model, prompt: bytes, n: int) -> list[int]:
    """The float PyTorch model's greedy tokens, the whole sequence recomputed at every step (no cache)."""
    ids = torch.tensor([list(prompt)])
    out = []
    for _ in range(n):
        with torch.no_grad():
            nxt = int(model(ids)[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    return out


def test_generate_gives_the_float_models_greedy_tokens(float_graph):
    _, path = float_graph
    prompt = "    def __init__(self, name):\n        self."
    r = cli("generate", path, "--prompt", prompt, "--max-new-tokens", 24, "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["prompt_tokens"] == list(prompt.encode())  # the sample's tokenizer: one token per byte
    assert res["tokens"] == _greedy(tiny_llama.build(), prompt.encode(), 24)
    assert res["text"] == bytes(res["tokens"]).decode("utf-8", errors="replace") and res["mode"] == "greedy"
    # sampled: the seed decides, the same seed gives the same text
    a = json.loads(cli("generate", path, "--prompt", prompt, "--seed", 3, "--json").stdout)
    b = json.loads(cli("generate", path, "--prompt", prompt, "--seed", 3, "--json").stdout)
    assert a["tokens"] == b["tokens"] and a["tokens"] != res["tokens"] + a["tokens"][24:]
    # sampling settings without --seed did nothing (greedy) in silence; temperature 0 is greedy, said so
    for extra in (["--temperature", "0.5"], ["--top-k", "5"]):
        assert_clean_error(cli("generate", path, "--prompt", prompt, *extra), extra[0], "--seed")
    cold = json.loads(
        cli("generate", path, "--prompt", prompt, "--seed", 3, "--temperature", 0, "--json").stdout
    )
    assert cold["mode"] == "greedy" and cold["tokens"][:24] == res["tokens"]
    # beyond the context: what fits is said (the last token is never fed back: 512 + 1 - 500); a prompt
    # filling it was told "lower --max-new-tokens to 0"
    r = cli("generate", path, "--prompt", "x" * 500, "--max-new-tokens", 24)
    assert_clean_error(r, "context of 512 positions", "lower --max-new-tokens to 13")
    r = cli("generate", path, "--prompt", "x" * 600, "--max-new-tokens", 1)
    assert_clean_error(r, "shorten the prompt to at most 512 tokens")
    assert "max-new-tokens to" not in r.stderr
    # a prompt that fills the context takes one token; without --max-new-tokens, the default (64) is cut to
    # what the context leaves, not refused
    full = json.loads(cli("generate", path, "--prompt", "x" * 512, "--max-new-tokens", 1, "--json").stdout)
    assert len(full["tokens"]) == 1
    r = cli("generate", path, "--prompt", "x" * 500, "--json")
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["tokens"]) <= 13


def test_generate_refuses_a_prompt_that_is_no_utf8_and_an_infinite_temperature(float_graph):
    """Both ended in an internal error, exit 3 (UnicodeEncodeError; "Probabilities contain NaN")."""
    _, path = float_graph
    assert_clean_error(cli("generate", path, "--prompt", "abc\udcff"), "--prompt", "UTF-8")
    r = cli("generate", path, "--prompt", "abc", "--seed", 1, "--temperature", "inf", "--top-k", 5)
    assert_clean_error(r, "--temperature", "finite")


def test_generate_runs_a_graph_with_external_data_and_names_what_onnxruntime_cannot_load(
    float_graph, tmp_path
):
    """A graph with external data (export writes one past 1.8 GB) was loaded whole and checked in memory,
    which protobuf refuses past 2 GB ("not a valid ONNX model (Failed to serialize proto)"): generate leaves
    the weights on disk and the checker reads the path. A file onnxruntime itself cannot load (small
    constants saved as external data) was an internal error, exit 3."""
    import onnx

    _, path = float_graph
    want = json.loads(cli("generate", path, "--prompt", "import os", "--max-new-tokens", 4, "--json").stdout)
    model = onnx.load(str(path))
    ext = tmp_path / "ext.onnx"
    onnx.save(model, str(ext), save_as_external_data=True, location="ext.data", size_threshold=1024)
    r = cli("generate", ext, "--prompt", "import os", "--max-new-tokens", 4, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tokens"] == want["tokens"]
    every = tmp_path / "every.onnx"
    onnx.save(model, str(every), save_as_external_data=True, location="every.data", size_threshold=0)
    assert_clean_error(cli("generate", every, "--prompt", "x"), "onnxruntime cannot load", "every.onnx")


def test_generate_takes_a_thread_count(float_graph, monkeypatch):
    """generate built its session with onnxruntime's default threads and no way to set them (2x slower than
    one thread on a loaded 2-vCPU machine): --threads N sets intra_op_num_threads; the tokens are the same."""
    import onnxruntime as ort

    _, path = float_graph
    seen = []
    real = ort.InferenceSession

    def spy(model, options=None, *args, **kwargs):
        seen.append(None if options is None else options.intra_op_num_threads)
        return real(model, options, *args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", spy)
    want = json.loads(cli("generate", path, "--prompt", "import os", "--max-new-tokens", 6, "--json").stdout)
    r = cli("generate", path, "--prompt", "import os", "--max-new-tokens", 6, "--threads", 1, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tokens"] == want["tokens"] and seen[-1] == 1


def test_generate_prints_the_text_byte_for_byte(float_graph):
    """The plain output went through rich: ":smile:" became an emoji and tabs became spaces."""
    _, path = float_graph
    prompt = "a :smile: [bold]x[/bold]\tTAB"
    r = cli("generate", path, "--prompt", prompt, "--max-new-tokens", 2)
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(prompt)


def test_generate_streams_the_text_as_it_generates_and_keeps_stdout_for_it(float_graph, monkeypatch):
    """The text came out only when generation had ended (Ctrl-C lost it all), followed on stdout by the
    summary table: each token's text is written as the token comes, the table goes to stderr."""
    import sys

    from exporters.causal_lm.runner import DecodeSession

    _, path = float_graph
    events = []
    real_step = DecodeSession.step

    def step(self, token, cache):
        events.append(("step", None))
        return real_step(self, token, cache)

    monkeypatch.setattr(DecodeSession, "step", step)
    r0 = cli("generate", path, "--prompt", "import os", "--max-new-tokens", 12, "--json")
    want = json.loads(r0.stdout)
    events.clear()

    import quantcli.cli.generate as gen

    class Out:  # the module's sys.stdout, recording each write between the graph's steps
        def write(self, text):
            events.append(("write", text))
            return sys.stdout.write(text)

        def flush(self):
            sys.stdout.flush()

    class Sys:
        stdout = Out()

    monkeypatch.setattr(gen, "sys", Sys())
    r = cli("generate", path, "--prompt", "import os", "--max-new-tokens", 12)
    assert r.exit_code == 0, r.output
    assert r.stdout == "import os" + want["text"] + "\n"  # the text alone: the table is on stderr
    assert "decode_tokens_per_second" in r.stderr
    steps = [i for i, (kind, _) in enumerate(events) if kind == "step"]
    before_last = "".join(t for kind, t in events[: steps[-1]] if kind == "write")
    # by the last step, every token but the last two has been written (the prompt first)
    assert before_last.startswith("import os") and len(before_last) >= len("import os") + 12 - 2


def test_generate_runs_without_importing_torch(float_graph):
    """generate is onnxruntime and a tokenizer: it imported torch first (about 2 s before the first token on
    a loaded machine, through the decode graph's metadata reader and verify's package). Run here with torch
    blocked (an import of it raises), it gives the tokens it gives in-process."""
    import subprocess
    import sys

    _, path = float_graph
    args = ["generate", str(path), "--prompt", "import os", "--max-new-tokens", "8", "--json"]
    want = json.loads(cli(*args).stdout)
    code = (
        "import sys; sys.modules['torch'] = None; "
        f"sys.argv = ['quantcli'] + {args!r}; from quantcli.cli import main; main()"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == want["tokens"]


def test_a_streamed_text_never_writes_part_of_a_character():
    """A byte-level tokenizer's token may be one byte of a character: the chunk is held back until the
    character is complete, and the chunks add up to the text."""
    from quantcli.cli.generate import TextStream, continuation
    from quantcli.verify.lm_text import byte_codec

    codec = byte_codec()
    prompt = list("é: ".encode())
    new = list("naïve → ok 😀".encode())
    stream = TextStream(codec, prompt)
    chunks = [stream.chunk(new[: i + 1]) for i in range(len(new) - 1)]
    chunks.append(stream.chunk(new, final=True))
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == continuation(codec, prompt, new) == "naïve → ok 😀"
    assert chunks[2] == "" and chunks[3] == "ï"  # "ï" is two bytes: nothing after the first
    # a text that ends in an incomplete character is written whole at the end, as decoded
    cut = TextStream(codec, prompt)
    assert cut.chunk(new[:3]) == "na" and cut.chunk(new[:3], final=True) == "\ufffd"


def test_the_generated_text_is_the_decoded_whole_less_the_prompt():
    """A SentencePiece tokenizer drops the leading space of the first token it decodes: "France is" +
    decode(["▁Paris"]) printed "France isParis"."""
    from quantcli.cli.generate import continuation
    from quantcli.verify.lm_text import TextCodec

    pieces = {1: "<s>", 2: "</s>", 10: "▁France", 11: "▁is", 12: "▁Paris"}

    def decode(ids):  # as SentencePiece's Strip decoder: the leading space of the text removed
        return "".join(pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")

    codec = TextCodec("sp", None, decode)
    assert continuation(codec, [10, 11], [12]) == " Paris"
    assert continuation(codec, [1, 10, 11], [12]) == " Paris"  # after a BOS


def test_generate_refuses_what_is_not_a_decode_graph(float_graph, tmp_path, exported):
    ck, _ = float_graph
    prefill = tmp_path / "prefill.onnx"
    assert cli("export", ck, "--onnx", prefill, "--no-kv-cache").exit_code == 0
    assert_clean_error(cli("generate", prefill, "--prompt", "x"), "not a decode graph", "--no-kv-cache")
    # a CNN's graph was asked for a tokenizer first ("no tokenizer ... pass --tokenizer FOLDER")
    assert_clean_error(cli("generate", exported("digits_cnn", "int8"), "--prompt", "x"), "not a decode graph")
    assert_clean_error(cli("generate", tmp_path / "none.onnx", "--prompt", "x"), "does not exist")
    # a decode graph another tool wrote (its cache inputs, none of quantcli's metadata) was called "not a
    # decode graph (no KV cache inputs)"
    _, path = float_graph
    foreign = onnx.load(str(path))
    del foreign.metadata_props[:]
    onnx.save(foreign, str(tmp_path / "foreign.onnx"))
    assert_clean_error(
        cli("generate", tmp_path / "foreign.onnx", "--prompt", "x"), "did not write", "past_key_values"
    )


def _cache_off_by_one(src, dst) -> None:
    """The graph with every present output shifted by one position (its first dropped, its last repeated): the
    same lengths, each cached key and value one position off."""
    m = onnx.load(str(src))
    g = m.graph
    for out in g.output:
        if not out.name.startswith("present."):
            continue
        full = out.name + "_full"
        for node in g.node:
            node.output[:] = [full if o == out.name else o for o in node.output]
        names = {k: f"{out.name}_{k}" for k in ("one", "end", "last", "axis")}
        for k, v in {"one": [1], "end": [2**62], "last": [-1], "axis": [2]}.items():
            g.initializer.append(onnx.numpy_helper.from_array(np.array(v, np.int64), names[k]))
        g.node.extend(
            [
                helper.make_node(
                    "Slice", [full, names["one"], names["end"], names["axis"]], [full + "_tail"]
                ),
                helper.make_node(
                    "Slice", [full, names["last"], names["end"], names["axis"]], [full + "_last"]
                ),
                helper.make_node("Concat", [full + "_tail", full + "_last"], [out.name], axis=2),
            ]
        )
    onnx.save(m, str(dst))


def test_verify_passes_the_float_graph_and_fails_a_cache_off_by_one(float_graph, tmp_path):
    ck, path = float_graph
    r = cli("verify", path, "--reference", ck, "--json", "--num-samples", 4, "--decode-steps", 8)
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    checks = {c["name"]: c for c in rep["checks"]}
    assert set(checks) == {
        "structure",
        "lm.perplexity_increase",
        "lm.token_agreement",
        "lm.decode_parity",
        "lm.rms_ratio",
    }
    assert checks["lm.rms_ratio"]["value"] < 1  # the float graph: float rounding alone
    assert (
        abs(checks["lm.perplexity_increase"]["value"]) < 1e-4 and checks["lm.token_agreement"]["value"] == 1.0
    )
    assert checks["lm.decode_parity"]["value"] < 1e-5
    # perplexity: the float model's own, computed here independently
    m = tiny_llama.build()
    batches = tiny_llama.evaluation_batches()[:1]
    rows = [b["input_ids"][:4, :128] for b in batches]
    with torch.no_grad():
        ppl = tiny_llama.perplexity(lambda x: m(torch.from_numpy(x)).numpy(), [{"input_ids": rows[0]}])
    assert abs(rep["perplexity"]["float"] - ppl) < 1e-3 * ppl

    broken = tmp_path / "broken.onnx"
    _cache_off_by_one(path, broken)
    r = cli("verify", broken, "--reference", ck, "--json", "--num-samples", 4, "--decode-steps", 8)
    assert r.exit_code == 1, r.output
    bad = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert not bad["lm.decode_parity"]["passed"] and bad["lm.decode_parity"]["value"] > 1e-2
    assert bad["lm.perplexity_increase"]["passed"]  # one prefill, no cache: perplexity cannot see it
    # thresholds are options: the float graph meets the strictest token agreement
    r = cli(
        "verify",
        path,
        "--reference",
        ck,
        "--num-samples",
        2,
        "--decode-steps",
        4,
        "--min-token-agreement",
        1.0,
    )
    assert r.exit_code == 0 and "PASS" in r.output


def test_genai_config_lets_onnxruntime_genai_run_the_graph_as_generate_does(float_graph, tmp_path):
    """``export --genai-config``: onnxruntime-genai's Model/Generator load the folder and generate the tokens
    quantcli's own loop generates (skipped where onnxruntime-genai is not installed: it is optional)."""
    og = pytest.importorskip("onnxruntime_genai")
    ck, _ = float_graph
    folder = tmp_path / "genai"
    folder.mkdir()
    r = cli("export", ck, "--onnx", folder / "model.onnx", "--genai-config", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["genai_config"] == str(folder / "genai_config.json")
    prompt = b"import os\nimport sys\n\n\ndef "
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + 20)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([list(prompt)], dtype=np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    theirs = gen.get_sequence(0).tolist()[len(prompt) :]
    ours = json.loads(
        cli(
            "generate", folder / "model.onnx", "--prompt", prompt.decode(), "--max-new-tokens", 20, "--json"
        ).stdout
    )["tokens"]
    assert theirs == ours == _greedy(tiny_llama.build(), prompt, 20)
    # a prefill graph has no cache to describe
    assert_clean_error(
        cli("export", ck, "--onnx", tmp_path / "p.onnx", "--no-kv-cache", "--genai-config"),
        "--genai-config",
        "decode graph",
    )


def _llama_folder(folder, max_positions: int = 64):
    """A random Hugging Face Llama saved in ``folder`` with a WordLevel tokenizer trained here on CPython's
    docstrings that adds a BOS (``<s>``, id 2) as Llama's and Mistral's do. Returns (model, tokenizer,
    texts)."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from tests.test_decoder_lm import _texts

    texts = _texts()
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        texts, tokenizers.trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "<s>", "</s>"])
    )
    bos = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    tok.post_processor = bos
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>", pad_token="[PAD]"
    )
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(fast.get_vocab()),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_positions,
        bos_token_id=2,
        eos_token_id=None,
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(str(folder))
    fast.save_pretrained(str(folder))
    return model, fast, texts


def test_generate_encodes_as_calibration_did_from_anywhere_and_refuses_foreign_ids(tmp_path, monkeypatch):
    """A Hugging Face Llama folder whose tokenizer adds a BOS (as Llama's and Mistral's do): generate encoded
    the prompt without it (a different prompt from calibration's texts and transformers' generate), found the
    tokenizer by MODEL as typed (relative to the current directory, so it failed elsewhere or took another
    folder of that name), and ended in an internal error on a tokenizer whose ids the graph lacks. Now the
    prompt starts with the BOS, the greedy tokens are transformers' own, from another directory, and ids
    beyond the vocabulary are refused."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    work = tmp_path / "work"
    model, fast, texts = _llama_folder(work / "lm")
    vocab = len(fast.get_vocab())
    (work / "texts.txt").write_text("\n".join(texts[:24]) + "\n")
    (work / "float.json").write_text(json.dumps(FLOAT))
    monkeypatch.chdir(work)  # MODEL as a relative path, as users type it
    r = cli("calibrate", "lm", "--data", "texts.txt", "--config", "float.json", "--placement", "all")
    assert r.exit_code == 0, r.output
    r = cli("export", "lm.calib.pt", "--onnx", tmp_path / "lm.onnx")
    assert r.exit_code == 0, r.output
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "lm").mkdir(parents=True)  # a folder of the same name there, without a tokenizer
    monkeypatch.chdir(elsewhere)
    prompt = texts[0]
    r = cli("generate", tmp_path / "lm.onnx", "--prompt", prompt, "--max-new-tokens", 8, "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    enc = fast(prompt, return_tensors="pt")
    assert res["prompt_tokens"] == enc["input_ids"][0].tolist() and res["prompt_tokens"][0] == 2
    with torch.no_grad():
        want = model.generate(**enc, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert res["tokens"] == want[0, enc["input_ids"].shape[1] :].tolist()
    # a tokenizer with more ids than the graph's vocabulary: refused, not an internal error
    big = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(
            tokenizers.models.WordLevel({f"w{i}": i for i in range(vocab + 50)}, unk_token="w0")
        ),
        unk_token="w0",
    )
    big.save_pretrained(str(tmp_path / "big"))
    r = cli("generate", tmp_path / "lm.onnx", "--prompt", f"w{vocab + 10}", "--tokenizer", tmp_path / "big")
    assert_clean_error(r, f"token id {vocab + 10}", f"vocabulary of {vocab}", "--tokenizer")


def test_generate_stops_at_the_end_of_sequence_ids_of_generation_config(tmp_path, monkeypatch):
    """Llama-3-Instruct's end of turn is an eos id of generation_config.json only (config.json names end of
    text): transformers' generate stops there, quantcli generated on past it. The folder's
    generation_config.json ids are stored at calibration and the decode graph stops at them too."""
    model, fast, texts = _llama_folder(tmp_path / "lm")
    (tmp_path / "texts.txt").write_text("\n".join(texts[:24]) + "\n")
    (tmp_path / "float.json").write_text(json.dumps(FLOAT))
    monkeypatch.chdir(tmp_path)

    def tokens() -> dict:
        for cmd in (
            ("calibrate", "lm", "--data", "texts.txt", "--config", "float.json", "--placement", "all"),
            ("export", "lm.calib.pt", "--onnx", "lm.onnx"),
        ):
            r = cli(*cmd)
            assert r.exit_code == 0, r.output
        r = cli("generate", "lm.onnx", "--prompt", texts[0], "--max-new-tokens", 8, "--json")
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    free = tokens()
    assert free["stopped"] == "max_new_tokens" and len(free["tokens"]) == 8
    turn = free["tokens"][2]  # the third token generated: an end of turn from now on
    (tmp_path / "lm" / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, turn]}))
    stopped = tokens()
    first = free["tokens"].index(turn)
    assert stopped["stopped"] == "eos" and stopped["tokens"] == free["tokens"][: first + 1]


def test_verify_keeps_a_decode_graph_within_its_context(tmp_path, monkeypatch):
    """A Llama of 32 positions verified on texts of up to 75 tokens: verify fed the GroupQueryAttention graph
    sequences beyond its rotary tables and reported a failed check (``lm.graph_runs``). It now cuts the
    held-out sequences, and the prompt with the tokens generated after it, to the graph's context."""
    _llama_folder(tmp_path / "lm", max_positions=32)
    monkeypatch.chdir(tmp_path)
    from tests.test_decoder_lm import _texts

    long_lines = [" ".join(_texts()[i : i + 4]) for i in range(0, 64, 4)]  # 30-80 tokens each
    (tmp_path / "texts.txt").write_text("\n".join(long_lines) + "\n")
    (tmp_path / "float.json").write_text(json.dumps(FLOAT))
    r = cli("calibrate", "lm", "--data", "texts.txt", "--config", "float.json", "--placement", "all")
    assert r.exit_code == 0, r.output
    r = cli("export", "lm.calib.pt", "--onnx", "lm.onnx")
    assert r.exit_code == 0, r.output
    r = cli("verify", "lm.onnx", "--reference", "lm.calib.pt", "--data", "texts.txt", "--json")
    assert r.exit_code == 0, r.output
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert "lm.graph_runs" not in checks and checks["lm.decode_parity"]["passed"]


def test_verify_refuses_gates_of_the_other_kind_of_graph(float_graph, calibrated, exported):
    """A CI gate must not be dropped in silence: --min-cosine, --max-abs-diff, --per-layer... on a decode
    graph, and --max-ppl-increase, --decode-steps... on any other graph, were accepted and ignored (exit 0);
    and --decode-steps beyond the context was a failed check (exit 1) instead of bad input."""
    ck, path = float_graph
    for extra in (
        ["--min-cosine", "0.99"],
        ["--max-abs-diff", "0.1"],
        ["--per-layer"],
        ["--max-deploy-ratio", "9"],
    ):
        r = cli("verify", path, "--reference", ck, "--num-samples", 2, *extra)
        assert_clean_error(r, extra[0], "decode graph", "--max-ppl-increase")
    r = cli("verify", path, "--reference", ck, "--num-samples", 2, "--decode-steps", 1000)
    assert_clean_error(r, "--decode-steps 1000", "context of 512")
    cnn, cnn_ck = exported("digits_cnn", "int8"), calibrated("digits_cnn", "int8")
    for extra in (["--max-ppl-increase", "0.1"], ["--min-token-agreement", "0.9"], ["--decode-steps", "4"]):
        r = cli("verify", cnn, "--reference", cnn_ck, *extra)
        assert_clean_error(r, extra[0], "decode graphs")


def test_genai_config_of_gpt2_runs_in_onnxruntime_genai_as_generate_does(tmp_path):
    """GPT-2's genai_config named type "gpt2", which onnxruntime-genai takes for its older GPT model with one
    combined past per layer: Generator failed with "Model input was not found". The graph's inputs are those
    of its decoder-only models, and it now generates quantcli's own tokens. (GPT2Config's default EOS, 50256,
    is beyond this vocabulary: no token, left out of the layout, where genai refused it.)"""
    og = pytest.importorskip("onnxruntime_genai")
    transformers = pytest.importorskip("transformers")
    from exporters.causal_lm.runner import DecodeSession, generate
    from tests.test_decoder_lm import _texts, _tokenizer

    texts = _texts()
    tok = _tokenizer(texts)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=len(tok.get_vocab())
    )
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(str(tmp_path / "gpt2"))
    tok.save_pretrained(str(tmp_path / "gpt2"))
    (tmp_path / "texts.txt").write_text("\n".join(texts[:16]) + "\n")
    (tmp_path / "float.json").write_text(json.dumps(FLOAT))
    ck, folder = tmp_path / "g.calib.pt", tmp_path / "genai"
    r = cli(
        "calibrate",
        tmp_path / "gpt2",
        "--data",
        tmp_path / "texts.txt",
        "--config",
        tmp_path / "float.json",
        "--placement",
        "all",
        "--out",
        ck,
    )
    assert r.exit_code == 0, r.output
    folder.mkdir()
    r = cli("export", ck, "--onnx", folder / "model.onnx", "--genai-config")
    assert r.exit_code == 0, r.output
    prompt = [5, 6, 7, 8]
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + 12)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([prompt], dtype=np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    theirs = gen.get_sequence(0).tolist()[len(prompt) :]
    ours = generate(DecodeSession(folder / "model.onnx"), prompt, 12, stop_at_eos=False).tokens
    assert theirs == ours


def test_verify_reads_a_decode_graphs_texts_at_its_own_length_not_calibrations(tmp_path, monkeypatch):
    """Calibrated with --max-length 2, verify read --data at calibration's 2 tokens per text and asked for
    --data although it was given. A decode graph is judged on sequences up to verify's own window; an
    explicit --max-length too short to judge is refused naming it."""
    _llama_folder(tmp_path / "lm")
    monkeypatch.chdir(tmp_path)
    from tests.test_decoder_lm import _texts

    (tmp_path / "texts.txt").write_text("\n".join(_texts()[:24]) + "\n")
    (tmp_path / "float.json").write_text(json.dumps(FLOAT))
    r = cli(
        "calibrate",
        "lm",
        "--data",
        "texts.txt",
        "--config",
        "float.json",
        "--placement",
        "all",
        "--max-length",
        2,
    )
    assert r.exit_code == 0, r.output
    r = cli("export", "lm.calib.pt", "--onnx", "lm.onnx")
    assert r.exit_code == 0, r.output
    r = cli("verify", "lm.onnx", "--reference", "lm.calib.pt", "--data", "texts.txt", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["num_sequences"] == 16
    r = cli("verify", "lm.onnx", "--reference", "lm.calib.pt", "--data", "texts.txt", "--max-length", 3)
    assert_clean_error(r, "4 tokens or more", "--max-length")
