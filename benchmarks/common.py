"""Timing and memory helpers shared by the benchmark scripts."""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable


def setup_threads(n: int = 1) -> None:
    import torch

    torch.set_num_threads(n)


def median_time(fn: Callable[..., object], repeat: int = 5, warmup: int = 1, sync: Callable[[], None] | None = None,
                setup: Callable[[], object] | None = None) -> float:
    """Median wall time of ``fn()`` (or ``fn(setup())``, setup untimed) in seconds after ``warmup`` calls."""
    def once() -> float:
        arg = setup() if setup else None
        if sync:
            sync()
        t = time.perf_counter()
        fn(arg) if setup else fn()
        if sync:
            sync()
        return time.perf_counter() - t

    for _ in range(warmup):
        once()
    return statistics.median(once() for _ in range(repeat))


def peak_rss_of(code: str, env: dict | None = None) -> float:
    """Peak resident memory (MiB) of a fresh Python process running ``code``."""
    e = dict(os.environ)
    e.update(env or {})
    e.setdefault("OMP_NUM_THREADS", "1")
    wrapper = code + "\nimport resource, json, sys\nprint(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))\n"
    out = subprocess.run([sys.executable, "-c", wrapper], capture_output=True, text=True, env=e, check=True)
    kib = json.loads(out.stdout.strip().splitlines()[-1])
    return kib / 1024.0


def self_peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.system()} {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} thread(s), {gpu}"


def table(rows: list[dict], columns: list[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    line = "  ".join(c.ljust(widths[c]) for c in columns)
    out = [line, "  ".join("-" * widths[c] for c in columns)]
    for r in rows:
        out.append("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns))
    return "\n".join(out)
