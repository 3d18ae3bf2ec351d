"""FP8 graphs in onnxruntime: what the guards of :mod:`exporters.onnxruntime.compat` cost against the other
ways to load the same graph correctly.

    python -m benchmarks.bench_ort_fp8

Per sample model (fp8 preset, max calibration): latency over four held-out batches, 1 thread, best of
interleaved runs in one process, as a ratio to the guarded graph with default options: the unguarded graph
with ``session_needs``' ``disabled_optimizers``, the unguarded graph at ``ORT_ENABLE_BASIC``, the guarded
graph with optimizations off; and each one's largest output difference from the optimizations-off graph (0:
bit-identical).
"""

from __future__ import annotations

import argparse
import functools
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from benchmarks.common import best_interleaved, machine, run_all, setup_threads, table
from exporters import export_onnx
from exporters.onnxruntime.compat import session_needs, unguard_fp8
from quantcli import calibrate, quantize_model
from sample_models import SAMPLES


def _session(model: onnx.ModelProto, level=None, kwargs=None):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    if level is not None:
        so.graph_optimization_level = level
    return ort.InferenceSession(
        model.SerializeToString(), so, providers=["CPUExecutionProvider"], **(kwargs or {})
    )


def measure(name: str, workdir: Path, repeat: int) -> dict:
    sample = SAMPLES[name]
    model = quantize_model(sample.build().eval(), "fp8")
    calibrate(model, sample.calibration_batches(), "max", device="cpu")
    path = workdir / f"{name}.onnx"
    export_onnx(model, sample.evaluation_batches()[0], path)
    guarded = onnx.load(str(path))
    raw = onnx.load(str(path))
    guards = unguard_fp8(raw)
    sessions = {
        "guarded, default options": _session(guarded),
        "unguarded, disabled_optimizers": _session(raw, kwargs=session_needs(raw).session_kwargs()),
        "unguarded, ORT_ENABLE_BASIC": _session(raw, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC),
        "guarded, optimizations off": _session(guarded, ort.GraphOptimizationLevel.ORT_DISABLE_ALL),
    }
    feeds = [{k: v.numpy() for k, v in b.items()} for b in sample.evaluation_batches()[:4]]
    ref = sessions["guarded, optimizations off"]
    diff = {
        label: max(float(np.abs(s.run(None, f)[0] - ref.run(None, f)[0]).max()) for f in feeds)
        for label, s in sessions.items()
    }
    best = best_interleaved(
        {label: functools.partial(run_all, s, feeds) for label, s in sessions.items()}, repeat
    )
    ref_t = best["guarded, default options"]
    row = {"model": name, "guards": str(guards), "guarded default ms": f"{ref_t * 1e3:.1f}"}
    row["guarded default max|diff|"] = f"{diff['guarded, default options']:.2g}"
    row.update(
        {
            label: f"{t / ref_t:.2f}x, max|diff| {diff[label]:.2g}"
            for label, t in best.items()
            if label not in ("guarded, default options", "guarded, optimizations off")
        }
    )
    row["optimizations off"] = f"{best['guarded, optimizations off'] / ref_t:.2f}x"
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=15)
    a = p.parse_args(argv)
    setup_threads(1)
    print(f"fp8 in onnxruntime {ort.__version__}: {machine()}")
    with tempfile.TemporaryDirectory() as d:
        rows = [measure(name, Path(d), a.repeat) for name in ("digits_cnn", "text_encoder")]
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
