"""Latency-aware placement (``calibrate --placement auto``) against ``--placement all`` and fp32, in
onnxruntime.

    python -m benchmarks.bench_placement [--models digits_cnn,text_encoder] [--rounds 30]

Per sample model, in one process: calibrate (``int8`` preset, max) through the ``calibrate`` job, once with
``--placement auto`` (the real profiler timing on this machine) and once with ``all``; export both and the
fp32 model (every quantizer off); load each as a user would (``InferenceSession(path)``, default options) and
time one held-out batch, best of ``--rounds`` runs with the graphs interleaved run by run. Printed: the layers
auto kept float, and each graph's latency with its ratio to fp32. The CPU's flags decide the integer kernels:
printed too.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import onnxruntime as ort

from benchmarks.bench_reduce_range import cpu_flags
from benchmarks.common import best_interleaved, machine, table
from exporters import export_onnx
from quantcli.calibration.job import CalibrationJob, CalibrationRequest
from quantcli.nn.modes import keep_float
from quantcli.nn.tensor_quantizer import quantizers


def _calibrated(model: str, placement: str, out: Path):
    job = CalibrationJob.load(CalibrationRequest(model, out=out, placement=placement), None)
    summary = job.calibrate()
    job.place_for_latency(summary)
    return job


def measure(name: str, folder: Path, rounds: int) -> dict:
    from sample_models import SAMPLES

    auto = _calibrated(name, "auto", folder / f"{name}-auto.calib.pt")
    every = _calibrated(name, "all", folder / f"{name}-all.calib.pt")
    example = {k: v[:8] for k, v in auto.batches[0].items()}
    fp32 = copy.deepcopy(every.model)
    for q in quantizers(fp32).values():
        keep_float(q)
    paths = {}
    for label, model in (
        ("fp32", fp32),
        ("int8 --placement all", every.model),
        ("int8 --placement auto", auto.model),
    ):
        paths[label] = folder / f"{name}-{label.split()[-1]}.onnx"
        export_onnx(model, example, paths[label])
    batch = SAMPLES[name].evaluation_batches()[0]
    sessions = {k: ort.InferenceSession(str(p)) for k, p in paths.items()}
    feeds = {k: {i.name: batch[i.name].numpy() for i in s.get_inputs()} for k, s in sessions.items()}
    best = best_interleaved(
        {k: (lambda s=s, f=feeds[k]: s.run(None, f)) for k, s in sessions.items()}, rounds, warmup=2
    )
    kept = auto.latency.kept_float
    row = {
        "model": name,
        "batch": len(next(iter(batch.values()))),
        "auto kept float": f"{len(kept)} of {len(auto.latency.layers)}"
        + (f" ({', '.join(kept)})" if kept else ""),
    }
    for k, t in best.items():
        row[f"{k} ms"] = f"{t * 1e3:.2f} ({t / best['fp32']:.2f}x)"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="digits_cnn,text_encoder")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    print(machine())
    print(f"CPU flags: {cpu_flags()}; onnxruntime {ort.__version__}, default session options")
    with tempfile.TemporaryDirectory() as d:
        rows = [measure(m, Path(d), args.rounds) for m in args.models.split(",")]
    print(table(rows))


if __name__ == "__main__":
    main()
