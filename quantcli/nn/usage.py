"""Which quantizers' outputs reach a model's outputs: the difference between a layer an exporter drops as dead
code (it runs in ``forward`` but nothing uses its result, like a ``BertModel``'s pooler under mean pooling)
and a layer that lost its Q/DQ pair.

The trace is autograd's: a zero leaf that requires grad is added to every quantizer's output (``x + 0``, so
the graph stays connected through later quantizers), and ``torch.autograd.grad(..., allow_unused=True)``
returns ``None`` for exactly the leaves no output depends on.
That is connectivity, not values: a path whose gradient is zero (a rounding, a saturated clamp) still counts
as used. A path autograd cannot see (an ``argmax``, an integer cast, ``.detach()``) counts as unused, which is
why callers only apply this to quantizers that are also absent from the graph.
"""

from __future__ import annotations

import torch
from torch import nn

from quantcli.nn.forward_call import call_forward
from quantcli.nn.fresh_inputs import fresh
from quantcli.nn.tensor_quantizer import quantizers


def _flat_tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat_tensors(o)]
    values = getattr(out, "values", None)  # transformers' ModelOutput
    if callable(values):
        return [t for o in values() for t in _flat_tensors(o)]
    return []


def unused_quantizers(model: nn.Module, batch: dict[str, torch.Tensor]) -> set[str] | None:
    """Names of the enabled quantizers that ran on ``batch`` but whose output reaches none of the model's
    outputs.

    Quantizers that did not run at all are not in the set (they are "not called", another matter). Returns
    ``None`` when the trace cannot decide (no output depends on any quantizer, or autograd fails), so that a
    caller never calls a quantizer unused on a guess.
    """
    qs = {n: q for n, q in quantizers(model).items() if q.enabled}
    leaves: dict[str, list[torch.Tensor]] = {}

    def hook_for(name):
        def hook(_module, _inputs, output):
            if not isinstance(output, torch.Tensor) or not output.is_floating_point():
                return None
            leaf = torch.zeros((), dtype=output.dtype, device=output.device, requires_grad=True)
            leaves.setdefault(name, []).append(leaf)
            return output + leaf

        return hook

    handles = [q.register_forward_hook(hook_for(n)) for n, q in qs.items()]
    try:
        with torch.enable_grad():
            outs = [t for t in _flat_tensors(call_forward(model, fresh(batch))) if t.requires_grad]
            flat = [leaf for name in leaves for leaf in leaves[name]]
            if not outs or not flat:
                return None
            grads = torch.autograd.grad(
                outs, flat, grad_outputs=[torch.ones_like(t) for t in outs], allow_unused=True
            )
    except RuntimeError:
        return None
    finally:
        for h in handles:
            h.remove()
    unused, i = set(), 0
    for name, ls in leaves.items():
        if all(g is None for g in grads[i : i + len(ls)]):
            unused.add(name)
        i += len(ls)
    return unused
