"""YOLOS (transformers ``YolosForObjectDetection``: a ViT with detection tokens, DETR-style class and box
heads), small and randomly initialised. Returns (class logits, boxes)."""

import numpy as np
import torch
from torch import nn

IMAGE = 32


class Logits(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        out = self.model(pixel_values=pixel_values)
        return out.logits, out.pred_boxes


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
    from transformers import YolosConfig, YolosForObjectDetection

    torch.manual_seed(0)
    cfg = YolosConfig(
        image_size=[IMAGE, IMAGE],
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        num_detection_tokens=10,
        num_labels=5,
    )
    model = Logits(YolosForObjectDetection(cfg))
    warm_batchnorm(model, samples(64, 1000))
    return model
