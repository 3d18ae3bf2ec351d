"""Switching quantizers' modes for a while, and off for good, from outside a :class:`TensorQuantizer`.

Calibration, SmoothQuant, sensitivity analysis and mixed precision all run a model with some quantizers
standing aside and must leave every quantizer as it found it, whatever the block raises:
:func:`quantizer_modes` does that in one place. :func:`keep_float` is the permanent switch (a layer left in
float, a layer that never ran).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping

from torch import nn

from quantcli.nn.tensor_quantizer import TensorQuantizer, quantizers


@contextlib.contextmanager
def quantizer_modes(
    target: nn.Module | Iterable[TensorQuantizer], mode: str | Mapping[str, str]
) -> Iterator[None]:
    """Within the block, the quantizers of ``target`` are in ``mode``; afterwards each has its previous mode
    back exactly (also when the block raises), unless the block switched it off for good (:func:`keep_float`):
    that one stays ``"disabled"``.

    Args:
        target: a model (all its quantizers, by name as :func:`quantcli.nn.tensor_quantizer.quantizers` names
            them) or the quantizers themselves.
        mode: one mode for all (``"quantize"``, ``"disabled"``, ``"calibrate"``), or, for a model, quantizer
            name -> mode (quantizers not named keep theirs).

    Modes are set with :meth:`TensorQuantizer.set_mode`, so a quantizer that is not ``enabled`` stays
    ``"disabled"`` whatever is asked.
    """
    if isinstance(target, nn.Module):
        named = quantizers(target)
    else:
        named = {str(i): q for i, q in enumerate(target)}
        if not isinstance(mode, str):
            raise TypeError("a mode per quantizer name needs a model as the target")
    wanted = {n: mode for n in named} if isinstance(mode, str) else dict(mode)
    chosen = {n: named[n] for n in wanted if n in named}
    saved = {n: q.mode for n, q in chosen.items()}
    try:
        for n, q in chosen.items():
            q.set_mode(wanted[n])
        yield
    finally:
        for n, q in chosen.items():
            q.set_mode(saved[n])  # a quantizer keep_float() switched off inside the block stays disabled


def keep_float(quantizer: TensorQuantizer) -> None:
    """Switch ``quantizer`` off for good: not ``enabled`` (saved so in a calibrated checkpoint, skipped by
    export) and ``"disabled"`` (values pass through)."""
    quantizer.enabled = False
    quantizer.set_mode("disabled")
