"""The ``tiny_llama`` sample: a trained decoder with the structure of real ones (issue 37), readable as a
Hugging Face ``LlamaForCausalLM`` folder."""

import json

import numpy as np
import pytest
import torch

from sample_models import SAMPLES, tiny_llama

transformers = pytest.importorskip("transformers")


def test_weights_are_small_and_the_structure_is_llamas():
    assert tiny_llama.WEIGHTS.stat().st_size < 1_000_000
    m = tiny_llama.build()
    c = m.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 32)  # grouped-query attention
    assert m.lm_head.weight is m.model.embed_tokens.weight  # tied
    assert m.model.layers[0].self_attn.k_proj.out_features == c.num_key_value_heads * c.head_dim
    assert "tiny_llama" in SAMPLES


def test_held_out_perplexity_means_something():
    """Far below a model that knows only byte frequencies (the unigram entropy of the held-out text), and the
    same whether computed batch by batch or from hand-summed log-likelihoods."""
    m = tiny_llama.build()
    batches = tiny_llama.evaluation_batches()
    with torch.no_grad():
        ppl = tiny_llama.perplexity(lambda ids: m(torch.from_numpy(ids)).numpy(), batches)
    labels = tiny_llama.evaluation_labels().numpy().ravel()
    freq = np.bincount(labels, minlength=256) / labels.size
    unigram = float(np.exp(-np.log(freq[labels]).mean()))
    assert 1.5 < ppl < 8.0 and ppl < unigram / 3, (ppl, unigram)
    with torch.no_grad():
        logp = torch.log_softmax(m(batches[0]["input_ids"]).double(), -1)[:, :-1]
        ids = batches[0]["input_ids"]
        nll = -logp.gather(-1, ids[:, 1:, None]).mean().item()
        one = tiny_llama.perplexity(lambda x: m(torch.from_numpy(x)).numpy(), batches[:1])
    assert abs(np.exp(nll) - one) < 1e-6 * one


def test_hf_folder_is_a_llama_for_causal_lm_with_the_same_logits_and_a_byte_tokenizer(tmp_path):
    folder = tiny_llama.write_hf_folder(tmp_path / "tiny_llama")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    hf = transformers.LlamaForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()
    ids = tiny_llama.evaluation_batches()[0]["input_ids"][:4]
    with torch.no_grad():
        ours, theirs = tiny_llama.build()(ids), hf(input_ids=ids).logits
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    text = "def f(x):\n    return x  # é"
    assert tok(text)["input_ids"] == list(text.encode()) and tok.decode(list(text.encode())) == text
