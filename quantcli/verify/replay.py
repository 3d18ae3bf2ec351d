"""Per-quantizer evidence on a bounded sample: onnxruntime's tensors around every Q/DQ pair, compared with the
PyTorch model's.

Graph surgery makes every activation pair's ``DequantizeLinear`` output and the tensor its ``QuantizeLinear``
reads (before any ``Max``/``Min`` clip) extra graph outputs of the exact session. On one sample of at most
:data:`REPLAY_SAMPLES` inputs, three comparisons follow:

* **same-input codes** -- the PyTorch quantizer applied to onnxruntime's own input gives onnxruntime's codes
  (the arithmetic of the pair itself; anything below 1.0 is a bug).
* **replay** -- the fake-quant model runs with every quantizer's output *replaced by onnxruntime's*
  ``DequantizeLinear`` output, so each float segment between quantizers (biases, normalisations, activations,
  attention, residual adds) reads exactly what onnxruntime's read. Each quantizer's input then differs from
  onnxruntime's only by float rounding of that one segment -- far below a quantization step -- and a graph
  output only by the rounding of the last segment. A changed bias or float weight, a missing or replaced op,
  shows up as a deviation of its own segment, in quantization steps, named by the quantizer that reads it.
  Code flips cannot accumulate here, however deep the model.
* **end-to-end codes** -- the fake-quant model on its own (its outputs captured during verify's main pass over
  the same inputs, :func:`capture`): the fraction of codes equal to onnxruntime's at every quantizer (deep
  models flip a few by one step from float rounding and carry them on; reported, not a threshold).

Quantizers PyTorch calls more often than the graph has pairs for them, or with other shapes, are not replaced
(``not_replayed``); the segments after them then compare against PyTorch's own values.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch

from exporters.dynamic_linear import DynamicLayer, dynamic_layers
from exporters.graph import QdqPair, producer_map, qdq_pairs
from quantcli.analysis.quality import snr_db
from quantcli.inputs.batch_axes import split
from quantcli.inputs.data import Batch, num_samples, output_arrays, run_model
from quantcli.nn.recurrent import DYNAMIC_LSTM
from quantcli.nn.tensor_quantizer import owner, quantizers
from quantcli.quant import arithmetic
from quantcli.verify import sessions

REPLAY_SAMPLES = 16  # inputs of the per-quantizer evidence: a fixed cost, whatever the size of the data
_WHERE = "the per-quantizer sample"  # how errors name the sample
FP8_MANTISSA_BITS = 3
FP8_MIN_EXPONENT = -6


def activation_pairs(model: onnx.ModelProto) -> dict[str, list[QdqPair]]:
    """Quantizer -> its activation pairs (a ``QuantizeLinear`` computed at run time), in graph order."""
    inits = {t.name for t in model.graph.initializer}
    out: dict[str, list[QdqPair]] = {}
    for p in qdq_pairs(model):
        if p.quantizer and p.stored == "runtime" and p.tensor not in inits:
            out.setdefault(p.quantizer, []).append(p)
    return out


def source_tensors(model: onnx.ModelProto, names: list[str]) -> dict[str, str]:
    """The tensor each named tensor quantizes: followed back through ``Max``/``Min`` with a constant bound
    (the narrow-range and dead-channel clips, the float8 guards), which the PyTorch quantizer does
    internally."""
    g = model.graph
    constants = {t.name for t in g.initializer} | {
        o for n in g.node if n.op_type == "Constant" for o in n.output
    }
    producers = producer_map(g)
    out = {}
    for start in names:
        name = start
        for _ in range(8):
            n = producers.get(name)
            if n is None or n.op_type not in ("Max", "Min") or len(n.input) != 2:
                break
            a, b = n.input
            if b in constants and a not in constants:
                name = a
            elif a in constants and b not in constants:
                name = b
            else:
                break
        out[start] = name
    return out


def with_outputs(model: onnx.ModelProto, names: list[tuple[str, int]]) -> onnx.ModelProto:
    """A copy of ``model`` that also outputs ``names``: (tensor inside the graph, its ONNX element type)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    existing = {o.name for o in m.graph.output}
    for t, elem in names:
        if t not in existing:
            m.graph.output.append(onnx.helper.make_tensor_value_info(t, elem, None))
            existing.add(t)
    return m


