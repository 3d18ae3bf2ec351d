"""What the user-model factories share: BatchNorm statistics as training leaves them."""

import numpy as np
import torch
from torch import nn


def warm_batchnorm(model: nn.Module, inputs: dict[str, np.ndarray], passes: int = 4) -> None:
    """BatchNorm as training leaves it: gains and shifts spread around 1 and 0, running statistics from
    ``passes`` train-mode forward passes over ``inputs`` (cumulative average); then eval mode."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    gen = torch.Generator().manual_seed(1)
    for bn in bns:
        if bn.affine:
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
        bn.momentum = 0.1
    model.eval()


def conv_bn_relu(
    cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1, dims: int = 2
) -> nn.Sequential:
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    bn = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims]
    return nn.Sequential(
        conv(cin, cout, k, stride=stride, padding=k // 2, groups=groups, bias=False), bn(cout), nn.ReLU()
    )
