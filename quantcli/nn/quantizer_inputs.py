"""What some quantizers receive on one forward of a batch: their inputs, handed to a callback as they arrive.

Export reads the shape each static quantizer sees (:mod:`exporters.dynamo`) and the weight operands computed
from parameters (:mod:`quantcli.nn.derived_weights`, :func:`quantcli.nn.computed.weight_operands`), each from
one forward of the example batch, without autograd, on a copy of its inputs (:mod:`quantcli.nn.fresh_inputs`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from quantcli.nn.forward_call import call_forward
from quantcli.nn.fresh_inputs import fresh
from quantcli.nn.tensor_quantizer import quantizers


def observe_inputs(
    model: nn.Module,
    example: Mapping[str, torch.Tensor],
    names: Iterable[str],
    record: Callable[[str, torch.Tensor], None],
) -> None:
    """One forward of ``example`` under ``no_grad``, ``record(name, x)`` called with the input ``x`` of each
    quantizer of ``names`` on each of its calls. No forward runs where ``names`` is empty."""
    qs = quantizers(model)
    hooks = [qs[n].register_forward_pre_hook(lambda _m, a, n=n: record(n, a[0])) for n in names]
    if not hooks:
        return
    try:
        with torch.no_grad():
            call_forward(model, fresh(example))
    finally:
        for h in hooks:
            h.remove()
