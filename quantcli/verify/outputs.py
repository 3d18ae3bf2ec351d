"""The model's outputs as a flat list, and which of them are class logits (where top-1 agreement means
something)."""

from __future__ import annotations

import torch
from torch import nn

from quantcli.inputs.data import Batch, flat_outputs, run_model


def logit_outputs(model: nn.Module, batch: Batch) -> tuple[list[torch.Tensor], set[int]]:
    """(the outputs of ``model`` on ``batch``, the indices of those that are class logits).

    An output counts as logits when it is 2-D ``(batch, classes)`` with at least two classes and is the very
    tensor an ``nn.Linear`` returned (a classifier head). An embedding that is normalised, pooled or otherwise
    computed after its last Linear is not logits, and its argmax means nothing.
    """
    produced: list[torch.Tensor] = []

    def hook(_m, _i, out):
        if isinstance(out, torch.Tensor):
            produced.append(out)

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        with torch.inference_mode():
            outs = flat_outputs(run_model(model, batch, "the first batch"))
    finally:
        for h in handles:
            h.remove()
    linear_ids = {id(t) for t in produced}
    logits = {i for i, t in enumerate(outs) if t.dim() == 2 and t.shape[1] > 1 and id(t) in linear_ids}
    return outs, logits
