"""``calibrate --kv-cache int8``: the amax of every cached key and value channel, from the calibration data.

The cache holds each layer's keys after the rotary embedding and its values, ``[batch, kv_heads, positions,
head_size]`` (:mod:`exporters.causal_lm`). :func:`kv_cache_amax` runs the calibrated model as its decode
graph computes (the decode module over the model's own quantized modules, one prefill per calibration batch,
float cache) and takes the largest magnitude of each ``(layer, kv head, channel)`` over every position that
the batch's ``attention_mask`` keeps; :func:`calibrate_kv_cache` turns it into the int8 scales the export
writes (:class:`exporters.causal_lm.kv_cache.KVCacheQuant`). Max calibration: an int8 grid per channel keeps
the largest key channels (the ones RoPE models concentrate their magnitude in) unclipped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from exporters.causal_lm.kv_cache import GRANULARITIES, KVCacheQuant
from quantcli.errors import QuantCliError

#: ``--kv-cache`` values: the cache format and its scale granularity
CHOICES = {
    "float": None,
    "int8": "channel",
    "int8-channel": "channel",
    "int8-head": "head",
    "int8-tensor": "tensor",
}


def granularity_of(choice: str) -> str | None:
    """``--kv-cache``'s value -> the granularity of its int8 scales (None: a float cache)."""
    if choice not in CHOICES:
        raise QuantCliError(f"--kv-cache must be one of {', '.join(CHOICES)}, got {choice!r}")
    return CHOICES[choice]


def kv_cache_amax(model: nn.Module, batches: Sequence[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_amax, value_amax)`` ``[layers, kv_heads, head_size]`` of a causal LM over ``batches``
    (``input_ids``, optional ``attention_mask``); :class:`QuantCliError` for a model quantcli writes no decode
    graph for."""
    from exporters.causal_lm.decoder import DecoderWithCache
    from exporters.causal_lm.layout import NotDecodable

    try:
        decoder = DecoderWithCache(model.eval())
    except NotDecodable as e:
        raise QuantCliError(f"--kv-cache needs a causal LM that gets a decode graph: {e}") from None
    lo = decoder.layout
    key = torch.zeros(lo.num_layers, lo.num_kv_heads, lo.head_size)
    value = torch.zeros_like(key)
    seen = False
    for batch in batches:
        ids = batch.get("input_ids")
        if ids is None or ids.dim() != 2 or ids.shape[1] == 0:
            continue
        ids = ids.to(torch.int64).cpu()
        mask = batch.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask.to(torch.int64).cpu()
        b = ids.shape[0]
        empty = torch.zeros(b, lo.num_kv_heads, 0, lo.head_size)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        with torch.no_grad():
            out = decoder.step(ids, mask, positions, [empty] * (2 * lo.num_layers))
        keep = mask.bool()[:, None, :, None]  # [b, 1, seq, 1]: padded positions do not count
        for i in range(lo.num_layers):
            for store, name in ((key, f"present.{i}.key"), (value, f"present.{i}.value")):
                t = out[name].abs().masked_fill(~keep, 0)
                store[i] = torch.maximum(store[i], t.amax(dim=(0, 2)))
        seen = True
    if not seen:
        raise QuantCliError("--kv-cache needs calibration batches with input_ids [batch, sequence]")
    return key, value


def calibrate_kv_cache(model: nn.Module, batches: Sequence[dict], granularity: str) -> KVCacheQuant:
    """The int8 cache scales of ``model`` from ``batches`` at ``granularity`` (``channel``, ``head``,
    ``tensor``)."""
    if granularity not in GRANULARITIES:
        raise QuantCliError(f"KV cache granularity must be one of {', '.join(GRANULARITIES)}")
    key, value = kv_cache_amax(model, batches)
    return KVCacheQuant.from_amax(key, value, granularity)
