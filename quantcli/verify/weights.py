"""Fake-quant weights quantized once per verify instead of once per batch.

A quantized layer quantizes its weight on every forward (``weight_quantizer(self.weight)``); over a verify run
the weights do not change, so each weight quantizer's output is computed once and handed back for that very
parameter afterwards -- the same tensor, bit for bit, without a round, a clamp and a scale per layer and
batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from quantcli.nn.tensor_quantizer import owner, quantizers


@contextlib.contextmanager
def constant_weights(model: nn.Module) -> Iterator[None]:
    """Within the block, every quantizing ``<layer>.weight_quantizer`` returns its first result for
    ``<layer>.weight`` (a disabled one, as in the float model, passes the weight through already: nothing to
    cache)."""
    modules = dict(model.named_modules())
    patched = []
    for name, q in quantizers(model).items():
        if not name.endswith("weight_quantizer") or q.mode != "quantize":
            continue
        if q.amax is None and not q.desc.dynamic:
            continue  # uncalibrated: refused where it is used, with the name of what to do
        layer = modules.get(owner(name))
        weight = getattr(layer, "weight", None)
        if not isinstance(weight, torch.Tensor) or getattr(layer, "weight_derived", False):
            continue  # a derived operand (a slice, a transpose, a standardised weight) is not the parameter
        with torch.no_grad():
            cached = q(weight.detach())

        def forward(x, _q=q, _w=weight, _c=cached):
            # a quantizer turned off within the block (the float pass of quantizers_disabled) passes through
            return _c if x is _w and _q.mode == "quantize" else type(_q).forward(_q, x)

        q.forward = forward  # an instance attribute: nn.Module.__call__ looks it up first
        patched.append(q)
    try:
        yield
    finally:
        for q in patched:
            del q.forward
