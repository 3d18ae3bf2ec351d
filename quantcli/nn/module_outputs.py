"""Each module's float output on the example batch, and the first module whose output a transformation
changed.

quantcli transforms the float model before it quantizes it (BatchNorm folding, layer conversion, SmoothQuant,
placement rewrites). Each is meant to compute what the model as loaded computes, up to float rounding; a
transformation that does not (a padding that a converted class's ``forward`` no longer applies, a BatchNorm
folded into a layer whose ``forward`` does more than its convolution) must not pass in silence. The model as
loaded is read once (:func:`observer`, :func:`capture`): for every module, the first call's output, as its
shapes and a bounded, evenly strided sample of its values (at most :data:`SAMPLE` per tensor, so the memory
does not grow with the model's activations). The transformed model, quantizers off, is read the same way and
compared module by module in the order the modules finished (:func:`differences`): the first module listed is
the innermost, earliest one whose output moved.

Modules a transformation changes by design are left out of the comparison by the caller (a layer a BatchNorm
was folded into: the BatchNorm's output, which it now computes, is compared instead; a norm whose scale
SmoothQuant moved into the next layer's input), and so are modules the transformed model lacks or did not
call.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from quantcli.nn.forward_call import call_forward
from quantcli.nn.fresh_inputs import fresh

#: values kept per output tensor
SAMPLE = 4096
#: relative RMS change of a module's output beyond float rounding (verify's reference.transformations bound)
TOLERANCE = 1e-3
#: below this RMS a change is rounding whatever the output's own scale (outputs that are exactly zero)
_ABSOLUTE = 1e-7
#: the random state every compared forward starts from (a model that samples in ``forward`` draws the same)
SEED = 0


@contextlib.contextmanager
def same_randomness() -> Iterator[None]:
    """The block runs from torch's CPU random state :data:`SEED`; the caller's state is back after it, so a
    forward that draws random numbers draws the same ones on the model as loaded and on the transformed
    one."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        yield


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """CUDA's float32 convolutions and matmuls in full precision within the block: a model moved to the GPU
    (calibration, SmoothQuant) is compared with its CPU reference, and TensorFloat-32's 10-bit mantissa
    (cuDNN's default for convolutions) moves an output by about 1e-3, the tolerance itself."""
    cudnn, matmul = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = cudnn, matmul


def on_device_of(model: nn.Module, example: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``example`` on the device of the model's parameters (a model calibrated or smoothed on the GPU stays
    there)."""
    p = next(model.parameters(), None)
    if p is None or all(not isinstance(v, torch.Tensor) or v.device == p.device for v in example.values()):
        return example
    return {k: v.to(p.device) if isinstance(v, torch.Tensor) else v for k, v in example.items()}


@dataclass
class Fingerprint:
    """One module output: each tensor's shape and dtype, and its sampled values (float64)."""

    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]
    values: list[torch.Tensor]


