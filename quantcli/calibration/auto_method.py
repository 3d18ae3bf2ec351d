"""``--method auto`` on a model: what it observes while calibrating, and the choice made from it.

Per activation quantizer that is a quantized layer's input, the candidate range whose layer output is closest
(MSE) to the float layer's output on a bounded sample of the layer's calibration inputs
(:mod:`calibrators.auto`). **The quantizers of one tensor take one choice**: the q, k and v projections of an
attention layer read one tensor, and so do a residual block's first convolution and the residual Add's
quantizer of the same input. The export shares one QuantizeLinear among quantizers of one tensor and one grid
(:func:`exporters.onnxruntime.placement.share_quantize`), and onnxruntime fuses a residual Add into
``QLinearAdd`` only when its operand's Q is the one the next layer reads: chosen one by one, such quantizers
got different ranges, so the graph quantized one tensor twice and the Add ran in float. Their choice is the
candidate with the smallest sum of the layers' relative errors (each layer's MSE over its float output's mean
square, so a layer with large outputs does not outvote the others); a quantizer of the tensor that is no
layer's input (the residual Add's) takes it as well.

Quantizers are "of one tensor" when the pass gave them the very same tensor object (the identity the shared
observations of :mod:`calibrators.shared` use), their grids are equal (the same descriptor but for its name:
one Q cannot serve two grids, so those choose apart) and their calibrators observed the same values (a tensor
changed in place between their calls is one object holding other values).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from calibrators import MaxCalibrator
from calibrators.auto import CANDIDATES, InputSample, choose
from calibrators.methods import HISTOGRAM_METHODS, defined_for
from calibrators.two_sided import METHODS as TWO_SIDED_METHODS
from quantcli.nn.modes import quantizer_modes
from quantcli.nn.modules import input_quantized_before
from quantcli.nn.tensor_quantizer import owner

#: the method a quantizer with no choice of its own takes (a histogram's mse; asymmetric: the mse range)
FALLBACK = "mse"


@dataclass
class LayerInput:
    """What ``--method auto`` observes of one layer-input quantizer besides its histogram."""

    layer: nn.Module
    max_calibrator: MaxCalibrator | None  # None for an asymmetric quantizer: its calibrator has the extremes
    sample: InputSample
    hooks: list = field(default_factory=list)

    def observe(self, _quantizer, args) -> None:
        self.max_calibrator.collect(args[0])

    def keep(self, _layer, args) -> None:
        # the layer's own input: what layer(x) takes again when candidates are compared (SmoothQuant's Mul
        # and a padding the quantizer runs before sit between it and the quantizer's input)
        self.sample.collect(args[0])

    def output(self, q, x: torch.Tensor) -> torch.Tensor:
        """The layer's output on its input ``x`` with ``q`` as it is set: where ``q`` runs before a zero
        padding (:func:`quantcli.nn.modules.apply_input_quantizer_before`), the layer skips it, and ``q`` of
        the padded ``x`` is the padding of ``q(x)``."""
        if input_quantized_before(self.layer) is not None:
            x = q(x)
        return self.layer(x)


class TensorGroups:
    """Which activation quantizers were given the very same tensor, from each one's first call."""

    def __init__(self):
        self._seen: dict[int, tuple[weakref.ref, int]] = {}  # id(x) -> (x, group)
        self.group_of: dict[str, int] = {}

    def hook(self, name: str):
        def record(_quantizer, args) -> None:
            if name in self.group_of or not args or not isinstance(args[0], torch.Tensor):
                return
            x = args[0]
            hit = self._seen.get(id(x))
            if hit is None or hit[0]() is not x:  # a new tensor (or a freed one's id reused)
                hit = (weakref.ref(x), len(self._seen) + len(self.group_of))
                self._seen[id(x)] = hit
            self.group_of[name] = hit[1]

        return record

    def groups(self, acts: dict) -> list[list[str]]:
        """The quantizers of one tensor and one grid that observed the same values, two or more, in
        ``acts``' order. Inference tensors keep no version counter: a tensor changed in place between two
        quantizers' calls (a folded BatchNorm hands on its Conv's very output, which a MobileOne block sums
        into) is one object holding other values, which their statistics tell apart."""
        by_key: dict[tuple, list[str]] = {}
        for name, q in acts.items():
            if name in self.group_of:
                by_key.setdefault((self.group_of[name], _grid(q)), []).append(name)
        out = []
        for names in by_key.values():
            alike: list[tuple[tuple, list[str]]] = []  # (statistics, names)
            for n in names:
                stats = _statistics(acts[n])
                same = next((g for s, g in alike if stats and _equal(s, stats)), None)
                if same is None:
                    alike.append((stats, [n]))
                else:
                    same.append(n)
            out += [g for _, g in alike if len(g) > 1]
        return out


