"""Decoder LMs (GPT-2, Llama/Qwen2-style) export with both exporters and verify; an op no exporter translates
is named with what to try (issues 23 and 26)."""

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

from exporters import aten_symbolics
from quantcli import load_calibrated
from tests.helpers import assert_clean_error, cli

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


# ------------------------------------------------------------------ aten::diff / aten::cumsum translations


class Masks(nn.Module):
    """What transformers' find_packed_sequence_indices computes, plus the other forms of torch.diff."""

    def forward(self, pos, x, flags):
        d = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1)
        packed = (d != 1).cumsum(-1)
        return (
            packed,
            torch.diff(x, n=2, dim=0, append=x[:1]),
            torch.diff(flags, dim=1),
            flags.to(torch.int32).cumsum(1),
            x.cumsum(dim=1, dtype=torch.float64),
        )


def test_diff_and_cumsum_translations_equal_torch_in_onnxruntime(tmp_path):
    pos = torch.tensor([[0, 1, 2, 0, 1, 5, 6], [3, 4, 5, 6, 7, 8, 9]])
    x = torch.randn(4, 5)
    flags = torch.tensor([[True, False, False, True], [False, False, True, True]])
    aten_symbolics.register()
    path = tmp_path / "masks.onnx"
    torch.onnx.export(
        Masks(), (pos, x, flags), str(path), dynamo=False, opset_version=17, input_names=["pos", "x", "flags"]
    )
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"pos": pos.numpy(), "x": x.numpy(), "flags": flags.numpy()})
    expected = Masks()(pos, x, flags)
    assert got[0].tolist() == [[0, 0, 0, 1, 1, 2, 2], [0] * 7]  # by hand: new sequences start at 0 and 5
    for g, e in zip(got, expected):
        assert g.dtype == e.numpy().dtype and np.array_equal(g, e.numpy())


# ---------------------------------------------------------------- an op the TorchScript exporter cannot write

UNSUPPORTED = """
import torch
import torch.nn.functional as F
from torch import nn


class Folding(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 12)

    def forward(self, x):
        return F.fold(self.fc(x), output_size=(3, 4), kernel_size=(1, 1))  # aten::col2im: opset 18


class RunningMax(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 12)

    def forward(self, x):
        return torch.cummax(self.fc(x), dim=-1).values  # aten::cummax: no ONNX translation in torch
"""


@pytest.mark.parametrize(
    "factory,exporter,fragments",
    [
        ("Folding", "torchscript", ("aten::col2im", "at opset 13", "--opset 18", "--exporter dynamo")),
        (
            "RunningMax",
            "torchscript",
            ("aten::cummax", "at opset 13", "--exporter dynamo", "no ONNX translation"),
        ),
        ("RunningMax", "dynamo", ("aten::cummax", "dynamo exporter", "neither torch exporter", "other ops")),
    ],
)
def test_an_op_torch_cannot_export_is_named_with_what_to_try(tmp_path, factory, exporter, fragments):
    (tmp_path / "ops.py").write_text(UNSUPPORTED)
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((8, 1, 12)).astype(np.float32))
    out = tmp_path / "m.calib.pt"
    r = cli("calibrate", f"{tmp_path / 'ops.py'}:{factory}", "--data", tmp_path / "x.npy", "--out", out)
    assert r.exit_code == 0, r.output
    r = cli("export", out, "--onnx", tmp_path / "m.onnx", "--exporter", exporter)
    assert_clean_error(r, *fragments)  # one line on stderr, nothing on stdout: no IR dump, no traceback
    r = cli("export", out, "--onnx", tmp_path / "m.onnx", "--exporter", exporter, "--json")
    error = json.loads(r.stdout)  # stdout holds the error object alone: torch's IR dump would break the parse
    assert (
        r.exit_code == 2
        and error["exit_code"] == 2
        and error["error"] == r.stderr.strip().removeprefix("error: ")
    )
    assert not (tmp_path / "m.onnx").exists()


# ------------------------------------------------------------------ decoder LMs end to end


