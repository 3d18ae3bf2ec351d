"""u8s8 saturation in a fake-quant model: which layers can saturate on an x86 CPU without VNNI, and what
such a CPU's deployed session computes.

onnxruntime's uint8 x int8 kernels on x86 without VNNI add pairs of products in saturating 16-bit lanes
(:mod:`quantcli.quant.u8s8`). Two uses here:

* :func:`saturating_layers`: the quantized layers whose 8-bit weight codes *can* saturate with some uint8
  activation (a static check of the codes, no data): calibrate reports them when it writes such a graph for a
  CPU that saturates.
* :class:`Emulation`: a context under which the fake-quant model computes what the deployed session of such a
  CPU computes: each quantized convolution and linear op that onnxruntime runs with a u8s8 kernel gets the
  kernel's error added to its output (its int32 sums minus the exact ones, times the scales), and per layer
  the saturated pairs and the size of the change are recorded. It intercepts the op the layer's forward calls
  (``F.conv1d/2d/3d``, ``F.linear``, ``torch.matmul``; a computed layer's where it runs, through
  :data:`quantcli.nn.computed.OP_OBSERVERS`), so padding done in Python before the op is seen as the
  kernel sees it. Checked against onnxruntime's AVX2 kernels: the same int32 sums (tests/test_saturation.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from quantcli.nn.computed import OP_OBSERVERS, ComputedLayer
from quantcli.nn.config import kernel_can_saturate
from quantcli.nn.tensor_quantizer import TensorQuantizer, quantizer_name
from quantcli.quant import arithmetic, u8s8

_CONVS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}
_MATMULS = (F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)


def _u8s8_layer(module: nn.Module) -> bool:
    """A quantized layer that onnxruntime runs with a uint8 x int8 kernel: 8-bit integer input (static or
    dynamic) and 8-bit-or-narrower symmetric signed integer weights per tensor or per output channel, and a
    kernel that can saturate (not a depthwise convolution)."""
    qi, qw = getattr(module, "input_quantizer", None), getattr(module, "weight_quantizer", None)
    if not isinstance(qi, TensorQuantizer) or not isinstance(qw, TensorQuantizer):
        return False
    if not (qi.enabled and qw.enabled) or qi.mode != "quantize" or qw.mode != "quantize":
        return False
    di, dw = qi.desc, qw.desc
    if di.is_fp8 or dw.is_fp8 or di.num_bits != 8 or dw.num_bits > 8 or dw.unsigned or dw.asymmetric:
        return False
    if dw.block_sizes or di.axis is not None or getattr(module, "weight", None) is None:
        return False
    if isinstance(module, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        return False  # onnxruntime's CPU provider has no integer ConvTranspose kernel: it runs in float
    return kernel_can_saturate(module)


def _activation_qparams(q: TensorQuantizer, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(scale, uint8 zero point) of the activation codes the kernel reads: int8 activations run as uint8 with
    zero point 128 on x86."""
    d = q.desc
    if q.dynamic_uint8:
        scale, zp = arithmetic.dynamic_qparams(x)
        return scale.reshape(()).float(), int(zp.reshape(()))
    if d.asymmetric:
        amin = q.amin if q.amin is not None else torch.zeros_like(q.amax)
        scale, zp = arithmetic.affine_qparams(amin, q.amax, d.num_bits)
        return scale.reshape(()).float(), int(zp.reshape(()))
    scale = arithmetic.symmetric_scale(q.amax, arithmetic.symmetric_bound(d.num_bits, d.unsigned))
    return scale.reshape(()).float(), 0 if d.unsigned else 128


def _weight_scale(q: TensorQuantizer) -> torch.Tensor:
    d = q.desc
    return arithmetic.symmetric_scale(q.amax, arithmetic.symmetric_bound(d.num_bits, d.unsigned)).float()


def _codes(x: torch.Tensor, scale: torch.Tensor, zero_point: int = 0) -> torch.Tensor:
    """Integer codes of fake-quantized values (exact: ``(c - zp) * s / s`` rounds back to ``c - zp``)."""
    return torch.round(x.detach().float() / scale).to(torch.int64) + zero_point


