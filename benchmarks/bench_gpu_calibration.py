"""Calibration against a plain forward pass on models of the size people calibrate on a GPU (issue 38).

Five workloads (``benchmarks.sized_models``, random weights; the samples with their own data): a
ResNet-50-shaped CNN at batch 64 x 224 x 224, a BERT-base-shaped encoder at batch 32 x 128 tokens, a decoder
of about 1 B parameters in bfloat16 at batch 4 x 512 tokens, digits_cnn and text_encoder. For each and each
method (max, entropy, mse, percentile): the plain forward pass of the batches (the same quantized model, every
quantizer disabled, under ``inference_mode``) against ``calibrate()`` of the same batches, both already on the
device, timed with the device synchronised before and after, the first run of each (allocation, kernel
selection) not timed, the fastest of the rounds kept. ``calibrate`` is split at its last batch (a CUDA event
there): the observing pass (weights too) and the searches after it, per quantizer searched; and the weights'
amax before the first batch are timed on their own (``weights ms``). The host time per
quantizer per batch is what the observing loop spent in Python and dispatch beyond the plain loop's, per batch
and observing quantizer (on a GPU, without waiting).

Targets (issue 38): max <= 1.15x and histogram methods <= 1.5x a plain forward pass on the ResNet-50- and
BERT-base-shaped models, <= 2x on the decoder and the samples; each entropy/mse search <= 10 ms per quantizer.

    python -m benchmarks.bench_gpu_calibration [--device cuda|cpu] [--quick] [--rounds N] [--models a,b]
        [--methods m,n] [--json FILE] [--cuda-graph]

``--quick`` shrinks every model and batch (for a CPU: ``--device cpu --quick`` runs in a few minutes); the
verdicts printed then are of those shapes, not of the issue's.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from dataclasses import dataclass

import torch

from benchmarks.common import machine, setup_threads, table, verdict

METHODS = ("max", "entropy", "mse", "percentile")
SEARCH_MS_TARGET = 10.0


@dataclass
class Workload:
    name: str
    build: object  # (scale) -> nn.Module
    batches: object  # (device, quick) -> list of batches
    dtype: torch.dtype = torch.float32
    limits: tuple[float, float] = (2.0, 2.0)  # (max, histogram methods)
    quick_scale: float = 0.25


def _ids(count: int, batch: int, tokens: int, vocab: int, device):
    g = torch.Generator().manual_seed(0)
    return [
        {"input_ids": torch.randint(0, vocab, (batch, tokens), generator=g).to(device)} for _ in range(count)
    ]


def _images(count: int, batch: int, side: int, device):
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(batch, 3, side, side, generator=g).to(device)} for _ in range(count)]


def _sample(name: str):
    def build(_scale):
        from quantcli.inputs.loading import load_model

        return load_model(name)[0]

    return build


def _sample_batches(name: str):
    def batches(device, quick):
        from benchmarks.bench_calibration import workloads

        label = next(k for k in workloads("cpu") if k.startswith(name))
        found = workloads(device)[label][1]
        return found[:2] if quick else found

    return batches


def workloads() -> dict[str, Workload]:
    from benchmarks.sized_models import BertBaseLike, Decoder1BLike, ResNet50Like

    return {
        w.name: w
        for w in (
            Workload(
                "resnet50 (8 x 64 x 224^2)",
                ResNet50Like,
                lambda d, q: _images(2 if q else 8, 2 if q else 64, 64 if q else 224, d),
                limits=(1.15, 1.5),
            ),
            Workload(
                "bert_base (16 x 32 x 128)",
                BertBaseLike,
                lambda d, q: _ids(3 if q else 16, 4 if q else 32, 32 if q else 128, 30522, d),
                limits=(1.15, 1.5),
            ),
            Workload(
                "decoder_1b bf16 (8 x 4 x 512)",
                Decoder1BLike,
                lambda d, q: _ids(3 if q else 8, 2 if q else 4, 64 if q else 512, 2000 if q else 32000, d),
                dtype=torch.bfloat16,
                quick_scale=1 / 16,
            ),
            Workload("digits_cnn (8 x 256)", _sample("digits_cnn"), _sample_batches("digits_cnn")),
            Workload("text_encoder (32 batches)", _sample("text_encoder"), _sample_batches("text_encoder")),
        )
    }


def _built(w: Workload, device: torch.device, quick: bool):
    from quantcli.nn import quantize_model

    torch.manual_seed(0)
    with torch.device(device):
        model = w.build(w.quick_scale if quick else 1.0)
    model = model.to(device=device, dtype=w.dtype).eval()
    return quantize_model(model)


def _sync(device: torch.device):
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _plain(model, batches) -> float:
    """Host seconds to run (on a GPU: to enqueue) the batches through ``model``."""
    t = time.perf_counter()
    with torch.inference_mode():
        for b in batches:
            model(**b)
    return time.perf_counter() - t


def measure(
    w: Workload, method: str, device: torch.device, quick: bool, rounds: int, model=None, cuda_graph=False
) -> dict:
    """One row: the plain pass and calibrate() alternate ``rounds`` times after one untimed run of each."""
    from quantcli.calibration import calibrate as calibrate_module
    from quantcli.calibration.calibrate import calibrate
    from quantcli.nn import quantizers
    from quantcli.nn.modes import quantizer_modes

    model = model if model is not None else _built(w, device, quick)
    batches = w.batches(device, quick)
    qs = list(quantizers(model).values())
    sync = _sync(device)
    cuda = device.type == "cuda"
    best = {k: float("inf") for k in ("plain", "calibrate", "observe", "weights")}
    host = {"plain": float("inf"), "observe": float("inf")}
    last = len(batches) - 1
    for r in range(rounds + 1):
        with quantizer_modes(qs, "disabled"):
            _plain(model, batches)  # the first batch of a pass allocates: as calibrate's first batch
            sync()
            t = time.perf_counter()
            h = _plain(model, batches)
            sync()
            tp = time.perf_counter() - t
        marks: dict = {}
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        end_observe = torch.cuda.Event(enable_timing=True) if cuda else None

        def progress(i, marks=marks, end_observe=end_observe):
            if i == 0:
                marks["first"] = time.perf_counter()
            if i == last:
                marks["last"] = time.perf_counter()
                if end_observe is not None:
                    end_observe.record()

        observe_activations = calibrate_module._observe_activations
        end_weights = torch.cuda.Event(enable_timing=True) if cuda else None

        def observing(*args, marks=marks, end_weights=end_weights, run=observe_activations, **kwargs):
            # the observing loop starts: everything before it is the weights' amax (and argument checks)
            marks["weights"] = time.perf_counter()
            if end_weights is not None:
                end_weights.record()
            return run(*args, **kwargs)

        sync()
        t = time.perf_counter()
        if start is not None:
            start.record()
        calibrate_module._observe_activations = observing
        try:
            summary = calibrate(
                model, batches, method, device=device, progress=progress, cuda_graph=cuda_graph
            )
        finally:
            calibrate_module._observe_activations = observe_activations
        sync()
        tc = time.perf_counter() - t
        observe = start.elapsed_time(end_observe) / 1e3 if cuda else marks["last"] - t
        weights = start.elapsed_time(end_weights) / 1e3 if cuda else marks["weights"] - t
        if r == 0:
            continue  # warm-up: allocation, kernel selection, caches
        best["plain"] = min(best["plain"], tp)
        best["calibrate"] = min(best["calibrate"], tc)
        best["observe"] = min(best["observe"], observe)
        best["weights"] = min(best["weights"], weights)
        host["plain"] = min(host["plain"], h * last / len(batches))  # batches 1.. of the plain loop
        host["observe"] = min(host["observe"], marks["last"] - marks["first"])
    observing = [n for n in summary.calibrated if not n.endswith("weight_quantizer")]
    searched = sum(1 for q in qs if q.histogram is not None) if method != "max" else 0
    row = _row(w, method, best, host, len(observing), searched, last)
    row["graph replays"] = summary.graph_replays  # batches replayed as a CUDA graph (0: observed one by one)
    return row


def _row(
    w: Workload, method: str, best: dict, host: dict, observing: int, searched: int, batches: int
) -> dict:
    limit = w.limits[0 if method == "max" else 1]
    ratio = best["calibrate"] / best["plain"]
    search_ms = max(0.0, best["calibrate"] - best["observe"]) * 1e3
    per_search = search_ms / searched if searched else None
    host_us = (host["observe"] - host["plain"]) / max(1, observing * batches) * 1e6
    row = {
        "model": w.name,
        "method": method,
        "plain ms": f"{best['plain'] * 1e3:.1f}",
        "calibrate ms": f"{best['calibrate'] * 1e3:.1f}",
        "ratio": f"{ratio:.2f}x",
        "target": f"<= {limit:.2f}x",
        "result": verdict(ratio <= limit),
        "weights ms": f"{best['weights'] * 1e3:.1f}",
        "observe ratio": f"{best['observe'] / best['plain']:.2f}x",
        "search ms": f"{search_ms:.1f}",
        "ms / search": "-" if per_search is None else f"{per_search:.2f}",
        "search target": "-" if per_search is None or method == "percentile" else verdict(per_search <= 10),
        "host us / q / batch": f"{host_us:.1f}",
        "quantizers": observing,
        "_ratio": ratio,
    }
    return row


def gpu_description(device: torch.device) -> str:
    """GPU name, driver and CUDA, torch version (or the CPU's description)."""
    if device.type != "cuda":
        return machine() + f", CPU flags: {cpu_flags()}"
    name = torch.cuda.get_device_name(device)
    try:
        driver = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            .stdout.split("\n")[0]
            .strip()
        )
    except (OSError, subprocess.SubprocessError):
        driver = "unknown"
    return (
        f"{name}, driver {driver or 'unknown'}, CUDA {torch.version.cuda}, torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}"
    )


