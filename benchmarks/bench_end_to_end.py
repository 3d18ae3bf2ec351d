"""End to end: quantcli vs onnxruntime's ``quantize_static`` (a peer), whether calibration memory stays flat
as samples grow (with a leaky calibrator as a control that must fail the check), export time and verify
throughput.

    python -m benchmarks.bench_end_to_end [--quick] [--models digits_cnn,text_encoder,resnet_cnn] \\
        [--samples 512,2048]

Like with like against the peer: the same samples (one ``.npz`` per model and sample count, cut into batches
of 32 on both sides), the nearest settings (QDQ, int8 weights per channel, symmetric int8 activations per
tensor; max vs MinMax, entropy vs Entropy, each tool's default bins), 1 thread. The peer quantizes a float
ONNX graph, which is exported from the same PyTorch model OUTSIDE every clock (its time is printed beside, for
reference).

- In one process (imports of both tools done, data in memory, interleaved, fastest of R): calibration alone
  (quantcli ``calibrate()`` on a model with quantizers inserted vs the peer's calibrator, its augmented graph
  and session built: run the batches, compute the ranges; building either is untimed), and the whole job
  (load the model, insert quantizers, ``calibrate()``, ``export_onnx`` vs the whole ``quantize_static``).
- As a user runs it (fresh processes, wall clock, fastest of 2): ``quantcli calibrate MODEL --data D.npz``
  then ``quantcli export``, vs a numpy-only script calling ``quantize_static`` (benchmarks/ort_peer.py: it
  needs neither torch nor quantcli). Memory: each side's peak RSS, and its growth over the state after its
  imports.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import (
    PEAK_RSS_SNIPPET,
    load_line,
    machine,
    peak_rss_from,
    setup_threads,
    table,
    verdict,
)

METHODS = (("max", "MinMax"), ("entropy", "Entropy"))
REPO = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------------------------ vs the peer, in-process


def _ours_calibrate(name: str, batches: list, method: str) -> tuple[float, torch.nn.Module]:
    """Seconds of ``calibrate()`` on a freshly quantized model, and the model."""
    from benchmarks.peer_data import build
    from quantcli.calibration.calibrate import calibrate
    from quantcli.nn import quantize_model

    m = quantize_model(build(name), "int8")  # built untimed: the peer's float graph is also ready beforehand
    t = time.perf_counter()
    calibrate(m, batches, method, device="cpu")
    return time.perf_counter() - t, m


@contextlib.contextmanager
def _quiet():
    """onnxruntime's calibrators print progress and log a pre-processing hint on every call."""
    level = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.getLogger().setLevel(level)


