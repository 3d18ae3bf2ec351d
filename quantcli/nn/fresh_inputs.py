"""A batch's tensors copied for one forward pass.

quantcli runs a model's ``forward`` several times on one batch (the operations it computes, its structure,
calibration, the float check, the export's trace, verify), and a forward may change its inputs in place
(``x /= 4``, ``x.clamp_(...)``): on the batch itself, each call would see what the one before left, and the
data (and the example batch stored in the checkpoint) would drift from what the user gave. Every forward
quantcli runs takes :func:`fresh` copies: one copy of each input per call, beside a forward pass.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def fresh(batch: Mapping) -> dict:
    """``batch`` with every tensor replaced by a copy of it (other values as they are)."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
