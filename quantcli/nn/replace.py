"""In-place module replacement: ``quantize_model(model, config)``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from quantcli.nn.config import QuantConfig, load_config
from quantcli.nn.fold_bn import FoldReport, fold_batchnorm
from quantcli.nn.modules import QUANT_CLASSES
from quantcli.nn.tensor_quantizer import TensorQuantizer


@dataclass
class QuantizeReport:
    layers: list[str] = field(default_factory=list)
    unmatched_patterns: list[str] = field(default_factory=list)
    batchnorm: FoldReport = field(default_factory=FoldReport)  # the BatchNorms folded, and those left alone


def quantizers(model: nn.Module) -> dict[str, TensorQuantizer]:
    """Every TensorQuantizer in ``model``, by its module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, TensorQuantizer)}


def quantize_model(model: nn.Module, config=None, *, example: Mapping[str, torch.Tensor] | None = None,
                   fold: bool | None = None) -> nn.Module:
    """Insert quantizers in place into every ``nn.Linear``, ``nn.ConvNd`` and ``nn.ConvTransposeNd`` (exact types).

    First, when the config's ``fold_batchnorm`` is on (the default), every BatchNorm that only its preceding
    Conv/ConvTranspose/Linear feeds is folded into that layer (:func:`quantcli.nn.fold_bn.fold_batchnorm`), so
    weights are calibrated as they will run; the BatchNorm becomes ``nn.Identity``. Otherwise module names,
    parameters, hooks and ``state_dict`` keys are kept (quantizer ``amax`` buffers are added).
    ``config`` is anything :func:`quantcli.nn.config.load_config` takes (default: the ``int8`` preset). The
    report (layers converted, rule patterns that matched nothing, BatchNorms folded and not) is at
    ``model.quantcli_report``.

    Args:
        example: one keyword batch for ``model(**example)``; only a BatchNorm after a Linear needs it to fold.
        fold: overrides the config's ``fold_batchnorm`` (``load_calibrated`` restores stored folds instead).
    """
    cfg: QuantConfig = load_config(config)
    report = QuantizeReport()
    if cfg.fold_batchnorm if fold is None else fold:
        report.batchnorm = fold_batchnorm(model, example)
    used: set[int] = set()
    for name, module in list(model.named_modules()):
        qcls = QUANT_CLASSES.get(type(module))
        if qcls is None:
            continue
        module.__class__ = qcls
        for kind in ("input", "weight"):
            qname = f"{name}.{kind}_quantizer" if name else f"{kind}_quantizer"
            enabled, desc, matched = cfg.resolve(qname, kind, module)
            used.update(matched)
            module.add_module(f"{kind}_quantizer", TensorQuantizer(desc, name=qname, enabled=enabled))
        report.layers.append(name)
    report.unmatched_patterns = [r["pattern"] for i, r in enumerate(cfg.rules) if i not in used]
    model.quantcli_config = cfg
    model.quantcli_report = report
    return model
