"""Export-time helpers shared by both exporters."""

from __future__ import annotations

import torch


def export_amax(amax: torch.Tensor) -> torch.Tensor:
    """amax as a graph constant: the TorchScript exporter hands constants (not parameters) to ``symbolic``."""
    return torch.tensor(amax.detach().cpu().tolist(), dtype=torch.float32)
