"""Weight-rounding PTQ for weight-only layers: ``rtn`` (round to nearest, what calibration alone does),
``gptq`` (:mod:`quantcli.calibration.gptq`) and ``awq`` (:mod:`quantcli.calibration.awq`), chosen with
``quantcli calibrate --weight-method``.

Both data-driven methods need, per weight-only Linear, only ``H = 2 X.T X`` of its inputs (AWQ also the mean
``|x|`` per input channel), accumulated streaming over the calibration batches on the model's device: memory
is one ``in x in`` float64 matrix per layer (GPTQ, layer by layer: one at a time), whatever the number of
samples. Under ``torch.distributed`` every rank accumulates its own batches and the statistics are summed over
the ranks (``all_reduce(SUM)`` in float64, where every product of two float32 inputs is exact): each rank then
holds the statistics of all the batches. The sums are associated differently than in one process (a difference
of about 1e-16 of the sum, float64 rounding), far below the float32 precision GPTQ's updates run in; on the
sample decoder two ranks give one process's weights bit for bit
(``tests/test_weight_rounding_distributed.py``), but that is not guaranteed for every input.

``awq`` runs before calibration (it rescales weights; their amax is then calibrated on the scaled weights),
``gptq`` after it (it keeps the calibrated amax and moves the weights within that grid).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from calibrators.distributed import comm_device, world_size
from quantcli.calibration.awq import ALPHAS, search_scale
from quantcli.calibration.gptq import DEFAULT_DAMP, HessianAccumulator, gptq_weights
from quantcli.errors import CalibrationError
from quantcli.inputs.data import Batch, run_model, to_device
from quantcli.nn.modes import quantizer_modes
from quantcli.nn.modules import QuantLinear
from quantcli.nn.tensor_quantizer import quantizer_name, quantizers

WEIGHT_METHODS = ("rtn", "gptq", "awq")


@dataclass
class WeightRoundingReport:
    method: str
    layers: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # layer -> why it was left to round-to-nearest
    rows: int = 0  # input rows (tokens, samples) the statistics were accumulated over, all ranks together
    seconds: float = 0.0
    details: dict = field(default_factory=dict)  # method-specific (awq: alpha and fold per input)

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "layers": len(self.layers),
            "skipped": self.skipped,
            "rows": self.rows,
            "seconds": round(self.seconds, 4),
            **self.details,
        }


def weight_only_layers(model: nn.Module) -> tuple[dict[str, QuantLinear], dict[str, str]]:
    """(Linear layers whose weights are quantized to a symmetric integer grid and whose inputs stay float,
    layers with a weight quantizer left out and why)."""
    layers, skipped = {}, {}
    for name, m in model.named_modules():
        wq = m._modules.get("weight_quantizer")
        if wq is None or not getattr(wq, "enabled", False):
            continue
        if not isinstance(m, QuantLinear):
            # (a layer quantized where its operation runs, nn.MultiheadAttention's projections, a convolution)
            kind = type(m).__name__.removeprefix("Quant")
            skipped[name] = (
                f"a {kind} quantized where its operation runs, not an nn.Linear called as a module (weight "
                "rounding reads a Linear's input at its call): its weights are rounded to nearest"
            )
            continue
        d = m.weight_quantizer.desc
        if m.input_quantizer.enabled:
            skipped[name] = "its input is quantized too (weight rounding is for weight-only layers)"
        elif d.is_fp8 or d.asymmetric or d.dynamic or not isinstance(d.num_bits, int) or d.num_bits > 8:
            skipped[name] = f"{d.format_name} weights: weight rounding is for symmetric integer grids"
        else:
            layers[name] = m
    return layers, skipped


def accumulate_hessians(
    model: nn.Module,
    layers: dict[str, nn.Linear],
    batches: Sequence[Batch],
    device: torch.device,
    extra=None,
    group=None,
    modes: str | dict[str, str] = "disabled",
) -> dict[str, HessianAccumulator]:
    """One pass of the model over ``batches`` with its quantizers in ``modes`` (default: all disabled, the
    float model): each layer's :class:`~quantcli.calibration.gptq.HessianAccumulator`, summed over the ranks.
    ``extra(name, x)`` sees every input too."""
    acc = {n: HessianAccumulator(m.in_features, m.weight.device) for n, m in layers.items()}

    def hook(name):
        def pre(_module, args):
            acc[name].add(args[0])
            if extra is not None:
                extra(name, args[0])

        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in layers.items()]
    try:
        with quantizer_modes(model, modes), torch.inference_mode():
            for i, batch in enumerate(batches):
                run_model(model, to_device(batch, device), where=f"calibration batch {i}")
    finally:
        for h in handles:
            h.remove()
    if world_size(group) > 1:
        sum_over_ranks_([a.hessian for a in acc.values()], group)
        rows = torch.tensor([float(a.rows) for a in acc.values()], dtype=torch.float64)
        sum_over_ranks_([rows], group)
        for a, r in zip(acc.values(), rows.tolist()):
            a.rows = int(r)
    return acc


def sum_over_ranks_(tensors: list[torch.Tensor], group=None) -> None:
    """``all_reduce(SUM)`` of each tensor in place, through the group's communication device."""
    dev = comm_device(group)
    for t in tensors:
        moved = t.to(dev)
        dist.all_reduce(moved, op=dist.ReduceOp.SUM, group=group)
        t.copy_(moved.to(t.device))


