"""A small U-Net: two encoder stages, a bottleneck, two decoder stages that upsample with
``ConvTranspose2d`` and concatenate the encoder's skip; 13 layers (11 Conv2d, 2 ConvTranspose2d). Random init,
BatchNorm warmed."""

import numpy as np
import torch
from torch import nn

from tests.user_models._common import conv_bn_relu, warm_batchnorm

IMAGE = 32


def _double(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(conv_bn_relu(cin, cout), conv_bn_relu(cout, cout))


class UNet(nn.Module):
    def __init__(self, classes: int = 2):
        super().__init__()
        self.enc1, self.enc2, self.mid = _double(3, 8), _double(8, 16), _double(16, 32)
        self.pool = nn.MaxPool2d(2)
        self.up2, self.dec2 = nn.ConvTranspose2d(32, 16, 2, stride=2), _double(32, 16)
        self.up1, self.dec1 = nn.ConvTranspose2d(16, 8, 2, stride=2), _double(16, 8)
        self.head = nn.Conv2d(8, classes, 1)

    def forward(self, image):
        e1 = self.enc1(image)
        e2 = self.enc2(self.pool(e1))
        m = self.mid(self.pool(e2))
        d2 = self.dec2(torch.cat([self.up2(m), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))
        return self.head(d1)


def samples(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"image": rng.standard_normal((n, 3, IMAGE, IMAGE)).astype(np.float32)}


def make() -> nn.Module:
    torch.manual_seed(0)
    model = UNet()
    warm_batchnorm(model, samples(64, 1000))
    return model