def _statistics(q) -> tuple:
    """What ``q``'s calibrator observed, as its amax searches read it; () where it cannot say."""
    read = getattr(q.calibrator, "statistics", None)
    return tuple(read()) if read is not None else ()


def _equal(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _grid(q) -> str:
    """The quantizer's grid: its descriptor but for the name (one Q serves quantizers of one grid only)."""
    return repr(sorted((k, repr(v)) for k, v in q.desc.dict().items() if k != "name"))


class AutoRun:
    """``--method auto``'s observers on a model, from :func:`start` until :meth:`stop`."""

    def __init__(self, layers: dict[str, LayerInput], tensors: TensorGroups, hooks: list):
        self.layers = layers
        self.tensors = tensors
        self._hooks = hooks

    def stop(self) -> None:
        for h in self._hooks:
            h.remove()
        for st in self.layers.values():
            for h in st.hooks:
                h.remove()

    def choose_all(self, acts: dict, kwargs: dict) -> dict[str, dict]:
        """Set every activation quantizer's amax in ``acts`` (their calibrators have observed the pass);
        returns the report of each layer-input quantizer's choice."""
        report: dict[str, dict] = {}
        done: set[str] = set()
        for names in self.tensors.groups(acts):
            choosers = [n for n in names if n in self.layers]
            if not choosers:
                continue  # no layer input among them: each takes the fallback alike
            scored = {n: _candidates(acts[n], self.layers[n], kwargs) for n in choosers}
            pick = _joint_pick(scored)
            picked = None
            for n in names:
                if n in scored:
                    report[n] = _apply(acts[n], scored[n], pick)
                    report[n]["shared_with"] = [m for m in names if m != n]
                    picked = acts[n]
                else:
                    acts[n].load_calib_amax(FALLBACK, **kwargs)
            for n in names:  # the candidates of equal histograms are equal; copied, not recomputed
                if n not in scored:
                    _copy_range(picked, acts[n])
            done.update(names)
        for n, st in self.layers.items():
            if n in acts and n not in done and acts[n].calibrator is not None:
                scored = _candidates(acts[n], st, kwargs)
                report[n] = _apply(acts[n], scored, _joint_pick({n: scored}))
                done.add(n)
        for n, q in acts.items():
            if n not in done:
                q.load_calib_amax(FALLBACK, **kwargs)
        return report


def start(model: nn.Module, acts: dict, num_batches: int) -> AutoRun:
    """Observers for the input quantizers of quantized layers, and a record of which quantizers read one
    tensor. Others (blocked; a quantizer outside a layer) have no choice of their own: the fallback's amax,
    or their tensor's choice."""
    layers = {}
    for name, q in acts.items():
        layer = model.get_submodule(owner(name))
        if (
            not name.endswith("input_quantizer")
            or q._block is not None
            or getattr(layer, "input_quantizer", None) is not q
            or not hasattr(layer, "weight_quantizer")
            or not runs_alone(layer)
        ):
            continue
        nb = q.desc.num_bits
        sample = InputSample(num_batches, rows_last=isinstance(layer, nn.Linear))
        if q.desc.asymmetric:
            st = LayerInput(layer, None, sample)
            st.hooks = [layer.register_forward_pre_hook(st.keep)]
        else:
            bits = nb if isinstance(nb, int) else tuple(nb)
            st = LayerInput(layer, MaxCalibrator(bits, q.desc.axis, q.desc.unsigned, name=name), sample)
            st.hooks = [q.register_forward_pre_hook(st.observe), layer.register_forward_pre_hook(st.keep)]
        layers[name] = st
    tensors = TensorGroups()
    hooks = [q.register_forward_pre_hook(tensors.hook(n)) for n, q in acts.items() if q._block is None]
    return AutoRun(layers, tensors, hooks)


def runs_alone(layer: nn.Module) -> bool:
    """Whether ``layer(x)`` computes the layer's operation on ``x`` (``--method auto`` compares candidates
    so): every class-path layer; a computed layer only when it is a torch convolution or linear layer (its own
    ``forward`` takes one input: "same" padding, weight standardisation), not ``nn.MultiheadAttention``."""
    if not getattr(layer, "weight_from_forward", False):
        return True
    return isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)) and not isinstance(
        layer, nn.modules.linear.NonDynamicallyQuantizableLinear
    )


