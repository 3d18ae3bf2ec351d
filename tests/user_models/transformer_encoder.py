"""``nn.TransformerEncoder`` (two ``nn.TransformerEncoderLayer``, batch first, no dropout) between an input
projection and a classifier. Random init."""

import numpy as np
import torch
from torch import nn

TOKENS, FEATURES, DIM, HEADS, CLASSES = 16, 24, 32, 4, 6


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(FEATURES, DIM)
        layer = nn.TransformerEncoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def samples(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"tokens": rng.standard_normal((n, TOKENS, FEATURES)).astype(np.float32)}


def make() -> nn.Module:
    torch.manual_seed(0)
    return Encoder().eval()
