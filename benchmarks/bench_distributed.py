"""Data-parallel calibration: one process vs N ranks (torch.distributed, Gloo on the CPU), and the merge's
share.

One job of N spawned ranks does both sides, interleaved: rank 0 calibrates the whole set alone (the other
ranks wait in a barrier, off the CPU), then every rank calibrates its strided share and the statistics are
merged. Calibration time of the N-rank side is the slowest rank's ``quantcli.calibrate`` wall time, merge
included; the merge is timed on its own after a barrier (the time a rank waits there for a slower one is
reported apart, as load imbalance). Fastest of ``--repeat`` runs each; every run builds fresh models
(untimed).

Targets: merge <= 5% of calibration time; speed-up near-linear (>= 0.8 x ranks) while data loading is not the
limit (the batches are in memory here). On a machine shared with other work the speed-up is disturbed: a
second process only runs as fast as a free core lets it.

    python -m benchmarks.bench_distributed [--model resnet_cnn|conv1d_bn|digits_cnn] [--samples 4096] \\
        [--ranks 2]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from benchmarks.common import machine, setup_threads, table

MERGE_SHARE_TARGET = 0.05
LINEARITY_TARGET = 0.8


def workload(model: str, samples: int, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """``samples`` inputs for ``model`` in batches: the digits (calibration + held-out images, repeated), or
    the structured sample models' own batch helpers (``resnet_cnn``: digits upsampled to 3x32x32)."""
    if model == "digits_cnn":
        from sample_models import digits_cnn

        x = torch.cat(
            [b["x"] for b in digits_cnn.calibration_batches()]
            + [b["x"] for b in digits_cnn.evaluation_batches()]
        )
        x = x.repeat(1 + samples // len(x), 1, 1, 1)[:samples]
        return [{"x": b} for b in x.split(batch_size)]
    from sample_models import structured

    return {"resnet_cnn": structured.resnet_batches, "conv1d_bn": structured.conv1d_batches}[model](
        samples, batch_size
    )


def _fresh(model: str):
    from quantcli.nn import quantize_model

    if model == "digits_cnn":
        from quantcli.inputs.loading import load_model

        return quantize_model(load_model(model)[0])
    from sample_models import structured

    return quantize_model(getattr(structured, model)())


def _rank(
    rank: int,
    world: int,
    init_file: str,
    out_file: str,
    model: str,
    samples: int,
    batch_size: int,
    methods: list[str],
    repeat: int,
    device: str,
) -> None:
    import torch.distributed as dist

    import quantcli.calibration.calibrate as calibration

    torch.set_num_threads(1)
    cuda = device == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
    )
    solo = dist.new_group([0])  # rank 0 alone: the one-process reference, in the same warmed-up process
    batches = [{k: v.to(dev) for k, v in b.items()} for b in workload(model, samples, batch_size)]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    timing: dict = {}
    calibration.merge_calibrators = _timed_merge(calibration.merge_calibrators, timing)
    rows = []
    try:
        for method in methods:
            row = _measure(method, rank, world, model, dev, batches, repeat, solo, sync, timing)
            if row is not None:
                rows.append(row)
    finally:
        if rank == 0:
            torch.save(rows, out_file)
        dist.destroy_process_group()


def _timed_merge(merge, timing: dict):
    """``merge_calibrators`` timed: the wait at a barrier first (load imbalance), then the merge itself."""
    import torch.distributed as dist

    def timed_merge(cals, group=None):
        t0 = time.perf_counter()
        dist.barrier(group)
        t1 = time.perf_counter()
        merge(cals, group)
        timing.update(wait=t1 - t0, merge=time.perf_counter() - t1, quantizers=len(cals))

    return timed_merge


def _timed_calibrate(
    model: torch.nn.Module, batches, method: str, dev: torch.device, group, sync
) -> tuple[float, float]:
    """(wall, CPU) seconds of one ``calibrate`` call, the device synchronised on both sides."""
    from quantcli.calibration.calibrate import calibrate

    sync()
    t, c = time.perf_counter(), time.process_time()
    calibrate(model, batches, method, device=dev, group=group)
    sync()
    return time.perf_counter() - t, time.process_time() - c