def _flat(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    values = getattr(output, "values", None)  # transformers' ModelOutput, dicts
    if callable(values) and not isinstance(output, (tuple, list)):
        output = list(values())
    return [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]


def fingerprint(output) -> Fingerprint:
    shapes, dtypes, values = [], [], []
    for t in _flat(output):
        flat = t.detach().reshape(-1)
        if flat.numel() > SAMPLE:
            flat = flat[:: -(-flat.numel() // SAMPLE)]  # every k-th value: at most SAMPLE of them, a view
        shapes.append(tuple(t.shape))
        dtypes.append(t.dtype)
        values.append(flat.to("cpu", torch.float64, copy=True))
    return Fingerprint(shapes, dtypes, values)


def relative_change(ref: Fingerprint, got: Fingerprint) -> float:
    """RMS(got - ref) / RMS(ref) over the sampled values (inf where shapes or dtypes differ; integer tensors:
    0 or inf)."""
    if ref.shapes != got.shapes or ref.dtypes != got.dtypes:
        return math.inf
    worst = 0.0
    for dtype, a, b in zip(ref.dtypes, ref.values, got.values):
        if not dtype.is_floating_point:
            if not torch.equal(a, b):
                return math.inf
            continue
        finite = torch.isfinite(a)
        if not torch.equal(finite, torch.isfinite(b)) or not torch.equal(torch.isnan(a), torch.isnan(b)):
            return math.inf
        infinite = ~finite & ~torch.isnan(a)  # +-inf where both have one: the same sign
        if not torch.equal(a[infinite], b[infinite]):
            return math.inf
        if not finite.any():
            continue
        a, b = a[finite], b[finite]
        diff = float((b - a).pow(2).mean().sqrt())
        if diff <= _ABSOLUTE:
            continue
        ref_rms = float(a.pow(2).mean().sqrt())
        worst = max(worst, diff / ref_rms if ref_rms > 0 else math.inf)
    return worst


def observer(store: dict[str, Fingerprint], keep: Callable[[str, nn.Module], bool] | None = None):
    """A ``(name, module, output)`` callback that stores each module's first output in ``store``."""

    def observe(name: str, module: nn.Module, output) -> None:
        if name not in store and (keep is None or keep(name, module)):
            store[name] = fingerprint(output)

    return observe


def capture(
    model: nn.Module,
    example: Mapping[str, torch.Tensor],
    names: Iterable[str] | None = None,
) -> dict[str, Fingerprint]:
    """Every module's (or only ``names``') first output on one forward of ``model`` on ``example``, with every
    quantizer passing values through; the model's modes and quantizer modes are restored after."""
    from quantcli.nn.modes import quantizer_modes

    wanted = set(names) if names is not None else None
    store: dict[str, Fingerprint] = {}
    observe = observer(store)
    handles = []
    for name, m in model.named_modules():
        if wanted is not None and name not in wanted:
            continue
        handles.append(
            m.register_forward_hook(lambda mod, a, out, name=name: observe(name, mod, out), always_call=True)
        )
    training = {m: m.training for m in model.modules()}
    example = on_device_of(model, example)
    try:
        model.eval()
        with quantizer_modes(model, "disabled"), torch.no_grad(), same_randomness(), full_float32():
            call_forward(model, fresh(example))
    finally:
        for h in handles:
            h.remove()
        for m, t in training.items():
            m.training = t
    return store


def unstable(model: nn.Module, example: Mapping[str, torch.Tensor], names: Iterable[str]) -> set[str]:
    """The modules of ``names`` whose output differs between two forwards of the same ``model`` (a forward
    that reads a clock, a counter or a global it changes): no transformation explains their differences."""
    names = list(names)
    first, second = capture(model, example, names), capture(model, example, names)
    return {n for n in names if n in first and n in second and relative_change(first[n], second[n]) > 0.0}


def fold_changes(reference: Mapping[str, Fingerprint], folds: Iterable[tuple[str, str]]) -> set[str]:
    """The modules whose output BatchNorm folds ``(layer, batchnorm)`` change by design: each layer, and the
    modules of ``reference`` (in the order their forwards finished) that finished after it and before its
    BatchNorm: what returns the layer's output onward, a container ending in it (timm's deep stem, the
    Sequential ending in the Conv a BatchNorm after it is folded into)."""
    order = {name: i for i, name in enumerate(reference)}
    out: set[str] = set()
    for layer, bn in folds:
        out.add(layer)
        if layer in order and bn in order:
            out |= {name for name, i in order.items() if order[layer] < i < order[bn]}
    return out


def differences(
    reference: Mapping[str, Fingerprint], got: Mapping[str, Fingerprint], skip: Iterable[str] = ()
) -> list[tuple[str, float]]:
    """``(module, relative change)`` of every module of ``reference`` (in its order) whose output in ``got``
    moved beyond :data:`TOLERANCE`; modules in ``skip`` or missing from ``got`` are not compared."""
    skip = set(skip)
    out = []
    for name, ref in reference.items():
        if name in skip or name not in got:
            continue
        rel = relative_change(ref, got[name])
        if rel > TOLERANCE:
            out.append((name, rel))
    return out


def describe_change(rel: float) -> str:
    if math.isinf(rel):
        return "its output changed shape, type or where it is not finite"
    return f"its output moved by relative RMS {rel:.3g}"