def weight_columns(module: nn.Module, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's weight codes as the kernel reads them: ``(groups, K, N)`` in its K order."""
    q = module.weight_quantizer
    w = q(module.weight) if weight is None else weight
    sw = _weight_scale(q)
    axis = getattr(module, "weight_axis", 0)
    if sw.numel() > 1:
        shape = [1] * w.dim()
        shape[axis] = -1
        sw = sw.reshape(shape)
    codes = _codes(w, sw)
    if codes.dim() > 2:  # a convolution's (Cout, Cin/g, *k)
        return u8s8.conv_weight_columns(codes, getattr(module, "groups", 1))
    return (codes.t() if axis == 0 else codes).unsqueeze(0)


def saturating_layers(
    model: nn.Module, example: Mapping[str, torch.Tensor] | None = None, unknown: bool = False
) -> list[str]:
    """The quantized layers onnxruntime runs with a u8s8 kernel whose weight codes can saturate with uint8
    activations up to 255 (:func:`quantcli.quant.u8s8.can_saturate`), by module name.

    A layer whose weight operand is computed in its forward (a slice, a transpose, weight standardisation:
    ``weight_derived``) is judged on the operand it takes on one forward of ``example``; without an example
    its codes are not known, and it is listed where ``unknown`` (the cautious answer for a caller deciding
    whether to emulate saturation) and left out otherwise."""
    layers = [
        (n, m) for n, m in model.named_modules() if _u8s8_layer(m) and m.weight_quantizer.amax is not None
    ]
    operands = {}
    if example is not None and any(getattr(m, "weight_derived", False) for _, m in layers):
        from quantcli.nn.computed import weight_operands

        operands = weight_operands(model, example)
    out = []
    with torch.no_grad():
        for name, m in layers:
            w = _weight_operand(name, m, operands)
            if w is None:
                if unknown:
                    out.append(name)
                continue
            if any(u8s8.can_saturate(c) for c in weight_columns(m, m.weight_quantizer(w))):
                out.append(name)
    return out


def _weight_operand(name: str, module: nn.Module, operands: dict) -> torch.Tensor | None:
    """The weight the layer's operation takes: its parameter, or the operand recorded for a derived one;
    ``None`` where not known or where its quantizer's amax does not fit it."""
    if getattr(module, "weight_derived", False):
        w = operands.get(quantizer_name(name, "weight_quantizer"))
    else:
        w = module.weight_source() if hasattr(module, "weight_source") else module.weight
    return w if w is not None and _amax_fits(module, w) else None


def _amax_fits(module: nn.Module, w: torch.Tensor) -> bool:
    """Whether the layer's weight amax is one per tensor or one per channel of ``w`` along its axis."""
    amax = module.weight_quantizer.amax
    axis = getattr(module, "weight_axis", 0)
    return amax.numel() == 1 or (w.dim() > axis and amax.numel() == w.shape[axis])


@dataclass
class LayerSaturation:
    """What the emulated kernel did in one layer, summed over the batches run."""

    layer: str
    saturated: int = 0  # product pairs that clipped
    pairs: int = 0  # product pairs computed
    delta_sq: float = 0.0  # sum of squared output changes
    out_sq: float = 0.0  # sum of squared outputs (the fake-quant op's)

    @property
    def fraction(self) -> float:
        return self.saturated / self.pairs if self.pairs else 0.0

    @property
    def relative_change(self) -> float:
        """RMS of the output change over RMS of the output."""
        return math.sqrt(self.delta_sq / self.out_sq) if self.out_sq > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "layer": self.layer,
            "saturated_pairs": self.saturated,
            "pairs": self.pairs,
            "fraction": self.fraction,
            "relative_change": self.relative_change,
        }