def _check_runtime(onnx_path, layers: int) -> None:
    r = cli("inspect", onnx_path, "--runtime", "onnxruntime", "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert (info["quantized_layers"], info["unfused_layers"]) == (layers, 0)


def _export_and_verify(ck, onnx_path, data, exporter, layers: int, *extra) -> dict:
    r = cli("export", ck, "--onnx", onnx_path, "--exporter", exporter, "--json", *extra)
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert (res["quantized_layers"], res["unfused_layers"]) == (layers, 0)
    r = cli("verify", onnx_path, "--reference", ck, "--data", data, "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["passed"] and {c["name"]: c["value"] for c in rep["checks"]}["fidelity.codes"] == 1.0
    return res


FACTORY = """
import torch
import transformers


class LogitsOnly(torch.nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):  # no attention mask: transformers' masks call torch.diff
        return self.lm(input_ids=input_ids, use_cache=False).logits


def gpt2():
    torch.manual_seed(0)
    return LogitsOnly(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0,
    )).eval())


def llama():  # the default attention (scaled_dot_product_attention): opset 14
    torch.manual_seed(0)
    return LogitsOnly(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
    )).eval())
"""


@pytest.mark.parametrize("factory,layers,opset", [("gpt2", 9, 17), ("llama", 15, 14)])
def test_decoder_factory_exports_with_torchscript(tmp_path, factory, layers, opset):
    (tmp_path / "lm.py").write_text(FACTORY)
    np.savez(tmp_path / "ids.npz", input_ids=np.random.default_rng(0).integers(0, 64, (12, 10)))
    ck = tmp_path / "lm.calib.pt"
    r = cli(
        "calibrate", f"{tmp_path / 'lm.py'}:{factory}", "--data", tmp_path / "ids.npz", "--out", ck, "--json"
    )
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["layers"]["quantized"]) == layers
    res = _export_and_verify(ck, tmp_path / "lm.onnx", tmp_path / "ids.npz", "torchscript", layers)
    assert res["opset"] == opset
    _check_runtime(tmp_path / "lm.onnx", layers)


def _tokenizer(texts, pad: bool = True):
    """A WordLevel tokenizer trained here on the texts: nothing downloaded. ``pad=False``: no padding token,
    only an end-of-sequence token, as GPT-2's and Llama's tokenizers have."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        texts, tokenizers.trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"])
    )
    special = {"pad_token": "[PAD]"} if pad else {"eos_token": "[EOS]"}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", **special, model_input_names=["input_ids", "attention_mask"]
    )


def _texts():
    """Lines of CPython's own documentation (module docstrings)."""
    import argparse
    import json as json_module
    import textwrap

    return [
        ln.strip() for m in (json_module, argparse, textwrap) for ln in m.__doc__.splitlines() if ln.strip()
    ]


def _causal_lm(kind: str, vocab: int):
    common = dict(vocab_size=vocab, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, **common)
        )
    cls, cfg = {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
    }[kind]
    return cls(
        cfg(
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
            **common,
        )
    )


@pytest.mark.parametrize(
    "kind,layers,exporters",
    [
        ("gpt2", 9, ("torchscript", "dynamo")),
        ("llama", 15, ("torchscript", "dynamo")),
        ("qwen2", 15, ("torchscript",)),
    ],
)
def test_causal_lm_folder_with_text_data(tmp_path, kind, layers, exporters):
    texts = _texts()
    tok = _tokenizer(texts, pad=kind != "llama")  # Llama's: an end-of-sequence token and no padding token
    torch.manual_seed(0)
    model = _causal_lm(kind, len(tok.get_vocab())).eval()
    folder = tmp_path / kind
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(texts[:20]) + "\n")
    ck = tmp_path / f"{kind}.calib.pt"
    r = cli("calibrate", folder, "--data", data, "--out", ck, "--json", "--batch-size", "8")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert len(info["layers"]["quantized"]) == layers and info["num_batches"] == 3
    for exporter in exporters:
        onnx_path = tmp_path / f"{kind}-{exporter}.onnx"
        # the prefill graph (a decode graph with a KV cache is the default: tests/test_decode_graph.py)
        res = _export_and_verify(ck, onnx_path, data, exporter, layers, "--no-kv-cache")
        assert res["input_names"] == ["input_ids", "attention_mask"] and res["output_names"] == ["logits"]
        _full_sequence_logits(onnx_path, model, tok, texts[20:23])


