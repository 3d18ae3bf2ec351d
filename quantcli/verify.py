"""``verify_onnx``: prove in onnxruntime that an exported graph computes what the calibrated model computes.

Checks, each reported with its numbers:

* **structure** — every enabled quantizer of the checkpoint has its Q/DQ pair in the graph with the scale and
  zero point its amax implies (float32-exact), stored weight codes equal the checkpoint's, and the graph's
  inputs match the checkpoint's input names.
* **fidelity** — onnxruntime (graph optimizations off) vs the fake-quant PyTorch model on the same inputs:
  output differences, and per activation quantizer the fraction of identical integer codes.
* **quality** — onnxruntime vs the float model: cosine similarity, SNR, abs errors, top-1 agreement for 2-D logits.
* **deployment** — fidelity again with onnxruntime's default optimizations on (reported, never a threshold).
* **layers** (``per_layer``) — each quantizer's local error in onnxruntime (its DequantizeLinear output vs its
  own float input), ranked worst first, plus identical-code fractions.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from exporters.dynamic_linear import dynamic_layers
from exporters.graph import qdq_pairs, read_onnx, to_numpy
from quantcli import arithmetic as ar
from quantcli.checkpoint import Calibrated, load_calibrated
from quantcli.data import Batch, describe, num_samples, run_model
from quantcli.errors import VerifyError
from quantcli.granularity import broadcast_onnx_param
from quantcli.nn.replace import quantizers

LAYER_CHUNK = 64  # extra graph outputs per onnxruntime session (bounds memory with --per-layer)


@dataclass
class Check:
    name: str
    threshold: float
    value: float
    passed: bool
    kind: str  # "max" (value must be <= threshold) or "min"

    def to_dict(self) -> dict:
        return {"name": self.name, "threshold": self.threshold, "value": self.value, "passed": self.passed,
                "kind": self.kind}


@dataclass
class VerifyReport:
    onnx: str
    checkpoint: str
    provider: str
    num_batches: int
    num_samples: int
    checks: list[Check] = field(default_factory=list)
    structure: dict[str, Any] = field(default_factory=dict)
    fidelity: dict[str, Any] = field(default_factory=dict)
    quality: dict[str, Any] = field(default_factory=dict)
    deployment: dict[str, Any] = field(default_factory=dict)
    layers: list[dict[str, Any]] | None = None
    seconds: float = 0.0
    provider_note: str | None = None

    @property
    def passed(self) -> bool:
        return self.structure.get("passed", False) and all(c.passed for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed, "onnx": self.onnx, "checkpoint": self.checkpoint, "provider": self.provider,
            "provider_note": self.provider_note,
            "num_batches": self.num_batches, "num_samples": self.num_samples,
            "checks": [c.to_dict() for c in self.checks], "structure": self.structure, "fidelity": self.fidelity,
            "quality": self.quality, "deployment": self.deployment, "layers": self.layers,
            "seconds": round(self.seconds, 3),
        }


# ------------------------------------------------------------------------------------------- providers


def choose_provider(provider: str = "auto") -> str:
    import onnxruntime as ort

    available = ort.get_available_providers()
    cuda_ok = "CUDAExecutionProvider" in available and torch.cuda.is_available()
    if provider == "auto":
        return "CUDAExecutionProvider" if cuda_ok else "CPUExecutionProvider"
    if provider == "cpu":
        return "CPUExecutionProvider"
    if provider == "cuda":
        if not cuda_ok:
            raise VerifyError("--provider cuda: onnxruntime's CUDAExecutionProvider or a CUDA GPU is not available "
                              "here; use --provider cpu or auto")
        return "CUDAExecutionProvider"
    raise VerifyError(f"unknown --provider {provider!r}; use auto, cpu or cuda")


def _session(model: onnx.ModelProto, provider: str, optimize: bool):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3  # no warnings about missing CUDA libraries on CPU machines
    so.intra_op_num_threads = max(1, torch.get_num_threads())
    try:
        return ort.InferenceSession(model.SerializeToString(), so, providers=[provider])
    except Exception as e:
        raise VerifyError(f"onnxruntime cannot load the model: {str(e).strip().splitlines()[0][:200]}") from None


_ORT_TYPES = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32,
              "tensor(bool)": np.bool_, "tensor(double)": np.float64, "tensor(float16)": np.float16}


def _feeds(sess, batch: Batch, where: str) -> dict[str, np.ndarray]:
    feeds = {}
    for i in sess.get_inputs():
        if i.name not in batch:
            raise VerifyError(f"{where}: the ONNX input {i.name!r} has no data (data has {', '.join(batch)})")
        v = batch[i.name].detach().cpu()
        want = _ORT_TYPES.get(i.type)
        if want is not None and np.issubdtype(want, np.integer) and v.dtype.is_floating_point:
            raise VerifyError(f"{where}: input {i.name!r} is {str(v.dtype).replace('torch.', '')} but the graph "
                              f"expects {i.type}")
        arr = v.numpy()
        feeds[i.name] = arr.astype(want) if want is not None else arr
        if len(i.shape) != arr.ndim or any(isinstance(d, int) and d != s for d, s in zip(i.shape, arr.shape)):
            raise VerifyError(f"{where}: input {i.name!r} has shape {list(arr.shape)} but the graph expects {i.shape}")
    return feeds


def _run(sess, feeds, where: str, names=None) -> list[np.ndarray]:
    try:
        return sess.run(names, feeds)
    except Exception as e:
        raise VerifyError(f"onnxruntime failed on {where}: {str(e).strip().splitlines()[0][:200]}") from None


# ------------------------------------------------------------------------------------------- metrics


class _Stats:
    """Streaming comparison of ``got`` vs ``ref`` (memory independent of the number of batches)."""

    def __init__(self):
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.sum_abs = 0.0
        self.count = 0
        self.dot = 0.0
        self.n_got = 0.0
        self.n_ref = 0.0
        self.err2 = 0.0
        self.top1_same = 0
        self.top1_total = 0
        self.identical = 0
        self.nonfinite = 0

    def add(self, got: np.ndarray, ref: np.ndarray) -> None:
        g = np.asarray(got, np.float64)
        r = np.asarray(ref, np.float64)
        if g.shape != r.shape:
            raise VerifyError(f"output shapes differ: onnxruntime {list(g.shape)} vs PyTorch {list(r.shape)}")
        finite = np.isfinite(g) & np.isfinite(r)
        self.nonfinite += int((~finite).sum())
        g, r = np.where(finite, g, 0.0), np.where(finite, r, 0.0)
        d = np.abs(g - r)
        self.max_abs = max(self.max_abs, float(d.max(initial=0)))
        self.max_rel = max(self.max_rel, float((d / np.maximum(np.abs(r), 1e-12)).max(initial=0)))
        self.sum_abs += float(d.sum())
        self.count += d.size
        self.identical += int((d == 0).sum())
        self.dot += float((g * r).sum())
        self.n_got += float((g * g).sum())
        self.n_ref += float((r * r).sum())
        self.err2 += float(((g - r) ** 2).sum())
        if r.ndim == 2 and r.shape[1] > 1:
            self.top1_same += int((g.argmax(1) == r.argmax(1)).sum())
            self.top1_total += r.shape[0]

    @property
    def cosine(self) -> float | None:
        den = math.sqrt(self.n_got * self.n_ref)
        return self.dot / den if den > 0 else None

    @property
    def snr_db(self) -> float | None:
        if self.n_ref == 0:
            return None
        return math.inf if self.err2 == 0 else 10 * math.log10(self.n_ref / self.err2)

    def fidelity(self) -> dict[str, Any]:
        return {"max_abs_diff": self.max_abs, "max_rel_diff": self.max_rel,
                "mean_abs_diff": self.sum_abs / max(self.count, 1), "nonfinite": self.nonfinite}

    def quality(self) -> dict[str, Any]:
        out = {"cosine": self.cosine, "snr_db": self.snr_db, "max_abs_error": self.max_abs,
               "mean_abs_error": self.sum_abs / max(self.count, 1)}
        if self.top1_total:
            out["top1_agreement"] = self.top1_same / self.top1_total
        return out


def _flat_outputs(out) -> list[torch.Tensor]:
    if isinstance(out, dict):
        return [v for v in out.values() if isinstance(v, torch.Tensor)]
    if isinstance(out, (tuple, list)):
        return [v for v in out if isinstance(v, torch.Tensor)]
    return [out]


# ------------------------------------------------------------------------------------------- structure


def _expected_scale(q) -> tuple[np.ndarray, np.ndarray | None]:
    d = q.desc
    a = q.amax.detach().cpu().to(torch.float32)
    if d.asymmetric:
        from quantcli.tensor_quant import affine_qparams

        s, zp = affine_qparams(q.amin if q.amin is not None else torch.zeros(()), a, d.num_bits)
        return s.reshape(-1).numpy(), zp.reshape(-1).numpy()
    bound = ar.FP8_E4M3_MAX if d.is_fp8 else ar.symmetric_bound(d.num_bits, d.unsigned)
    s = ar.symmetric_scale(a, bound)
    return s.reshape(-1).numpy(), None


def check_structure(model: onnx.ModelProto, ckpt: Calibrated) -> dict[str, Any]:
    problems: list[str] = []
    graph_inputs = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    if graph_inputs != ckpt.input_names:
        raise VerifyError(f"the ONNX inputs {graph_inputs} do not match the checkpoint's inputs {ckpt.input_names}; "
                          "export this checkpoint with `quantcli export` or pass the matching --reference")
    pairs = {p.quantizer: p for p in qdq_pairs(model) if p.quantizer}
    qs = {n: q for n, q in quantizers(ckpt.model).items() if q.enabled}
    inits = {t.name: t for t in model.graph.initializer}
    weights = dict(ckpt.model.named_parameters())
    layer_problems: dict[str, list[str]] = {}
    dynamic = _check_dynamic_layers(model, ckpt, qs, layer_problems)
    for name, q in qs.items():
        if name in dynamic:
            continue
        p = pairs.get(name)
        if p is None:
            layer_problems.setdefault(name, []).append("Q/DQ pair missing from the graph")
            continue
        want, want_zp = _expected_scale(q)
        got = p.scale.reshape(-1).astype(np.float32)
        if got.shape != want.shape or not np.array_equal(got, want):
            idx = int(np.argmax(got != want)) if got.shape == want.shape else 0
            layer_problems.setdefault(name, []).append(
                f"scale differs from amax/bound (e.g. index {idx}: {got.flat[idx] if got.size else 'none'} vs {want.flat[idx]:.9g})")
        if want_zp is not None and not np.array_equal(p.zero_point.reshape(-1).astype(np.float32), want_zp.astype(np.float32)):
            layer_problems.setdefault(name, []).append("zero point differs from the calibrated range")
        if name.endswith("weight_quantizer") and p.stored == "initializer" and p.tensor in inits:
            module = name.rsplit(".", 1)[0]
            w = weights.get(f"{module}.weight" if module else "weight")
            if w is not None:
                with torch.no_grad():
                    want_w = q(w.detach()).cpu().numpy()
                scale = p.scale.astype(np.float32)
                codes = to_numpy(inits[p.tensor]).astype(np.float32)
                deq = _dequantize(codes, scale, p.zero_point.astype(np.float32), p.axis, p.block_size)
                bad = int((deq != want_w).sum())
                if bad:
                    layer_problems.setdefault(name, []).append(f"{bad} stored weight code(s) differ from the checkpoint's weights")
    extra = sorted((set(pairs) | dynamic) - set(qs))
    for name, probs in layer_problems.items():
        problems += [f"{name}: {x}" for x in probs]
    return {"passed": not problems, "problems": problems, "layers_with_problems": sorted(layer_problems),
            "quantizers_expected": len(qs), "quantizers_found": len((set(pairs) | dynamic) & set(qs)),
            "unmapped_pairs": sum(1 for p in qdq_pairs(model) if not p.quantizer), "unexpected_quantizers": extra}


def _check_dynamic_layers(model: onnx.ModelProto, ckpt: Calibrated, qs: dict, problems: dict[str, list[str]]) -> set[str]:
    """Structure of the ``DynamicQuantizeLinear -> MatMulInteger`` layers (:mod:`exporters.dynamic_linear`).

    The input quantizer has no scale to compare (it is computed at run time; ``fidelity.codes`` checks it);
    the weight's float32 scale must be ``amax / bound`` exactly, its zero point 0 and its stored codes the
    checkpoint's. Returns the quantizer names found in such layers."""
    found: set[str] = set()
    inits = {t.name: t for t in model.graph.initializer}
    weights = dict(ckpt.model.named_parameters())
    for layer in dynamic_layers(model):
        for name in (layer.input_quantizer, layer.weight_quantizer):
            if name is not None:
                found.add(name)
        wname = layer.weight_quantizer
        if wname not in qs:
            continue
        q = qs[wname]
        want, _ = _expected_scale(q)
        got = layer.weight_scale
        if got is None or got.reshape(-1).shape != want.shape or not np.array_equal(got.reshape(-1), want):
            problems.setdefault(wname, []).append("weight scale (in the Mul after MatMulInteger) differs from amax/bound")
            continue
        if layer.weight_zero_point is not None and np.any(layer.weight_zero_point != 0):
            problems.setdefault(wname, []).append("weight zero point is not 0")
        module = wname.rsplit(".", 1)[0]
        w = weights.get(f"{module}.weight")
        if layer.weight in inits and w is not None:
            with torch.no_grad():
                want_w = q(w.detach()).cpu().numpy()
            codes = to_numpy(inits[layer.weight]).astype(np.float32)  # (K, N)
            deq = (codes * want.reshape(1, -1) if want.size > 1 else codes * want.reshape(())).T
            bad = int((deq.astype(np.float32) != want_w).sum()) if deq.shape == want_w.shape else want_w.size
            if bad:
                problems.setdefault(wname, []).append(f"{bad} stored weight code(s) differ from the checkpoint's weights")
    return found


