"""In-place module replacement: ``quantize_model(model, config)``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from quantcli.nn.config import QuantConfig, load_config
from quantcli.nn.fold_bn import FoldReport, fold_batchnorm
from quantcli.nn.linear_like import float_reason, quant_class, resolve_parametrizations
from quantcli.nn.modules import QUANT_POOL_CLASSES, apply_input_quantizer_before, apply_output_quantizer_after
from quantcli.nn.placement import Placement, analyse, insert_residual_quantizers, nonnegative
from quantcli.nn.recurrent import WeightView
from quantcli.nn.recurrent import convert as convert_lstm
from quantcli.nn.recurrent import float_reason as recurrent_float_reason
from quantcli.nn.recurrent import weight_format_reason as lstm_weight_format_reason
from quantcli.nn.tensor_quantizer import TensorQuantizer
from quantcli.quant.descriptor import QuantDescriptor

# rule fields that choose an activation grid themselves: placement leaves such quantizers as the rules say
_GRID_FIELDS = ("unsigned", "asymmetric", "num_bits", "axis", "block_sizes", "dynamic")


def _grid_chosen(cfg: QuantConfig, matched: list[int]) -> bool:
    """Whether one of the ``matched`` rules sets a grid field (then placement leaves the quantizer's grid)."""
    return any(f in cfg.rules[i] for i in matched for f in _GRID_FIELDS)


@dataclass
class QuantizeReport:
    layers: list[str] = field(default_factory=list)
    unmatched_patterns: list[str] = field(default_factory=list)
    batchnorm: FoldReport = field(default_factory=FoldReport)  # the BatchNorms folded, and those left alone
    placement: Placement | None = None
    # modules that own a 2+-D floating weight and stay float: {"name", "type", "reason"}
    # (quantcli.nn.linear_like)
    float_layers: list[dict[str, str]] = field(default_factory=list)
    # torch layers whose parametrized weight (weight_norm, ...) was stored as the value it computes
    resolved_parametrizations: list[str] = field(default_factory=list)


def quantize_model(
    model: nn.Module,
    config=None,
    *,
    example: Mapping[str, torch.Tensor] | None = None,
    fold: bool | None = None,
) -> nn.Module:
    """Insert quantizers in place into every ``nn.Linear``, ``nn.ConvNd`` and ``nn.ConvTransposeNd``, and
    every module that computes what one does (:mod:`quantcli.nn.linear_like`: transformers' ``Conv1D``,
    subclasses, weight-normed convolutions); the report lists the weighted modules left float and why.

    First, when the config's ``fold_batchnorm`` is on (the default), every BatchNorm that only its preceding
    Conv/ConvTranspose/Linear feeds is folded into that layer (:func:`quantcli.nn.fold_bn.fold_batchnorm`), so
    weights are calibrated as they will run; the BatchNorm becomes ``nn.Identity``. Otherwise module names,
    parameters, hooks and ``state_dict`` keys are kept (quantizer ``amax`` buffers are added).
    ``config`` is anything :func:`quantcli.nn.config.load_config` takes (default: the ``int8`` preset). The
    report (layers converted, rule patterns that matched nothing, BatchNorms folded and not) is at
    ``model.quantcli_report``.

    Args:
        example: one keyword batch for ``model(**example)``. The model's structure (BatchNorm folding,
            placement) is read from one forward on it, as the exporter reads it
            (:mod:`quantcli.nn.recorded_graph`); without it, from ``torch.fx`` symbolic tracing, which fails
            on Python control flow and leaves a BatchNorm after a Linear unfolded.
        fold: overrides the config's ``fold_batchnorm`` (``load_calibrated`` restores stored folds instead).

    The config's ``target`` then decides the placement (:mod:`quantcli.nn.placement`): for ``onnxruntime``,
    inputs that are non-negative by construction use the unsigned grid, Convs whose output no quantized layer
    reads directly get an ``output_quantizer``, and Conv/2-D Linear biases are rounded to int32 codes; for
    ``tensorrt``, the skip inputs of residual Adds get a ``residual_quantizer``.
    """
    cfg: QuantConfig = load_config(config)
    report = QuantizeReport()
    # first: a folded BatchNorm scales the weight a parametrization would otherwise recompute
    report.resolved_parametrizations = resolve_parametrizations(model)
    if cfg.fold_batchnorm if fold is None else fold:
        report.batchnorm = fold_batchnorm(model, example)
    used: set[int] = set()
    layers: dict[str, nn.Module] = {}
    own_grid: set[str] = set()  # input quantizers whose grid a rule chose
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.RNNBase):  # LSTM as onnxruntime's DynamicQuantizeLSTM; GRU, RNN: float
            if _recurrent(name, module, cfg, report, used):
                report.layers.append(name)
            continue
        qcls = quant_class(module)
        if qcls is None:
            reason = float_reason(module)
            if reason is not None:
                report.float_layers.append({"name": name, "type": type(module).__name__, "reason": reason})
            continue
        module.__class__ = qcls
        for kind in ("input", "weight"):
            qname = _qname(name, kind)
            enabled, desc, matched = cfg.resolve(qname, kind, module)
            used.update(matched)
            if kind == "input" and _grid_chosen(cfg, matched):
                own_grid.add(name)
            module.add_module(f"{kind}_quantizer", TensorQuantizer(desc, name=qname, enabled=enabled))
        report.layers.append(name)
        layers[name] = module
    if cfg.target == "onnxruntime" and not getattr(cfg, "legacy_placement", False):
        used.update(_place_for_onnxruntime(model, cfg, layers, own_grid, report, example))
    elif cfg.target == "tensorrt":
        used.update(_place_for_tensorrt(model, cfg, layers, report, example))
    report.unmatched_patterns = [r["pattern"] for i, r in enumerate(cfg.rules) if i not in used]
    model.quantcli_config = cfg
    model.quantcli_report = report
    return model


