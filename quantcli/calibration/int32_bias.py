"""Weight ranges widened where a layer's int32 bias would saturate.

On onnxruntime the bias of a quantized Conv or Gemm is stored as int32 codes of ``input_scale * weight_scale``
(:meth:`quantcli.nn.modules.QuantMixin.int32_bias_constants`). A channel whose weights are near zero (pruned,
or driven there by weight decay) but whose bias is not has a tiny weight scale, and its bias code leaves the
int32 range: clamped, the channel's output loses its bias, and both the fake-quant model and the graph compute
the clamped value, so nothing downstream can tell. onnxruntime's own ``quantize_static`` widens that
channel's weight scale until the bias fits (``QDQQuantizer._adjust_weight_scale_for_int32_bias``, with a
margin of 1e-4); so does :func:`fit_int32_biases`, by widening the weight quantizer's ``amax`` (and ``amin``)
by the same ratio. The channel's weights then round more coarsely, which costs nothing that matters: they
were small beside its bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantcli.errors import CalibrationError

#: the largest bias code a widened channel may have: onnxruntime's margin, 1e-4 below the int32 range
LIMIT = ((1 << 31) - 1) / 1.0001


@dataclass
class WidenedWeights:
    """A layer whose weight range was widened so its int32 bias fits."""

    layer: str
    channels: int  # output channels whose bias code left the int32 range (or whose bias scale underflowed)
    ratio: float | None  # the largest factor a channel's weight amax was multiplied by (None: each was 0)
    underflowed: int = 0  # of those, channels whose bias scale was below TINY (subnormal or zero weights)

    def to_dict(self) -> dict:
        return {
            "layer": self.layer,
            "channels": self.channels,
            "ratio": self.ratio,
            "underflowed": self.underflowed,
        }


#: the smallest bias scale a channel may have: float32's smallest normal number. Below it the scale of a
#: channel whose weights are subnormal (or a product that underflows) is 0 or imprecise; a zero bias is 0 / 0
TINY = float(torch.finfo(torch.float32).tiny)


def required_scales(bias: torch.Tensor, limit: float = LIMIT) -> torch.Tensor:
    """Per output channel, the smallest bias scale (float64) for which ``|bias / scale| <= limit``, and at
    least :data:`TINY`."""
    return torch.clamp(bias.detach().to(torch.float64).abs() / limit, min=TINY)


def widening_ratios(bias: torch.Tensor, scale: torch.Tensor, limit: float = LIMIT) -> torch.Tensor:
    """Per output channel, the factor (>= 1) a bias scale must grow by for ``|bias / scale| <= limit`` (and
    to be at least :data:`TINY`), in float64: 1 where the code fits already; inf for a scale of 0."""
    return torch.clamp(required_scales(bias, limit) / scale.to(torch.float64), min=1.0)


def fit_int32_biases(model: nn.Module) -> list[WidenedWeights]:
    """Widen the weight range of every channel of ``model`` whose int32 bias code would leave the int32 range
    or whose bias scale would be below :data:`TINY` (see the module); returns the layers changed. Layers
    without an int32 bias (other targets, formats without one integer scale, quantizers disabled) are left as
    they are.

    A dozen operations and one read back for the whole model (on a GPU, one synchronisation): a bound on
    every layer's largest code screens them all at once, and only the layers it does not clear (rare) are
    computed channel by channel."""
    layers = [
        (name, m)
        for name, m in model.named_modules()
        if getattr(m, "int32_bias", False)
        and getattr(m, "bias", None) is not None
        and m.input_quantizer.has_integer_scale()
        and m.weight_quantizer.has_integer_scale()
        and m.input_quantizer.amax.numel() == 1
    ]
    widened = []
    for name, m in _not_cleared(layers):
        _, scale = m.int32_bias_constants()  # (a pair: both quantizers have one integer scale)
        ratio = widening_ratios(m.bias, scale)
        over = ratio > 1
        if not bool(over.any()):
            continue
        _widen(m.weight_quantizer, ratio, m.weight_axis, required_scales(m.bias), m.input_quantizer)
        codes, scale = m.int32_bias_constants()  # as the graph will hold them: within the range now
        if bool((codes.abs() > LIMIT * 1.00001).any()) or not bool((scale >= TINY).all()):
            raise CalibrationError(
                f"{name}: its int32 bias cannot be made to fit by widening its weight range (weights "
                f"{m.weight_quantizer.amax.abs().max().item():.3g} at most, input amax "
                f"{m.input_quantizer.amax.item():.3g}); keep the layer float with a config rule "
                f'(pattern "{name}.*", enable: false)'
            )
        finite = ratio[over & torch.isfinite(ratio)]
        floor = over & (m.bias.detach().to(torch.float64).abs() / LIMIT < TINY).to(over.device)
        widened.append(
            WidenedWeights(
                name,
                int(over.sum()),
                float(finite.max()) if finite.numel() else None,
                int(floor.sum()),
            )
        )
    return widened


def _not_cleared(layers: list) -> list:
    """The layers whose largest bias code may leave the int32 range, by a bound computed for all at once:
    ``max|bias| / (input_scale * smallest weight scale)``, each scale at least ``amax / (2**bits - 1)`` (of
    every grid, symmetric or affine, ``amax >= 0``), with 1 % to spare."""
    if not layers:
        return []
    inf = float("inf")
    with torch.no_grad():  # (a detach per bias otherwise)
        biggest = torch.stack(torch._foreach_norm([m.bias for _, m in layers], inf))
    amax_in = torch.stack(torch._foreach_norm([m.input_quantizer.amax for _, m in layers], inf))
    amax_w = torch.stack(torch._foreach_norm([m.weight_quantizer.amax for _, m in layers], -inf))
    levels = [
        ((1 << m.input_quantizer.desc.num_bits) - 1) * ((1 << m.weight_quantizer.desc.num_bits) - 1)
        for _, m in layers
    ]
    levels = torch.tensor(levels, dtype=torch.float64).to(biggest.device)
    smallest = amax_in.double() * amax_w.double() / levels  # a lower bound on the bias scale (amax > 0)
    # code <= biggest / (amax_in / levels_in * amax_w / levels_w): over LIMIT * 0.99 where this holds; a bias
    # scale that may fall below TINY (subnormal weights) is computed too
    over = ((biggest.double() >= smallest * 0.99 * LIMIT) | (smallest < TINY * 1e3)).tolist()
    return [layer for layer, o in zip(layers, over) if o]


def _widen(q, ratio: torch.Tensor, axis: int, required: torch.Tensor, input_quantizer) -> None:
    """Multiply ``q``'s amax (and amin) by ``ratio`` per output channel; by its largest value where the
    weight quantizer is per tensor (one scale for every channel). A symmetric grid's amax is set from the
    ``required`` bias scale directly (``required / input_scale * bound``): a channel whose amax is 0 (a dead
    channel: placeholder scale 1.0) or subnormal cannot be scaled up by a ratio."""
    amax = q.amax
    d = q.desc
    if not d.asymmetric:
        from quantcli.quant import arithmetic

        bound = arithmetic.symmetric_bound(d.num_bits, d.unsigned)
        sx = input_quantizer.integer_scale().to(torch.float64)
        # a hair above: float32 rounding of amax / bound must not land below the required scale
        want = (required * (1 + 1e-6) / sx * bound).to(amax.device)
        old = amax.double()
        if amax.numel() == want.numel():
            over = (ratio > 1).to(amax.device).reshape(amax.shape)
            new = torch.where(over, torch.maximum(want.reshape(amax.shape), old), old)
        else:  # per tensor: one amax for every channel
            new = torch.maximum(want.max().expand(amax.shape), old)
        q.set_amax(new.to(torch.float32))
        return
    if amax.numel() != ratio.numel():  # per tensor (or channels shared across groups): one factor for all
        r = ratio.max().to(torch.float32).expand(amax.shape)
    else:
        shape = [1] * amax.dim()
        shape[axis if amax.dim() > 1 else 0] = -1
        r = ratio.to(torch.float32).reshape(shape)
    q.set_amax((amax * r).to(torch.float32))
    if q.amin is not None:
        q.amin = (q.amin * r).to(torch.float32)
