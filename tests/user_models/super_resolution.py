"""ESPCN-style super-resolution: three convolutions, the last producing ``scale**2`` channels that
``PixelShuffle`` rearranges into an image twice the size. Random init."""

import numpy as np
import torch
from torch import nn

IMAGE, SCALE = 16, 2


class SuperResolution(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 16, 3, padding=1)
        self.conv3 = nn.Conv2d(16, SCALE**2, 3, padding=1)
        self.shuffle = nn.PixelShuffle(SCALE)

    def forward(self, low_res):
        x = torch.relu(self.conv1(low_res))
        x = torch.relu(self.conv2(x))
        return self.shuffle(self.conv3(x))


def samples(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"low_res": rng.random((n, 1, IMAGE, IMAGE), dtype=np.float32)}


def make() -> nn.Module:
    torch.manual_seed(0)
    return SuperResolution().eval()
