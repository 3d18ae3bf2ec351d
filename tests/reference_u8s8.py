"""An independent, brute-force reference of the non-VNNI u8s8 kernel for tests: every pair of adjacent
products along K, one at a time, clipped to int16 as ``VPMADDUBSW`` clips it (no pruning, no vectorised
gather: :mod:`quantcli.quant.u8s8` is checked against this and against onnxruntime itself)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

I16_MIN, I16_MAX = -32768, 32767


def saturating_dot(a_u8: torch.Tensor, w_s8: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(int64 sums (M, N) as VPMADDUBSW + VPMADDWD compute them, saturated pairs, pairs) of ``(M, K)`` uint8
    codes and ``(K, N)`` int8 codes."""
    a, w = a_u8.to(torch.int64), w_s8.to(torch.int64)
    if a.shape[1] % 2:
        a, w = F.pad(a, (0, 1)), F.pad(w, (0, 0, 0, 1))
    out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.int64)
    saturated = 0
    for k in range(0, a.shape[1], 2):
        pair = a[:, k, None] * w[None, k] + a[:, k + 1, None] * w[None, k + 1]
        clipped = pair.clamp(I16_MIN, I16_MAX)
        saturated += int((clipped != pair).sum())
        out += clipped
    return out, saturated, a.shape[0] * w.shape[1] * (a.shape[1] // 2)
