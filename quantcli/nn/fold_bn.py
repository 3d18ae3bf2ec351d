"""BatchNorm folding: a BatchNorm that directly follows a Conv/ConvTranspose/Linear becomes part of that
layer.

In eval mode a BatchNorm is a per-channel affine map of its input ``z``::

    y = gamma * (z - mean) / sqrt(var + eps) + beta = s * z + t
    s = gamma / sqrt(var + eps),  t = beta - mean * s

so when ``z = W x + b`` comes straight from a layer, ``y = (s W) x + (s b + t)``: the layer with weight ``s
W`` (scaled along its output channels) and bias ``s b + t`` computes the same thing, and the BatchNorm becomes
an ``nn.Identity`` (a BatchNorm with its activation, timm's ``BatchNormAct2d``, becomes that activation:
:func:`remainder`). Folding happens before quantizers are inserted (``quantize_model``), so the weights are
calibrated and quantized as they will run, and the exported graph has no BatchNormalization after a quantized
layer (onnxruntime cannot fuse a Conv into an integer kernel across one).

A BatchNorm is folded only when nothing else reads its layer's output. Where the model traces with
``torch.fx`` the graph says so (the layer's output node has exactly one user, the BatchNorm, and both modules
are called once). Where it does not trace (data-dependent control flow, say), each largest submodule that
traces is judged by its own graph (a block's ``conv -> bn`` inside it is private to it), and an unmodified
``nn.Sequential`` that does not trace folds its adjacent layer and BatchNorm children. A layer or BatchNorm
registered under two names is never folded (the other name would still reach it). Every other BatchNorm is
left alone and reported with the reason.

Folding an already calibrated model (``fold_batchnorm(quantized_model)``): the input quantizers keep their
amax (the layer's input does not change, and neither, up to float rounding, does the BatchNorm's output that
the next layer reads). A symmetric weight quantizer per output channel gets ``amax * |s|`` per channel: ``s W
/ (amax |s| / bound) = sign(s) W / (amax / bound)``, so every integer code stays the same, or flips sign where
gamma < 0, up to float rounding at exact ties. Any other weight quantizer (per tensor, blocked, asymmetric) is
recalibrated with max from the folded weights; a weight quantizer calibrated from a histogram is not, and its
layer is not folded (calibrate again with folding on).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from quantcli.errors import DataError, QuantCliError, first_line
from quantcli.nn.forward_call import call_forward
from quantcli.nn.fresh_inputs import fresh
from quantcli.nn.modes import quantizer_modes
from quantcli.nn.modules import QUANT_CLASSES
from quantcli.nn.recorded_graph import RecordedNode, record
from quantcli.nn.tensor_quantizer import TensorQuantizer

#: layer types a BatchNorm folds into (exact types, and their quantized wrappers)
FOLDABLE: tuple[type, ...] = (*QUANT_CLASSES, *QUANT_CLASSES.values())
_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


@dataclass
class Fold:
    """One folded pair. ``weight_amax``: for a calibrated layer, ``"scaled"`` (per-channel amax times |s|) or
    ``"recalibrated"``; empty when the layer had no calibrated weight quantizer."""

    layer: str
    batchnorm: str
    weight_amax: str = ""

    def to_dict(self) -> dict[str, str]:
        d = {"layer": self.layer, "batchnorm": self.batchnorm}
        if self.weight_amax:
            d["weight_amax"] = self.weight_amax
        return d


@dataclass
class FoldReport:
    """What :func:`fold_batchnorm` did. ``detection``: ``"recorded"`` (the data flow of one forward on the
    example batch, as the exporter records it), ``"fx"`` (no example: the model traced), ``"fx per
    submodule"`` (it does not; ``trace_error`` says why) or ``"none"`` (no BatchNorm)."""

    folded: list[Fold] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (batchnorm, reason)
    detection: str = "none"
    trace_error: str = ""
    # BatchNorm -> (the layer's weight and bias before folding, the BatchNorm module): what :func:`unfold`
    # puts back (not part of the report the model carries)
    saved: dict = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict:
        return {
            "folded": [f.to_dict() for f in self.folded],
            "not_folded": [{"batchnorm": b, "reason": r} for b, r in self.skipped],
            "detection": self.detection,
        }


# ---------------------------------------------------------------------------------------------- arithmetic


