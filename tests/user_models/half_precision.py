"""A small CNN as users save it for deployment: in half precision, the whole module pickled
(``torch.save(model.half(), path)``). An ``nn.Sequential`` of torch's own layers, so the pickle needs no code
of its own. ``make()`` returns it in float16 as a factory could too. Random init, BatchNorm warmed."""

import numpy as np
import torch
from torch import nn

from tests.user_models._common import warm_batchnorm

IMAGE, CLASSES = 16, 10


def float_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, CLASSES),
    )
    data = samples(64, 1000)
    warm_batchnorm(_Named(model), data)
    return model


class _Named(nn.Module):
    """The Sequential called by keyword, as warm_batchnorm calls models."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input):  # noqa: A002  (nn.Sequential's argument name)
        return self.model(input)


def samples(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input": rng.standard_normal((n, 3, IMAGE, IMAGE)).astype(np.float32)}


def make() -> nn.Module:
    return float_model().half().eval()