def _dequantize(codes, scale, zp, axis, block) -> np.ndarray:
    """ONNX DequantizeLinear of stored codes, with the parameters in ONNX layout."""
    shape = tuple(codes.shape)
    s = broadcast_onnx_param(torch.from_numpy(np.asarray(scale, np.float32)), shape, axis, block)
    z = broadcast_onnx_param(torch.from_numpy(np.asarray(zp, np.float32)), shape, axis, block)
    return ar.dequantize_linear(torch.from_numpy(np.asarray(codes, np.float32)), s, z).numpy()


# ------------------------------------------------------------------------------------------- main entry


def default_max_abs_diff(ref_abs_max: float) -> float:
    """Output tolerance for fidelity: 2% of the largest |output| (at least 1e-5).

    Every quantizer's arithmetic is checked exactly (``fidelity.codes``: identical codes for identical
    inputs). What remains between onnxruntime and PyTorch is float accumulation order (a few ulps), which
    now and then moves a value across a rounding boundary and flips one code downstream; one flip moves an
    output by about a quantization step. A wrong scale, a damaged weight or a missing pair moves it by far
    more, and the structure check names the layer exactly.
    """
    return max(2e-2 * ref_abs_max, 1e-5)


def verify_onnx(
    onnx_path: str | Path,
    calibrated: Calibrated | str | Path,
    batches: list[Batch] | None = None,
    *,
    provider: str = "auto",
    max_abs_diff: float | None = None,
    min_cosine: float | None = None,
    min_snr: float | None = None,
    per_layer: bool = False,
    deployment: bool = True,
) -> VerifyReport:
    """Run every check; returns the report (``report.passed``). Bad input raises VerifyError."""
    t0 = time.perf_counter()
    model = read_onnx(onnx_path)
    ckpt = calibrated if isinstance(calibrated, Calibrated) else load_calibrated(calibrated)
    prov = choose_provider(provider)
    if batches is None:
        batches = ckpt.evaluation_batches() or [ckpt.example]
    if not batches:
        raise VerifyError("no verification data")
    structure = check_structure(model, ckpt)

    qmodel = ckpt.model
    fmodel = ckpt.float_model()
    provider_note = None
    try:
        sess = _session(model, prov, optimize=False)
    except VerifyError as e:
        if provider != "auto" or prov == "CPUExecutionProvider":
            raise
        # onnxruntime-gpu lists CUDA but its libraries are missing or broken: auto means "CPU then"
        provider_note = f"CUDAExecutionProvider failed ({e}); ran on CPUExecutionProvider"
        prov = "CPUExecutionProvider"
        sess = _session(model, prov, optimize=False)
    out_names = [o.name for o in sess.get_outputs()]
    dsess, deployment_error = None, None
    if deployment:
        try:
            dsess = _session(model, prov, optimize=True)
        except VerifyError as e:  # e.g. the CPU provider fuses FP8 Q/DQ into QGemm, which has no fp8 kernel
            deployment_error = str(e)
    fid = {n: _Stats() for n in out_names}
    qual = {n: _Stats() for n in out_names}
    dep = {n: _Stats() for n in out_names}
    ref_abs_max = 0.0
    for i, batch in enumerate(batches):
        where = f"batch {i} ({describe(batch)})"
        feeds = _feeds(sess, batch, where)
        got = _run(sess, feeds, where)
        with torch.inference_mode():
            ref = [t.detach().cpu().numpy() for t in _flat_outputs(run_model(qmodel, batch, where))]
            flt = [t.detach().cpu().numpy() for t in _flat_outputs(run_model(fmodel, batch, where))]
        if len(ref) != len(got):
            raise VerifyError(f"the graph has {len(got)} outputs, the model {len(ref)}")
        for n, g, r, f in zip(out_names, got, ref, flt):
            fid[n].add(g, r)
            qual[n].add(g, f)
            ref_abs_max = max(ref_abs_max, float(np.abs(r).max(initial=0)))
        if dsess is not None:
            try:
                for n, g, r in zip(out_names, _run(dsess, feeds, where), ref):
                    dep[n].add(g, r)
            except VerifyError as e:
                dsess, deployment_error = None, str(e)

    report = VerifyReport(str(onnx_path), ckpt.path, prov, len(batches), num_samples(batches), structure=structure,
                          provider_note=provider_note)
    report.fidelity = {"outputs": {n: s.fidelity() for n, s in fid.items()}}
    report.quality = {"outputs": {n: s.quality() for n, s in qual.items()}}
    if deployment:
        report.deployment = {"graph_optimization": "ORT_ENABLE_ALL", "error": deployment_error,
                             "outputs": {} if deployment_error else {n: s.fidelity() for n, s in dep.items()}}

    tol = default_max_abs_diff(ref_abs_max) if max_abs_diff is None else max_abs_diff
    worst = max(s.max_abs for s in fid.values())
    nonfinite = sum(s.nonfinite for s in fid.values())
    report.checks.append(Check("fidelity.max_abs_diff", tol, worst, worst <= tol and nonfinite == 0, "max"))
    if min_cosine is not None:
        values = [s.cosine for s in qual.values()]
        if any(v is None for v in values):
            raise VerifyError("--min-cosine cannot be evaluated: an output is all zeros (cosine is undefined)")
        v = min(values)
        report.checks.append(Check("quality.min_cosine", min_cosine, v, v >= min_cosine, "min"))
    if min_snr is not None:
        values = [s.snr_db for s in qual.values()]
        if any(v is None for v in values):
            raise VerifyError("--min-snr cannot be evaluated: a float reference output is all zeros")
        v = min(values)
        report.checks.append(Check("quality.min_snr_db", min_snr, v, v >= min_snr, "min"))

    # identical integer codes per quantizer are part of fidelity; --per-layer adds the ranked local errors
    layers = _layer_report(model, ckpt, batches, prov)
    report.fidelity["quantizers"] = {
        r["quantizer"]: {"identical_codes": r["identical_codes"], "identical_codes_end_to_end": r["identical_codes_end_to_end"]}
        for r in layers
    }
    fractions = [r["identical_codes"] for r in layers if r["identical_codes"] is not None]
    worst_codes = min(fractions, default=1.0)
    report.checks.insert(1, Check("fidelity.codes", 1.0, worst_codes, worst_codes == 1.0, "min"))
    if per_layer:
        report.layers = layers
    report.seconds = time.perf_counter() - t0
    return report


