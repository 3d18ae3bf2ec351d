"""An EfficientNet built the way the widely copied EfficientNet-PyTorch implementation builds it (issue 35).

Its convolutions are ``nn.Conv2d`` subclasses that apply TensorFlow's "same" padding in ``forward``:
``Conv2dStaticSamePadding`` pads with an ``nn.ZeroPad2d`` computed for the image size it was built for,
``Conv2dDynamicSamePadding`` with ``F.pad`` computed from the input's size at every call (the implementation
picks one per model; here the stem, the squeeze-excitation and head convolutions are static and the blocks'
dynamic, so both forms are covered). A stride-2 3x3 layer on an even input pads only right and bottom, which a
9x9 probe never sees. Mobile inverted-bottleneck blocks (expansion, depthwise convolution, squeeze-excitation
with ``torch.sigmoid(x_squeezed) * x``, projection) add their input back under a Python ``if`` on the block's
configuration, and ``forward`` takes ``drop_connect_rate`` as an argument tested with ``if`` (so
``torch.fx`` cannot trace a block). Swish is ``x * sigmoid(x)`` (the implementation's export form). Random
initialisation, BatchNorm statistics from a few train-mode passes; ``make()`` and ``samples(n, seed)`` as the
zoo's factory files have them.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

IMAGE = 64
CLASSES = 10
# (expand ratio, kernel, stride, input filters, output filters) of each block, EfficientNet-B0's stages
# narrowed and shortened; blocks with stride 1 and equal filters add their input back (six of them, two stages
# with two in a row, where the skip input is the previous block's sum)
BLOCKS = (
    (1, 3, 1, 16, 8),
    (6, 3, 2, 8, 12),
    (6, 3, 1, 12, 12),
    (6, 5, 2, 12, 20),
    (6, 5, 1, 20, 20),
    (6, 5, 1, 20, 20),
    (6, 3, 2, 20, 32),
    (6, 3, 1, 32, 32),
    (6, 3, 1, 32, 32),
    (6, 5, 1, 32, 40),
    (6, 5, 1, 40, 40),
)
#: a shorter network for the default tests: a stride-2 block (right/bottom padding only), then two residual
#: blocks in a row (the second one's skip input is the first one's sum)
SHORT_BLOCKS = ((1, 3, 1, 16, 8), (6, 3, 2, 8, 12), (6, 5, 1, 12, 12), (6, 3, 1, 12, 12))
BN_MOMENTUM, BN_EPS = 0.01, 1e-3
DROP_CONNECT_RATE = 0.2


def same_padding(size: int, kernel: int, stride: int, dilation: int = 1) -> tuple[int, int]:
    """TensorFlow's "same" padding of one spatial dimension: (before, after), the odd pixel after."""
    out = math.ceil(size / stride)
    pad = max((out - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)
    return pad // 2, pad - pad // 2


class Conv2dDynamicSamePadding(nn.Conv2d):
    """TensorFlow's "same" padding computed from the input's size at every call, then ``F.conv2d``."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, dilation=1, groups=1, bias=True):
        super().__init__(in_channels, out_channels, kernel_size, stride, 0, dilation, groups, bias=bias)
        self.stride = self.stride if len(self.stride) == 2 else [self.stride[0]] * 2

    def forward(self, x):
        ih, iw = x.size()[-2:]
        kh, kw = self.weight.size()[-2:]
        top, bottom = same_padding(ih, kh, self.stride[0], self.dilation[0])
        left, right = same_padding(iw, kw, self.stride[1], self.dilation[1])
        if top or bottom or left or right:
            x = F.pad(x, [left, right, top, bottom])
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class Conv2dStaticSamePadding(nn.Conv2d):
    """TensorFlow's "same" padding for the image size given at construction, as an ``nn.ZeroPad2d``
    (or ``nn.Identity``)."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, image_size=None, **kwargs):
        super().__init__(in_channels, out_channels, kernel_size, stride, **kwargs)
        self.stride = self.stride if len(self.stride) == 2 else [self.stride[0]] * 2
        kh, kw = self.weight.size()[-2:]
        top, bottom = same_padding(image_size, kh, self.stride[0], self.dilation[0])
        left, right = same_padding(image_size, kw, self.stride[1], self.dilation[1])
        if top or bottom or left or right:
            self.static_padding = nn.ZeroPad2d((left, right, top, bottom))
        else:
            self.static_padding = nn.Identity()

    def forward(self, x):
        x = self.static_padding(x)
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class Swish(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


def drop_connect(inputs: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    if not training:
        return inputs
    keep = 1 - p
    mask = torch.floor(
        keep + torch.rand([inputs.shape[0], 1, 1, 1], dtype=inputs.dtype, device=inputs.device)
    )
    return inputs / keep * mask


class MBConvBlock(nn.Module):
    def __init__(self, expand: int, kernel: int, stride: int, inp: int, out: int, image_size: int):
        super().__init__()
        self.expand, self.stride, self.inp, self.out = expand, stride, inp, out
        self.id_skip = True
        mid = inp * expand
        if expand != 1:
            self._expand_conv = Conv2dDynamicSamePadding(inp, mid, 1, bias=False)
            self._bn0 = nn.BatchNorm2d(mid, momentum=BN_MOMENTUM, eps=BN_EPS)
        self._depthwise_conv = Conv2dDynamicSamePadding(
            mid, mid, kernel, stride=stride, groups=mid, bias=False
        )
        self._bn1 = nn.BatchNorm2d(mid, momentum=BN_MOMENTUM, eps=BN_EPS)
        squeezed = max(1, inp // 4)
        self._se_reduce = Conv2dStaticSamePadding(mid, squeezed, 1, image_size=1)
        self._se_expand = Conv2dStaticSamePadding(squeezed, mid, 1, image_size=1)
        self._project_conv = Conv2dDynamicSamePadding(mid, out, 1, bias=False)
        self._bn2 = nn.BatchNorm2d(out, momentum=BN_MOMENTUM, eps=BN_EPS)
        self._swish = Swish()

    def forward(self, inputs, drop_connect_rate=None):
        x = inputs
        if self.expand != 1:
            x = self._swish(self._bn0(self._expand_conv(inputs)))
        x = self._swish(self._bn1(self._depthwise_conv(x)))
        x_squeezed = F.adaptive_avg_pool2d(x, 1)
        x_squeezed = self._se_expand(self._swish(self._se_reduce(x_squeezed)))
        x = torch.sigmoid(x_squeezed) * x
        x = self._bn2(self._project_conv(x))
        if self.id_skip and self.stride == 1 and self.inp == self.out:
            if drop_connect_rate:
                x = drop_connect(x, p=drop_connect_rate, training=self.training)
            x = x + inputs
        return x


class EfficientNet(nn.Module):
    def __init__(self, image_size: int = IMAGE, classes: int = CLASSES, blocks=BLOCKS):
        super().__init__()
        self._conv_stem = Conv2dStaticSamePadding(3, 16, 3, stride=2, bias=False, image_size=image_size)
        self._bn0 = nn.BatchNorm2d(16, momentum=BN_MOMENTUM, eps=BN_EPS)
        size = math.ceil(image_size / 2)
        layers = []
        for expand, kernel, stride, inp, out in blocks:
            layers.append(MBConvBlock(expand, kernel, stride, inp, out, size))
            size = math.ceil(size / stride)
        self._blocks = nn.ModuleList(layers)
        head = 4 * blocks[-1][4]
        self._conv_head = Conv2dStaticSamePadding(blocks[-1][4], head, 1, bias=False, image_size=size)
        self._bn1 = nn.BatchNorm2d(head, momentum=BN_MOMENTUM, eps=BN_EPS)
        self._avg_pooling = nn.AdaptiveAvgPool2d(1)
        self._dropout = nn.Dropout(0.2)
        self._fc = nn.Linear(head, classes)
        self._swish = Swish()

    def extract_features(self, inputs):
        x = self._swish(self._bn0(self._conv_stem(inputs)))
        for idx, block in enumerate(self._blocks):
            drop_connect_rate = DROP_CONNECT_RATE
            if drop_connect_rate:
                drop_connect_rate *= float(idx) / len(self._blocks)
            x = block(x, drop_connect_rate=drop_connect_rate)
        return self._swish(self._bn1(self._conv_head(x)))

    def forward(self, inputs):
        x = self._avg_pooling(self.extract_features(inputs))
        x = x.flatten(start_dim=1)
        return self._fc(self._dropout(x))


def samples(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"inputs": rng.standard_normal((n, 3, IMAGE, IMAGE)).astype(np.float32)}


def warm_batchnorm(model: nn.Module, inputs: dict[str, np.ndarray], passes: int = 4) -> None:
    """BatchNorm as training leaves it: gains and shifts spread around 1 and 0, running statistics from
    ``passes`` train-mode passes (cumulative average); then eval mode."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    gen = torch.Generator().manual_seed(1)
    for bn in bns:
        with torch.no_grad():
            bn.weight.copy_(torch.rand(bn.weight.shape, generator=gen) + 0.5)
            bn.bias.copy_(0.1 * torch.randn(bn.bias.shape, generator=gen))
        bn.reset_running_stats()
        bn.momentum = None
    model.train()
    with torch.no_grad():
        for k in range(passes):
            model(**{n: torch.from_numpy(v[k::passes]) for n, v in inputs.items()})
    for bn in bns:
        bn.momentum = BN_MOMENTUM
    model.eval()


def make() -> nn.Module:
    torch.manual_seed(0)
    model = EfficientNet()
    warm_batchnorm(model, samples(64, 1000))
    return model


def make_short() -> nn.Module:
    """The same construction with :data:`SHORT_BLOCKS` (21 convolutions instead of 57)."""
    torch.manual_seed(0)
    model = EfficientNet(blocks=SHORT_BLOCKS)
    warm_batchnorm(model, samples(64, 1000))
    return model
