"""Outputs at the positions a batch's ``attention_mask`` marks as real tokens.

A batch of text is padded to its longest example; what a model computes at the padded positions is never read
(the attention mask hides them from every real token) and may be anything: under a sliding-window mask a
right-padded row's logits there differ between a float and a quantized model by far more than the real
tokens' do. Compared with them, cosine, SNR and the error ratios moved with ``--batch-size`` (how much
padding a batch has), and a graph correct on every real token failed ``--min-cosine``.
"""

from __future__ import annotations

import numpy as np
import torch


def padding_mask(batch) -> np.ndarray | None:
    """``(batch, tokens)`` booleans, True at real tokens, where ``batch`` has a 2-D ``attention_mask`` that
    marks padding; None where it has none (nothing to leave out)."""
    mask = batch.get("attention_mask") if hasattr(batch, "get") else None
    if mask is None:
        return None
    m = mask.detach().cpu().numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
    if m.ndim != 2 or m.all():
        return None
    return m.astype(bool)


def real_positions(mask: np.ndarray | None, outputs: list | None):
    """Each per-token output (``(batch, tokens, ...)``, 3-D or more, its first two axes the mask's) at the
    real tokens only, as ``(real tokens, ...)``; other outputs (pooled, per sample) and ``None`` as they are.
    Tensors or arrays, returned as given (``outputs`` None: None, a session that did not run)."""
    if mask is None or outputs is None:
        return outputs
    keep = torch.from_numpy(mask)
    out = []
    for a in outputs:
        if a is not None and a.ndim >= 3 and tuple(a.shape[:2]) == mask.shape:
            a = a[keep.to(a.device)] if isinstance(a, torch.Tensor) else a[mask]
        out.append(a)
    return out
