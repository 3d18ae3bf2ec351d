"""Checking many quantizers' amax with one host read (issue 38).

``TensorQuantizer.set_amax`` refuses an amax that is not finite and >= 0. Checked one by one that is two reads
back to the host per quantizer, and on a GPU each read waits for the device: at the end of a calibration of a
few hundred quantizers, hundreds of synchronisations. Within :func:`checked_together` the amax set are kept
and checked at the end of the block, all at once (:func:`amax_span`: one reduction over all of them and one
read per device); the first one that fails, in the order they were set, is refused with the same message.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch

from quantcli.errors import CalibrationError

_kept: dict[str, list | None] = {"amax": None}


def amax_span(amaxes: Sequence[torch.Tensor]) -> tuple[float, float]:
    """The smallest and largest value over every element of ``amaxes`` (NaN where one is NaN), read to the
    host once per device they are on. ``(nan, nan)`` for no elements."""
    by_device: dict[torch.device, tuple[list, list]] = {}
    for a in amaxes:
        if a.numel():
            scalars, others = by_device.setdefault(a.device, ([], []))
            if a.dim() == 0:
                scalars.append(a)  # stacked together: one operation for all, not a reshape each
            else:
                others.append(a.reshape(-1))
    lo = hi = math.nan
    for scalars, others in by_device.values():
        if scalars and others:
            flat = torch.cat([torch.stack(scalars).to(others[0].dtype), *others])
        else:
            flat = torch.stack(scalars) if scalars else torch.cat(others)
        g_lo, g_hi = torch.stack(torch.aminmax(flat.to(torch.float32))).tolist()
        if math.isnan(g_lo) or math.isnan(g_hi):
            return math.nan, math.nan
        lo = g_lo if math.isnan(lo) else min(lo, g_lo)
        hi = g_hi if math.isnan(hi) else max(hi, g_hi)
    return lo, hi


def valid(lo: float, hi: float) -> bool:
    """Whether amax values spanning ``[lo, hi]`` are finite and >= 0 (a NaN fails)."""
    return lo >= 0 and math.isfinite(hi)


def refusal(name: str, hint: str | None = None) -> CalibrationError:
    return CalibrationError(f"{name}: amax must be finite and >= 0" + (f"; {hint}" if hint else ""))


def check_now(name: str, amax: torch.Tensor) -> None:
    """Refuse ``amax`` at once, unless a :func:`checked_together` block keeps it for its end."""
    kept = _kept["amax"]
    if kept is not None:
        kept.append((name, amax))
        return
    if amax.numel() and not valid(*amax_span([amax])):
        raise refusal(name)


@contextlib.contextmanager
def checked_together(hint: str | None = None) -> Iterator[None]:
    """Within the block, every amax set is checked at its end, together (see the module); ``hint`` is added
    to the refusal. A block that raises raises its own error, unchecked."""
    outer, _kept["amax"] = _kept["amax"], []
    try:
        yield
        kept = _kept["amax"]
    finally:
        _kept["amax"] = outer
    if kept and not valid(*amax_span([a for _, a in kept])):
        for name, a in kept:
            if a.numel() and not valid(*amax_span([a])):
                raise refusal(name, hint)
