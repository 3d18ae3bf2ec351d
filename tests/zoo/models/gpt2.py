"""GPT-2 (transformers ``GPT2LMHeadModel``: ``Conv1D`` projections), small and randomly initialised; logits,
no KV cache."""

import numpy as np
import torch
from torch import nn

TOKENS = 16
VOCAB = 256


class Model(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def samples(n: int, seed: int) -> dict[str, np.ndarray]:
    """Token ids, and attention masks with a padded tail on every other sample."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, VOCAB, (n, TOKENS), dtype=np.int64)
    mask = np.ones((n, TOKENS), dtype=np.int64)
    mask[1::2, TOKENS - 4 :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def make() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2
    )
    return Model(GPT2LMHeadModel(cfg)).eval()
