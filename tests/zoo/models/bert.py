"""BERT (transformers ``BertForSequenceClassification``), small and randomly initialised."""

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
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def samples(n: int, seed: int) -> dict[str, np.ndarray]:
    """Token ids, and attention masks with a padded tail on every other sample."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, VOCAB, (n, TOKENS), dtype=np.int64)
    mask = np.ones((n, TOKENS), dtype=np.int64)
    mask[1::2, TOKENS - 4 :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def make() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        num_labels=3,
    )
    return Model(BertForSequenceClassification(cfg)).eval()