def _layer_report(model: onnx.ModelProto, ckpt: Calibrated, batches: list[Batch], provider: str) -> list[dict[str, Any]]:
    """Per quantizer: identical-code fraction (ORT vs PyTorch) and local error (DQ output vs its own input)."""
    from exporters.ort_placement import strip_propagated

    model = strip_propagated(model)  # a Q moved in front of MaxPool/Flatten would otherwise read quantized values
    pairs = [p for p in qdq_pairs(model) if p.quantizer]
    inits = {t.name for t in model.graph.initializer}
    qs = quantizers(ckpt.model)
    rows: dict[str, dict[str, Any]] = {}
    # weights stored in the file: compare to the checkpoint's float weights directly
    params = dict(ckpt.model.named_parameters())
    for p in pairs:
        if p.stored == "initializer" or p.tensor in inits:
            module = p.quantizer.rsplit(".", 1)[0]
            w = params.get(f"{module}.weight")
            if w is None:
                continue
            with torch.no_grad():
                fq = qs[p.quantizer](w.detach()).numpy()
            loc = _Stats()
            loc.add(fq, w.detach().numpy())
            stored = _stored_weight(model, p)
            same = float((stored == fq).mean()) if stored is not None and stored.shape == fq.shape else None
            rows[p.quantizer] = {"quantizer": p.quantizer, "module": module, "kind": "weight",
                                 "snr_db": loc.snr_db, "max_abs_error": loc.max_abs, "identical_codes": same,
                                 "identical_codes_end_to_end": same}
    act = [p for p in pairs if p.stored == "runtime" and p.tensor not in inits]
    for start in range(0, len(act), LAYER_CHUNK):
        chunk = act[start : start + LAYER_CHUNK]
        m = onnx.ModelProto()
        m.CopyFrom(model)
        existing = {o.name for o in m.graph.output}
        names = []
        for p in chunk:
            for t in (p.output, p.tensor):
                if t not in existing:
                    m.graph.output.append(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None))
                    existing.add(t)
                names.append(t)
        sess = _session(m, provider, optimize=False)
        captured: dict[str, list[np.ndarray]] = {}
        hooks = [qs[p.quantizer].register_forward_hook(_capture(captured, p.quantizer)) for p in chunk]
        local = {p.quantizer: _Stats() for p in chunk}
        codes = {p.quantizer: _Stats() for p in chunk}  # same input: PyTorch quantizer on ORT's Q input
        e2e = {p.quantizer: _Stats() for p in chunk}  # end to end: PyTorch model vs ORT
        try:
            for i, batch in enumerate(batches):
                captured.clear()
                with torch.inference_mode():
                    run_model(ckpt.model, batch, f"batch {i}")
                outs = dict(zip(names, _run(sess, _feeds(sess, batch, f"batch {i}"), f"batch {i}", names)))
                for p in chunk:
                    dq, x = outs[p.output], outs[p.tensor]
                    local[p.quantizer].add(dq, x)
                    with torch.inference_mode():
                        codes[p.quantizer].add(dq, qs[p.quantizer](torch.from_numpy(np.ascontiguousarray(x))).numpy())
                    for t in captured.get(p.quantizer, [])[:1]:
                        if t.shape == dq.shape:
                            e2e[p.quantizer].add(dq, t)
        finally:
            for h in hooks:
                h.remove()
        for p in chunk:
            c, e = codes[p.quantizer], e2e[p.quantizer]
            rows[p.quantizer] = {"quantizer": p.quantizer, "module": p.quantizer.rsplit(".", 1)[0], "kind": "activation",
                                 "snr_db": local[p.quantizer].snr_db, "max_abs_error": local[p.quantizer].max_abs,
                                 "identical_codes": c.identical / c.count if c.count else None,
                                 "identical_codes_end_to_end": e.identical / e.count if e.count else None}
    rows.update(_dynamic_rows(model, ckpt, batches, provider))
    ranked = sorted(rows.values(), key=lambda r: (r["snr_db"] if r["snr_db"] is not None else math.inf))
    for rank, r in enumerate(ranked, start=1):
        r["rank"] = rank
    return ranked


