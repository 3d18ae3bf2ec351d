"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights of Linear layers.

For the input channels ``j`` of the Linear layers that read one tensor ``X`` (the q, k and v projections of an
attention layer read one), with ``amax_X[j] = max |X[..., j]|`` over the calibration data and
``amax_W[j] = max |W[:, j]|`` over the rows of every one of those layers' weights::

    s[j] = amax_X[j] ** alpha / amax_W[j] ** (1 - alpha)        (1 where either max is 0)
    X' = X / s,   W' = W * s    for every layer reading X,  so  X' @ W'.T == X @ W.T

The division is folded into the op that produced ``X`` where that keeps the float model equal:

- ``layernorm``: ``X`` is a LayerNorm's output: its weight and bias are divided by ``s`` (valid where every
  reader of the LayerNorm's output is smoothed by ``s``, as in pre-LN transformers);
- ``linear``: ``X`` is channel-wise linear in an earlier Linear's output (attention's output projection reads
  ``softmax(.) @ V``, linear in each channel of V): that Linear's output rows (weight rows and bias) are
  divided;
- ``mul``: otherwise (the FFN down-projection after GELU; a post-LN transformer's LayerNorm, whose output also
  feeds the residual Add) each reader gets an explicit ``Mul`` by ``1 / s`` (:mod:`quantcli.nn.smooth`), one
  ONNX ``Mul`` in the exported graph.

Whether a fold keeps the model equal is not guessed from module names: each candidate fold is applied with
random factors ``r`` in ``[1/e, e]`` and kept only if the model's outputs on a calibration batch stay equal to
float rounding (a fold through a nonlinearity changes them by orders of magnitude more); the model is restored
exactly after each trial. Call :func:`smooth_quant` after ``quantize_model`` and before ``calibrate``: it runs
the float model (every quantizer disabled) once over the calibration data for ``amax_X``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from quantcli.calibration.calibrate import resolve_device
from quantcli.calibration.smoothing_gain import MIN_GAIN, checkable, relative_error, sample_rows
from quantcli.errors import CalibrationError
from quantcli.inputs.batch_axes import head
from quantcli.inputs.data import Batch, run_model, to_device
from quantcli.nn.linear_like import QuantLinearLike
from quantcli.nn.modes import quantizer_modes
from quantcli.nn.modules import QuantLinear
from quantcli.nn.smooth import attach, smoothed_layers

DEFAULT_ALPHA = 0.5
#: s is kept in [1e-5, 1e5] so that 1 / s and W * s stay finite for near-zero maxima
SCALE_RANGE = (1e-5, 1e5)
#: a trial fold is accepted when every output moves by at most this fraction of its largest magnitude: :
# float32 rounding of a 6-layer encoder moves outputs by ~1e-6 of it, a fold through GELU or a residual by
# >1e-2
FOLD_RTOL = 1e-4
#: how many earlier Linear layers (nearest first) are tried as the producer of a Linear's input
LINEAR_CANDIDATES = 3
#: samples of the first calibration batch used for the fold trials
CHECK_SAMPLES = 4


@dataclass
class SmoothGroup:
    """The layers reading one tensor, smoothed by one ``s``."""

    consumers: list[str]
    fold: str  # "layernorm", "linear" or "mul"
    into: str | None  # the LayerNorm or Linear that absorbed 1 / s (None for "mul")
    scale_min: float
    scale_max: float

    def to_dict(self) -> dict:
        return {
            "consumers": self.consumers,
            "fold": self.fold,
            "into": self.into,
            "scale_min": self.scale_min,
            "scale_max": self.scale_max,
        }


@dataclass
class SmoothReport:
    alpha: float
    min_gain: float = MIN_GAIN
    groups: list[SmoothGroup] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # layer -> why it was not smoothed
    seconds: float = 0.0

    def counts(self) -> dict[str, int]:
        out = {"layernorm": 0, "linear": 0, "mul": 0}
        for g in self.groups:
            out[g.fold] += 1
        return out

    def to_dict(self) -> dict:
        return {
            "alpha": self.alpha,
            "min_gain": self.min_gain,
            "counts": self.counts(),
            "groups": [g.to_dict() for g in self.groups],
            "skipped": self.skipped,
            "seconds": round(self.seconds, 4),
        }