def dynamic_inputs(model: onnx.ModelProto) -> dict[str, DynamicLayer]:
    """Input quantizer -> its ``DynamicQuantizeLinear -> MatMulInteger`` layer
    (:mod:`exporters.dynamic_linear`)."""
    return {d.input_quantizer: d for d in dynamic_layers(model) if d.input_quantizer}


def _dynamic_outputs(d: DynamicLayer) -> list[tuple[str, int]]:
    f32, u8 = onnx.TensorProto.FLOAT, onnx.TensorProto.UINT8
    return [(d.input, f32), (d.codes, u8), (d.scale, f32), (d.zero_point, u8)]


def evidence_quantizers(model: onnx.ModelProto) -> list[str]:
    """The activation quantizers the sample covers: Q/DQ pairs and dynamic layers."""
    pairs = activation_pairs(model)
    return list(pairs) + [n for n in dynamic_inputs(model) if n not in pairs]


def evidence_outputs(model: onnx.ModelProto) -> list[tuple[str, int]]:
    """Every extra output the replay needs: each activation pair's source tensor and DequantizeLinear output,
    each dynamic layer's input, codes, scale and zero point."""
    pairs = [p for ps in activation_pairs(model).values() for p in ps]
    sources = source_tensors(model, [p.tensor for p in pairs])
    f32 = onnx.TensorProto.FLOAT
    out = [(t, f32) for p in pairs for t in (sources[p.tensor], p.output)]
    return out + [o for d in dynamic_inputs(model).values() for o in _dynamic_outputs(d)]


def split_sample(batches: list[Batch]) -> tuple[Batch, list[Batch]]:
    """(the first :data:`REPLAY_SAMPLES` inputs of the first batch, every other input in batches)."""
    sample, rest = split(batches[0], REPLAY_SAMPLES)  # each input along its batch axis
    return sample, ([rest] if rest is not None else []) + list(batches[1:])


def _steps(diff: np.ndarray, x: np.ndarray, p: QdqPair) -> float:
    """Largest ``|diff|`` in quantization steps of pair ``p`` at values ``x`` (float8: the E4M3 spacing
    there)."""
    if diff.size == 0:
        return 0.0
    s = np.asarray(p.scale, np.float64)
    if s.size > 1:
        shape = [1] * diff.ndim
        if p.block_size or p.axis is None or s.ndim != 1:
            s = np.asarray(s.min())  # conservative: the finest step of the tensor
        else:
            shape[p.axis % diff.ndim] = s.size
            s = s.reshape(shape)
    s = np.maximum(s, np.finfo(np.float32).tiny)
    step = s
    if p.format.startswith("fp8"):
        exp = np.floor(np.log2(np.maximum(np.abs(x) / s, 2.0**FP8_MIN_EXPONENT)))
        step = s * np.exp2(np.maximum(exp, FP8_MIN_EXPONENT) - FP8_MANTISSA_BITS)
    return float((np.abs(diff) / step).max())


def _after_recurrent(producers: dict[str, onnx.NodeProto], tensor: str) -> bool:
    """Whether the float segment that computes ``tensor`` (back to the DequantizeLinear outputs and graph
    inputs before it) holds a ``DynamicQuantizeLSTM``. Such a segment quantizes inside itself, at every time
    step, with scales computed from its own values: one code that float rounding flips at one step (PyTorch's
    thread count changes it) is carried through every later step, so the segment replayed on onnxruntime's
    input is not within float rounding of onnxruntime (an accurate 2-layer LSTM over 32 steps: 4 steps at
    the next quantizer with 2 threads, 3e-4 with 1). The deployment checks judge what it computes.
    ``producers``: tensor -> the node writing it (:func:`exporters.graph.producer_map`)."""
    stack, seen = [tensor], {tensor}
    while stack:
        node = producers.get(stack.pop())
        if node is None or node.op_type == "DequantizeLinear":
            continue
        if node.op_type == DYNAMIC_LSTM:
            return True
        fresh = [i for i in node.input if i and i not in seen]
        seen.update(fresh)
        stack.extend(fresh)
    return False