def _measure(
    method: str,
    rank: int,
    world: int,
    model: str,
    dev: torch.device,
    batches: list,
    repeat: int,
    solo,
    sync,
    timing: dict,
) -> dict | None:
    """One method, both sides interleaved: rank 0 alone on every batch, then every rank on its strided share
    (the job as slow as its slowest rank). Fastest of ``repeat`` runs after a warm-up; the row on rank 0."""
    import torch.distributed as dist

    alone, together, together_cpu = [], [], []
    for i in range(repeat + 1):  # the first run of each side warms up
        m = _fresh(model).to(dev)
        dist.barrier()
        if rank == 0:
            wall_cpu = _timed_calibrate(m, batches, method, dev, solo, sync)
            if i:
                alone.append(wall_cpu)
        m = _fresh(model).to(dev)
        dist.barrier()
        wall, cpu = _timed_calibrate(m, batches[rank::world], method, dev, None, sync)
        runs: list = [None] * world
        dist.all_gather_object(runs, (wall, timing["merge"], timing["wait"], cpu))
        if i:
            together.append(max(runs))  # the job takes as long as its slowest rank
            together_cpu.append(max(r[3] for r in runs))
    if rank != 0:
        return None
    t1 = min(alone)[0]
    tn, t_merge, t_wait, _ = min(together)
    return {
        "method": method,
        "quantizers": timing["quantizers"],
        "t1": t1,
        "tn": tn,
        "merge": t_merge,
        "wait": t_wait,
        "cpu1": min(a[1] for a in alone),
        "cpun": min(together_cpu),
    }


def run(
    model: str = "resnet_cnn",
    samples: int = 4096,
    batch_size: int = 64,
    ranks: int = 2,
    methods: tuple[str, ...] = ("max", "entropy"),
    repeat: int = 3,
    device: str = "cpu",
) -> list[dict]:
    """Rows of the table; on ``cuda`` one rank per GPU (NCCL), rank 0's GPU alone as the reference."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.pt")
        mp.spawn(
            _rank,
            args=(
                ranks,
                os.path.join(d, "init"),
                out,
                model,
                samples,
                batch_size,
                list(methods),
                repeat,
                device,
            ),
            nprocs=ranks,
            join=True,
        )
        raw = torch.load(out, weights_only=False)
    rows = []
    for r in raw:
        speedup, share, cpu_speedup = r["t1"] / r["tn"], r["merge"] / r["tn"], r["cpu1"] / r["cpun"]
        rows.append(
            {
                "model": model,
                "method": r["method"],
                "samples": samples,
                "quantizers": r["quantizers"],
                "1 process ms": f"{r['t1'] * 1e3:.1f}",
                f"{ranks} ranks ms": f"{r['tn'] * 1e3:.1f}",
                "speed-up": f"{speedup:.2f}x",
                "merge ms": f"{r['merge'] * 1e3:.2f}",
                "merge share": f"{share:.1%}",
                "imbalance wait ms": f"{r['wait'] * 1e3:.1f}",
                "CPU s 1 / busiest rank": f"{r['cpu1']:.2f} / {r['cpun']:.2f}",
                "CPU-time ratio": f"{cpu_speedup:.2f}x",
                "merge <= 5%": "met" if share <= MERGE_SHARE_TARGET else "missed",
                f"speed-up >= {LINEARITY_TARGET * ranks:.1f}x": "met"
                if speedup >= LINEARITY_TARGET * ranks
                else "missed",
                "_speedup": speedup,
                "_merge_share": share,
                "_cpu_speedup": cpu_speedup,
            }
        )
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default="resnet_cnn", help="resnet_cnn, conv1d_bn (sample_models.structured) or digits_cnn"
    )
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--methods", default="max,entropy")
    p.add_argument(
        "--device", default="cpu", help="cpu (Gloo), or cuda: one rank per GPU (NCCL), --ranks GPUs"
    )
    a = p.parse_args(argv)
    setup_threads(1)
    if a.device == "cuda" and torch.cuda.device_count() < a.ranks:
        print(
            f"data-parallel calibration on cuda: {torch.cuda.device_count()} GPU(s), {a.ranks} ranks "
            f"asked for; "
            "nothing to compare (NCCL needs one GPU per rank)"
        )
        return []
    rows = run(a.model, a.samples, a.batch_size, a.ranks, tuple(a.methods.split(",")), a.repeat, a.device)
    backend = "NCCL ranks (one GPU each)" if a.device == "cuda" else "Gloo ranks (1 thread each)"
    print(
        f"data-parallel calibration, 1 process vs {a.ranks} {backend} — {machine()}; "
        f"load average {os.getloadavg()[0]:.1f} (other work on the machine disturbs the speed-up)"
    )
    print(
        f"(fastest of {a.repeat} interleaved runs; {a.ranks}-rank time = the slowest rank's calibrate(), "
        f"merge "
        "included; merge timed after a barrier, the wait there reported as imbalance)"
    )
    print(
        "(CPU-time ratio: the process CPU time of the one-process run over that of the busiest rank, the "
        "speed-up the split of the work allows when every rank has a free core; wall-clock speed-up is the "
        "target)"
    )
    cols = [
        "model",
        "method",
        "samples",
        "quantizers",
        "1 process ms",
        f"{a.ranks} ranks ms",
        "speed-up",
        "merge ms",
        "merge share",
        "imbalance wait ms",
        "CPU s 1 / busiest rank",
        "CPU-time ratio",
        "merge <= 5%",
        f"speed-up >= {LINEARITY_TARGET * a.ranks:.1f}x",
    ]
    print(table(rows, cols))
    return rows


if __name__ == "__main__":
    main()
