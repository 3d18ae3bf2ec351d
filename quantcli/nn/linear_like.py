"""Layers that are a Linear or a Conv in all but name, found by what they compute, not only by their class.

:func:`quant_class` decides which modules keep the class path (the module's class becomes a quantized wrapper
whose ``forward`` is the layer's):

* an exact torch layer: its ``Quant*`` class;
* a subclass of one whose ``forward`` is the torch layer's: a subclass of both (``Quant<Name>``), so the
  module keeps its own attributes;
* a parametrized torch layer (``torch.nn.utils.parametrize``, e.g. ``weight_norm``):
  :func:`resolve_parametrizations` first stores the weight it computes (the same value, computed once), after
  which it is the plain layer;
* any other leaf module whose parameters are a 2-D ``weight`` and an optional ``bias``, when its ``forward``
  is checked to equal ``F.linear(x, W, b)`` (``[out, in]``) or ``x @ W + b`` (``[in, out]``, as transformers'
  ``Conv1D``, which computes it with ``torch.addmm``) for random ``W``, ``b`` and ``x``
  (:func:`linear_layout`): a ``Quant<Name>`` whose forward is that computation on quantized ``x`` and ``W``.
  The probe uses its own random values, never the module's weights, so the answer is the same at calibration
  and when a checkpoint is rebuilt from freshly initialised modules.

A subclass whose ``forward`` is its own (EfficientNet's "same"-padding ``Conv2dStaticSamePadding``, weight
standardisation, a LoRA branch) is not converted by class: a probe on a small input cannot show what its
``forward`` does on the real one (a stride-2 layer's right and bottom padding never reaches a 9x9 probe's
windows, so the layer passed as a plain Conv2d and its padding vanished). Such modules,
``nn.MultiheadAttention`` and modules whose weight other code passes to ``F.linear`` are quantized where
their operations run (:mod:`quantcli.nn.computed`); :func:`float_reason` says why a module with a floating
``*weight`` of two or more dimensions is left float.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from quantcli.nn.modules import QUANT_CLASSES, QuantMixin, dynamic_export

_PROBE_SEED = 0
_PROBE_TOL = 1e-4  # relative to the reference's scale; layouts or formulas that differ are off by O(1)


class QuantLinearLike(QuantMixin):
    """Mixed in front of a module found to compute ``F.linear(x, W, b)`` (``weight_axis = 0``, ``W`` is
    ``[out, in]``) or ``x @ W + b`` (``weight_axis = 1``, ``W`` is ``[in, out]``: transformers' ``Conv1D``).
    The output channel is ``weight_axis``, so per-channel weight scales follow the outputs in both layouts,
    and the transposed layout exports as ``MatMul(x, DequantizeLinear(W, axis=1))``, the form onnxruntime
    fuses. The bias is added in float there (as a 3-D ``nn.Linear`` does: ``MatMulIntegerToFloat`` adds a
    float bias); ``F.linear`` on a 2-D input takes the int32 bias QGemm adds, as ``nn.Linear`` does."""

    #: see :class:`quantcli.nn.modules.QuantLinear` (``F.linear`` with a dynamic input quantizer)
    export_hook = None

    @property
    def takes_int32_bias(self) -> bool:
        """``F.linear(x, W, b)`` on a 2-D input exports as Gemm, which onnxruntime runs as QGemm with an int32
        bias, as for ``nn.Linear``; ``x @ W + b`` adds ``b`` after a MatMul, in float."""
        return self.weight_axis == 0 and isinstance(self._parameters.get("bias"), torch.Tensor)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        smooth = self._modules.get("input_smooth")  # SmoothQuant's explicit Mul (quantcli.nn.smooth), if any
        if smooth is not None:
            input = smooth(input)
        exported = dynamic_export(self, input)  # a dynamic input exports as a Linear's does (either layout)
        if exported is not None:
            return exported
        x, w = self.input_quantizer(input), self.quantized_weight()
        bias = self._parameters.get("bias")
        if self.weight_axis == 1:
            y = torch.matmul(x, w)
            return self.quantize_output(y if bias is None else y + bias)
        if bias is not None and input.dim() == 2:  # Gemm: QGemm's int32 bias, as nn.Linear's
            bias = self.quantized_bias()
        return self.quantize_output(F.linear(x, w, bias))


_SUBCLASSES: dict[tuple[type, type, int | None], type] = {}


def _subclass(qbase: type, cls: type, weight_axis: int | None = None) -> type:
    """``Quant<Name>``: ``qbase``'s forward in front of the user's class (its attributes and methods stay)."""
    key = (qbase, cls, weight_axis)
    if key not in _SUBCLASSES:
        attrs = {"__module__": __name__}
        if weight_axis is not None:
            attrs["weight_axis"] = weight_axis
        _SUBCLASSES[key] = type(f"Quant{cls.__name__}", (qbase, cls), attrs)
    return _SUBCLASSES[key]


def _torch_base(cls: type) -> type | None:
    """The exact torch layer class ``cls`` derives from (nearest in its MRO), if any."""
    return next((c for c in cls.__mro__ if c in QUANT_CLASSES), None)


def resolve_parametrizations(model: nn.Module) -> list[str]:
    """Store the weights that ``torch.nn.utils.parametrize`` computes (``weight_norm``'s ``g * v / ||v||``) in
    the torch layers that hold them, which become the plain layer again: the same value, computed once instead
    of per call, and a layer :func:`quant_class` converts. Returns the names of the layers resolved."""
    done = []
    for name, module in list(model.named_modules()):
        if not parametrize.is_parametrized(module):
            continue
        if _torch_base(parametrize.type_before_parametrizations(module)) is None:
            continue
        for tensor in list(module.parametrizations):
            parametrize.remove_parametrizations(module, tensor, leave_parametrized=True)
        done.append(name)
    return done


def _close(y, ref: torch.Tensor) -> bool:
    if not isinstance(y, torch.Tensor) or y.shape != ref.shape:
        return False
    scale = ref.abs().max().clamp(min=1.0)
    return bool(((y.double() - ref.double()).abs().max() <= _PROBE_TOL * scale).item())


def _random_params(module: nn.Module, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {k: torch.randn(p.shape, generator=gen).to(p) for k, p in module.named_parameters(recurse=False)}


@contextlib.contextmanager
def _parameters_set(module: nn.Module, params: dict[str, torch.Tensor]):
    """``module`` with its own parameters replaced by ``params`` (restored after)."""
    saved = {k: module._parameters[k] for k in params}
    try:
        for k, v in params.items():
            module._parameters[k] = nn.Parameter(v, requires_grad=False)
        yield module
    finally:
        module._parameters.update(saved)


def linear_layout(module: nn.Module) -> int | None:
    """The output-channel axis of ``module``'s weight when its ``forward`` is a Linear's: 0 for ``F.linear(x,
    W, b)`` (``W`` is ``[out, in]``), 1 for ``x @ W + b`` (``[in, out]``); None otherwise. Checked on random
    ``W``, ``b`` and a 3-D ``x`` against a float64 reference; the module's own weights are not read."""
    own = dict(module.named_parameters(recurse=False))
    w, b = own.get("weight"), own.get("bias")
    if w is None or w.dim() != 2 or not w.is_floating_point() or set(own) - {"weight", "bias"}:
        return None
    if any(True for _ in module.children()) or (b is not None and b.dim() != 1):
        return None
    for axis in (0, 1):
        out, inp = w.shape[axis], w.shape[1 - axis]
        if b is not None and b.shape[0] != out:
            continue
        gen = torch.Generator().manual_seed(_PROBE_SEED)
        params = _random_params(module, gen)
        x = torch.randn(2, 3, inp, generator=gen).to(w)
        W = params["weight"].double()
        ref = x.double() @ (W.T if axis == 0 else W)
        if b is not None:
            ref = ref + params["bias"].double()
        try:
            with torch.no_grad(), _parameters_set(module, params):
                y = module.forward(x)
        except Exception:  # a forward that takes other inputs is not a Linear's
            continue
        if _close(y, ref):
            return axis
    return None


def quant_class(module: nn.Module) -> type | None:
    """The class to convert ``module`` to in place, or None when it is not a Linear/Conv in all but name."""
    cls = type(module)
    if pads_itself(module):
        return None  # computed where its convolution runs, after its padding (quantcli.nn.computed)
    if cls in QUANT_CLASSES:
        return QUANT_CLASSES[cls]
    if cls.__module__.startswith("quantcli."):
        return None  # already converted
    base = _torch_base(cls)
    if base is not None:
        if cls.__name__ == "NonDynamicallyQuantizableLinear" or overrides_forward(cls):
            return None  # computed where its operations run (quantcli.nn.computed)
        return _subclass(QUANT_CLASSES[base], cls)
    if cls.__module__.startswith("torch."):
        return None
    axis = linear_layout(module)
    return None if axis is None else _subclass(QuantLinearLike, cls, axis)


def pads_itself(module: nn.Module) -> bool:
    """A convolution with ``padding_mode`` reflect, replicate or circular: torch pads its input with
    ``F.pad`` before ``F.conv2d`` (padding 0). Quantized as a class, the input quantizer would run before the
    padding, and onnxruntime cannot fuse ``DequantizeLinear -> Pad -> Conv`` into QLinearConv; quantized
    where the convolution runs, the Q/DQ pair reads the padded tensor."""
    return isinstance(module, nn.modules.conv._ConvNd) and getattr(module, "padding_mode", "zeros") != "zeros"


def overrides_forward(cls: type) -> bool:
    """Whether a torch layer's subclass has a ``forward`` of its own."""
    base = _torch_base(cls)
    return base is not None and cls.forward is not base.forward


def torch_base(cls: type) -> type | None:
    """The exact torch layer class ``cls`` derives from, if any."""
    return _torch_base(cls)


#: normalizations whose gain may have 2+ dimensions (LayerNorm over [C, H, W]): no product to quantize
NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.RMSNorm)


def float_reason(module: nn.Module) -> str | None:
    """Why a module that owns a floating weight of 2+ dimensions stays float (None for other modules)."""
    ws = [
        p
        for n, p in module.named_parameters(recurse=False)
        if n.endswith("weight") and p.is_floating_point() and p.dim() >= 2
    ]
    if not ws or isinstance(module, QuantMixin) or type(module).__name__.startswith("TensorQuantizer"):
        return None
    cls = type(module)
    if isinstance(module, nn.Embedding):
        return "a lookup table: no matmul to quantize"
    if isinstance(module, nn.MultiheadAttention) or cls.__name__ == "NonDynamicallyQuantizableLinear":
        return "nn.MultiheadAttention computes with these weights itself (F.multi_head_attention_forward)"
    base = _torch_base(cls)
    if base is not None:
        return (
            f"its forward (overridden) is not {base.__name__}'s, and no example batch showed the "
            "operations it computes"
        )
    return (
        "its forward is neither F.linear(x, W, b) nor x @ W + b of its own weight (checked on a probe), "
        "and no example batch showed a convolution, linear or matmul computed with its weight"
    )
