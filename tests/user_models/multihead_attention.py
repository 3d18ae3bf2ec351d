"""Self-attention with ``nn.MultiheadAttention`` between two Linears, a residual and a LayerNorm; mean-pooled
into a classifier. Random init."""

import numpy as np
import torch
from torch import nn

TOKENS, FEATURES, DIM, HEADS, CLASSES = 16, 24, 32, 4, 6


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(FEATURES, DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, tokens):
        x = self.embed(tokens)
        a, _ = self.attn(x, x, x, need_weights=False)
        return self.head(self.norm(x + a).mean(1))


def samples(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"tokens": rng.standard_normal((n, TOKENS, FEATURES)).astype(np.float32)}


def make() -> nn.Module:
    torch.manual_seed(0)
    return Attention().eval()
