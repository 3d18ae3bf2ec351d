"""A T5 encoder (transformers ``T5EncoderModel``: relative position buckets, RMS LayerNorm, no biases), small
and randomly initialised; the last hidden state."""

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
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def samples(n: int, seed: int) -> dict[str, np.ndarray]:
    """Token ids, and attention masks with a padded tail on every other sample."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, VOCAB, (n, TOKENS), dtype=np.int64)
    mask = np.ones((n, TOKENS), dtype=np.int64)
    mask[1::2, TOKENS - 4 :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def make() -> nn.Module:
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
    return Model(T5EncoderModel(cfg)).eval()
