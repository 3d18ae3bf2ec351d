"""ConvNeXt (transformers ``ConvNextForImageClassification``: depthwise 7x7, LayerNorm, inverted MLP, layer
scale), small and randomly initialised."""

import numpy as np
import torch
from torch import nn

IMAGE = 32


class Logits(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model(pixel_values=pixel_values).logits


def samples(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"pixel_values": rng.standard_normal((n, 3, IMAGE, IMAGE)).astype(np.float32)}


def warm_batchnorm(model: nn.Module, inputs: dict[str, np.ndarray], passes: int = 4) -> None:
    """BatchNorm as training leaves it: gains and shifts spread around 1 and 0 (some initialisations start the
    gains near 0, which makes a deep network's output vanish), running statistics from ``passes`` train-mode
    forward passes (cumulative average); then eval mode."""
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


def make() -> nn.Module:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    torch.manual_seed(0)
    cfg = ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[2, 2], num_labels=10)
    model = Logits(ConvNextForImageClassification(cfg))
    warm_batchnorm(model, samples(64, 1000))
    return model