def _recurrent(
    name: str, module: nn.Module, cfg: QuantConfig, report: QuantizeReport, used: set[int]
) -> bool:
    """Convert an LSTM into a :class:`~quantcli.nn.recurrent.QuantLSTM` (True), or report why a recurrent
    module stays float (False)."""
    why = recurrent_float_reason(module, cfg.target)
    if why is None:
        _, desc, _ = cfg.resolve(
            _qname(f"{name}.l0" if name else "l0", "weight"), "weight", WeightView(module)
        )
        why = lstm_weight_format_reason(desc)
    if why is not None:
        report.float_layers.append({"name": name, "type": type(module).__name__, "reason": why})
        return False

    def resolve(path: str):
        qname = f"{name}.{path}" if name else path
        enabled, desc, matched = cfg.resolve(qname, "weight", WeightView(module))
        used.update(matched)
        return enabled, desc, qname

    convert_lstm(module, resolve)
    return True


def _qname(layer: str, kind: str) -> str:
    return f"{layer}.{kind}_quantizer" if layer else f"{kind}_quantizer"


def _integer8_desc(d: QuantDescriptor) -> bool:
    return not d.is_fp8 and not d.dynamic and not d.block_sizes and d.num_bits <= 8


def _unsigned_when(nonnegative: bool, desc: QuantDescriptor) -> QuantDescriptor:
    """``desc`` on the uint8 grid when its tensor is >= 0 by construction and ``desc`` is a symmetric
    per-tensor 8-bit integer format (a rule that asks for something else keeps it)."""
    if (
        nonnegative
        and _integer8_desc(desc)
        and not desc.unsigned
        and not desc.asymmetric
        and desc.axis is None
    ):
        return QuantDescriptor(**{**desc.dict(), "unsigned": True})
    return desc


def _integer8(q: TensorQuantizer) -> bool:
    d = q.desc
    return q.enabled and not d.is_fp8 and not d.dynamic and q._block is None and d.num_bits <= 8