def smoothing_scales(act_amax: torch.Tensor, weight_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s = act_amax**alpha / weight_amax**(1 - alpha)`` per input channel, 1 where either max is 0.

    ``act_amax``, ``weight_amax``: ``(C,)`` non-negative maxima (activation over the data, weight over the
    output rows of every reader). Returns float32 ``(C,)`` in :data:`SCALE_RANGE`.
    """
    a, w = act_amax.float(), weight_amax.float()
    live = (a > 0) & (w > 0)  # a dead channel or an all-zero weight column: nothing to migrate
    s = a.clamp(min=1e-30).pow(alpha) / w.clamp(min=1e-30).pow(1.0 - alpha)
    return torch.where(live, s, torch.ones_like(s)).clamp(*SCALE_RANGE)


def smooth_quant(
    model: nn.Module,
    batches: Sequence[Batch],
    alpha: float = DEFAULT_ALPHA,
    *,
    device: str | torch.device = "auto",
    min_gain: float = MIN_GAIN,
) -> SmoothReport:
    """Smooth every Linear layer of a quantized ``model`` whose input quantizer is enabled, in place, where
    smoothing divides the layers' quantization error by at least ``min_gain``
    (:mod:`quantcli.calibration.smoothing_gain`; 0: every layer; the others are reported in ``skipped``).

    The float model (quantizers disabled) computes the same outputs before and after, to float rounding. Run
    it before :func:`quantcli.calibration.calibrate.calibrate` (which then calibrates the smoothed tensors).
    """
    if not 0.0 <= alpha <= 1.0:
        raise CalibrationError(f"--smoothquant alpha must be in [0, 1], got {alpha}")
    if not min_gain >= 0.0:
        raise CalibrationError(f"--smoothquant-min-gain must be a number >= 0, got {min_gain}")
    if not batches:
        raise CalibrationError("no calibration batches")
    if smoothed_layers(model):
        raise CalibrationError("the model is already smoothed (it has smoothing Muls); smooth it once")
    t0 = time.perf_counter()
    dev = resolve_device(device)
    model.eval()
    model.to(dev)
    layers = {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, (QuantLinear, QuantLinearLike)) and m.input_quantizer.enabled
    }
    report = SmoothReport(alpha, min_gain)
    tied = _tied_weights(model, layers)
    layers = {n: m for n, m in layers.items() if n not in tied}
    if not layers and tied:
        raise CalibrationError(
            f"no Linear layer to smooth: {', '.join(tied)} share their weight with another module"
        )
    if not layers:
        raise CalibrationError(
            "no Linear layer with an enabled input quantizer: nothing to smooth (SmoothQuant eases "
            "quantizing activations; a weight-only config such as int4-weight-only quantizes none): leave "
            "out --smoothquant"
        )
    check = head(to_device(batches[0], dev), CHECK_SAMPLES)
    with quantizer_modes(model, "disabled"), torch.inference_mode():  # observe the float model
        obs = _observe(model, layers, batches, dev)
        reference = _outputs(run_model(model, check, where="calibration batch 0"))
        plans, useless = [], {}
        for inp, consumers in obs.groups:
            act = torch.stack([obs.act_amax[c] for c in consumers]).amax(0)
            w = torch.stack([_weight_in_amax(layers[c]) for c in consumers]).amax(0)
            s = smoothing_scales(act, w, alpha)
            worse = _no_gain(obs.samples.get(inp), consumers, layers, s, min_gain) if min_gain > 0 else ""
            if worse:
                useless.update(dict.fromkeys(consumers, worse))
                continue
            # no floating-point output to compare (e.g. class ids): no trial can show a fold exact, so Muls
            # only
            fold, into = (
                _choose_fold(model, check, reference, obs, inp, consumers, layers)
                if reference
                else ("mul", None)
            )
            plans.append((consumers, fold, into, s))
    # outside inference mode: the Muls' buffers must be ordinary tensors (export traces them)
    with torch.no_grad():
        for consumers, fold, into, s in plans:
            s = s.clone()
            _apply(model, layers, consumers, fold, into, s, explicit=True)
            report.groups.append(SmoothGroup(consumers, fold, into, float(s.min()), float(s.max())))
    report.skipped = {**tied, **obs.skipped, **useless}
    report.seconds = time.perf_counter() - t0
    return report


# ------------------------------------------------------------------------------------------ observation


@dataclass
class _Observed:
    act_amax: dict[str, torch.Tensor]  # layer -> (C,) max |input| per channel over every batch
    groups: list[tuple[int, list[str]]]  # (input tensor id on batch 0, the layers reading it), in call order
    order: dict[str, int]  # Linear layer -> index of its first call on batch 0
    ln_outputs: dict[int, str]  # id of a LayerNorm's output on batch 0 -> the LayerNorm's name
    skipped: dict[str, str]
    samples: dict[int, torch.Tensor] = field(default_factory=dict)  # input id -> rows of it from batch 0


def _observe(model: nn.Module, layers: dict[str, QuantLinear], batches: Sequence[Batch], dev) -> _Observed:
    """One pass over the data: per-channel input maxima; on the first batch, who reads what (by identity)."""
    amax: dict[str, torch.Tensor] = {}
    inputs: dict[str, list[torch.Tensor]] = {}  # batch 0: the tensor objects each layer read
    order: dict[str, int] = {}
    ln_out: dict[int, str] = {}
    held: list[torch.Tensor] = []  # keeps batch 0's tensors alive, so that no id() is reused
    first = [True]
    samples: dict[int, torch.Tensor] = {}

    def pre_hook(name):
        def hook(module, args):
            x = args[0].detach()
            m = x.abs().reshape(-1, x.shape[-1]).amax(0)
            amax[name] = m if name not in amax else torch.maximum(amax[name], m)
            if first[0]:  # the very object (not x, a new one): q, k and v are given one tensor
                inputs.setdefault(name, []).append(args[0])

        return hook

    def order_hook(name):
        def hook(module, args):
            if first[0]:
                order.setdefault(name, len(order))

        return hook

    def ln_hook(name):
        def hook(module, args, output):
            if first[0] and isinstance(output, torch.Tensor):
                ln_out[id(output)] = name
                held.append(output)

        return hook

    handles = [m.register_forward_pre_hook(pre_hook(n)) for n, m in layers.items()]
    handles += [
        m.register_forward_pre_hook(order_hook(n))
        for n, m in model.named_modules()
        if isinstance(m, (nn.Linear, QuantLinearLike))
    ]
    handles += [
        m.register_forward_hook(ln_hook(n)) for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)
    ]
    try:
        for i, batch in enumerate(batches):
            run_model(model, to_device(batch, dev), where=f"calibration batch {i}")
            if i == 0:
                groups = _group(inputs, order)
                samples = {inp: sample_rows(inputs[cs[0]][0]) for inp, cs in groups}
                first[0] = False
    finally:
        for h in handles:
            h.remove()
    skipped = {n: "never called during calibration" for n in layers if n not in amax}
    skipped.update(
        {
            n: "called on more than one tensor per forward (one s cannot fit both)"
            for n, xs in inputs.items()
            if len({id(x) for x in xs}) > 1
        }
    )
    groups = [(i, [c for c in cs if c not in skipped]) for i, cs in groups]
    groups = [(i, cs) for i, cs in groups if cs]
    obs = _Observed(amax, groups, order, dict(ln_out), skipped, samples)
    held.clear()
    inputs.clear()
    return obs


def _group(inputs: dict[str, list[torch.Tensor]], order: dict[str, int]) -> list[tuple[int, list[str]]]:
    by_input: dict[int, list[str]] = {}
    for name in sorted(inputs, key=lambda n: order.get(n, 0)):
        by_input.setdefault(id(inputs[name][0]), []).append(name)
    return list(by_input.items())


def _no_gain(
    x: torch.Tensor | None, consumers: list[str], layers: dict, s: torch.Tensor, min_gain: float
) -> str:
    """Why smoothing the layers ``consumers`` by ``s`` is left out ("" to smooth them): their summed
    relative output error with every operand quantized (:mod:`quantcli.calibration.smoothing_gain`) on the
    sample ``x`` of their input is not ``min_gain`` times lower smoothed than as it is."""
    if x is None:
        return ""
    first = layers[consumers[0]]
    if not all(checkable(first.input_quantizer.desc, layers[c].weight_quantizer.desc) for c in consumers):
        return ""
    weights = [layers[c].weight if _out_axis(layers[c]) == 0 else layers[c].weight.T for c in consumers]
    descs = [layers[c].weight_quantizer.desc for c in consumers]
    x = x.to(weights[0].device)
    plain = relative_error(x, weights, torch.ones_like(s), first.input_quantizer.desc, descs)
    smoothed = relative_error(x, weights, s, first.input_quantizer.desc, descs)
    if smoothed * min_gain <= plain:
        return ""
    return (
        f"smoothing would not lower its quantization error by {min_gain:g}x (relative output error "
        f"{smoothed:.3g} smoothed, {plain:.3g} as it is, on calibration batch 0): its input has no outlier "
        "channels to move"
    )


# ------------------------------------------------------------------------------------------ folding


def _choose_fold(
    model, check, reference, obs: _Observed, inp: int, consumers: list[str], layers: dict[str, QuantLinear]
) -> tuple[str, str | None]:
    """The first fold that keeps the model's outputs equal under random factors, else ``mul``."""
    channels = _features(layers[consumers[0]])[0]
    r = torch.empty(channels).uniform_(-1.0, 1.0, generator=torch.Generator().manual_seed(channels)).exp()
    candidates: list[tuple[str, str]] = []
    if inp in obs.ln_outputs:
        ln = model.get_submodule(obs.ln_outputs[inp])
        if ln.weight is not None and ln.bias is not None and tuple(ln.normalized_shape) == (channels,):
            candidates.append(("layernorm", obs.ln_outputs[inp]))
    else:
        start = min(obs.order[c] for c in consumers)
        earlier = sorted(
            (n for n, i in obs.order.items() if i < start and n not in consumers), key=lambda n: -obs.order[n]
        )
        linears = [n for n in earlier if _features(model.get_submodule(n))[1] == channels]
        candidates += [("linear", n) for n in linears[:LINEAR_CANDIDATES]]
    own = None  # the readers' outputs on the check batch, unsmoothed (taken once a candidate is tried)
    for fold, into in candidates:
        if own is None:
            own = _readers_outputs(model, check, layers, consumers)[1]
        if _fold_holds(
            model,
            check,
            reference,
            own,
            layers,
            consumers,
            fold,
            into,
            r.to(layers[consumers[0]].weight.device),
        ):
            return fold, into
    return "mul", None


def _readers_outputs(model, check, layers, consumers) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The model's floating outputs on ``check``, and each reader's own output in that pass."""
    seen: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(_module, _args, output):
            if isinstance(output, torch.Tensor):
                seen.setdefault(name, output.detach().clone())

        return hook

    hooks = [layers[c].register_forward_hook(keep(c)) for c in consumers]
    try:
        outputs = _outputs(run_model(model, check, where="calibration batch 0"))
    finally:
        for h in hooks:
            h.remove()
    return outputs, seen


def _fold_holds(model, check, reference, own, layers, consumers, fold, into, r) -> bool:
    """Whether the fold keeps the model's outputs and the readers' own outputs equal (to float rounding)
    under the random factors ``r``: a fold through a nonlinearity deep in a model (SegFormer's MixFFN: a
    depthwise conv and GELU between the Linear folded into and the reader) moved the model's outputs by less
    than the bound, its reader's by 19%."""
    saved = _apply(model, layers, consumers, fold, into, r, explicit=False)
    try:
        outputs, now = _readers_outputs(model, check, layers, consumers)
    finally:
        for t, old in saved:
            t.copy_(old)
    readers = all(c in now and _close(now[c], own[c]) for c in own)
    return readers and all(_close(a, b) for a, b in zip(outputs, reference))


def _close(a: torch.Tensor, ref: torch.Tensor) -> bool:
    if a.shape != ref.shape:
        return False
    scale = ref.abs().max().item() if ref.numel() else 0.0
    return bool(((a - ref).abs() <= FOLD_RTOL * scale).all())


def _apply(
    model, layers, consumers, fold, into, s, explicit: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Divide channel j of the readers' input by ``s[j]`` and multiply their weight columns by it.
    ``explicit=False`` (a trial): ``mul`` is not applied; returns (tensor, original copy) pairs to restore."""
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def scale_(t: torch.Tensor, by: torch.Tensor) -> None:
        saved.append((t, t.detach().clone()))
        t.mul_(by.to(t.dtype))

    with torch.no_grad():
        for c in consumers:  # input channel j of the weight times s[j]
            scale_(layers[c].weight.data, s if _out_axis(layers[c]) == 0 else s[:, None])
        if fold == "layernorm":
            ln = model.get_submodule(into)
            scale_(ln.weight.data, 1.0 / s)
            scale_(ln.bias.data, 1.0 / s)
        elif fold == "linear":
            producer = model.get_submodule(into)
            # output channel j divided by s[j]
            scale_(producer.weight.data, (1.0 / s)[:, None] if _out_axis(producer) == 0 else 1.0 / s)
            if producer.bias is not None:
                scale_(producer.bias.data, 1.0 / s)
        elif explicit:
            for c in consumers:
                attach(layers[c], (1.0 / s).to(torch.float32))
    return saved


def _tied_weights(model: nn.Module, layers: dict[str, nn.Module]) -> dict[str, str]:
    """Layers whose weight is also another module's parameter (an LM head tied to the token embedding):
    scaling it in place would change that module too, so the float model would no longer compute the
    original."""
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    out = {}
    for n, m in layers.items():
        others = [o for o in owners.get(id(m.weight), []) if o != (f"{n}.weight" if n else "weight")]
        if others:
            out[n] = f"its weight is also {others[0]} (tied): scaling it would change that module too"
    return out


def _out_axis(layer: nn.Module) -> int:
    """The weight's output-channel axis: 0 for ``nn.Linear`` (``[out, in]``), 1 for transformers' ``Conv1D``
    (``[in, out]``, :class:`quantcli.nn.linear_like.QuantLinearLike`)."""
    return getattr(layer, "weight_axis", 0)


def _features(layer: nn.Module) -> tuple[int, int]:
    """(input channels, output channels) of a Linear-like layer's weight."""
    axis = _out_axis(layer)
    return layer.weight.shape[1 - axis], layer.weight.shape[axis]


def _weight_in_amax(layer: nn.Module) -> torch.Tensor:
    """Max |weight| per input channel, ``(in,)``."""
    return layer.weight.detach().abs().amax(_out_axis(layer))


def _outputs(out) -> list[torch.Tensor]:
    """The floating-point tensors of a model's output (a tensor, tuple, list, dict or ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _outputs(o)]
    return []


# ----------------------------------------------------------------------------------------- for other scalings


def plan_folds(
    model: nn.Module,
    layers: dict[str, QuantLinear],
    batch: Batch,
    device: torch.device,
) -> tuple[list[tuple[list[str], str, str | None]], dict[str, str]]:
    """Where a per-input-channel scaling of ``layers`` (any Linear layers, e.g. AWQ's weight-only ones) folds:
    ``(consumers, fold, into)`` per tensor read (the layers reading it, ``layernorm``/``linear``/``mul``, the
    module absorbing ``1 / s``), found on one batch by the trials :func:`smooth_quant` runs; and the layers
    left out with why."""
    check = head(to_device(batch, device), CHECK_SAMPLES)
    with quantizer_modes(model, "disabled"), torch.inference_mode():
        obs = _observe(model, layers, [batch], device)
        reference = _outputs(run_model(model, check, where="calibration batch 0"))
        plans = [
            (
                consumers,
                *(
                    _choose_fold(model, check, reference, obs, inp, consumers, layers)
                    if reference
                    else ("mul", None)
                ),
            )
            for inp, consumers in obs.groups
        ]
    return plans, obs.skipped


def apply_scales(
    model: nn.Module,
    layers: dict[str, QuantLinear],
    consumers: list[str],
    fold: str,
    into: str | None,
    s: torch.Tensor,
) -> None:
    """Multiply the weight columns of ``consumers`` by ``s`` and divide their input by it (folded into
    ``into``, or an explicit Mul), as planned by :func:`plan_folds`."""
    with torch.no_grad():
        _apply(model, layers, consumers, fold, into, s.detach().clone().to(torch.float32), explicit=True)
