"""Timing and memory helpers shared by the benchmark scripts."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path


def setup_threads(n: int = 1) -> None:
    import torch

    torch.set_num_threads(n)


def median_time(
    fn: Callable[..., object],
    repeat: int = 5,
    warmup: int = 1,
    sync: Callable[[], None] | None = None,
    setup: Callable[[], object] | None = None,
) -> float:
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


def best_interleaved(runs: dict[str, Callable[[], object]], rounds: int, warmup: int = 0) -> dict[str, float]:
    """Best-of-``rounds`` wall time (seconds) of each callable, the callables interleaved within each round so
    that every one sees the same machine state; ``warmup`` untimed calls of each first (first runs allocate
    and pick kernels)."""
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for label, fn in runs.items():
            t = time.perf_counter()
            fn()
            best[label] = min(best[label], time.perf_counter() - t)
    return best


def run_all(session, feeds: list[dict]) -> None:
    """One run of an onnxruntime ``session`` on each feed dict: what a latency figure over several batches
    times."""
    for f in feeds:
        session.run(None, f)


def rows_per_model(names: Iterable[str], measure: Callable[[str, Path], list[dict]]) -> list[dict]:
    """The rows ``measure(name, folder)`` returns for each model, every file written to one temporary folder
    (removed afterwards). A model whose optional dependency is missing (ImportError) is skipped with a line
    saying so; after each model the 1-minute load average is printed (latency figures are read beside it)."""
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        for name in names:
            try:
                rows += measure(name, Path(d))
            except ImportError as e:  # deep_encoder needs transformers (the test extra)
                print(f"{name}: skipped ({e})")
                continue
            print(f"  {name} done; load average {os.getloadavg()[0]:.2f}", flush=True)
    return rows


PEAK_RSS_SNIPPET = (
    "\nimport re\n"
    "print('PEAK_RSS_KIB', re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
)
"""Appended to a child's code: its own peak RSS. Not ``ru_maxrss``: Linux carries that across fork and exec,
so a child would report at least its parent's peak."""


def peak_rss_from(stdout: str) -> float:
    """MiB, from the line PEAK_RSS_SNIPPET printed."""
    line = next(ln for ln in stdout.splitlines() if ln.startswith("PEAK_RSS_KIB"))
    return int(line.split()[1]) / 1024.0


def peak_rss_of(code: str, env: dict | None = None) -> float:
    """Peak resident memory (MiB) of a fresh Python process running ``code``."""
    e = dict(os.environ)
    e.update(env or {})
    e.setdefault("OMP_NUM_THREADS", "1")
    out = subprocess.run(
        [sys.executable, "-c", code + PEAK_RSS_SNIPPET], capture_output=True, text=True, env=e, check=True
    )
    return peak_rss_from(out.stdout)


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    threads = torch.get_num_threads()
    system = f"{platform.system()} {cpu}, {os.cpu_count()} cores"
    return f"{system}, torch {torch.__version__}, {threads} thread(s), {gpu}"


def table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Rows as aligned text columns; ``columns`` defaults to every key of the rows, in first-seen order."""
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    line = "  ".join(c.ljust(widths[c]) for c in columns)
    out = [line, "  ".join("-" * widths[c] for c in columns)]
    for r in rows:
        out.append("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns))
    return "\n".join(out)


def verdict(met: bool) -> str:
    """What a benchmark prints for each target it states: computed from the measurement, never fixed."""
    return "MET" if met else "MISSED"


def load_line(text: str, key: str) -> float:
    """The number after ``key`` on the line of ``text`` that starts with it."""
    return float(next(ln.split()[1] for ln in text.splitlines() if ln.startswith(key)))


#: one-sided 95% quantiles of Student's t by degrees of freedom (a standard table; scipy is not a dependency)
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833}


def paired_difference(ours: list[float], theirs: list[float]) -> tuple[float, float]:
    """``(mean of ours[i] - theirs[i], noise)`` over paired measurements (the same calibration draw ``i``),
    where ``noise`` is the one-sided 95% t bound of that mean: a mean below ``-noise`` is below in earnest,
    one within it cannot be told from a tie by these draws. At least two pairs."""
    if len(ours) != len(theirs) or len(ours) < 2:
        raise ValueError(f"need at least two paired values, got {len(ours)} and {len(theirs)}")
    d = [a - b for a, b in zip(ours, theirs)]
    se = statistics.stdev(d) / len(d) ** 0.5
    return statistics.fmean(d), T95[min(len(d) - 1, max(T95))] * se


def cpu_flags() -> str:
    """The instruction-set flags that decide onnxruntime's integer kernels, and the CPU kind they make
    (:func:`quantcli.quant.cpu.flags`)."""
    from quantcli.quant import cpu

    return cpu.flags()
