"""verify on the CPU that deploys: which CPU kinds are judged, and the u8s8 saturation check.

The deployed session (``InferenceSession(path)``, default options) runs this machine's kernels, so it judges
this machine. A graph is also judged for a CPU whose uint8 x int8 kernels can saturate (x86 without VNNI, and
``any``) when ``--cpu`` names one, when the graph was made for one (its ``quantcli.cpu`` metadata), or when
this machine is one: the fake-quant model runs once more with those kernels emulated
(:class:`quantcli.analysis.saturation.Emulation`), and ``deployment.saturation`` holds the emulated outputs
to the deployed bound, naming the layers that saturate and the remedy. On an x86 CPU without VNNI the
emulation and the deployed session compute the same (tests/test_saturation.py); elsewhere the emulation is
the only way to see it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import torch

from exporters.graph import CPU_KEY
from quantcli.analysis.saturation import Emulation, LayerSaturation
from quantcli.inputs.data import Batch, output_arrays, run_model
from quantcli.quant import cpu as cpu_kinds
from quantcli.verify.stats import PairStats, ratio
from quantcli.verify.verdict import Check, at_most

#: layers named in a failed check's detail
SHOWN = 5


def graph_cpu(model: onnx.ModelProto) -> str | None:
    """The CPU kind the graph's grids were chosen for (None: not recorded, e.g. a graph of an older
    quantcli)."""
    return {p.key: p.value for p in model.metadata_props}.get(CPU_KEY)


def emulated_kind(option: str | None, made_for: str | None) -> str | None:
    """The saturating CPU kind verify emulates, or None: ``--cpu`` if it names one (``auto``: this machine),
    else the graph's own kind if it is one, else this machine if it is one."""
    for kind in (cpu_kinds.resolve(option) if option else None, made_for, cpu_kinds.detect()):
        if kind is not None and cpu_kinds.can_saturate(kind):
            return kind
    return None


@dataclass
class Saturation:
    """The emulated kernels' outputs against the fake-quant model, per graph output, and per layer what
    saturated."""

    kind: str
    fused: set[str]  # the layers onnxruntime runs with a uint8 x int8 kernel (the others run in float)
    outputs: dict[str, PairStats] = field(default_factory=dict)
    layers: dict[str, LayerSaturation] = field(default_factory=dict)

    def add(self, model: torch.nn.Module, batch: Batch, ref: list[np.ndarray], names: list[str], where: str):
        """Run ``model`` on ``batch`` with the kernels emulated; compare with its fake-quant outputs
        ``ref``."""
        with torch.inference_mode(), Emulation(model, self.fused) as emu:
            got = output_arrays(run_model(model, batch, where))
        for k, n in enumerate(names):
            self.outputs.setdefault(n, PairStats()).add(got[k], ref[k])
        for name, s in emu.layers.items():
            total = self.layers.setdefault(name, LayerSaturation(name))
            total.saturated += s.saturated
            total.pairs += s.pairs
            total.delta_sq += s.delta_sq
            total.out_sq += s.out_sq

    def ranked(self) -> list[LayerSaturation]:
        """The layers that saturated, the largest change of their output first."""
        hit = [s for s in self.layers.values() if s.saturated]
        return sorted(hit, key=lambda s: -s.relative_change)

    def to_dict(self, qerr: dict[str, PairStats]) -> dict:
        return {
            "cpu": self.kind,
            "outputs": {
                n: {**s.deviation(), "rms_ratio": ratio(s.rms, qerr[n].error_scale)}
                for n, s in self.outputs.items()
            },
            "layers": [s.to_dict() for s in self.ranked()],
        }


#: onnxruntime's kernels that multiply uint8 activations by int8 weights
U8S8_KERNELS = frozenset(
    {
        "QLinearConv",
        "QGemm",
        "QLinearMatMul",
        "MatMulIntegerToFloat",
        "DynamicQuantizeMatMul",
        "MatMulInteger",
    }
)


def u8s8_layers(onnx_path) -> set[str]:
    """The layers of the graph at ``onnx_path`` that onnxruntime (CPU provider, default options) runs with a
    uint8 x int8 kernel, by module name (:func:`exporters.onnxruntime.fusion.inspect_fusion`)."""
    from exporters.onnxruntime.fusion import inspect_fusion

    return {lf.layer for lf in inspect_fusion(onnx_path).layers if lf.fused and lf.kernel in U8S8_KERNELS}


def layers_text(ranked: list[LayerSaturation]) -> str:
    """``"conv1 (2.1% of pairs saturate, output moves 18% of its RMS), ..."``."""
    shown = [
        f"{s.layer} ({100 * s.fraction:.2g}% of product pairs saturate, its output moves "
        f"{100 * s.relative_change:.2g}% of its RMS)"
        for s in ranked[:SHOWN]
    ]
    more = f" and {len(ranked) - SHOWN} more" if len(ranked) > SHOWN else ""
    return ", ".join(shown) + more


def remedy(kind: str) -> str:
    return (
        f"calibrate again for this CPU (--cpu {kind}, or leave reduce_range at auto: 7-bit weights where "
        "its uint8 x int8 kernels could saturate); " + cpu_kinds.remedy_link()
    )


def saturation_check(sat: Saturation, qerr: dict[str, PairStats], bound: float) -> Check:
    """``deployment.saturation``: the emulated kernels' worst output ratio (as ``deployment.rms_ratio``)
    within ``bound``; a failure names the layers that saturate and the remedy."""
    ratios = {n: ratio(s.rms, qerr[n].error_scale) for n, s in sat.outputs.items()}
    worst = max(ratios, key=ratios.get)
    check = at_most("deployment.saturation", bound, ratios[worst], worst)
    ranked = sat.ranked()
    if not check.passed:
        check.detail = (
            f"{worst}: on {sat.kind} onnxruntime's uint8 x int8 kernels saturate in "
            f"{layers_text(ranked) or 'no layer'}; {remedy(sat.kind)}"
        )
    elif ranked:
        check.detail = f"{worst}; within the bound, saturating: {layers_text(ranked)}"
    return check
