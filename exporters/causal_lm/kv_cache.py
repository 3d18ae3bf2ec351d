"""An int8 KV cache: the cached keys and values stored as int8 codes with calibrated scales.

onnxruntime's CPU ``GroupQueryAttention`` (1.31) runs a quantized cache: ``past_key``/``past_value`` (and the
``present`` outputs) of type int8 with ``k_scale``/``v_scale`` and ``k_quant_type``/``v_quant_type``
``PER_TENSOR`` (scale ``[1]``) or ``PER_CHANNEL`` (scale ``[1, kv_heads, 1, head_size]``),
``kv_cache_bit_width`` 8. Measured against it (tests/test_kv_cache.py): it stores the new keys (after the
rotary embedding) and values as ``clip(round_half_even(x / scale), -128, 127)`` and attends over every cached
position, the new ones included, dequantized as ``code * scale`` -- the ONNX ``QuantizeLinear`` /
``DequantizeLinear`` arithmetic, so one prefill and step-by-step decoding compute the same. Its 4-bit cache
(uint8, two codes a byte) and float8 cache are not used here (float8: no CPU kernel).

:class:`KVCacheQuant` holds a model's scales ``[layers, kv_heads, head_size]`` for keys and values, from the
calibrated amax of each cached channel (``granularity`` ``channel``), of each head (``head``: one amax over a
head's channels, stored per channel) or of each layer (``tensor``). :func:`quantize` and :func:`dequantize`
are the arithmetic above; the decode module uses them in its plain-ops attention and in the eager kernel of
its ``GroupQueryAttention`` op, so the PyTorch decode module computes what the graph computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GRANULARITIES = ("channel", "head", "tensor")
BOUND = 127  # symmetric int8: amax maps to 127, codes saturate at -128 and 127
QMIN, QMAX = -128, 127


@dataclass
class KVCacheQuant:
    """Per-layer int8 scales of the cached keys and values: ``key_scale``/``value_scale`` ``[layers,
    kv_heads, head_size]`` float32 (equal along the axes the ``granularity`` does not split)."""

    granularity: str
    key_scale: torch.Tensor
    value_scale: torch.Tensor
    num_bits: int = 8

    @classmethod
    def from_amax(cls, key_amax: torch.Tensor, value_amax: torch.Tensor, granularity: str) -> KVCacheQuant:
        """Scales from per-channel amax ``[layers, kv_heads, head_size]``: reduced to the granularity's
        groups, ``amax / 127`` (a channel that never left zero gets scale 1: its codes are 0 either way)."""
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
        return cls(granularity, _scale(key_amax, granularity), _scale(value_amax, granularity))

    @property
    def quant_type(self) -> str:
        """onnxruntime's ``k_quant_type``/``v_quant_type``."""
        return "PER_TENSOR" if self.granularity == "tensor" else "PER_CHANNEL"

    def layer_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_scale, v_scale)`` of one layer in onnxruntime's shapes: ``[1]`` per tensor, ``[1, kv_heads,
        1, head_size]`` per channel (or head)."""
        k, v = self.key_scale[layer], self.value_scale[layer]
        if self.granularity == "tensor":
            return k.reshape(-1)[:1].clone(), v.reshape(-1)[:1].clone()
        return k[None, :, None].clone(), v[None, :, None].clone()

    def bytes_per_token(self) -> int:
        """Cache bytes one position takes over all layers (keys and values)."""
        return int(2 * self.key_scale.numel() * self.num_bits // 8)

    def to_plain(self) -> dict:
        """What the checkpoint stores (tensors; ``torch.load(weights_only=True)`` reads it)."""
        return {
            "num_bits": self.num_bits,
            "granularity": self.granularity,
            "key_scale": self.key_scale.detach().cpu().float().clone(),
            "value_scale": self.value_scale.detach().cpu().float().clone(),
        }

    @classmethod
    def from_plain(cls, d: dict) -> KVCacheQuant:
        """From :meth:`to_plain`'s dict; ``ValueError`` names what is wrong with a damaged one."""
        try:
            out = cls(d["granularity"], d["key_scale"].float(), d["value_scale"].float(), int(d["num_bits"]))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"the KV cache entry lacks {e}") from None
        if out.num_bits != 8 or out.granularity not in GRANULARITIES:
            raise ValueError(f"a {out.num_bits}-bit {out.granularity!r} KV cache is not one quantcli writes")
        if out.key_scale.dim() != 3 or out.key_scale.shape != out.value_scale.shape:
            raise ValueError("its key and value scales are not [layers, kv_heads, head_size]")
        if not bool((out.key_scale > 0).all() and (out.value_scale > 0).all()):
            raise ValueError("a scale is not positive")
        return out

    def summary(self) -> dict:
        """The scales' ranges and the cache's size, for reports."""
        return {
            "num_bits": self.num_bits,
            "granularity": self.granularity,
            "key_scale_range": [float(self.key_scale.min()), float(self.key_scale.max())],
            "value_scale_range": [float(self.value_scale.min()), float(self.value_scale.max())],
            "bytes_per_token": self.bytes_per_token(),
            "float32_bytes_per_token": 4 * self.bytes_per_token() * 8 // self.num_bits,
        }


def _scale(amax: torch.Tensor, granularity: str) -> torch.Tensor:
    a = amax.detach().float()
    if granularity == "head":
        a = a.amax(dim=-1, keepdim=True).expand_as(amax)
    elif granularity == "tensor":
        a = a.flatten(1).amax(dim=1)[:, None, None].expand_as(amax)
    return torch.where(a > 0, a / BOUND, torch.ones_like(a)).contiguous()


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes of ``x`` ``[b, kv_heads, s, d]``; ``scale`` broadcastable to it (``[1]`` or ``[1, kv, 1,
    d]``): ``clip(round_half_even(x / scale), -128, 127)``."""
    return torch.clamp(torch.round(x / scale), QMIN, QMAX).to(torch.int8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``codes * scale`` in float32."""
    return codes.to(torch.float32) * scale
