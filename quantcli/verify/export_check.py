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

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from quantcli.errors import VerifyError, first_line
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
    fixed: list = field(default_factory=list)  # FixedSize: named dynamic sizes the graph cannot vary
    error: str | None = None  # onnxruntime could not load or run the graph on the example batch: why

    @property
    def passed(self) -> bool:
        return self.error is None and all(r <= self.limit for r in self.outputs.values())

    @property
    def worst(self) -> str:
        return max(self.outputs, key=self.outputs.get)

    def to_dict(self) -> dict:
        return {
            "outputs": self.outputs,
            "limit": self.limit,
            "passed": self.passed,
            "fixed_sizes": [f.to_dict() for f in self.fixed],
            **({"error": self.error} if self.error else {}),
        }


def graph_agreement(
    path: str | Path, model: nn.Module, example: Batch, requested: dict | None = None
) -> GraphAgreement | None:
    """The exact session of the graph at ``path`` against ``model`` (calibrated, fake-quant) on ``example``;
    ``error`` set where onnxruntime does not load or run it on the example batch; None where the two cannot
    be paired (a different number of outputs, an output of another shape: verify reports those). Its
    ``fixed`` lists the sizes the graph names as dynamic but cannot vary (:func:`fixed_sizes`)."""
    try:
        session = sessions.open_session(Path(path).read_bytes(), "CPUExecutionProvider", optimize=False)
        outputs = _agreement(session, model, example, "the example batch")
    except VerifyError as e:  # a graph onnxruntime cannot load or run: said, not skipped in silence
        return GraphAgreement({}, error=first_line(e, 300))
    if outputs is None:
        return None
    return GraphAgreement(outputs, fixed=fixed_sizes(session, model, example, requested))


def _agreement(
    session, model: nn.Module, batch: Batch, where: str, ref: list | None = None
) -> dict[str, float] | None:
    """Per float output, RMS(graph - fake-quant) over the quantization error on ``batch``; None where the
    outputs cannot be paired. A graph that does not take or run the batch raises :class:`VerifyError`.
    ``ref``: the fake-quant model's outputs on ``batch``, where the caller has them."""
    got = sessions.run(session, sessions.feeds(session, batch, where), where)
    with torch.inference_mode():
        if ref is None:
            ref = output_arrays(run_model(model, batch))
        with quantizer_modes(model, "disabled"):
            flt = output_arrays(run_model(model, batch))
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
    return outputs or None


@dataclass
class FixedSize:
    """A size the graph's inputs name as dynamic (``batch``, ``sequence``) that the graph cannot vary: the
    trace fixed it inside (a ``Reshape`` to the traced length, as TorchScript writes
    ``nn.MultiheadAttention``), so the graph fails, or computes something else, at another size the model
    runs at."""

    dim: str
    axes: list[str]  # ``input_ids[1]``
    traced: int
    tried: int
    error: str
    model_runs: bool = True  # False: an axis --dynamic-dim asked for, at which the model itself fails

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        where = f"{self.dim} ({', '.join(self.axes)}) is dynamic in the graph's inputs, but"
        if not self.model_runs:
            return (
                f"{where} the model itself does not run at {self.tried} there ({self.error}); the weights "
                "fix sizes such as channels and features"
            )
        return (
            f"{where} the graph runs at the traced size {self.traced} only: at {self.tried}, where the model "
            f"runs, {self.error}"
        )


def fixed_sizes(
    session, model: nn.Module, example: Batch, requested: dict | None = None, limit: float = MAX_RMS_RATIO
) -> list[FixedSize]:
    """The graph's named dynamic sizes it cannot vary: for each, the example cut (or grown by one) along every
    input axis of that name, at most 2 rows along the others' batch, run in the graph and in the model. A
    size the model itself cannot run at is not judged, except on an axis ``requested`` (``--dynamic-dim``:
    input name -> axes), which is then named (``model_runs`` False): the user asked for it to vary."""
    dims: dict[str, list[tuple[str, int]]] = {}
    for i in session.get_inputs():
        for axis, d in enumerate(i.shape):
            if isinstance(d, str) and i.name in example and example[i.name].dim() > axis:
                dims.setdefault(d, []).append((i.name, axis))
    out = []
    for dim, where in dims.items():
        name, axis = where[0]
        n = int(example[name].shape[axis])
        size = n - 1 if n > 1 else 2
        batch = dict(example)
        for k, a in where:
            t = batch[k]
            batch[k] = t.narrow(a, 0, size) if size < n else torch.cat([t, t.narrow(a, 0, size - n)], a)
        batch = _few_rows(batch, dims, dim)
        try:
            with torch.inference_mode():
                ref = output_arrays(run_model(model, batch))
        except Exception as e:  # the model itself does not run at that size (a size made up here)
            if any(a in (requested or {}).get(k, ()) for k, a in where):
                error = first_line(e, 300).partition(" failed on batch: ")[2] or first_line(e, 200)
                out.append(FixedSize(dim, [f"{k}[{a}]" for k, a in where], n, size, error, model_runs=False))
            continue
        try:
            outputs = _agreement(session, model, batch, f"{dim} {size}", ref)
        except VerifyError as e:
            node = re.search(r"running (\w+) node\. Name:'([^']*)'", str(e))
            error = f"its {node[1]} node {node[2]!r} fails" if node else f"it fails: {first_line(e, 200)}"
        else:
            worst = max(outputs.values()) if outputs else 0.0
            if worst <= limit:
                continue
            error = f"it is {worst:.3g}x the quantization error off the model (verify fails over {limit:g})"
        out.append(FixedSize(dim, [f"{k}[{a}]" for k, a in where], n, size, error))
    return out


def _few_rows(batch: Batch, dims: dict, probed: str) -> Batch:
    """``batch`` cut to 2 rows along every other named size of the inputs' first axis (the batch), so that the
    probe costs a few rows' forward whatever the example's size."""
    for dim, where in dims.items():
        if dim == probed:
            continue
        for k, a in where:
            if a == 0 and batch[k].shape[0] > 2:
                batch[k] = batch[k].narrow(0, 0, 2)
    return batch