@dataclass
class Replay:
    """The per-quantizer evidence of one sample."""

    samples: int
    rows: list[dict[str, Any]] = field(default_factory=list)  # per activation quantizer
    output_deviation: dict[str, float] = field(default_factory=dict)  # max |replayed PyTorch - onnxruntime|
    # quantizers PyTorch called where the graph has no pair
    not_replayed: list[str] = field(default_factory=list)
    # quantizers whose segment holds a recurrent layer (:func:`_after_recurrent`): replayed, not judged
    recurrent_segments: list[str] = field(default_factory=list)
    # graph outputs whose segment holds a recurrent layer: replayed, not judged (the same reason)
    recurrent_outputs: list[str] = field(default_factory=list)


@contextlib.contextmanager
def capture(qmodel: torch.nn.Module, names) -> Iterator[dict[str, list[np.ndarray]]]:
    """While active, every output of the named quantizers, per call (the end-to-end comparison's PyTorch
    side)."""
    qs = quantizers(qmodel)
    seen: dict[str, list[np.ndarray]] = {}

    def keep(name):
        def hook(_m, _i, out):
            # a copy: the model may change its quantizer's output in place afterwards (``out += identity``,
            # ``ReLU(inplace=True)``), and a view would then hold the changed values, not the quantizer's
            seen.setdefault(name, []).append(out.detach().cpu().numpy().copy())

        return hook

    handles = [qs[n].register_forward_hook(keep(n)) for n in names if n in qs]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def replay(
    sess,
    model: onnx.ModelProto,
    out_names: list[str],
    qmodel: torch.nn.Module,
    batch: Batch,
    seen: dict[str, list[np.ndarray]],
) -> tuple[Replay, list[np.ndarray]]:
    """The sample through the exact session (with the extra outputs) and the fake-quant model replayed on it.

    ``seen``: the fake-quant model's own quantizer outputs on ``batch`` (:func:`capture`). Returns the
    evidence and the exact session's outputs on the sample.
    """
    pairs = activation_pairs(model)
    found = source_tensors(model, [p.tensor for ps in pairs.values() for p in ps])
    sources = {p.output: found[p.tensor] for ps in pairs.values() for p in ps}
    dyn = {n: d for n, d in dynamic_inputs(model).items() if n not in pairs}
    extra = [t for ps in pairs.values() for p in ps for t in (sources[p.output], p.output)]
    extra += [t for d in dyn.values() for t, _ in _dynamic_outputs(d)]
    values = sessions.run(sess, sessions.feeds(sess, batch, _WHERE), _WHERE, out_names + extra)
    ort_out, named = values[: len(out_names)], dict(zip(out_names + extra, values))
    qs = quantizers(qmodel)
    rep = Replay(samples=num_samples([batch]))
    # dynamic layers: onnxruntime's codes dequantized with its own run-time scale and zero point
    dyn_deq = {
        n: (
            (named[d.codes].astype(np.float32) - named[d.zero_point].astype(np.float32))
            * named[d.scale].astype(np.float32)
        ).astype(np.float32)
        for n, d in dyn.items()
    }
    forcing = _Forcing(pairs, sources, dyn, named, dyn_deq)
    forced = forcing.run(qmodel, qs, batch)
    for n, g, r in zip(out_names, ort_out, forced):
        if g.shape == r.shape:
            d = np.abs(g.astype(np.float64) - r)
            rep.output_deviation[n] = float(np.nan_to_num(d, nan=np.inf).max(initial=0.0))
    rep.not_replayed = sorted(forcing.not_replayed)
    recurrent: set[str] = set()
    if any(n.op_type == DYNAMIC_LSTM for n in model.graph.node):
        producers = producer_map(model.graph)
        recurrent = {
            n for n, ps in pairs.items() if any(_after_recurrent(producers, sources[p.output]) for p in ps)
        }
        rep.recurrent_outputs = [n for n in out_names if _after_recurrent(producers, n)]
    rep.recurrent_segments = sorted(recurrent & set(qs))
    for name, ps in pairs.items():
        if name in qs:
            steps = None if name in recurrent else forcing.deviation.get(name)
            rep.rows.append(_pair_row(name, ps, qs[name], sources, named, seen, steps))
    for name, d in dyn.items():
        if name in qs:
            rep.rows.append(_dynamic_row(name, d, named, dyn_deq[name], seen, forcing.deviation.get(name)))
    return rep, ort_out