def batchnorm_affine(bn: _BatchNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """The eval-mode BatchNorm as ``y = s * z + t`` per channel: ``(s, t)``, float64, shape ``(C,)``.

    Float64 so that the folded float32 parameters are the correctly rounded values of the exact fold.
    """
    var = bn.running_var.detach().double()
    mean = bn.running_mean.detach().double()
    gamma = bn.weight.detach().double() if bn.weight is not None else torch.ones_like(var)
    beta = bn.bias.detach().double() if bn.bias is not None else torch.zeros_like(var)
    s = gamma / torch.sqrt(var + bn.eps)
    return s, beta - mean * s


def _channel_view(s: torch.Tensor, weight_shape: torch.Size, axis: int, groups: int) -> torch.Tensor:
    """``s`` (one value per output channel) broadcastable against the weight.

    Conv/Linear weights are ``(Cout, Cin / groups, *kernel)``: output channel = axis 0. ConvTranspose weights
    are ``(Cin, Cout / groups, *kernel)``: output channel ``g * Cout/groups + j`` for input rows of group
    ``g``.
    """
    if axis == 0:
        return s.view(-1, *([1] * (len(weight_shape) - 1)))
    cin, per_group = weight_shape[0], weight_shape[1]
    ones = [1] * (len(weight_shape) - 2)
    s = s.view(groups, 1, per_group, *ones).expand(groups, cin // groups, per_group, *ones)
    return s.reshape(cin, per_group, *ones)


def fold_parameters(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    s: torch.Tensor,
    t: torch.Tensor,
    axis: int = 0,
    groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s W, s b + t)`` in the weight's dtype, computed in float64.

    Args:
        weight: the layer's weight; ``axis`` its output-channel axis (1 for ConvTranspose), ``groups`` its
            groups.
        bias: the layer's bias ``(Cout,)`` or None (zero).
        s, t: :func:`batchnorm_affine` of the BatchNorm, ``(Cout,)``.
    """
    w = weight.detach().double() * _channel_view(s, weight.shape, axis, groups)
    b = bias.detach().double() if bias is not None else torch.zeros_like(s)
    return w.to(weight.dtype), (s * b + t).to(weight.dtype)


# ---------------------------------------------------------------------------------------------- detection


def _out_channels(layer: nn.Module) -> int:
    return layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels


#: the forwards that compute exactly a BatchNorm (a subclass that overrides forward, as timm's BatchNormAct2d
# adds : its activation there, computes something else)
_BATCHNORM_FORWARDS = (_BatchNorm.forward, nn.SyncBatchNorm.forward)


def remainder(bn: _BatchNorm) -> nn.Module | None:
    """What is left of ``bn``'s module once its normalisation is folded into the layer before: nothing
    (``nn.Identity``) for a BatchNorm; for a BatchNorm with its activation (timm's ``BatchNormAct2d``, whose
    ``forward`` is ``act(drop(batch_norm(x)))``: the most common normalisation of timm's CNNs) its ``drop``
    and ``act`` in that order, the same module objects; None for another subclass with a ``forward`` of its
    own. The float check compares every folded model with the model as loaded, so a subclass that computes
    something else is caught and unfolded."""
    if type(bn).forward in _BATCHNORM_FORWARDS:
        return nn.Identity()
    act, drop = getattr(bn, "act", None), getattr(bn, "drop", None)
    if "BatchNormAct" in type(bn).__name__ and isinstance(act, nn.Module) and isinstance(drop, nn.Module):
        return nn.Sequential(drop, act)
    return None


def _batchnorm_problem(bn: _BatchNorm, layer: nn.Module) -> str:
    """Why ``bn`` cannot fold into ``layer`` whatever the data flow, or ''."""
    if remainder(bn) is None:
        return (
            f"{type(bn).__name__} overrides BatchNorm's forward, so it may compute more than a BatchNorm "
            "(timm's BatchNormAct2d, its activation after it, folds)"
        )
    if bn.running_mean is None or bn.running_var is None:
        return "it normalises with batch statistics (track_running_stats=False), which no weight can express"
    if isinstance(bn.running_var, nn.parameter.UninitializedBuffer):
        return "it is an uninitialised lazy BatchNorm"
    if bn.num_features != _out_channels(layer):
        return (
            f"its {bn.num_features} features are not the {_out_channels(layer)} output channels of the layer"
        )
    return ""


class _LeafTracer(torch.fx.Tracer):
    """Keeps layers, BatchNorms and quantizers as single ``call_module`` nodes (a quantized layer is a
    subclass outside ``torch.nn``, which fx would otherwise trace into)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, (*FOLDABLE, _BatchNorm, TensorQuantizer)):
            return True
        return super().is_leaf_module(m, qualname)


def _bn_input_ranks(
    model: nn.Module, names: list[str], example: Mapping[str, torch.Tensor] | None
) -> dict[str, int]:
    """The rank of each named BatchNorm's input on one forward of ``example`` (empty without one)."""
    if example is None or not names:
        return {}
    ranks: dict[str, int] = {}

    def record(name: str):
        def hook(module, args):  # returns None: the input is left alone
            ranks.setdefault(name, args[0].dim())

        return hook

    hooks = [model.get_submodule(n).register_forward_pre_hook(record(n)) for n in names]
    try:
        with torch.no_grad():
            call_forward(model, fresh(example))
    except (RuntimeError, ValueError, TypeError, IndexError, AssertionError) as e:
        msg = first_line(e)
        raise DataError(
            f"forward() failed on the example batch while checking BatchNorm folding: {msg}"
        ) from None
    finally:
        for h in hooks:
            h.remove()
    return ranks


def _forward_problem(name: str, layer: nn.Module, census) -> str:
    """Why a BatchNorm cannot fold into ``layer`` because of what its ``forward`` does, or ''.

    Folding scales the weight and bias the layer's operation takes, which computes the BatchNorm's output only
    when the layer's output is that operation's output, with the weight parameter itself and its own bias: a
    torch layer's ``forward`` does that; an overridden one (a "same" padding before the convolution is fine; a
    standardised weight or a LoRA branch added to the output is not) is checked on the operations one forward
    on the example batch computed (:func:`quantcli.nn.computed.census`)."""
    cls = type(layer)
    base = next((c for c in cls.__mro__ if c in QUANT_CLASSES), None)
    if base is None or cls.forward in (base.forward, QUANT_CLASSES[base].forward):
        return ""
    if cls.__name__ == "NonDynamicallyQuantizableLinear":
        return "its layer never computes its own output (nn.MultiheadAttention reads its weight)"
    uses = census.by_layer().get(name) if census is not None else None
    if uses is None:
        return (
            f"{type(layer).__name__} overrides {base.__name__}'s forward, and no example batch showed "
            "what it computes"
        )
    if len(uses) != 1:
        return f"{name}'s forward computes {len(uses)} operations with its weight"
    u = uses[0]
    kind = "conv_transpose" if base in _TRANSPOSED else ("linear" if base is nn.Linear else "conv")
    if u.kind != kind or u.caller != name or u.derived or u.params != ("weight",) or u.bias == "other":
        return f"{name}'s forward computes its {u.kind} with " + (
            "a weight computed from its parameters"
            if u.derived
            else "other operands than its own weight and bias"
        )
    if not u.returns_output:
        return f"{name}'s forward computes more after its {u.kind} (its output is not the {u.kind}'s)"
    return ""


def _linear_problem(bn_name: str, ranks: dict[str, int], have_example: bool) -> str:
    """A Linear's output ``(N, ..., F)`` has its features last; a BatchNorm normalises dim 1, so the pair
    folds only when the BatchNorm sees ``(N, F)``."""
    if bn_name not in ranks:
        return (
            "a Linear's BatchNorm folds only when its input is (N, features), which needs an example batch "
            "to check"
            if not have_example
            else "it did not run on the example batch"
        )
    if ranks[bn_name] != 2:
        return f"it normalises dim 1 of a {ranks[bn_name]}-D Linear output, not the Linear's features"
    return ""


def find_foldable(
    model: nn.Module, example: Mapping[str, torch.Tensor] | None = None, census=None
) -> FoldReport:
    """Which BatchNorms of ``model`` fold into the layer before them (nothing is changed).

    ``example``: one keyword batch for ``model(**example)``: the data flow is read from one forward on it
    (:mod:`quantcli.nn.recorded_graph`), so Python control flow in ``forward`` does not hide a pair; without
    it, ``torch.fx`` symbolic tracing, and a BatchNorm after a Linear does not fold. ``census``: the weighted
    operations of one forward (:func:`quantcli.nn.computed.census`), which tell whether a layer with a
    ``forward`` of its own returns its operation's output (:func:`_forward_problem`).
    """
    report = FoldReport()
    modules = dict(model.named_modules())
    bns = [n for n, m in modules.items() if isinstance(m, _BatchNorm)]
    if not bns:
        return report
    if example is not None:  # the graph the exporter will record: one forward on the example batch
        graph = record(
            model,
            example,
            lambda name, m: (
                isinstance(m, (*FOLDABLE, _BatchNorm, TensorQuantizer)) or next(m.children(), None) is None
            ),
        )
        report.detection = "recorded"
        candidates, reasons = _traced_candidates(graph, model)
    else:
        try:
            graph = _LeafTracer().trace(model)
        # symbolic tracing fails on data-dependent control flow, unsupported calls, ...
        except Exception as e:
            report.detection = "fx per submodule"
            report.trace_error = first_line(e, 160)
            candidates, reasons = _untraced_candidates(model)
        else:
            report.detection = "fx"
            candidates, reasons = _traced_candidates(graph, model)
    candidates = _registered_once(model, candidates, reasons)
    linear_bns = [bn for layer, bn in candidates if isinstance(modules[layer], nn.Linear)]
    ranks = _bn_input_ranks(model, linear_bns, example)
    for layer, bn in candidates:
        problem = _batchnorm_problem(modules[bn], modules[layer]) or _forward_problem(
            layer, modules[layer], census
        )
        if not problem and isinstance(modules[layer], nn.Linear):
            problem = _linear_problem(bn, ranks, example is not None)
        if problem:
            reasons[bn] = problem
        else:
            report.folded.append(Fold(layer, bn))
    found = {bn for _, bn in candidates}
    for bn in bns:
        if bn not in found and bn not in reasons:
            reasons[bn] = (
                "the model does not trace with torch.fx, and no submodule that traces (or plain "
                "nn.Sequential) holds both it and the layer before it"
            )
        if bn in reasons:
            report.skipped.append((bn, reasons[bn]))
    return report


def _user(node, prefix: str) -> str:
    """A graph node that reads a layer's output, as the user knows it: its module, the function or method it
    calls (``torch.cat``, ``Tensor.view``), or the model's output; not the trace's own node name (``n5``)."""
    if node.op == "call_module":
        return str(prefix + node.target)
    if node.op == "call_function":
        fn = node.target
        module = getattr(fn, "__module__", None) or ""
        name = getattr(fn, "__name__", str(fn))
        lead = "torch" if module.startswith("torch") and not module.startswith("torch.nn") else module
        return f"{lead}.{name}" if lead else name
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "output":
        return "the model's output"
    return str(node.name)


def _traced_candidates(graph: torch.fx.Graph, root: nn.Module, prefix: str = ""):
    """(layer, BatchNorm) pairs and reasons from the fx graph of ``root`` (a submodule named ``prefix``)."""
    modules = dict(root.named_modules())
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    seen = {n.target for n in graph.nodes if n.op == "call_module"}
    where = f"{prefix}'s forward" if prefix else "forward"
    candidates, reasons = [], {}
    for name, m in modules.items():
        if isinstance(m, _BatchNorm) and name not in seen and not prefix:
            reasons[name] = "forward never calls it"
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(modules[node.target], _BatchNorm):
            continue
        bn = prefix + node.target
        src = node.args[0] if node.args else None
        if calls[node.target] > 1:
            reasons[bn] = f"{where} calls it more than once"
        elif not (
            isinstance(src, (torch.fx.Node, RecordedNode))
            and src.op == "call_module"
            and isinstance(modules[src.target], FOLDABLE)
        ):
            reasons[bn] = "its input is not the output of a Conv, ConvTranspose or Linear"
        elif calls[src.target] > 1:
            reasons[bn] = (
                f"{where} calls {prefix + src.target} more than once, and only one call is followed by it"
            )
        elif len(src.users) > 1:
            others = sorted({_user(u, prefix) for u in src.users if u is not node})
            reasons[bn] = f"the output of {prefix + src.target} is also used by {', '.join(others)}"
        else:
            candidates.append((prefix + src.target, bn))
    return candidates, reasons


def _untraced_candidates(model: nn.Module):
    """The model does not trace: each largest submodule that does is traced on its own. Inside it, a layer
    output that only its BatchNorm reads is read by nothing outside either (the submodule does not return it).
    A submodule that does not trace is searched further down; if it is an unmodified ``nn.Sequential``, its
    adjacent layer and BatchNorm children fold as well (its forward feeds each child's output to the next
    child only).
    """
    candidates, reasons = [], {}

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}{child_name}"
            if isinstance(child, (_BatchNorm, *FOLDABLE)) or not any(
                isinstance(m, _BatchNorm) for m in child.modules()
            ):
                continue
            try:
                graph = _LeafTracer().trace(child)
            except Exception:
                if isinstance(child, nn.Sequential) and type(child).forward is nn.Sequential.forward:
                    kids = list(child.named_children())
                    for (ln, layer), (bn_n, bn) in zip(kids, kids[1:]):
                        if isinstance(layer, FOLDABLE) and isinstance(bn, _BatchNorm):
                            candidates.append((f"{name}.{ln}", f"{name}.{bn_n}"))
                visit(f"{name}.", child)
                continue
            c, r = _traced_candidates(graph, child, f"{name}.")
            candidates.extend(c)
            reasons.update(r)

    if isinstance(model, nn.Sequential) and type(model).forward is nn.Sequential.forward:
        kids = list(model.named_children())
        candidates += [
            (ln, bn_n)
            for (ln, layer), (bn_n, bn) in zip(kids, kids[1:])
            if isinstance(layer, FOLDABLE) and isinstance(bn, _BatchNorm)
        ]
    visit("", model)
    return candidates, reasons


def _registered_once(model: nn.Module, candidates: list[tuple[str, str]], reasons: dict[str, str]):
    """Drop pairs whose layer or BatchNorm is registered under two names: replacing one name would leave the
    BatchNorm reachable (and applied again) under the other."""
    uses = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    modules = dict(model.named_modules(remove_duplicate=False))
    kept = []
    for layer, bn in candidates:
        if uses[id(modules[layer])] > 1 or uses[id(modules[bn])] > 1:
            reasons[bn] = "the layer or the BatchNorm is registered under two names"
        else:
            kept.append((layer, bn))
    return kept


# ---------------------------------------------------------------------------------------------- folding


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _ensure_bias(layer: nn.Module) -> None:
    if layer.bias is None:
        layer.bias = nn.Parameter(
            torch.zeros(_out_channels(layer), dtype=layer.weight.dtype, device=layer.weight.device),
            requires_grad=layer.weight.requires_grad,
        )


def _weight_axis_and_groups(layer: nn.Module) -> tuple[int, int]:
    if isinstance(layer, _TRANSPOSED):
        return 1, layer.groups
    return 0, getattr(layer, "groups", 1)


def _calibrated_weight_quantizer(layer: nn.Module) -> TensorQuantizer | None:
    q = getattr(layer, "weight_quantizer", None)
    return (
        q
        if isinstance(q, TensorQuantizer) and q.enabled and q.amax is not None and not q.desc.dynamic
        else None
    )


def _amax_scales(q: TensorQuantizer, layer: nn.Module) -> bool:
    """Whether ``amax * |s|`` per channel is exact for this weight quantizer (module docstring)."""
    axis, groups = _weight_axis_and_groups(layer)
    return (
        q.desc.axis == axis
        and q._block is None
        and not q.desc.asymmetric
        and not q.desc.unsigned
        and _groups_ok(axis, groups)
        and q.amax.numel() == _out_channels(layer)
    )


def _groups_ok(axis: int, groups: int) -> bool:
    """A ConvTranspose with groups has ``Cout / groups`` weight columns per output-channel index: its per-axis
    amax is not one per output channel."""
    return axis == 0 or groups == 1


def fold_batchnorm(
    model: nn.Module, example: Mapping[str, torch.Tensor] | None = None, census=None
) -> FoldReport:
    """Fold every foldable BatchNorm of ``model`` into the layer before it, in place (see the module
    docstring).

    The BatchNorm is replaced by ``nn.Identity`` (its name stays, its ``state_dict`` keys go); a layer without
    a bias gets one. Works on a float model and on a quantized one, calibrated or not.

    Args:
        example: one keyword batch for ``model(**example)``; needed only for a BatchNorm after a Linear.
        census: what one forward computes (:func:`quantcli.nn.computed.census`), for layers whose ``forward``
            is their own.

    Returns:
        the :class:`FoldReport`: folded pairs, and every BatchNorm left alone with the reason. The pairs
        folded so far are also listed in ``model.quantcli_folded_batchnorm``, which the calibrated checkpoint
        stores.
    """
    report = find_foldable(model, example, census)
    done = []
    for fold in report.folded:
        layer, bn = model.get_submodule(fold.layer), model.get_submodule(fold.batchnorm)
        q = _calibrated_weight_quantizer(layer)
        if q is not None and not _amax_scales(q, layer) and q.desc.calib_method == "histogram":
            report.skipped.append(
                (
                    fold.batchnorm,
                    f"{q.name} was calibrated from a histogram; calibrate again with BatchNorm folding on",
                )
            )
            continue
        out = getattr(layer, "output_quantizer", None)
        if isinstance(out, TensorQuantizer) and out.enabled and out.amax is not None:
            # its range is of the layer's output before the BatchNorm: the folded layer computes another
            report.skipped.append(
                (
                    fold.batchnorm,
                    f"{out.name} was calibrated on {fold.layer}'s output before the BatchNorm; calibrate "
                    "again with BatchNorm folding on",
                )
            )
            continue
        s, t = batchnorm_affine(bn)
        axis, groups = _weight_axis_and_groups(layer)
        w, b = fold_parameters(layer.weight, layer.bias, s, t, axis, groups)
        report.saved[fold.batchnorm] = (
            layer.weight.detach().clone(),
            None if layer.bias is None else layer.bias.detach().clone(),
            bn,
        )
        with torch.no_grad():
            layer.weight.copy_(w)
            _ensure_bias(layer)
            layer.bias.copy_(b)
        if q is not None:
            fold.weight_amax = _refit_weight_amax(q, layer, s)
        _set_module(model, fold.batchnorm, remainder(bn))
        done.append(fold)
    report.folded = done
    report.skipped.sort()
    # what a checkpoint stores to rebuild this structure (quantcli.inputs.checkpoint), over every call
    model.quantcli_folded_batchnorm = [
        *getattr(model, "quantcli_folded_batchnorm", []),
        *({"layer": f.layer, "batchnorm": f.batchnorm} for f in done),
    ]
    return report


def unfold(model: nn.Module, report: FoldReport, batchnorm: str, reason: str) -> Fold:
    """Undo the fold of ``batchnorm`` (an uncalibrated one, as :func:`fold_batchnorm` left it): the layer's
    weight and bias as they were, the BatchNorm back in its place; the report lists it as not folded, for
    ``reason``."""
    fold = next(f for f in report.folded if f.batchnorm == batchnorm)
    weight, bias, bn = report.saved.pop(batchnorm)
    layer = model.get_submodule(fold.layer)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is None:
            layer.bias = None
        else:
            layer.bias.copy_(bias)
    _set_module(model, batchnorm, bn)
    report.folded.remove(fold)
    report.skipped.append((batchnorm, reason))
    report.skipped.sort()
    model.quantcli_folded_batchnorm = [
        f for f in getattr(model, "quantcli_folded_batchnorm", []) if f["batchnorm"] != batchnorm
    ]
    return fold


def _refit_weight_amax(q: TensorQuantizer, layer: nn.Module, s: torch.Tensor) -> str:
    if _amax_scales(q, layer):
        amax = (q.amax.double() * s.abs().view(q.amax.shape)).to(torch.float32)
        q.set_amax(amax)
        return "scaled"
    # calibrating switches modes; give back the one it had, whatever happens
    with quantizer_modes([q], q.mode):
        q.start_calibration("max")
        q.collect(layer.weight.detach())
        q.load_calib_amax("max")
    return "recalibrated"


def restore_folds(model: nn.Module, folds: list[Mapping[str, str]]) -> None:
    """Give a freshly built ``model`` the structure of the folded one (BatchNorms replaced by ``nn.Identity``,
    biases added), so that the folded model's ``state_dict`` loads into it. The folded values come from that
    state dict: nothing is recomputed, so the reload is bit-identical.

    Raises :class:`QuantCliError` when a stored pair does not name a layer and a BatchNorm of ``model``.
    """
    modules = dict(model.named_modules())
    for f in folds:
        layer, bn = modules.get(f["layer"]), modules.get(f["batchnorm"])
        if not isinstance(layer, FOLDABLE) or not isinstance(bn, _BatchNorm):
            raise QuantCliError(
                f"the checkpoint folded BatchNorm {f['batchnorm']} into {f['layer']}, but "
                f"the model "
                "built from its spec has no such layer and BatchNorm"
            )
        _ensure_bias(layer)
        _set_module(model, f["batchnorm"], remainder(bn) or nn.Identity())
    model.quantcli_folded_batchnorm = [{"layer": f["layer"], "batchnorm": f["batchnorm"]} for f in folds]