def _full_sequence_logits(onnx_path, model, tok, texts) -> None:
    """The graph gives logits for every position (a prefill), close to transformers' own on held-out text."""
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(texts, padding=True, return_tensors="np")
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    (logits,) = sess.run(
        None,
        {
            "input_ids": enc["input_ids"].astype(np.int64),
            "attention_mask": enc["attention_mask"].astype(np.int64),
        },
    )
    with torch.inference_mode():
        ref = model(
            input_ids=torch.from_numpy(enc["input_ids"]),
            attention_mask=torch.from_numpy(enc["attention_mask"]),
            use_cache=False,
        ).logits.numpy()
    assert logits.shape == ref.shape == (*enc["input_ids"].shape, len(tok.get_vocab()))
    keep = enc["attention_mask"].astype(bool)
    a, b = logits[keep].ravel(), ref[keep].ravel()
    assert np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.99


def test_texts_longer_than_a_models_positions_are_cut_to_them(tmp_path):
    """A GPT-2 of 16 learned positions and lines of up to ~60 tokens: the default --max-length (128) went past
    its position embedding and calibration stopped with "index out of range in self". The default now keeps
    within the model's positions, and a longer --max-length is refused with the limit."""
    from quantcli import load_calibrated

    texts = _texts()
    tok = _tokenizer(texts)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=len(tok.get_vocab())
        )
    ).eval()
    folder = tmp_path / "gpt2"
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(" ".join(texts[i : i + 3]) for i in range(0, 24, 3)) + "\n")
    ck = tmp_path / "g.calib.pt"
    r = cli("calibrate", folder, "--data", data, "--out", ck)
    assert r.exit_code == 0, r.output
    assert load_calibrated(ck).example["input_ids"].shape[1] == 16
    r = cli("calibrate", folder, "--data", data, "--out", tmp_path / "h.calib.pt", "--max-length", 64)
    assert_clean_error(r, "--max-length 64", "16 positions")


def test_a_causal_lm_ignores_the_token_types_its_tokenizer_emits(tmp_path):
    """GPT-2 beside a tokenizer that emits token_type_ids (a BERT-style one): calibrate fed them (GPT-2 adds
    their embeddings), the decode graph takes none, and verify refused the pair calibrate and export had made
    ("the ONNX inputs ... do not match the checkpoint's inputs"). A causal LM generates without token types:
    they are not an input."""
    texts = _texts()
    tok = _tokenizer(texts)
    tok.model_input_names = ["input_ids", "token_type_ids", "attention_mask"]
    assert "token_type_ids" in tok(texts[:2])
    torch.manual_seed(0)
    model = _causal_lm("gpt2", len(tok.get_vocab())).eval()
    folder = tmp_path / "gpt2"
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(texts[:20]) + "\n")
    ck, graph = tmp_path / "g.calib.pt", tmp_path / "g.onnx"
    r = cli("calibrate", folder, "--data", data, "--out", ck, "--json", "--batch-size", "8")
    assert r.exit_code == 0, r.output
    assert load_calibrated(ck).input_names == ["input_ids", "attention_mask"]
    assert cli("export", ck, "--onnx", graph).exit_code == 0
    held = tmp_path / "held.txt"
    held.write_text("\n".join(texts[20:40]) + "\n")
    r = cli("verify", graph, "--reference", ck, "--data", held)
    assert r.exit_code == 0, r.output


def test_a_tokenizer_without_padding_or_end_token_takes_batch_size_1():
    """Such a tokenizer is refused for batches ("pass --batch-size 1, or set pad_token"); --batch-size 1
    then failed too ("Asking to pad but the tokenizer does not have a padding token"): one text needs no
    padding."""
    from quantcli.errors import DataError
    from quantcli.inputs.text_data import text_batches

    texts = _texts()[:6]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    bare = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    accepted = ["input_ids", "attention_mask"]
    batches = text_batches(texts, bare, 32, 1, accepted, False)
    assert len(batches) == 6 and all(b["input_ids"].shape[0] == 1 for b in batches)
    assert batches[0]["input_ids"].shape[1] == len(bare(texts[0])["input_ids"])
    with pytest.raises(DataError, match="pass --batch-size 1"):
        text_batches(texts, bare, 32, 2, accepted, False)