def in_process_rows(names, samples, repeat: int, workdir: Path) -> list[dict]:
    """Both tools imported, data in memory; each row's four measurements interleaved, fastest of
    ``repeat``."""
    from benchmarks import ort_peer
    from benchmarks.peer_data import arrays, build, export_fp32, torch_batches
    from exporters import export_onnx
    from quantcli.calibration.calibrate import calibrate
    from quantcli.nn import quantize_model

    rows = []
    for name in names:
        fp32 = str(workdir / f"{name}.fp32.onnx")
        t = time.perf_counter()
        export_fp32(build(name), arrays(name, 64), fp32)
        t_fp32 = time.perf_counter() - t
        for n in samples:
            data = arrays(name, n)
            batches = torch_batches(data)
            for ours, peer in METHODS:
                times = {"oc": [], "pc": [], "of": [], "pf": []}
                # a first, untimed round per model: first calls (exporter, sessions) cost extra once per
                # process
                for _ in range(repeat + (n == samples[0] and ours == "max")):
                    times["oc"].append(_ours_calibrate(name, batches, ours)[0])
                    with _quiet():
                        times["pc"].append(ort_peer.calibrate(fp32, data, peer)[1])
                    # the whole job, as quantize_static's: load, quantize, calibrate, write
                    t = time.perf_counter()
                    m = quantize_model(build(name), "int8")
                    calibrate(m, batches, ours, device="cpu")
                    export_onnx(m, {k: v[:8] for k, v in batches[0].items()}, workdir / "ours.onnx")
                    times["of"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    with _quiet():
                        ort_peer.quantize(fp32, data, str(workdir / "peer.onnx"), peer)
                    times["pf"].append(time.perf_counter() - t)
                b = {k: min(v[-repeat:]) for k, v in times.items()}
                rows.append(
                    {
                        "model": name,
                        "samples": n,
                        "method": f"{ours} / {peer}",
                        "calibrate: quantcli s": f"{b['oc']:.3f}",
                        "onnxruntime s": f"{b['pc']:.3f}",
                        "peer / quantcli": f"{b['pc'] / b['oc']:.2f}x",
                        "whole job: quantcli s": f"{b['of']:.3f}",
                        "onnxruntime s ": f"{b['pf']:.3f}",
                        "peer / quantcli ": f"{b['pf'] / b['of']:.2f}x",
                        "fp32 export s": f"{t_fp32:.2f}",
                    }
                )
    return rows


# ----------------------------------------------------------------------------- vs the peer, as a user runs it

_CLI = """
import atexit, re, sys
def _hwm():
    return int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) / 1024.0
atexit.register(lambda: print('PEAK_MIB', _hwm(), file=sys.stderr))
{preimport}
print('BASE_MIB', _hwm(), file=sys.stderr)
sys.argv = ['quantcli'] + {args!r}
from quantcli.cli import main
main()
"""
"""The installed CLI's own ``main`` in a fresh interpreter, reporting its peak RSS at exit. ``preimport``
(what the command imports anyway) is done first, so BASE_MIB is the state after imports, as the peer
reports."""


def _run(cmd: list[str]) -> tuple[float, float, float]:
    """(wall seconds, BASE_MIB, PEAK_MIB) of one fresh process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed: {p.stderr[-2000:]}")
    out = p.stdout + p.stderr
    return wall, load_line(out, "BASE_MIB"), load_line(out, "PEAK_MIB")


def _ours_cli(name: str, npz: Path, method: str, d: Path) -> tuple[float, float, float]:
    from benchmarks.peer_data import SPECS

    ck, onnx_out = d / "ours.calib.pt", d / "ours_cli.onnx"
    cal = _CLI.format(
        preimport="import torch, quantcli.calibration.calibrate, quantcli.inputs.data, "
        "quantcli.inputs.loading",
        args=[
            "calibrate",
            SPECS[name],
            "--data",
            str(npz),
            "--batch-size",
            "32",
            "--method",
            method,
            "--out",
            str(ck),
        ],
    )
    exp = _CLI.format(
        preimport="import torch, onnx, exporters, quantcli.inputs.checkpoint",
        args=["export", str(ck), "--onnx", str(onnx_out)],
    )
    w1, b1, p1 = _run([sys.executable, "-c", cal])
    w2, b2, p2 = _run([sys.executable, "-c", exp])
    return w1 + w2, b1, max(p1, p2), w1, w2


def _peer_cli(fp32: Path, npz: Path, method: str, d: Path) -> tuple[float, float, float]:
    return _run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "ort_peer.py"),
            str(fp32),
            str(npz),
            str(d / "peer_cli.onnx"),
            method,
        ]
    )


def user_rows(names, samples, repeat: int, workdir: Path) -> list[dict]:
    from benchmarks.peer_data import arrays, build, export_fp32

    rows = []
    for name in names:
        fp32 = workdir / f"{name}.fp32.onnx"
        if not fp32.exists():
            export_fp32(build(name), arrays(name, 64), str(fp32))
        for n in samples:
            npz = workdir / f"{name}-{n}.npz"
            np.savez(npz, **arrays(name, n))
            for ours, peer in METHODS:
                o, p = [], []
                for _ in range(repeat):  # interleaved
                    o.append(_ours_cli(name, npz, ours, workdir))
                    p.append(_peer_cli(fp32, npz, peer, workdir))
                wo, wp = min(r[0] for r in o), min(r[0] for r in p)
                bo, po = min(r[1] for r in o), max(r[2] for r in o)
                bp, pp = min(r[1] for r in p), max(r[2] for r in p)
                rows.append(
                    {
                        "model": name,
                        "samples": n,
                        "method": f"{ours} / {peer}",
                        "quantcli s (calibrate + export)": f"{wo:.2f} ({min(r[3] for r in o):.2f} + "
                        f"{min(r[4] for r in o):.2f})",
                        "onnxruntime s": f"{wp:.2f}",
                        "peer / quantcli": f"{wp / wo:.2f}x",
                        "quantcli peak MiB": f"{po:.0f} (+{po - bo:.0f})",
                        "onnxruntime peak MiB": f"{pp:.0f} (+{pp - bp:.0f})",
                    }
                )
    return rows


# ------------------------------------------------------------------------------------------ memory stays flat

_FLAT = """
import torch
torch.set_num_threads(1)
from quantcli.calibration.calibrate import calibrate
from quantcli.nn import quantize_model
from sample_models.structured import resnet_batches, resnet_cnn
pool = resnet_batches(256, 32)  # the same 8 batches in memory whatever the sample count: data cannot grow
flipped = [{{"x": b["x"].flip(-1)}} for b in pool]
def batches(n):  # a list (calibrate takes one) of references to those 16 batches
    return [(pool if (i // len(pool)) % 2 == 0 else flipped)[i % len(pool)] for i in range(n // 32)]
kept = []
if {leak}:  # the control: a calibrator that keeps every batch it sees, as a buggy one would
    from calibrators import HistogramCalibrator, MaxCalibrator
    for cls in (HistogramCalibrator, MaxCalibrator):
        def collect(self, x, _orig=cls.collect):
            kept.append(x.detach().clone())
            _orig(self, x)
        cls.collect = collect
m = quantize_model(resnet_cnn(), "int8")
calibrate(m, batches({n}), "{method}", device="cpu")
"""

FLAT_SAMPLES = (256, 2048)
FLAT_LIMIT = 1.10


def memory_rows() -> list[dict]:
    """Peak RSS of calibrating resnet_cnn on 256 vs 2048 samples, fresh process each. Keeping its activations
    would cost about 0.2 MiB a sample (the leaky control shows how much): 2048 samples' worth is visible."""
    rows = []
    for method, leak in (("max", False), ("entropy", False), ("entropy", True)):
        peaks = {}
        for n in FLAT_SAMPLES:
            out = subprocess.run(
                [sys.executable, "-c", _FLAT.format(n=n, method=method, leak=leak) + PEAK_RSS_SNIPPET],
                capture_output=True,
                text=True,
                check=True,
                cwd=REPO,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            ).stdout
            peaks[n] = peak_rss_from(out)
        ratio = peaks[FLAT_SAMPLES[1]] / peaks[FLAT_SAMPLES[0]]
        met = ratio <= FLAT_LIMIT
        rows.append(
            {
                "calibrator": f"{method}{' (leaky control)' if leak else ''}",
                f"{FLAT_SAMPLES[0]} samples MiB": f"{peaks[FLAT_SAMPLES[0]]:.0f}",
                f"{FLAT_SAMPLES[1]} samples MiB": f"{peaks[FLAT_SAMPLES[1]]:.0f}",
                "ratio": f"{ratio:.3f}x",
                "target": f"<= {FLAT_LIMIT:.2f}x",
                "result": verdict(met),
                "_met": met,
                "_leak": leak,
            }
        )
    return rows


# ------------------------------------------------------------------------------------------ export and verify


def export_verify_rows() -> list[dict]:
    from exporters import export_onnx
    from quantcli.calibration.calibrate import calibrate
    from quantcli.inputs.checkpoint import save_calibrated
    from quantcli.inputs.loading import load_model
    from quantcli.nn import quantize_model
    from quantcli.verify import verify_onnx
    from sample_models import SAMPLES

    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, sample in SAMPLES.items():
            m, spec = load_model(name)
            quantize_model(m)
            batches = sample.calibration_batches()
            calibrate(m, batches, "max", device="cpu")
            ck = Path(d) / f"{name}.calib.pt"
            save_calibrated(ck, m, spec, batches[0])
            for exporter in ("torchscript", "dynamo"):
                t = time.perf_counter()
                export_onnx(
                    m, {k: v[:8] for k, v in batches[0].items()}, Path(d) / f"{name}.onnx", exporter=exporter
                )
                t_export = time.perf_counter() - t
                t = time.perf_counter()
                rep = verify_onnx(Path(d) / f"{name}.onnx", ck)
                t_verify = time.perf_counter() - t
                rows.append(
                    {
                        "model": name,
                        "exporter": exporter,
                        "export s": f"{t_export:.2f}",
                        "verify s": f"{t_verify:.2f}",
                        "verify samples/s": f"{rep.num_samples / t_verify:.0f}",
                        "verdict": "pass" if rep.passed else "FAIL",
                    }
                )
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--models", default="digits_cnn,text_encoder,resnet_cnn")
    p.add_argument("--samples", default="512,2048")
    p.add_argument("--repeat", type=int, default=3, help="in-process runs per row (fastest counts)")
    p.add_argument("--quick", action="store_true", help="one in-process run and one user run per row")
    p.add_argument("--skip", default="", help="comma-separated sections to skip: peer,user,memory,export")
    a = p.parse_args(argv)
    setup_threads(a.threads)
    names, samples = a.models.split(","), [int(s) for s in a.samples.split(",")]
    skip = set(filter(None, a.skip.split(",")))
    print(f"end to end — {machine()}; load average {os.getloadavg()[0]:.1f} at start")
    try:
        import onnxruntime.quantization  # noqa: F401
    except ImportError:
        skip |= {"peer", "user"}
        print("onnxruntime.quantization not installed: no peer comparison")
    with tempfile.TemporaryDirectory() as d:
        if "peer" not in skip:
            print(
                "\nvs onnxruntime quantize_static, in one process (both imported, data in memory, fp32 "
                "ONNX exported "
                f"beforehand, untimed; fastest of {1 if a.quick else a.repeat} interleaved runs)"
            )
            rows = in_process_rows(names, samples, 1 if a.quick else a.repeat, Path(d))
            print(table(rows, list(rows[0])))
        if "user" not in skip:
            print(
                "\nvs onnxruntime, as a user runs it (fresh processes, wall clock incl. interpreter start "
                "and imports; quantcli: calibrate + export commands; peer: numpy + quantize_static script; "
                "peak RSS (+ growth over the state after imports))"
            )
            rows = user_rows(names, samples, 1 if a.quick else 2, Path(d))
            print(table(rows, list(rows[0])))
    print(f"(load average {os.getloadavg()[0]:.1f})")
    if "memory" not in skip:
        print(
            f"\npeak RSS of calibrating resnet_cnn, {FLAT_SAMPLES[0]} vs {FLAT_SAMPLES[1]} samples (fresh "
            f"process each; "
            "the data is the same 256 samples in memory)"
        )
        rows = memory_rows()
        print(table(rows, [c for c in rows[0] if not c.startswith("_")]))
        leaky = [r for r in rows if r["_leak"]]
        caught = all(not r["_met"] for r in leaky)
        print(f"the check discriminates (the leaky control misses the target): {'yes' if caught else 'NO'}")
    if "export" not in skip:
        print("\nexport and verify (verify: every check, held-out data, CPU provider)")
        print(
            table(
                export_verify_rows(),
                ["model", "exporter", "export s", "verify s", "verify samples/s", "verdict"],
            )
        )


if __name__ == "__main__":
    main()
