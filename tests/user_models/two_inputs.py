"""Two inputs (an image and a vector of metadata) and a dict output: the image through a small CNN, the
metadata through a Linear, both concatenated into ``proj``, whose output is both the ``embedding`` output and
the input of the ``logits`` head. Random init, BatchNorm warmed."""

import numpy as np
import torch
from torch import nn

from tests.user_models._common import conv_bn_relu, warm_batchnorm

IMAGE, META, CLASSES = 16, 8, 4


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.cnn = nn.Sequential(conv_bn_relu(3, 16), nn.MaxPool2d(2), conv_bn_relu(16, 16, stride=2))
        self.meta = nn.Linear(META, 16)
        self.proj = nn.Linear(32, 16)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, image, meta):
        a = self.cnn(image).mean((2, 3))
        b = torch.relu(self.meta(meta))
        embedding = self.proj(torch.cat([a, b], dim=1))
        return {"logits": self.head(torch.relu(embedding)), "embedding": embedding}


def samples(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "image": rng.standard_normal((n, 3, IMAGE, IMAGE)).astype(np.float32),
        "meta": rng.standard_normal((n, META)).astype(np.float32),
    }


def make() -> nn.Module:
    torch.manual_seed(0)
    model = TwoInputs()
    warm_batchnorm(model, samples(64, 1000))
    return model
