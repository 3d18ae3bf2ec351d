"""A keyword spotter over MFCC frames: a Conv1d, two depthwise-separable Conv1d blocks (depthwise k=3, then
pointwise), mean over time, a Linear. Random init, BatchNorm warmed."""

import numpy as np
import torch
from torch import nn

from tests.user_models._common import conv_bn_relu, warm_batchnorm

MFCC, FRAMES, CHANNELS, KEYWORDS = 40, 49, 64, 12


def _separable(c: int) -> nn.Sequential:
    return nn.Sequential(conv_bn_relu(c, c, 3, groups=c, dims=1), conv_bn_relu(c, c, 1, dims=1))


class KeywordSpotter(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = conv_bn_relu(MFCC, CHANNELS, 3, stride=2, dims=1)
        self.blocks = nn.Sequential(_separable(CHANNELS), _separable(CHANNELS))
        self.fc = nn.Linear(CHANNELS, KEYWORDS)

    def forward(self, mfcc):
        return self.fc(self.blocks(self.stem(mfcc)).mean(2))


def samples(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"mfcc": rng.standard_normal((n, MFCC, FRAMES)).astype(np.float32)}


def make() -> nn.Module:
    torch.manual_seed(0)
    model = KeywordSpotter()
    warm_batchnorm(model, samples(64, 1000))
    return model
