"""The float check: what quantcli's transformations did to the float model, module by module (issue 35).

``quantize_model`` compares its BatchNorm folds, layer conversions and placement rewrites with the model as
loaded on the example batch (:mod:`quantcli.nn.module_outputs`), undoes a fold or a conversion that changed a
module's output and stops on a placement rewrite that did. Here the same comparison covers what calibrate does
after it (SmoothQuant, :func:`check_unchanged`), and names the first module that differs for verify's
``reference.transformations`` (:func:`first_difference`), so a failure says where the float model changed,
not only that an output did.

Modules changed by design are not compared: a layer a BatchNorm was folded into (the BatchNorm, now an
identity, computes what it computed), and a LayerNorm or Linear that absorbed SmoothQuant's ``1 / s`` with
the modules that finish between it and the layers reading the divided tensor (those layers, multiplied back,
compute what they computed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from quantcli.errors import TransformationError
from quantcli.nn.module_outputs import Fingerprint, capture, describe_change, differences, fold_changes


def expected_changes(
    folds: Iterable[Mapping[str, str]],
    smoothed: Iterable[tuple[str, Iterable[str]]],
    reference: Mapping[str, Fingerprint],
) -> set[str]:
    """The modules whose float output a correct transformation changes: the layers BatchNorms were folded
    into with every module of ``reference`` that finished after such a layer and before its BatchNorm, and for
    each ``(into, consumers)`` SmoothQuant group the module that absorbed ``1 / s`` with every
    module of ``reference`` that finished after it and before the first of its readers did (what runs between
    the producer and the readers carries the divided tensor: a Linear's output through attention's softmax
    times V, the wrapper that returns it, a dropout). The readers themselves, and every module after them,
    must compute what they computed."""
    order = {name: i for i, name in enumerate(reference)}
    # a container whose last module is the layer (timm's deep stem: the Sequential ending in the Conv, its
    # BatchNorm after it) returns the folded layer's output: what finished between the two changed too
    changed = fold_changes(reference, ((f["layer"], f.get("batchnorm", "")) for f in folds))
    for into, consumers in smoothed:
        if not into:
            continue
        changed.add(into)
        if into not in order:
            continue
        ends = [order[c] for c in consumers if c in order]
        end = min(ends) if ends else order[into] + 1
        changed.update(name for name, i in order.items() if order[into] < i < end)
    return changed


def smoothed_modules(smooth_report) -> list[tuple[str, list[str]]]:
    """``(into, consumers)`` of every SmoothQuant group that folded ``1 / s`` into a LayerNorm or Linear (a
    :class:`SmoothReport` or its dict)."""
    if smooth_report is None:
        return []
    groups = smooth_report.get("groups", []) if isinstance(smooth_report, dict) else smooth_report.groups
    pairs = [
        (g["into"], list(g["consumers"])) if isinstance(g, dict) else (g.into, list(g.consumers))
        for g in groups
    ]
    return [(into, consumers) for into, consumers in pairs if into]


def check_unchanged(
    model: nn.Module,
    example: Mapping[str, torch.Tensor],
    reference: Mapping[str, Fingerprint],
    skip: set[str],
    what: str,
    remedy: str,
) -> None:
    """Raise :class:`TransformationError` naming the first module of ``reference`` whose float output (every
    quantizer off) ``model`` no longer computes, after ``what``."""
    if not reference:
        return
    diffs = differences(reference, capture(model, example, reference), skip)
    if diffs:
        module, rel = diffs[0]
        raise TransformationError(
            f"{what} changed what the float model computes: {module} ({describe_change(rel)} on the example "
            f"batch); {remedy}"
        )


def first_difference(
    loaded: nn.Module,
    transformed: nn.Module,
    example: Mapping[str, torch.Tensor],
    folds: Iterable[Mapping[str, str]] = (),
    smoothed: Iterable[tuple[str, Iterable[str]]] = (),
) -> tuple[str, float] | None:
    """The first module (innermost, earliest to finish) whose output ``transformed`` computes differently from
    ``loaded`` on ``example``, quantizers off, with its relative change; None when none does. ``folds`` and
    ``smoothed``: what the transformations changed by design (:func:`expected_changes`)."""
    reference = capture(loaded, example)
    skip = expected_changes(folds, smoothed, reference)
    diffs = differences(reference, capture(transformed, example, reference), skip)
    return diffs[0] if diffs else None


def describe_first(found: tuple[str, float] | None) -> str:
    if found is None:
        return "no module's output differs on the sample (the difference is in how modules are combined)"
    module, rel = found
    return f"first module that differs: {module} ({describe_change(rel)})"
