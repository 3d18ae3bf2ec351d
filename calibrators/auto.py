"""``--method auto``: per activation quantizer, the candidate amax with the smallest local error.

Candidates are the amax each method would choose for the quantizer: ``max`` (the running max), and
``percentile``, ``mse``, ``entropy`` from one histogram. The criterion, evaluated by the caller
(:mod:`quantcli.calibration.calibrate`), is the **mean squared error of the quantized layer's output against
the float layer's output** on a bounded sample of that layer's calibration inputs, with the layer's weights
quantized as they will be deployed. Histogram-MSE scores the error of ``x`` alone, weighting every value
equally; the layer's output weights each input channel by its weights, so clipping an outlier channel that the
layer reads with large weights costs what it really costs.

This module holds the data-independent parts: the bounded input sample and the choice rule.
"""

from __future__ import annotations

import math

import torch

from calibrators.methods import AMAX_METHODS

#: candidate methods, in tie-breaking order (a tie keeps the earlier one: max clips nothing)
CANDIDATES = AMAX_METHODS

#: the sample of one layer's inputs is at most this many elements (float32: 2 MiB), at least MIN_ROWS rows
SAMPLE_ELEMENTS = 1 << 19
MIN_ROWS = 256


class InputSample:
    """A bounded, deterministic sample of one layer's inputs, spread evenly over the calibration batches.

    ``rows_last``: the input is ``(..., features)`` (a Linear): every position is a row and rows are sampled.
    Otherwise (a convolution) whole samples along dim 0 are kept, since the op needs their spatial extent.
    Memory is bounded by :data:`SAMPLE_ELEMENTS` (or :data:`MIN_ROWS` rows), whatever the number of batches.
    """

    def __init__(self, num_batches: int, rows_last: bool):
        self.num_batches = max(1, num_batches)
        self.rows_last = rows_last
        self.parts: list[torch.Tensor] = []
        self._kept = 0

    def collect(self, x: torch.Tensor) -> None:
        x = x.detach()
        rows = x.reshape(-1, x.shape[-1]) if self.rows_last else x
        if rows.shape[0] == 0:
            return
        per_row = max(1, rows[0].numel())
        budget = max(MIN_ROWS if self.rows_last else 1, SAMPLE_ELEMENTS // per_row)
        take = min(rows.shape[0], math.ceil(budget / self.num_batches), budget - self._kept)
        if take <= 0:
            return
        # evenly spaced rows of this batch (not the first ones: those are the first tokens of every sequence)
        idx = torch.linspace(0, rows.shape[0] - 1, take, device=rows.device).round().long()
        self.parts.append(rows.index_select(0, idx).to(torch.float32).clone())
        self._kept += take

    def tensor(self) -> torch.Tensor | None:
        """The sample, ``(rows, features)`` or ``(samples, *input shape[1:])``; ``None`` if nothing was seen.
        Convolution samples of different spatial sizes are not concatenated: the first size is kept."""
        if not self.parts:
            return None
        if self.rows_last:
            return torch.cat(self.parts)
        first = self.parts[0].shape[1:]
        return torch.cat([p for p in self.parts if p.shape[1:] == first])


def choose(errors: dict[str, float]) -> str:
    """The method with the smallest error; among equal errors the earliest of :data:`CANDIDATES`.
    Non-finite errors never win (``max`` is always finite: it clips nothing)."""
    best, best_err = None, math.inf
    for method in CANDIDATES:
        e = errors.get(method)
        if e is not None and math.isfinite(e) and e < best_err:
            best, best_err = method, e
    if best is None:
        raise ValueError(f"no finite local error among {errors}")
    return best