@dataclass
class _Forcing:
    """The replay: every quantizer reads PyTorch's segment output, and hands on onnxruntime's DequantizeLinear
    output (forward hooks); records how far each quantizer's input is from onnxruntime's, in steps."""

    pairs: dict[str, list[QdqPair]]
    sources: dict[str, str]  # DequantizeLinear output -> the tensor its QuantizeLinear reads
    dyn: dict[str, DynamicLayer]
    named: dict[str, np.ndarray]  # the exact session's tensors
    dyn_deq: dict[str, np.ndarray]
    deviation: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    not_replayed: set[str] = field(default_factory=set)

    def run(self, qmodel: torch.nn.Module, qs: dict, batch: Batch) -> list[np.ndarray]:
        """The fake-quant model's outputs on ``batch`` with every quantizer's output replaced."""
        handles = [
            qs[n].register_forward_hook(self._hook(n)) for n in list(self.pairs) + list(self.dyn) if n in qs
        ]
        try:
            with torch.inference_mode():
                return output_arrays(run_model(qmodel, batch, _WHERE))
        finally:
            for h in handles:
                h.remove()

    def _hook(self, name: str):
        def hook(_m, inputs, out):
            k = self.calls.get(name, 0)
            self.calls[name] = k + 1
            if name in self.dyn:
                return self._force_dynamic(name, inputs, out, k)
            return self._force(name, inputs, out, k)

        return hook

    def _force(self, name: str, inputs, out: torch.Tensor, k: int) -> torch.Tensor | None:
        ps = self.pairs[name]
        if k >= len(ps):
            self.not_replayed.add(name)
            return None
        p = ps[k]
        x_ort, dq = self.named[self.sources[p.output]], self.named[p.output]
        x = inputs[0].detach().cpu().numpy()
        if x.shape != x_ort.shape or dq.shape != tuple(out.shape):
            self.not_replayed.add(name)
            return None
        d = _steps(x.astype(np.float64) - x_ort, x_ort, p)
        self.deviation[name] = max(self.deviation.get(name, 0.0), d if math.isfinite(d) else math.inf)
        return _private_tensor(dq, out.dtype)

    def _force_dynamic(self, name: str, inputs, out: torch.Tensor, k: int) -> torch.Tensor | None:
        d, deq = self.dyn[name], self.dyn_deq[name]
        x_ort, x = self.named[d.input], inputs[0].detach().cpu().numpy()
        if k > 0 or x.shape != x_ort.shape or deq.shape != tuple(out.shape):
            self.not_replayed.add(name)
            return None
        # the run-time scale: one step
        step = max(float(self.named[d.scale]), float(np.finfo(np.float32).tiny))
        diff = float(np.abs(x.astype(np.float64) - x_ort).max(initial=0.0)) / step
        self.deviation[name] = diff if math.isfinite(diff) else math.inf
        return _private_tensor(deq, out.dtype)


