"""What a uint8 x int8 integer kernel computes on an x86 CPU without VNNI, emulated in PyTorch.

onnxruntime's u8s8 GEMM and symmetric-conv kernels for AVX2 (and AVX-512 without VNNI) multiply with
``VPMADDUBSW``: each pair of adjacent uint8 x int8 products along the reduction axis is added into a
*saturating* signed 16-bit lane, then widened to int32 (``VPMADDWD``). 255 * 127 * 2 = 64770 does not fit in
16 bits, so a pair of large products clips at 32767; VNNI (``VPDPBUSD``) accumulates in 32 bits and never
clips. onnxruntime runs int8 activations as uint8 (code + 128), so even small activations make large products.

:func:`saturating_dot` computes the kernel's int32 sums; :func:`install` adds, to each given quantized layer
of a fake-quant model, the difference between those sums and the exact ones (times the scales), so that the
model computes what a deployed session on such a CPU computes for those layers. An emulation, not a
measurement: the pairing follows the kernels' K order ((kh, kw, cin) for convolutions, onnxruntime's NHWC
layout).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from quantcli.quant import arithmetic

I16_MIN, I16_MAX = -32768, 32767


def saturating_dot(
    a_u8: torch.Tensor, w_s8: torch.Tensor, chunk: int = 4096
) -> tuple[torch.Tensor, int, int]:
    """(int64 sums (M, N) as VPMADDUBSW + VPMADDWD compute them, saturated pairs, pairs).

    Args:
        a_u8: (M, K) integer-valued, 0..255.
        w_s8: (K, N) integer-valued, -128..127.
    """
    a = a_u8.to(torch.int64)
    w = w_s8.to(torch.int64)
    if a.shape[1] % 2:
        a = F.pad(a, (0, 1))
        w = F.pad(w, (0, 0, 0, 1))
    out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.int64)
    saturated = 0
    for s in range(0, a.shape[0], chunk):
        rows = a[s : s + chunk]
        for k in range(0, a.shape[1], 2):
            pair = rows[:, k, None] * w[None, k] + rows[:, k + 1, None] * w[None, k + 1]
            clipped = pair.clamp(I16_MIN, I16_MAX)
            saturated += int((clipped != pair).sum())
            out[s : s + chunk] += clipped
    return out, saturated, a.shape[0] * w.shape[1] * (a.shape[1] // 2)


def _codes(q, x: torch.Tensor) -> torch.Tensor:
    d = q.desc
    bound = arithmetic.symmetric_bound(d.num_bits, d.unsigned)
    qmin, qmax = arithmetic.integer_range(d.num_bits, d.unsigned, d.narrow_range)
    return arithmetic.quantize_linear(
        x, arithmetic.symmetric_scale(q.amax, bound), 0, qmin, qmax
    ), arithmetic.symmetric_scale(q.amax, bound)


def _rows(module: nn.Module, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Callable]:
    """(activation rows (M, K), weight (K, N), fold: (M, N) -> the layer's output layout), K in the kernel's
    order."""
    if isinstance(module, nn.Linear):
        lead = x.shape[:-1]
        return x.reshape(-1, x.shape[-1]), w.t(), lambda y: y.reshape(*lead, -1)
    if isinstance(module, nn.Conv2d) and module.groups == 1:
        n, c, h, wd = x.shape
        kh, kw = module.kernel_size
        cols = F.unfold(x, (kh, kw), dilation=module.dilation, padding=module.padding, stride=module.stride)
        L = cols.shape[-1]
        cols = cols.view(n, c, kh * kw, L).permute(0, 3, 2, 1).reshape(n * L, kh * kw * c)  # (kh, kw, cin)
        oh = (h + 2 * module.padding[0] - module.dilation[0] * (kh - 1) - 1) // module.stride[0] + 1
        ow = (wd + 2 * module.padding[1] - module.dilation[1] * (kw - 1) - 1) // module.stride[1] + 1
        wk = w.permute(0, 2, 3, 1).reshape(w.shape[0], -1).t()
        return cols, wk, lambda y: y.view(n, oh, ow, -1).permute(0, 3, 1, 2)
    raise ValueError(f"{type(module).__name__} is not emulated (Linear and 2-D convolutions with groups=1)")


class Stats:
    def __init__(self):
        self.saturated = 0
        self.pairs = 0


def install(model: nn.Module, layers: Iterable[str], stats: Stats | None = None) -> list:
    """Forward hooks on ``layers`` (module names) that add the non-VNNI kernel's error; returns the
    handles."""
    modules = dict(model.named_modules())
    handles = []

    def hook(module, inputs, output):
        x = inputs[0]
        iq, wq = module.input_quantizer, module.weight_quantizer
        a, sx = _codes(iq, x)
        wc, sw = _codes(wq, module.weight)
        if not (iq.desc.unsigned or iq.desc.asymmetric):
            a = a + 128  # onnxruntime runs int8 activations as uint8 with zero point 128
        rows, wk, fold = _rows(module, a, wc)
        sat, n_sat, n_pairs = saturating_dot(rows, wk)
        exact = rows.to(torch.int64) @ wk.to(torch.int64)
        if stats is not None:
            stats.saturated += n_sat
            stats.pairs += n_pairs
        delta = (sat - exact).to(torch.float32) * sx.reshape(()) * sw.reshape(1, -1)
        return output + fold(delta)

    for name in layers:
        handles.append(modules[name].register_forward_hook(hook))
    return handles