def cpu_flags() -> str:
    """The SIMD flags that decide CPU kernels here (avx2, avx512f, avx512_vnni, amx)."""
    try:
        flags = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile")
    return " ".join(f for f in wanted if f in flags) or "none of avx2/avx512"


def run(
    device: str, quick: bool, rounds: int, models: list[str] | None, methods, cuda_graph: bool = False
) -> list[dict]:
    dev = torch.device(device)
    rows = []
    for name, w in workloads().items():
        if models and not any(name.startswith(m) for m in models):
            continue
        t = time.perf_counter()
        model = _built(w, dev, quick)
        print(f"{name}: built in {time.perf_counter() - t:.1f} s", flush=True)
        for method in methods:
            rows.append(measure(w, method, dev, quick, rounds, model, cuda_graph))
            r = rows[-1]  # as it comes: a run cut short by a time limit keeps what it measured
            print(
                f"  {method}: plain {r['plain ms']} ms, calibrate {r['calibrate ms']} ms, {r['ratio']} "
                f"{r['result']} ({r['target']}); weights {r['weights ms']} ms, observe {r['observe ratio']}, "
                f"search {r['search ms']} ms "
                f"({r['ms / search']} ms each), host {r['host us / q / batch']} us/q/batch, "
                f"{r['graph replays']} graph replays",
                flush=True,
            )
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