def _padding(padding, kernel, dilation, nd: int) -> tuple[tuple[int, int], ...]:
    if isinstance(padding, str):
        if padding == "valid":
            return ((0, 0),) * nd
        total = [d * (k - 1) for k, d in zip(kernel, dilation)]  # "same": torch puts the odd one after
        return tuple((t // 2, t - t // 2) for t in total)
    p = (padding,) * nd if isinstance(padding, int) else tuple(padding)
    return tuple((v, v) for v in p)


def _tuple(v, nd: int) -> tuple[int, ...]:
    return (v,) * nd if isinstance(v, int) else tuple(v)


class Emulation(TorchFunctionMode):
    """Run the fake-quant model as a CPU without VNNI runs its graph (see the module docstring).

    Use as ``with Emulation(model) as emu: model(...)``; ``emu.layers`` holds a :class:`LayerSaturation` per
    emulated layer that ran."""

    def __init__(self, model: nn.Module, layers: set[str] | None = None):
        """``layers``: the module names to emulate (those onnxruntime fuses into u8s8 integer kernels); None:
        every quantized layer with such a kernel."""
        super().__init__()
        self.layers: dict[str, LayerSaturation] = {}
        self._stack: list[tuple[str, nn.Module]] = []
        self._qparams: dict[str, tuple[torch.Tensor, int]] = {}
        self._handles = []
        self._names: dict[int, str] = {}  # the emulated layers' names, by id
        self._busy = False
        for name, m in model.named_modules():
            if _u8s8_layer(m) and (layers is None or name in layers):
                self._names[id(m)] = name
                self._handles += [
                    m.register_forward_pre_hook(self._enter(name, m)),
                    m.register_forward_hook(self._leave),
                    m.input_quantizer.register_forward_hook(self._seen_input(name)),
                ]

    # -- the layer whose forward runs, and its input quantizer's parameters
    def _enter(self, name: str, module: nn.Module):
        def hook(_m, _args):
            self._stack.append((name, module))

        return hook

    def _leave(self, _m, _args, _out):
        self._stack.pop()

    def _seen_input(self, name: str):
        def hook(q, args, _out):
            self._qparams[name] = _activation_qparams(q, args[0])

        return hook

    def __enter__(self):
        OP_OBSERVERS.append(self._observe)
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        if self._observe in OP_OBSERVERS:
            OP_OBSERVERS.remove(self._observe)
        return super().__exit__(*exc)

    # -- the op
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._busy or not self._stack or (func not in _CONVS and func not in _MATMULS):
            return out
        name, module = self._stack[-1]
        if isinstance(module, ComputedLayer):  # its operations are seen where they run (_observe)
            return out
        return self._emulated(name, module, func, args, kwargs, out)

    def _observe(self, layer: nn.Module, func, args: tuple, kwargs: dict, out):
        """A computed layer's operation, its operands quantized (:data:`quantcli.nn.computed.OP_OBSERVERS`):
        ``nn.MultiheadAttention``'s projections run inside ``F.multi_head_attention_forward``, where no mode
        sees them, and its ``out_proj`` without its module being called."""
        name = self._names.get(id(layer))
        if name is None or (func not in _CONVS and func not in _MATMULS):
            return out
        return self._emulated(name, layer, func, args, kwargs, out)

    def _emulated(self, name: str, module: nn.Module, func, args: tuple, kwargs: dict, out):
        """``out`` plus the kernel's error, for layer ``name``'s operation ``func(*args, **kwargs)``."""
        if name not in self._qparams:  # the input quantizer ran elsewhere (before a padding module)
            qi = module.input_quantizer
            if qi.dynamic_uint8:
                return out
            self._qparams[name] = _activation_qparams(qi, args[0])
        x, w = args[0], args[1] if len(args) > 1 else kwargs.get("weight", kwargs.get("other"))
        if w is None or not _amax_fits(module, w):
            return out
        self._busy = True  # the emulation's own products are not a layer's
        try:
            with torch.no_grad():
                delta = self._delta(name, module, func, x, w, args, kwargs)
        finally:
            self._busy = False
        stats = self.layers.setdefault(name, LayerSaturation(name))
        stats.delta_sq += float((delta.double() ** 2).sum())
        stats.out_sq += float((out.detach().double() ** 2).sum())
        self._qparams.pop(name, None)
        return out + delta.to(out.dtype)

    def _delta(self, name, module, func, x, w, args, kwargs) -> torch.Tensor:
        sx, zp = self._qparams[name]
        a = _codes(x, sx, zp).clamp(0, 255)
        cols = weight_columns(module, w)
        sw = _weight_scale(module.weight_quantizer).reshape(-1)
        stats = self.layers.setdefault(name, LayerSaturation(name))
        if func in _CONVS:
            nd = _CONVS[func]
            names = ("stride", "padding", "dilation", "groups")
            given = dict(zip(names, args[3:]))
            given.update({k: v for k, v in kwargs.items() if k in names})
            kernel = tuple(w.shape[2:])
            dilation = _tuple(given.get("dilation", 1), nd)
            rows, spatial = u8s8.conv_rows(
                a,
                kernel,
                _tuple(given.get("stride", 1), nd),
                _padding(given.get("padding", 0), kernel, dilation, nd),
                dilation,
                int(given.get("groups", 1)),
                zp,
            )
            errs = []
            for g in range(rows.shape[0]):
                e, sat, pairs = u8s8.saturated_sums(rows[g], cols[g])
                stats.saturated, stats.pairs = stats.saturated + sat, stats.pairs + pairs
                errs.append(e)
            err = torch.cat(errs, dim=1).to(torch.float64) * float(sx) * sw.double().expand(w.shape[0])
            return err.reshape(x.shape[0], *spatial, -1).movedim(-1, 1)
        lead = x.shape[:-1]
        e, sat, pairs = u8s8.saturated_sums(a.reshape(-1, a.shape[-1]), cols[0])
        stats.saturated, stats.pairs = stats.saturated + sat, stats.pairs + pairs
        err = e.to(torch.float64) * float(sx) * sw.double().expand(cols.shape[-1])
        return err.reshape(*lead, -1)