def _dynamic_rows(model: onnx.ModelProto, ckpt: Calibrated, batches: list[Batch], provider: str) -> dict[str, dict]:
    """Rows of the dynamic layers (:mod:`exporters.dynamic_linear`).

    Activation: onnxruntime's ``DynamicQuantizeLinear`` input, codes, scale and zero point are read from the
    graph; the PyTorch quantizer's arithmetic on the same input must give the same scale, zero point and codes
    (``identical_codes``: the fraction of codes equal, 0 for a batch whose scale or zero point differs).
    Weight: the stored int8 codes against the checkpoint's fake-quantized weights."""
    qs = quantizers(ckpt.model)
    inits = {t.name: t for t in model.graph.initializer}
    params = dict(ckpt.model.named_parameters())
    layers = [d for d in dynamic_layers(model) if d.input_quantizer in qs]
    rows: dict[str, dict] = {}
    for d in layers:
        wq = qs.get(d.weight_quantizer) if d.weight_quantizer else None
        w = params.get(f"{d.weight_quantizer.rsplit('.', 1)[0]}.weight") if d.weight_quantizer else None
        if wq is None or w is None or d.weight not in inits or d.weight_scale is None:
            continue
        with torch.no_grad():
            fq = wq(w.detach()).numpy()
        loc = _Stats()
        loc.add(fq, w.detach().numpy())
        codes = to_numpy(inits[d.weight]).astype(np.float32)
        stored = (codes * d.weight_scale.reshape(1, -1) if d.weight_scale.size > 1 else codes * d.weight_scale).T
        same = float((stored.astype(np.float32) == fq).mean()) if stored.shape == fq.shape else None
        rows[d.weight_quantizer] = {"quantizer": d.weight_quantizer, "module": d.weight_quantizer.rsplit(".", 1)[0],
                                    "kind": "weight", "snr_db": loc.snr_db, "max_abs_error": loc.max_abs,
                                    "identical_codes": same, "identical_codes_end_to_end": same}
    u8, f32 = onnx.TensorProto.UINT8, onnx.TensorProto.FLOAT
    for start in range(0, len(layers), LAYER_CHUNK // 4):
        chunk = layers[start : start + LAYER_CHUNK // 4]
        m = onnx.ModelProto()
        m.CopyFrom(model)
        existing = {o.name for o in m.graph.output}
        for d in chunk:
            for t, elem in ((d.input, f32), (d.codes, u8), (d.scale, f32), (d.zero_point, u8)):
                if t not in existing:
                    m.graph.output.append(onnx.helper.make_tensor_value_info(t, elem, None))
                    existing.add(t)
        names = [t for d in chunk for t in (d.input, d.codes, d.scale, d.zero_point)]
        sess = _session(m, provider, optimize=False)
        captured: dict[str, list[np.ndarray]] = {}
        hooks = [qs[d.input_quantizer].register_forward_hook(_capture(captured, d.input_quantizer)) for d in chunk]
        local = {d.input_quantizer: _Stats() for d in chunk}
        e2e = {d.input_quantizer: _Stats() for d in chunk}
        same = {d.input_quantizer: [0, 0] for d in chunk}
        try:
            for i, batch in enumerate(batches):
                captured.clear()
                with torch.inference_mode():
                    run_model(ckpt.model, batch, f"batch {i}")
                outs = dict(zip(names, _run(sess, _feeds(sess, batch, f"batch {i}"), f"batch {i}", names)))
                for d in chunk:
                    x = np.ascontiguousarray(outs[d.input])
                    codes, scale, zp = outs[d.codes], outs[d.scale], outs[d.zero_point]
                    ps, pz = ar.dynamic_qparams(torch.from_numpy(x))
                    mine = ar.quantize_linear(torch.from_numpy(x), ps, pz, 0, ar.DYNAMIC_QMAX).numpy()
                    equal = float(ps) == float(scale) and float(pz) == float(zp)
                    same[d.input_quantizer][0] += int((mine == codes).sum()) if equal else 0
                    same[d.input_quantizer][1] += codes.size
                    deq = ((codes.astype(np.float32) - np.float32(zp)) * np.float32(scale)).astype(np.float32)
                    local[d.input_quantizer].add(deq, x)
                    for t in captured.get(d.input_quantizer, [])[:1]:
                        if t.shape == deq.shape:
                            e2e[d.input_quantizer].add(deq, t)
        finally:
            for h in hooks:
                h.remove()
        for d in chunk:
            n = d.input_quantizer
            e = e2e[n]
            rows[n] = {"quantizer": n, "module": n.rsplit(".", 1)[0], "kind": "activation (dynamic)",
                       "snr_db": local[n].snr_db, "max_abs_error": local[n].max_abs,
                       "identical_codes": same[n][0] / same[n][1] if same[n][1] else None,
                       "identical_codes_end_to_end": e.identical / e.count if e.count else None}
    return rows


def _stored_weight(model: onnx.ModelProto, p) -> np.ndarray | None:
    """The dequantized weight as the graph holds it (stored codes, or the Q input initializer)."""
    inits = {t.name: t for t in model.graph.initializer}
    if p.tensor not in inits:
        return None
    values = to_numpy(inits[p.tensor]).astype(np.float32)
    if p.stored == "runtime":  # float weight + Q/DQ in the graph: quantize it as QuantizeLinear would
        from exporters.fold import quantize_codes
        from exporters.formats import BY_NAME

        values = quantize_codes(values, p.scale, p.zero_point, BY_NAME[p.format].elem_type, p.axis, p.block_size)
    return _dequantize(values, p.scale.astype(np.float32), p.zero_point.astype(np.float32), p.axis, p.block_size)


def _capture(store: dict[str, list[np.ndarray]], name: str):
    def hook(_module, _inputs, output):
        store.setdefault(name, []).append(output.detach().cpu().numpy())

    return hook


def expected_scales(ckpt: Calibrated) -> dict[str, np.ndarray]:
    """Scale each enabled quantizer implies (for tests and tools)."""
    out = {}
    for name, q in quantizers(ckpt.model).items():
        if q.enabled and q.amax is not None and not q.dynamic_uint8:
            out[name] = _expected_scale(q)[0]
    return out


__all__ = ["verify_onnx", "VerifyReport", "Check", "choose_provider", "default_max_abs_diff", "expected_scales"]
