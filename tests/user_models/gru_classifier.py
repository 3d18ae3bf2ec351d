"""A sequence classifier: a two-layer ``nn.GRU`` over feature frames, a Linear on the last step. Random
init."""

import numpy as np
import torch
from torch import nn

FRAMES, FEATURES, HIDDEN, CLASSES = 32, 40, 128, 10


class GRUClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(FEATURES, HIDDEN, num_layers=2, batch_first=True)
        self.fc = nn.Linear(HIDDEN, CLASSES)

    def forward(self, frames):
        out, _ = self.gru(frames)
        return self.fc(out[:, -1])


def samples(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"frames": rng.standard_normal((n, FRAMES, FEATURES)).astype(np.float32)}


def make() -> nn.Module:
    torch.manual_seed(0)
    return GRUClassifier().eval()