COLUMNS = [
    "model",
    "method",
    "plain ms",
    "calibrate ms",
    "ratio",
    "target",
    "result",
    "weights ms",
    "observe ratio",
    "search ms",
    "ms / search",
    "search target",
    "host us / q / batch",
    "quantizers",
    "graph replays",
]


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="every model and batch shrunk (a CPU run)")
    p.add_argument("--rounds", type=int, default=None, help="timed runs per row (default 3, --quick 1)")
    p.add_argument("--models", default=None, help="comma-separated prefixes of the workloads to run")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="calibrate with cuda_graph=True (later batches replay a CUDA graph where they qualify)",
    )
    a = p.parse_args(argv)
    setup_threads(a.threads)
    rounds = a.rounds if a.rounds is not None else (1 if a.quick else 3)
    dev = torch.device(a.device)
    graph = ", --cuda-graph" if a.cuda_graph else ""
    print(f"calibration vs a plain forward pass on {a.device}{' (--quick shapes)' if a.quick else ''}{graph}")
    print(gpu_description(dev), flush=True)
    models = a.models.split(",") if a.models else None
    rows = run(a.device, a.quick, rounds, models, a.methods.split(","), a.cuda_graph)
    print(f"(fastest of {rounds} timed round(s) after an untimed one; batches on the device; synchronised)")
    print(table(rows, COLUMNS))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": gpu_description(dev), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
