"""``digits_cnn``: a small CNN (conv, batch norm, ReLU, max pooling, linear) for scikit-learn's 8x8 digits.

Input ``x``: float32 ``(N, 1, 8, 8)``, pixel intensities 0..16 divided by 16. Output: ``(N, 10)`` logits.
Weights and the calibration / held-out evaluation sets ship in ``sample_models/data``; retrain with
``python -m sample_models.train digits_cnn``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

DATA = Path(__file__).parent / "data"
WEIGHTS = DATA / "digits_cnn.safetensors"
SPLITS = DATA / "digits_cnn_data.npz"


class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.pool(self.relu(self.bn2(self.conv2(x))))
        x = self.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


def build(pretrained: bool = True) -> DigitsCNN:
    """The model, with the bundled trained weights unless ``pretrained=False``."""
    model = DigitsCNN()
    if pretrained:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(WEIGHTS)))
    return model.eval()


def _images(pixels: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(pixels.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)


def _split(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    with np.load(SPLITS) as z:
        return _images(z[f"{name}_x"]), torch.from_numpy(z[f"{name}_y"].astype(np.int64))


def calibration_batches(batch_size: int = 64) -> list[dict[str, torch.Tensor]]:
    """512 training images, in batches of ``{"x": (B, 1, 8, 8)}``."""
    x, _ = _split("calib")
    return [{"x": b} for b in x.split(batch_size)]


def evaluation_batches(batch_size: int = 128) -> list[dict[str, torch.Tensor]]:
    """The held-out test images (never trained or calibrated on)."""
    x, _ = _split("eval")
    return [{"x": b} for b in x.split(batch_size)]


def evaluation_labels() -> torch.Tensor:
    return _split("eval")[1]
