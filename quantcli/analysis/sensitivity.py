"""Quantizer sensitivity: the model's output quality when only some quantizers are on.

A *unit* is a named group of quantizers switched together: one quantizer (``analyze``) or one layer's input
and weight quantizers (mixed precision: a layer whose input or weight stays float computes in float anyway).

* **only enabled** — the unit alone is quantized, everything else computes in float: the error this unit
  causes by itself. Ranking by it finds the quantizers that hurt.
* **only disabled** — everything but the unit is quantized: what keeping this unit in float would recover.

Cost: one forward pass over the data per unit and per mode, so callers pass a bounded sample; the float
outputs are computed once (:func:`reference_outputs`) and reused by every pass.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from quantcli.analysis.quality import Quality, QualityMeter
from quantcli.inputs.data import Batch, flat_outputs, run_model
from quantcli.inputs.padding import padding_mask, real_positions
from quantcli.nn.modes import quantizer_modes
from quantcli.nn.tensor_quantizer import owner, quantizers


@contextlib.contextmanager
def quantizing(model: nn.Module, active: Iterable[str] | None = None, inactive: Iterable[str] = ()):
    """Within the block, only the enabled quantizers named in ``active`` (all enabled ones if ``None``) and
    not in ``inactive`` quantize; the others pass values through. Every quantizer's mode comes back after."""
    qs = quantizers(model)
    on = set(qs) if active is None else set(active)
    off = set(inactive)
    with quantizer_modes(model, {n: "quantize" if n in on and n not in off else "disabled" for n in qs}):
        yield


def reference_outputs(model: nn.Module, batches: list[Batch]) -> list[list[torch.Tensor]]:
    """The float model's outputs (every quantizer passing through), per batch."""
    with quantizing(model, active=()), torch.inference_mode():
        return [
            [t.detach().clone() for t in flat_outputs(run_model(model, b, f"batch {i}"))]
            for i, b in enumerate(batches)
        ]


def measure(model: nn.Module, batches: list[Batch], refs: list[list[torch.Tensor]]) -> Quality:
    """Quality of the model as its quantizers are set now, against ``refs``."""
    meter = QualityMeter()
    with torch.inference_mode():
        for i, (b, r) in enumerate(zip(batches, refs)):
            mask = padding_mask(b)  # per-token outputs at real tokens (quantcli.inputs.padding)
            got = flat_outputs(run_model(model, b, f"batch {i}"))
            meter.add(real_positions(mask, got), real_positions(mask, r))
    return meter.result()


@dataclass
class UnitSensitivity:
    unit: str
    quantizers: list[str]
    only_enabled: Quality
    only_disabled: Quality | None = None

    def to_dict(self) -> dict:
        return {
            "unit": self.unit,
            "quantizers": self.quantizers,
            "only_enabled": self.only_enabled.to_dict(),
            "only_disabled": None if self.only_disabled is None else self.only_disabled.to_dict(),
        }


def _badness(q: Quality, by: str) -> tuple[float, float]:
    """Sort key, worst first: lower cosine (or SNR) is worse; an undefined metric counts as worst."""
    cos = -math.inf if q.cosine is None else q.cosine
    snr = -math.inf if q.snr_db is None else q.snr_db
    return (snr, cos) if by == "snr" else (cos, snr)


def rank(
    model: nn.Module,
    batches: list[Batch],
    units: dict[str, list[str]],
    refs=None,
    *,
    only_disabled: bool = False,
    by: str = "cosine",
    progress: Callable[[int], None] | None = None,
) -> list[UnitSensitivity]:
    """Every unit's quality with only it quantized (and, with ``only_disabled``, with all but it), ranked
    worst first by the only-enabled ``by`` metric (``cosine`` or ``snr``; ties by the other).
    ``progress`` is called with the number of passes done."""
    refs = reference_outputs(model, batches) if refs is None else refs
    out, done = [], 0
    for name, members in units.items():
        with quantizing(model, active=members):
            alone = measure(model, batches, refs)
        done += 1
        without = None
        if only_disabled:
            with quantizing(model, inactive=members):
                without = measure(model, batches, refs)
            done += 1
        if progress is not None:
            progress(done)
        out.append(UnitSensitivity(name, list(members), alone, without))
    out.sort(key=lambda s: _badness(s.only_enabled, by))
    return out


def layer_units(model: nn.Module) -> dict[str, list[str]]:
    """Enabled quantizers grouped by the layer that owns them (``layer.input_quantizer`` /
    ``.weight_quantizer``)."""
    units: dict[str, list[str]] = {}
    for name, q in quantizers(model).items():
        if q.enabled:
            units.setdefault(owner(name), []).append(name)
    return units