@dataclass
class _Scored:
    """One quantizer's candidate ranges and its layer's output error with each."""

    amaxes: dict[str, torch.Tensor]
    amins: dict[str, torch.Tensor]  # asymmetric quantizers only
    errors: dict[str, float]  # MSE of the layer's output against the float layer's
    power: float  # the float layer output's mean square
    histogram: object


def _candidates(q, st: LayerInput, kwargs: dict) -> _Scored:
    """``q``'s candidate ranges, and its layer's output error on the input sample with each, the layer's
    weights quantized as deployed."""
    hist = q.calibrator
    cands, amins = {}, {}
    if st.max_calibrator is None:  # asymmetric: the data's (min, max), then the two-sided ranges
        for m in ("max", *TWO_SIDED_METHODS):
            q.calibrator = hist
            cands[m] = q.load_calib_amax(m, **kwargs).clone()
            amins[m] = q.amin.clone()
        if isinstance(q.desc.num_bits, int):  # and the range clipped at |x|'s entropy threshold
            lo, hi = hist.compute_entropy_range()
            scale = q.desc.scale_amax if q.desc.scale_amax is not None else 1.0
            amins["entropy"], cands["entropy"] = lo * scale, (hi * scale).to(cands["max"].dtype)
    else:
        q.calibrator = st.max_calibrator
        cands["max"] = q.load_calib_amax("max").clone()
        for m in HISTOGRAM_METHODS:
            if not defined_for(m, q.desc.is_fp8):
                continue
            q.calibrator = hist
            cands[m] = q.load_calib_amax(m, **kwargs).clone()
    x = st.sample.tensor()
    errors: dict[str, float] = {}
    power = 0.0
    if x is not None:
        layer, wq = st.layer, st.layer.weight_quantizer
        x = x.to(device=layer.weight.device, dtype=layer.weight.dtype)
        with quantizer_modes([q, wq], "disabled"), torch.inference_mode():
            ref = st.output(q, x).to(torch.float64)
            power = float((ref**2).mean())
            q.set_mode("quantize")
            wq.set_mode("quantize")
            for m, a in cands.items():
                q.set_amax(a)
                if m in amins:
                    q.amin = amins[m]
                errors[m] = float(((st.output(q, x).to(torch.float64) - ref) ** 2).mean())
    return _Scored(cands, amins, errors, power, hist)


def _joint_pick(scored: dict[str, _Scored]) -> str:
    """The candidate with the smallest sum of relative errors over the layers (one layer: its smallest
    error); ``max`` where no layer saw an input."""
    total: dict[str, float] = {}
    for s in scored.values():
        if not s.errors:
            continue
        scale = 1.0 / s.power if s.power > 0 and len(scored) > 1 else 1.0
        for m, e in s.errors.items():
            total[m] = total.get(m, 0.0) + e * scale
    common = {m: e for m, e in total.items() if all(m in s.amaxes for s in scored.values())}
    return choose(common) if common else CANDIDATES[0]


def _apply(q, s: _Scored, pick: str) -> dict:
    """Give ``q`` the candidate ``pick``; returns its report entry."""
    q.set_amax(s.amaxes[pick])
    q.histogram = s.histogram
    out = {
        "method": pick,
        "amax": float(s.amaxes[pick].max()),
        "errors": {m: s.errors.get(m) for m in s.amaxes},
        "candidates": {m: float(a.max()) for m, a in s.amaxes.items()},
    }
    if s.amins:
        q.amin = s.amins[pick]
        out.update(amin=float(s.amins[pick]), candidate_amin={m: float(a) for m, a in s.amins.items()})
    return out


def _copy_range(src, dst) -> None:
    """``dst`` quantizes on ``src``'s range (quantizers of one tensor and one grid)."""
    dst.set_amax(src.amax.clone())
    if src.amin is not None:
        dst.amin = src.amin.clone()
