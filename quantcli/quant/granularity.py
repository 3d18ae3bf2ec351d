"""How an amax tensor's shape maps onto the tensor it quantizes: per-tensor, per-axis, or blocked.

amax keeps the rank of the tensor (a conv weight's per-channel amax is ``(Cout, 1, 1, 1)``). Along each
dimension its size is 1 (shared), the tensor's size (one amax per index), or ``ceil(n / block)`` (one
amax per block of ``block`` consecutive elements).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Granularity:
    kind: str  # "tensor" | "axis" | "block"
    axis: int | None = None  # the per-axis or block axis (non-negative)
    block_size: int | None = None


def block_of(n: int, num_blocks: int) -> int:
    """The block size that cuts a dimension of ``n`` into ``num_blocks`` blocks, the last one possibly
    partial.

    ``(n, num_blocks)`` does not name one block size when the last block is partial (200 in 2 blocks: any of
    100..199; 300 in 3: 100 or 128), so the power of two that fits is taken (128: the block sizes MatMulNBits
    and most int4 formats use), else the even split ``ceil(n / num_blocks)``. Quantizers check at calibration
    that this reading gives their configured block size (:meth:`quantcli.nn.TensorQuantizer.collect`).
    """
    n, num_blocks = int(n), int(num_blocks)  # (traced shapes are tensors; blocked dims are static)
    even = -(-n // num_blocks)
    if num_blocks > 1:
        p2 = 1 << (even - 1).bit_length()
        if -(-n // p2) == num_blocks:
            return p2
    return even


def _dims(amax_shape: tuple[int, ...], x_shape: tuple[int, ...]) -> list[tuple[int, str, int]]:
    if len(amax_shape) == 0 or math.prod(amax_shape) == 1:
        return []
    if len(amax_shape) != len(x_shape):
        raise ValueError(
            f"amax of shape {tuple(amax_shape)} must have the rank of the tensor {tuple(x_shape)} "
            "(keep reduced axes as size 1) or be a scalar"
        )
    out = []
    for d, (a, n) in enumerate(zip(amax_shape, x_shape)):
        if a == 1 and n != 1:
            continue
        if a == n:
            if a != 1:
                out.append((d, "axis", 1))
            continue
        block = block_of(n, a)
        if a > n or -(-n // block) != a:
            raise ValueError(f"amax size {a} does not divide dimension {d} of size {n} into blocks")
        out.append((d, "block", block))
    return out


def granularity_of(amax_shape: tuple[int, ...], x_shape: tuple[int, ...]) -> Granularity:
    """Classify for ONNX: per-tensor, per-axis (one kept axis), or blocked (one blocked axis, every other
    axis kept whole, as ONNX's blocked QuantizeLinear wants its scale).

    A single block spanning a whole axis looks like a broadcast axis (amax size 1); when every other axis is
    kept, it is read as that block (a conv weight ``(O, I, kh, kw)`` blocked by ``I`` has amax ``(O, 1, kh,
    kw)``).
    """
    dims = _dims(tuple(amax_shape), tuple(x_shape))
    if not dims:
        return Granularity("tensor")
    kept = [d for d in dims if d[1] == "axis"]
    blocks = [d for d in dims if d[1] == "block"]
    broadcast = [d for d, (a, n) in enumerate(zip(amax_shape, x_shape)) if a == 1 and n != 1]
    if not blocks and len(kept) == 1:
        return Granularity("axis", kept[0][0])
    if not blocks and len(broadcast) == 1:
        d = broadcast[0]
        return Granularity("block", d, x_shape[d])
    if len(blocks) == 1 and not broadcast:
        d = blocks[0]
        return Granularity("block", d[0], d[2])
    raise ValueError(
        f"amax of shape {tuple(amax_shape)} for a tensor of shape {tuple(x_shape)} is neither per-tensor, "
        "per-axis (one axis) nor blocked along one axis; ONNX QuantizeLinear cannot express it"
    )


def expand_amax(amax: torch.Tensor, x_shape: tuple[int, ...]) -> torch.Tensor:
    """amax broadcastable elementwise against ``x_shape`` (blocked dims repeated to full size)."""
    if amax.dim() == 0 or amax.numel() == 1:
        return amax.reshape(())
    out = amax
    for d, kind, block in _dims(tuple(amax.shape), tuple(x_shape)):
        if kind == "block":
            out = out.repeat_interleave(block, dim=d).narrow(d, 0, x_shape[d])
    return out


def flatten_for_onnx(t: torch.Tensor, g: Granularity) -> torch.Tensor:
    """The scale layout ONNX wants: scalar per-tensor, 1-D per-axis, same-rank per-block."""
    if g.kind == "tensor":
        return t.reshape(())
    if g.kind == "axis":
        return t.reshape(-1)
    return t


def broadcast_onnx_param(
    p: torch.Tensor, x_shape: tuple[int, ...], axis: int | None, block_size: int | None
) -> torch.Tensor:
    """A QuantizeLinear/DequantizeLinear scale or zero point in ONNX layout (scalar; 1-D along ``axis``; or
    same-rank with ``axis`` in blocks of ``block_size``) made broadcastable elementwise against
    ``x_shape``."""
    if p.numel() == 1 and p.dim() <= 1:
        return p.reshape(())
    axis = axis % len(x_shape)
    if block_size:
        return p.repeat_interleave(block_size, dim=axis).narrow(axis, 0, x_shape[axis])
    shape = [1] * len(x_shape)
    shape[axis] = p.numel()
    return p.reshape(shape)
