"""verify's cost against what it checks: time against one onnxruntime pass plus one float-model pass over the
same data, and peak memory over 64 vs 1024 samples.

    python -m benchmarks.bench_verify [--samples 64 256] [--repeat 3] [--models text_encoder deep_encoder]

Time, in one process, interleaved, best of ``--repeat``: ``verify_onnx(path, checkpoint, batches)``
(checkpoint loaded, batches in memory: "after start-up") against the reference a user would run anyway: create
``onnxruntime.InferenceSession(path)`` with default options and run it over the batches, then run the float
PyTorch model over them (inference_mode). Target: verify <= 3x the reference.

Memory, in fresh processes: peak RSS (VmHWM) of loading the checkpoint and running verify over 64 inputs and
over the same 64 repeated 16 times (1024 samples; same batch shapes, since onnxruntime's and torch's
allocators keep the largest batch's buffers, which says nothing about growth). Target: 1024 / 64 <= 1.10x.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import PEAK_RSS_SNIPPET, machine, peak_rss_from, setup_threads, table

TIME_TARGET = 3.0
MEMORY_TARGET = 1.10
SPECS = {"text_encoder": "text_encoder", "deep_encoder": "sample_models.structured:deep_encoder"}


def batches_for(model: str, split: str, n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` samples of ``model``'s ``split`` (repeated when the split is smaller), in its own batches."""
    if model == "deep_encoder":
        from sample_models import structured

        base = structured.deep_encoder_batches(split)
    else:
        from sample_models import text_encoder

        base = text_encoder.calibration_batches() if split == "calib" else text_encoder.evaluation_batches()
    out, have, i = [], 0, 0
    while have < n:
        b = base[i % len(base)]
        take = min(n - have, next(iter(b.values())).shape[0])
        out.append({k: v[:take] for k, v in b.items()})
        have, i = have + take, i + 1
    return out


def prepare(model: str, root: Path) -> tuple[Path, Path]:
    """Calibrate (int8, max, 256 samples) and export; returns (checkpoint, onnx)."""
    from exporters import export_onnx
    from quantcli.calibration.calibrate import calibrate
    from quantcli.inputs.checkpoint import save_calibrated
    from quantcli.inputs.loading import load_model
    from quantcli.nn import quantize_model

    m, spec = load_model(SPECS[model])
    quantize_model(m)
    calib = batches_for(model, "calib", 256)
    calibrate(m, calib, "max", device="cpu")
    ck, path = root / f"{model}.calib.pt", root / f"{model}.onnx"
    save_calibrated(ck, m, spec, calib[0])
    export_onnx(m, calib[0], path)
    return ck, path


def reference_pass(path: Path, fmodel, batches) -> tuple[float, float]:
    """(seconds of InferenceSession(path) + its run over the batches, seconds of the float model's pass)."""
    import onnxruntime as ort

    t = time.perf_counter()
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    for b in batches:
        sess.run(None, {k: v.numpy() for k, v in b.items()})
    t_ort = time.perf_counter() - t
    t = time.perf_counter()
    with torch.inference_mode():
        for b in batches:
            fmodel(**b)
    return t_ort, time.perf_counter() - t


def time_row(model: str, ck: Path, path: Path, samples: int, repeat: int) -> dict:
    from quantcli.inputs.checkpoint import load_calibrated
    from quantcli.verify import verify_onnx

    ckpt = load_calibrated(ck)
    fmodel = ckpt.float_model()
    batches = batches_for(model, "eval", samples)
    best_v, best_o, best_f = float("inf"), float("inf"), float("inf")
    verdict = None
    for _ in range(repeat):  # interleaved: the machine's load drifts alike for both sides
        t = time.perf_counter()
        rep = verify_onnx(path, ckpt, batches)
        best_v = min(best_v, time.perf_counter() - t)
        verdict = "pass" if rep.passed else "FAIL"
        t_ort, t_float = reference_pass(path, fmodel, batches)
        if t_ort + t_float < best_o + best_f:
            best_o, best_f = t_ort, t_float
    ratio = best_v / (best_o + best_f)
    return {
        "model": model,
        "samples": samples,
        "verify s": f"{best_v:.2f}",
        "onnxruntime s": f"{best_o:.2f}",
        "float s": f"{best_f:.2f}",
        "ratio": f"{ratio:.2f}x",
        "verdict": verdict,
        "target <= 3x": "MET" if ratio <= TIME_TARGET else "MISSED",
    }


_MEMORY = """
import torch
torch.set_num_threads(1)
from benchmarks.bench_verify import batches_for
from quantcli.inputs.checkpoint import load_calibrated
from quantcli.verify import verify_onnx
ck = load_calibrated({ck!r})
# the same 64 inputs (the same batch shapes) repeated: what grows, grows with the number of samples
rep = verify_onnx({path!r}, ck, batches_for({model!r}, "eval", 64) * ({n} // 64))
print("PASSED", rep.passed, rep.num_samples)
"""


def memory_row(model: str, ck: Path, path: Path) -> dict:
    peaks = {}
    for n in (64, 1024):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                _MEMORY.format(ck=str(ck), path=str(path), model=model, n=n) + PEAK_RSS_SNIPPET,
            ],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        assert f"PASSED True {n}" in out.stdout, out.stdout + out.stderr
        peaks[n] = peak_rss_from(out.stdout)
    ratio = peaks[1024] / peaks[64]
    return {
        "model": model,
        "64 samples MiB": f"{peaks[64]:.0f}",
        "1024 samples MiB": f"{peaks[1024]:.0f}",
        "ratio": f"{ratio:.3f}x",
        "target <= 1.10x": "MET" if ratio <= MEMORY_TARGET else "MISSED",
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--samples", type=int, nargs="+", default=[64, 256], help="sample counts for the time comparison"
    )
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--models", nargs="+", default=list(SPECS), choices=list(SPECS))
    p.add_argument("--no-memory", action="store_true", help="skip the fresh-process memory rows")
    a = p.parse_args(argv)
    setup_threads(1)
    from quantcli.verify import REPLAY_SAMPLES

    print(f"verify: time and memory ({machine()}; load average {os.getloadavg()[0]:.1f} at start)")
    print(f"per-quantizer evidence on a fixed sample of {REPLAY_SAMPLES} inputs")
    times, mems = [], []
    with tempfile.TemporaryDirectory() as d:
        for model in a.models:
            ck, path = prepare(model, Path(d))
            times += [time_row(model, ck, path, n, a.repeat) for n in a.samples]
            if not a.no_memory:
                mems.append(memory_row(model, ck, path))
    print(table(times, list(times[0])))
    if mems:
        print()
        print(table(mems, list(mems[0])))
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
