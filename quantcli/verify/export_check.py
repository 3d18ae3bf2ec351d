"""Export's own look at the graph it wrote: does it compute what the model computes?

Export said success on graphs that compute something else: torch's TorchScript translation of ``//``
truncated, so a ``Conv2d`` subclass's "same" padding came out as none, and only ``quantcli verify`` (cosine
0.86) told. Here the graph runs once, in the exact session (no onnxruntime optimizations, each node its ONNX
definition), on the checkpoint's example batch, and is compared with the fake-quant model in verify's unit:
RMS(graph - fake-quant) over the quantization error's RMS (the fake-quant model against itself with its
quantizers off), the measure of ``fidelity.rms_ratio`` and its limit (:data:`MAX_RMS_RATIO`, derived from the
zoo's correct exports, docs/verify-criteria.md). One batch and one session: a guard that catches a graph
that is wrong, not the judgment of one that is right, which stays verify's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from quantcli.errors import VerifyError
from quantcli.inputs.data import Batch, output_arrays, run_model
from quantcli.nn.modes import quantizer_modes
from quantcli.verify import sessions
from quantcli.verify.stats import PairStats, ratio
from quantcli.verify.verdict import MAX_RMS_RATIO


@dataclass
class GraphAgreement:
    """Per graph output, RMS(graph - fake-quant) in units of the quantization error, on the example batch."""

    outputs: dict[str, float]
    limit: float = MAX_RMS_RATIO

    @property
    def passed(self) -> bool:
        return all(r <= self.limit for r in self.outputs.values())

    @property
    def worst(self) -> str:
        return max(self.outputs, key=self.outputs.get)

    def to_dict(self) -> dict:
        return {"outputs": self.outputs, "limit": self.limit, "passed": self.passed}


def graph_agreement(path: str | Path, model: nn.Module, example: Batch) -> GraphAgreement | None:
    """The exact session of the graph at ``path`` against ``model`` (calibrated, fake-quant) on ``example``;
    None where the two cannot be paired (the session does not load or run on the example, a different number
    of outputs, an output of another shape: verify reports those)."""
    try:
        session = sessions.open_session(Path(path).read_bytes(), "CPUExecutionProvider", optimize=False)
        feeds = sessions.feeds(session, example, "the example batch")
        got = sessions.run(session, feeds, "the example batch")
    except VerifyError:
        return None
    with torch.inference_mode():
        ref = output_arrays(run_model(model, example))
        with quantizer_modes(model, "disabled"):
            flt = output_arrays(run_model(model, example))
    names = [o.name for o in session.get_outputs()]
    if len(got) != len(ref) or any(g.shape != r.shape for g, r in zip(got, ref)):
        return None
    outputs = {}
    for name, g, r, f in zip(names, got, ref, flt):
        if not (r.dtype.kind == "f" and g.dtype.kind == "f"):
            continue  # token ids, masks: nothing quantized to measure in
        fid, qerr = PairStats(), PairStats()
        fid.add(g, r)
        qerr.add(r, f)
        outputs[name] = ratio(fid.rms, qerr.error_scale)
    return GraphAgreement(outputs) if outputs else None