def model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def gptq(
    model: nn.Module,
    batches: Sequence[Batch],
    *,
    damp: float = DEFAULT_DAMP,
    group=None,
    sequential: bool = True,
) -> WeightRoundingReport:
    """GPTQ every weight-only layer of a calibrated ``model`` in place (its weight amax stays), on the model's
    device. Call it on every rank under ``torch.distributed`` with that rank's batches.

    ``sequential`` (the paper's order): one pass over the data per layer, in module order, each layer's
    Hessian taken on the inputs the layers already rounded produce (their weight quantizers on, everything
    else off), one Hessian in memory at a time. Otherwise one pass of the float model collects every layer's
    Hessian at once.
    """
    t0 = time.perf_counter()
    layers, skipped = weight_only_layers(model)
    _need_layers("gptq", layers)
    report = WeightRoundingReport("gptq", skipped=skipped)
    missing = [n for n, m in layers.items() if m.weight_quantizer.amax is None]
    if missing:
        raise CalibrationError(
            f"GPTQ needs calibrated weight quantizers first; no amax: {', '.join(missing[:3])}"
        )
    stages = [[n] for n in layers] if sequential else [list(layers)]
    modes = dict.fromkeys(quantizers(model), "disabled")
    for stage in stages:
        acc = accumulate_hessians(
            model, {n: layers[n] for n in stage}, batches, model_device(model), group=group, modes=modes
        )
        for name in stage:
            if acc[name].rows == 0:
                report.skipped[name] = "never called during calibration"
                continue
            _round_layer(layers[name], acc[name], damp)
            modes[quantizer_name(name, "weight_quantizer")] = "quantize"
            report.layers.append(name)
            report.rows = max(report.rows, acc[name].rows)
    report.details = {"damp": damp, "sequential": sequential}
    report.seconds = time.perf_counter() - t0
    return report


def _round_layer(m: QuantLinear, acc: HessianAccumulator, damp: float) -> None:
    q = m.weight_quantizer
    d = q.desc
    new = gptq_weights(
        m.weight.detach(),
        acc.hessian,
        q.amax,
        d.num_bits,
        unsigned=d.unsigned,
        narrow_range=d.narrow_range,
        damp=damp,
    )
    with torch.no_grad():
        m.weight.copy_(new.to(m.weight.dtype))


def _block_of(q) -> int | None:
    """The quantizer's block along the input dimension of an ``(out, in)`` weight; None per output channel."""
    return q._block[1] if q._block is not None else None


def awq(
    model: nn.Module,
    batches: Sequence[Batch],
    *,
    device: str | torch.device = "auto",
    group=None,
    alphas: tuple[float, ...] = ALPHAS,
) -> WeightRoundingReport:
    """AWQ's scale search for every weight-only layer of a quantized ``model`` (before calibration), in place:
    the weights of the layers reading one tensor are multiplied by the chosen ``s``, their input divided by it
    (folded into the LayerNorm or Linear producing it where that keeps the float model equal, else an explicit
    Mul)."""
    from quantcli.calibration.calibrate import resolve_device
    from quantcli.calibration.smoothquant import apply_scales, plan_folds

    t0 = time.perf_counter()
    if not batches:
        raise CalibrationError("no calibration batches")
    dev = resolve_device(device)
    model.eval().to(dev)
    layers, skipped = weight_only_layers(model)
    _need_layers("awq", layers)
    sums = {n: torch.zeros(m.in_features, dtype=torch.float64, device=dev) for n, m in layers.items()}

    def absolute(name, x):
        sums[name] += x.detach().reshape(-1, x.shape[-1]).abs().to(torch.float64).sum(0)

    acc = accumulate_hessians(model, layers, batches, dev, extra=absolute, group=group)
    if world_size(group) > 1:
        sum_over_ranks_(list(sums.values()), group)
    plans, left_out = plan_folds(model, layers, batches[0], dev)
    report = WeightRoundingReport("awq", skipped={**skipped, **left_out})
    chosen, folds = {}, {"layernorm": 0, "linear": 0, "mul": 0}
    for consumers, fold, into in plans:
        first = consumers[0]
        if acc[first].rows == 0:
            continue
        q = layers[first].weight_quantizer
        s, alpha, _ = search_scale(
            [layers[c].weight for c in consumers],
            sums[first] / acc[first].rows,
            acc[first].hessian,
            q.desc.num_bits,
            _block_of(q),
            unsigned=q.desc.unsigned,
            narrow_range=q.desc.narrow_range,
            alphas=alphas,
        )
        apply_scales(model, layers, consumers, fold, into, s)
        report.layers += consumers
        chosen[",".join(consumers)] = {"alpha": alpha, "fold": fold, "into": into}
        folds[fold] += 1
        report.rows = max(report.rows, acc[first].rows)
    report.details = {"folds": folds, "inputs": chosen}
    report.seconds = time.perf_counter() - t0
    return report


def _need_layers(method: str, layers: dict) -> None:
    if not layers:
        raise CalibrationError(
            f"--weight-method {method} applies to weight-only integer Linear layers (e.g. "
            "--config int4-weight-only); this model and config have none"
        )
