"""A video-clip classifier: two ``Conv3d`` blocks over (frames, height, width), global average pooling, a
Linear. Random init, BatchNorm warmed."""

import numpy as np
import torch
from torch import nn

from tests.user_models._common import conv_bn_relu, warm_batchnorm

FRAMES, IMAGE, CLASSES = 4, 16, 5


class ClipClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.block1 = conv_bn_relu(3, 8, dims=3)
        self.block2 = conv_bn_relu(8, 16, stride=2, dims=3)
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.fc = nn.Linear(16, CLASSES)

    def forward(self, clip):
        return self.fc(self.pool(self.block2(self.block1(clip))).flatten(1))


def samples(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"clip": rng.standard_normal((n, 3, FRAMES, IMAGE, IMAGE)).astype(np.float32)}


def make() -> nn.Module:
    torch.manual_seed(0)
    model = ClipClassifier()
    warm_batchnorm(model, samples(64, 1000))
    return model