def _place_for_onnxruntime(
    model: nn.Module,
    cfg: QuantConfig,
    layers: dict[str, nn.Module],
    own_grid: set[str],
    report: QuantizeReport,
    example: Mapping[str, torch.Tensor] | None,
) -> set[int]:
    """Unsigned post-ReLU inputs, output quantizers, int32 biases; returns the indices of rules that
    matched."""
    used: set[int] = set()
    placement, graph = analyse(
        model,
        layers,
        cfg.target,
        {n: m.input_quantizer.enabled and not m.input_quantizer.desc.dynamic for n, m in layers.items()},
        {n: _integer8(m.weight_quantizer) for n, m in layers.items()},
        example,
    )
    for name in list(placement.unsigned_inputs):
        q = layers[name].input_quantizer
        d = q.desc
        if name in own_grid or not _integer8(q) or d.unsigned or d.asymmetric or d.axis is not None:
            placement.unsigned_inputs.remove(name)
            continue
        q.desc = QuantDescriptor(**{**d.dict(), "unsigned": True})
    modules = dict(model.named_modules())
    # the exported node of a hook-run quantizer is named after the hook module's parent: one per parent
    parents = [a.rsplit(".", 1)[0] if "." in a else "" for a, _ in placement.output_after.values()]
    placement.output_after = {
        k: v
        for k, v in placement.output_after.items()
        if parents.count(v[0].rsplit(".", 1)[0] if "." in v[0] else "") == 1
    }
    for name in placement.output_quantized:
        module = layers[name]
        qname = _qname(name, "output")
        enabled, desc, matched = cfg.resolve(qname, "input", module)
        used.update(matched)
        after = placement.output_after.get(name)
        if after is not None and not _grid_chosen(cfg, matched):
            desc = _unsigned_when(after[1], desc)  # after a ReLU: >= 0
        module.add_module("output_quantizer", TensorQuantizer(desc, name=qname, enabled=enabled))
        if after is not None:
            apply_output_quantizer_after(modules[after[0]], module)
    for name, pad in placement.input_before.items():
        apply_input_quantizer_before(modules[pad], layers[name])

    def activation_quantizer(qname: str, module: nn.Module, unsigned: bool) -> TensorQuantizer:
        """A quantizer the placement adds beside the layers' own: the config's input settings for ``qname``,
        on the uint8 grid where its tensor is >= 0."""
        enabled, desc, matched = cfg.resolve(qname, "input", module)
        used.update(matched)
        return TensorQuantizer(_unsigned_when(unsigned, desc), name=qname, enabled=enabled)

    for name, unsigned in list(placement.pool_inputs.items()):
        pool = modules[name]
        if type(pool) not in QUANT_POOL_CLASSES:  # a subclass with its own forward: left in float
            del placement.pool_inputs[name]
            continue
        quantizer = activation_quantizer(_qname(name, "input"), pool, unsigned)
        pool.__class__ = QUANT_POOL_CLASSES[type(pool)]
        pool.add_module("input_quantizer", quantizer)
    if placement.qlinear_adds:

        def make(qname: str, conv: nn.Module, skip) -> TensorQuantizer:
            return activation_quantizer(qname, conv, nonnegative(skip, modules))

        placement.residual_quantized, placement.residual_untraced = insert_residual_quantizers(
            model, layers, graph, make, only=placement.qlinear_adds
        )
    # graph nodes, linked to the whole recorded graph: not kept in the report the model carries (a deep copy
    # of the model would follow every link)
    placement.qlinear_adds = {}
    for module in layers.values():
        # QLinearConv and QGemm take an int32 bias; onnxruntime has no CPU QDQ rule for ConvTranspose
        if not isinstance(module, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)) and getattr(
            module, "takes_int32_bias", True
        ):
            module.int32_bias = True
    report.placement = placement
    if cfg.activations_asymmetric:
        placement.asymmetric = _asymmetric_activations(model, cfg, used)
    return used


def _asymmetric_activations(model: nn.Module, cfg: QuantConfig, used: set[int]) -> list[str]:
    """Put every signed 8-bit per-tensor activation quantizer whose grid no rule chose on uint8 with a zero
    point (the config's ``asymmetric_activations``); returns their names. Runs after the placement, so the
    quantizers it added are included and those it put on the unsigned grid (>= 0 by construction) keep it."""
    done = []
    for name, q in model.named_modules():
        if not isinstance(q, TensorQuantizer) or name.endswith("weight_quantizer"):
            continue
        d = q.desc
        if not _integer8_desc(d) or d.num_bits != 8 or d.unsigned or d.asymmetric or d.axis is not None:
            continue
        rules = cfg.matching_rules(q.name or name)
        if _grid_chosen(cfg, rules):
            continue
        used.update(rules)
        q.desc = QuantDescriptor(**{**d.dict(), "asymmetric": True})
        done.append(q.name or name)
    return done


def _place_for_tensorrt(
    model: nn.Module,
    cfg: QuantConfig,
    layers: dict[str, nn.Module],
    report: QuantizeReport,
    example: Mapping[str, torch.Tensor] | None,
) -> set[int]:
    """NVIDIA's placement: the per-layer quantizers plus the skip inputs of residual Adds."""
    used: set[int] = set()
    placement, graph = analyse(model, layers, cfg.target, {}, {}, example)
    if placement.analysed:

        def make(qname: str, conv: nn.Module, skip=None) -> TensorQuantizer:
            enabled, desc, matched = cfg.resolve(qname, "input", conv)
            used.update(matched)
            return TensorQuantizer(desc, name=qname, enabled=enabled)

        placement.residual_quantized, placement.residual_untraced = insert_residual_quantizers(
            model, layers, graph, make
        )
    report.placement = placement
    return used
