"""ConvNeXt-style blocks written as users write them: a patchify stem, then depthwise 7x7 conv, channels-last
``LayerNorm`` (permute), an inverted MLP with GELU, a learned layer scale and a residual add; a LayerNorm and
Linear head. Random init (layer scale 0.5, as training leaves it larger than its 1e-6 start)."""

import numpy as np
import torch
from torch import nn

IMAGE, DIM, CLASSES = 32, 32, 10


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(0.5 * torch.ones(dim))

    def forward(self, x):
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.gamma * self.pwconv2(self.act(self.pwconv1(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


class ConvNeXtBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, DIM, 4, stride=4)
        self.blocks = nn.Sequential(Block(DIM), Block(DIM))
        self.norm = nn.LayerNorm(DIM, eps=1e-6)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, pixels):
        x = self.blocks(self.stem(pixels))
        return self.head(self.norm(x.mean((2, 3))))


def samples(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"pixels": rng.standard_normal((n, 3, IMAGE, IMAGE)).astype(np.float32)}


def make() -> nn.Module:
    torch.manual_seed(0)
    return ConvNeXtBlocks().eval()
