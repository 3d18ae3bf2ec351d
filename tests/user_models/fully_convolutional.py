"""A fully convolutional net (a segmentation-style map at half resolution): it runs at any image size.
Calibrated at ``IMAGE``x``IMAGE``, verified at that size and at ``OTHER_IMAGE``. Random init, BatchNorm
warmed."""

import numpy as np
import torch
from torch import nn

from tests.user_models._common import conv_bn_relu, warm_batchnorm

IMAGE, OTHER_IMAGE, CLASSES = 32, 48, 4


class FullyConvolutional(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(conv_bn_relu(3, 16), conv_bn_relu(16, 32, stride=2), conv_bn_relu(32, 32))
        self.classifier = nn.Conv2d(32, CLASSES, 1)

    def forward(self, image):
        return self.classifier(self.body(image))


def samples(n: int, seed: int, size: int = IMAGE) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"image": rng.standard_normal((n, 3, size, size)).astype(np.float32)}


def make() -> nn.Module:
    torch.manual_seed(0)
    model = FullyConvolutional()
    warm_batchnorm(model, samples(64, 1000))
    return model
