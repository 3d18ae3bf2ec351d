"""Output quality against the float model: cosine similarity and SNR, accumulated over batches.

Each output of the model is compared as one long vector over every sample (as ``verify`` reports it): cosine
``<q, f> / (|q| |f|)`` and SNR ``10 log10(|f|^2 / |q - f|^2)`` dB, in float64. A model with several outputs
scores its worst output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def cosine(dot: float, n_got: float, n_ref: float) -> float | None:
    """Cosine similarity ``<g, r> / (|g| |r|)`` from the sums ``<g, r>``, ``|g|^2`` and ``|r|^2``; ``None``
    when either vector is all zeros."""
    den = math.sqrt(n_got * n_ref)
    return dot / den if den > 0 else None


def snr_db(n_ref: float, err2: float) -> float | None:
    """Signal-to-noise ratio ``10 log10(|r|^2 / |g - r|^2)`` in dB from the sums ``|r|^2`` and ``|g - r|^2``:
    ``inf`` when ``g == r``, ``None`` when the reference is all zeros."""
    if n_ref == 0:
        return None
    return math.inf if err2 == 0 else 10 * math.log10(n_ref / err2)


@dataclass(frozen=True)
class Quality:
    """The worst output's cosine (``None``: an output is all zeros) and SNR in dB (``inf``: identical)."""

    cosine: float | None
    snr_db: float | None

    def meets(self, min_cosine: float | None, min_snr: float | None) -> bool:
        if min_cosine is not None and (self.cosine is None or self.cosine < min_cosine):
            return False
        return not (min_snr is not None and (self.snr_db is None or self.snr_db < min_snr))

    def to_dict(self) -> dict:
        return {"cosine": self.cosine, "snr_db": self.snr_db}


class QualityMeter:
    """Streaming sums per output: ``<q, f>``, ``|q|^2``, ``|f|^2``, ``|q - f|^2`` (memory independent of
    data)."""

    def __init__(self):
        self.sums: list[list[float]] = []

    def add(self, got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
        if not self.sums:
            self.sums = [[0.0, 0.0, 0.0, 0.0] for _ in ref]
        for s, g, r in zip(self.sums, got, ref):
            g, r = g.detach().to(torch.float64).reshape(-1), r.detach().to(torch.float64).reshape(-1)
            s[0] += float(g @ r)
            s[1] += float(g @ g)
            s[2] += float(r @ r)
            s[3] += float((g - r) @ (g - r))

    def result(self) -> Quality:
        if not self.sums:
            return Quality(None, None)
        cosines, snrs = [], []
        for dot, gg, rr, err in self.sums:
            c = cosine(dot, gg, rr)
            cosines.append(None if c is None else min(1.0, c))  # float64 rounding can pass 1
            snrs.append(snr_db(rr, err))
        cos = None if any(c is None for c in cosines) else min(cosines)
        snr = None if any(s is None for s in snrs) else min(snrs)
        return Quality(cos, snr)