def _private_tensor(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of its own holding ``values``: the model may change what a quantizer hands on in place (``out
    += identity``, ``ReLU(inplace=True)``); a view would write into onnxruntime's evidence, which is compared
    later."""
    return torch.tensor(values, dtype=dtype)


def _pair_row(
    name: str,
    ps: list[QdqPair],
    q: torch.nn.Module,
    sources: dict[str, str],
    named: dict[str, np.ndarray],
    seen: dict[str, list[np.ndarray]],
    steps: float | None,
) -> dict[str, Any]:
    """One activation quantizer's evidence over its pairs: SNR and max error of onnxruntime's Q/DQ, the
    same-input and end-to-end code agreement, and its replay deviation ``steps``."""
    err2 = ref2 = max_abs = 0.0
    same = e2e = total = e2e_total = 0
    negative: dict[str, Any] | None = None
    for k, p in enumerate(ps):
        x, dq = named[sources[p.output]], named[p.output]
        d = dq - x
        err2 += float(np.square(d, dtype=np.float64).sum())  # float64: float32 sums overflow on wild values
        ref2 += float(np.square(x, dtype=np.float64).sum())
        max_abs = max(max_abs, float(np.abs(d).max(initial=0.0)))
        # an unsigned quantizer's input is non-negative in the model (after a ReLU); a negative one in the
        # graph is evidence (a ReLU removed or replaced): those values count as differing codes, the rest are
        # compared
        valid = x >= 0 if getattr(q.desc, "unsigned", False) else np.ones(x.shape, bool)
        if not valid.all():
            negative = {
                "tensor": sources[p.output],
                "count": int(x.size - np.count_nonzero(valid)),
                "min": float(x.min()),
            }
        with torch.inference_mode():  # forward(), not __call__: no hooks, just the quantizer's arithmetic
            mine = q.forward(
                torch.from_numpy(np.ascontiguousarray(np.where(valid, x, 0).astype(x.dtype)))
            ).numpy()
        same += int(np.count_nonzero((mine == dq) & valid))
        total += dq.size
        own = seen.get(name, [])
        if k < len(own) and own[k].shape == dq.shape:
            e2e += int(np.count_nonzero(own[k] == dq))
            e2e_total += dq.size
    return {
        "quantizer": name,
        "module": owner(name),
        "kind": "activation",
        "snr_db": snr_db(ref2, err2),
        "max_abs_error": max_abs,
        "identical_codes": same / total if total else None,
        "identical_codes_end_to_end": e2e / e2e_total if e2e_total else None,
        "replay_steps": steps,
        "negative_input": negative,  # {tensor, count, min} where the graph feeds an unsigned quantizer x < 0
    }


def _dynamic_row(
    name: str,
    d: DynamicLayer,
    named: dict[str, np.ndarray],
    deq: np.ndarray,
    seen: dict[str, list[np.ndarray]],
    steps: float | None,
) -> dict[str, Any]:
    """One dynamic layer's input quantizer: onnxruntime's run-time qparams and codes against quantcli's."""
    x, codes = np.ascontiguousarray(named[d.input]), named[d.codes]
    ps, pz = arithmetic.dynamic_qparams(torch.from_numpy(x))
    mine = arithmetic.quantize_linear(torch.from_numpy(x), ps, pz, 0, arithmetic.DYNAMIC_QMAX).numpy()
    params_equal = float(ps) == float(named[d.scale]) and float(pz) == float(named[d.zero_point])
    same = int(np.count_nonzero(mine == codes)) if params_equal else 0
    own = seen.get(name, [])
    e2e = own[0] if own and own[0].shape == deq.shape else None
    diff = deq.astype(np.float64) - x
    ref2, err2 = float(np.square(x, dtype=np.float64).sum()), float(np.square(diff).sum())
    return {
        "quantizer": name,
        "module": owner(name),
        "kind": "activation (dynamic)",
        "snr_db": snr_db(ref2, err2),
        "max_abs_error": float(np.abs(diff).max(initial=0.0)),
        "identical_codes": same / codes.size if codes.size else None,
        "identical_codes_end_to_end": float(np.count_nonzero(e2e == deq)) / deq.size
        if e2e is not None
        else None,
        "replay_steps": steps,
    }
