"""End-to-end calibration overhead: ``quantcli.calibrate`` vs a plain ``inference_mode`` forward pass.

Same process, same batches, same thread count. Targets on a CPU: max <= 1.15x, histogram methods (collection
plus amax search for every quantizer) <= 1.5x the plain forward time.

    python -m benchmarks.bench_calibration [--device cpu|cuda] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import machine, setup_threads, table


def workloads(device: str):
    from sample_models import digits_cnn, text_encoder

    x = torch.cat([b["x"] for b in digits_cnn.calibration_batches()] + [b["x"] for b in digits_cnn.evaluation_batches()])
    x = x.repeat(2, 1, 1, 1)[:2048]
    digits = [{"x": b.to(device)} for b in x.split(256)]
    text = [{k: v.to(device) for k, v in b.items()} for b in text_encoder.calibration_batches() * 4]
    return {"digits_cnn (8 x 256)": ("digits_cnn", digits), "text_encoder (32 batches)": ("text_encoder", text)}


def _plain_pass(model, batches) -> None:
    with torch.inference_mode():
        for b in batches:
            model(**b)


def _fresh_quantized(name: str):
    from quantcli.loading import load_model
    from quantcli.nn import quantize_model

    m, _ = load_model(name)
    return quantize_model(m)


def run(device: str = "cpu", repeat: int = 9) -> list[dict]:
    """Plain forward and calibration alternate within each repetition, each on a freshly built model (built
    untimed), so drift in the machine's speed and allocator warmth affect both sides alike; the ratio is of
    the medians."""
    import statistics

    from quantcli.calibration import calibrate
    from quantcli.loading import load_model

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rows = []
    for label, (name, batches) in workloads(device).items():
        _plain_pass(load_model(name)[0].to(device), batches)
        for method in ("max", "entropy", "mse", "percentile"):
            calibrate(_fresh_quantized(name), batches, method, device=device)  # warm-up
            t_plain, t_cal = [], []
            for _ in range(repeat):
                plain_model = load_model(name)[0].to(device)
                sync()
                t = time.perf_counter()
                _plain_pass(plain_model, batches)
                sync()
                t_plain.append(time.perf_counter() - t)
                m = _fresh_quantized(name)
                sync()
                t = time.perf_counter()
                calibrate(m, batches, method, device=device)
                sync()
                t_cal.append(time.perf_counter() - t)
            tp, tc = statistics.median(t_plain), statistics.median(t_cal)
            rows.append({"model": label, "method": method, "plain forward ms": f"{tp * 1e3:.1f}",
                         "calibrate ms": f"{tc * 1e3:.1f}", "ratio": f"{tc / tp:.2f}x",
                         "target": "<= 1.15x" if method == "max" else "<= 1.50x"})
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    setup_threads(a.threads)
    rows = run(a.device)
    print(f"calibration overhead on {a.device} — {machine()}")
    print("(medians of 9 interleaved runs; calibrate excludes building the model; both run the same batches)")
    print(table(rows, ["model", "method", "plain forward ms", "calibrate ms", "ratio", "target"]))
    return rows


if __name__ == "__main__":
    main()
