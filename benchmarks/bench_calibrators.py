"""Calibrator speed and memory: vectorized amax searches vs per-candidate loops, collection overhead vs the
matmul that produced the activation, state and peak memory for 10 vs 1000 batches.

Two references for entropy (tests/reference_amax.py): the pure-Python loop (a Python loop over bins inside
each candidate, minutes long, skipped by --quick) and the fair one (the same per-candidate loop, each
candidate vectorised over bins in numpy, as the mse reference is). Targets, computed per row: entropy <= 10 ms
per 2048-bin histogram and >= 100x faster than the pure-Python loop.

    python -m benchmarks.bench_calibrators [--device cpu|cuda] [--quick]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from benchmarks.common import machine, median_time, peak_rss_of, setup_threads, table, verdict

ENTROPY_MS_TARGET = 10.0
ENTROPY_LOOP_SPEEDUP_TARGET = 100.0


def _activation_hist(channels: int | None = None, device: str = "cpu"):
    from calibrators import HistogramCalibrator

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 768, generator=g) @ torch.randn(768, 3072, generator=g) / 28
    x = torch.nn.functional.gelu(x).to(device)
    c = HistogramCalibrator(axis=None if channels is None else 1)
    c.collect(x if channels is None else x[:, :channels])
    return c


def amax_rows(device: str, quick: bool) -> list[dict]:
    from calibrators.histogram import compute_amax_entropy, compute_amax_mse, compute_amax_percentile
    from tests.reference_amax import ref_entropy, ref_entropy_vectorized, ref_mse

    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    from calibrators import HistogramCalibrator

    dense = HistogramCalibrator()  # worst case: data in every one of the 2048 bins, every candidate evaluated
    g = torch.Generator().manual_seed(1)
    dense.collect(
        torch.cat([torch.rand(200_000, generator=g) * 1.99, torch.randn(200_000, generator=g).abs() * 0.3])
    )
    refs = {"entropy": ref_entropy, "mse": ref_mse}
    fair = {"entropy": ref_entropy_vectorized, "mse": ref_mse}
    fns = {"entropy": compute_amax_entropy, "mse": compute_amax_mse, "percentile": compute_amax_percentile}
    rows = []
    for label, c in (
        ("2048 bins, GELU activation", _activation_hist(device=device)),
        ("2048 bins, every bin filled", dense),
    ):
        rows += _amax_rows_for(c, label, fns, refs, fair, sync, quick)
    rows += _per_channel_rows(fns, sync, quick, device)
    return rows


def _amax_rows_for(c, label, fns, refs, fair, sync, quick) -> list[dict]:
    h, e = c.hist[0].double(), c.bin_edges[0]
    hn, en = h.cpu().numpy(), e.cpu().numpy()
    rows = []
    for name, fn in fns.items():
        t_fast = median_time(lambda fn=fn: fn(h, e), repeat=9, warmup=2, sync=sync)
        got = float(fn(h, e))
        row = {"method": name, "histogram": label, "quantcli ms": f"{t_fast * 1e3:.2f}"}
        if name in fair:  # numpy per-candidate loop: seconds at most, always run
            t0 = time.perf_counter()
            want = fair[name](hn, en)
            t_ref = time.perf_counter() - t0
            row.update(
                {
                    "fair reference ms": f"{t_ref * 1e3:.0f}",
                    "vs fair": f"{t_ref / t_fast:.0f}x",
                    "same bin": "yes" if got == want else f"no ({got} vs {want})",
                }
            )
        if name == "entropy" and not quick:  # pure-Python loop over bins inside each candidate: minutes
            t0 = time.perf_counter()
            want = refs[name](hn, en)
            t_ref = time.perf_counter() - t0
            row.update({"pure-Python loop ms": f"{t_ref * 1e3:.0f}", "vs loop": f"{t_ref / t_fast:.0f}x"})
            row["same bin"] += "" if got == want else f"; loop: no ({got} vs {want})"
        if name == "entropy":
            met = t_fast * 1e3 <= ENTROPY_MS_TARGET
            if not quick:
                met = met and t_ref / t_fast >= ENTROPY_LOOP_SPEEDUP_TARGET
            row["target"] = f"<= {ENTROPY_MS_TARGET:.0f} ms" + (
                "" if quick else f", >= {ENTROPY_LOOP_SPEEDUP_TARGET:.0f}x loop"
            )
            row["result"] = verdict(met)
        elif name == "percentile":
            cdf = np.cumsum(hn) / hn.sum()
            t0 = time.perf_counter()
            for _ in range(20):
                idx = next(i for i, v in enumerate(cdf) if v >= 0.9999)
            t_ref = (time.perf_counter() - t0) / 20
            row.update(
                {
                    "fair reference ms": f"{t_ref * 1e3:.2f} (loop over bins)",
                    "vs fair": f"{t_ref / t_fast:.1f}x",
                    "same bin": "yes" if got == en[idx + 1] else "no",
                }
            )
        rows.append(row)
    return rows


def _per_channel_rows(fns, sync, quick, device) -> list[dict]:
    # per-channel: 768 channels in one call vs a Python loop over channels of the same function
    rows = []
    pc = _activation_hist(channels=768, device=device)
    H, E = pc.hist.double(), pc.bin_edges
    for name, fn in fns.items():
        t_batched = median_time(lambda fn=fn: fn(H, E), repeat=3, warmup=1, sync=sync)
        n_loop = 32 if quick else 96
        t_loop = median_time(
            lambda fn=fn, n=n_loop: [fn(H[i], E[i]) for i in range(n)], repeat=1, warmup=0, sync=sync
        )
        t_loop *= 768 / n_loop
        rows.append(
            {
                "method": name,
                "histogram": "768 channels",
                "quantcli ms": f"{t_batched * 1e3:.1f}",
                "fair reference ms": f"{t_loop * 1e3:.0f} (loop over channels)",
                "vs fair": f"{t_loop / t_batched:.1f}x",
                "same bin": "-",
            }
        )
    return rows


def collect_rows(device: str) -> list[dict]:
    from calibrators import HistogramCalibrator, MaxCalibrator

    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 768, generator=g).to(device)
    w = torch.randn(768, 3072, generator=g).to(device)
    x = a @ w
    t_mm = median_time(lambda: a @ w, repeat=21, warmup=3, sync=sync)
    rows = []
    for label, c in (
        ("max, per-tensor", MaxCalibrator()),
        ("histogram, per-tensor", HistogramCalibrator()),
        ("histogram, per-channel (3072)", HistogramCalibrator(axis=1)),
    ):
        c.collect(x)
        t = median_time(lambda c=c: c.collect(x), repeat=21, warmup=3, sync=sync)
        rows.append(
            {
                "collect": label,
                "activation": "64 x 3072",
                "collect ms": f"{t * 1e3:.3f}",
                "matmul ms": f"{t_mm * 1e3:.3f}",
                "collect / matmul": f"{t / t_mm:.2f}",
            }
        )
    return rows


HOST_US_TARGET = 20.0


def host_rows(device: str = "cpu") -> list[dict]:
    """Host time and torch operations of one ``collect`` per calibrator kind, per tensor, on an activation of
    64 values (the kernels' own time is then negligible: what remains is Python, dispatch and launch) and on a
    64 x 768 one, batch after batch (state allocated, 2 x FOLD_EVERY batches so a device fold is in the
    average)."""
    from calibrators import HistogramCalibrator, MaxCalibrator, MinMaxCalibrator
    from calibrators.counting import FOLD_EVERY
    from calibrators.two_sided_calibrator import TwoSidedHistogramCalibrator
    from tests.dispatch import OpCounter

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    kinds = {
        "max": MaxCalibrator,
        "min/max (asymmetric, max)": MinMaxCalibrator,
        "histogram of |x|": HistogramCalibrator,
        "two-sided (asymmetric, mse/percentile)": TwoSidedHistogramCalibrator,
    }
    n = 2 * FOLD_EVERY
    rows = []
    for shape in ((4, 16), (64, 768)):
        g = torch.Generator().manual_seed(0)
        xs = [torch.randn(*shape, generator=g).to(device) for _ in range(8)]
        made, best = {}, {}
        with torch.inference_mode():
            for label, cls in kinds.items():
                c = made[label] = cls()
                for x in xs:
                    c.collect(x)
                counter = OpCounter()
                with counter:
                    for i in range(n):
                        c.collect(xs[i % 8])
                best[label] = (counter.count / n, float("inf"))
            # the kinds take turns, repeat after repeat: a burst of load elsewhere on a shared machine slows
            # every kind in one repeat, and the fastest repeat of each is one that missed it
            for _ in range(15):
                for label, c in made.items():
                    sync()
                    t = time.perf_counter()
                    for i in range(n):
                        c.collect(xs[i % 8])
                    host = (time.perf_counter() - t) / n  # on a GPU: without waiting for the kernels
                    best[label] = (best[label][0], min(best[label][1], host))
        for label, (ops, host) in best.items():
            row = {
                "calibrator": label,
                "activation": "x".join(map(str, shape)),
                "operations": f"{ops:.2f}",
                "host us": f"{host * 1e6:.1f}",
            }
            if shape == (4, 16) and device == "cpu":  # issue 38's target is the CPU's: a GPU host has none
                row["target"] = f"<= {HOST_US_TARGET:.0f} us"
                row["result"] = verdict(host * 1e6 <= HOST_US_TARGET)
            rows.append(row)
    return rows


_MEM = """
import torch
torch.set_num_threads(1)
from calibrators import HistogramCalibrator, MaxCalibrator
cs = [HistogramCalibrator(), HistogramCalibrator(axis=1), MaxCalibrator(axis=1)]
g = torch.Generator().manual_seed(0)
for i in range({n}):
    x = torch.randn(64, 3072, generator=g)
    for c in cs:
        c.collect(x)
for c in cs[:2]:
    c.compute_amax("entropy")
"""


def memory_rows() -> list[dict]:
    from calibrators import HistogramCalibrator

    rows = []
    peaks = {n: peak_rss_of(_MEM.format(n=n)) for n in (10, 1000)}
    c = HistogramCalibrator(axis=1)
    for _ in range(3):
        c.collect(torch.randn(64, 3072))
    state = c._hist.numel() * c._hist.element_size() + c._exp.numel() * 8
    for n, p in peaks.items():
        rows.append(
            {
                "batches": n,
                "peak RSS MiB": f"{p:.1f}",
                "vs 10 batches": f"{p / peaks[10]:.3f}x",
                "per-channel histogram state": f"{state / 2**20:.1f} MiB",
            }
        )
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="skip the minutes-long per-candidate loop references")
    a = p.parse_args(argv)
    setup_threads(a.threads)
    print(f"calibrators on {a.device} — {machine()}")
    print(
        f"\namax search (target: entropy <= {ENTROPY_MS_TARGET:.0f} ms per histogram and >= "
        f"{ENTROPY_LOOP_SPEEDUP_TARGET:.0f}x faster than the pure-Python per-candidate loop; the fair "
        f"reference "
        "vectorises each candidate over bins in numpy)"
    )
    rows = amax_rows(a.device, a.quick)
    print(
        table(
            rows,
            [
                "method",
                "histogram",
                "quantcli ms",
                "fair reference ms",
                "vs fair",
                "pure-Python loop ms",
                "vs loop",
                "same bin",
                "target",
                "result",
            ],
        )
    )
    print("\ncollection cost vs the matmul that produced the activation")
    print(
        table(
            collect_rows(a.device), ["collect", "activation", "collect ms", "matmul ms", "collect / matmul"]
        )
    )
    print("\nhost time and operations per quantizer per batch (64 values: what is not the kernels' own time)")
    print(
        table(host_rows(a.device), ["calibrator", "activation", "operations", "host us", "target", "result"])
    )
    if a.device == "cpu":
        print("\nmemory: three calibrators, 64 x 3072 activations, separate processes")
        print(
            table(memory_rows(), ["batches", "peak RSS MiB", "vs 10 batches", "per-channel histogram state"])
        )


if __name__ == "__main__":
    main()
