"""``quantcli --help`` start-up: wall time of fresh processes against a bare interpreter and ``import torch``.

    python -m benchmarks.bench_startup [--repeat N]

The CLI imports torch and onnx only inside the commands that need them, so ``--help`` costs an interpreter
plus typer and rich. Interleaved fresh processes, fastest of N each. Targets, computed: importing
``quantcli.cli`` loads neither torch nor onnx, and ``--help`` takes at most half the time of ``python -c
"import torch"``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import table, verdict

HELP_VS_TORCH_TARGET = 0.5


def _help_command() -> list[str]:
    """The installed console script next to this interpreter, else ``python -m quantcli``."""
    script = Path(sys.executable).parent / "quantcli"
    if script.exists() or shutil.which("quantcli"):
        return [str(script) if script.exists() else shutil.which("quantcli"), "--help"]
    return [sys.executable, "-m", "quantcli", "--help"]


def _wall(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.perf_counter() - t


def heavy_modules_after_cli_import() -> list[str]:
    """Which of torch, onnx, onnxruntime a fresh ``import quantcli.cli`` loads (the claim: none)."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, quantcli.cli; print(','.join(m for m in ('torch', 'onnx', 'onnxruntime') if m in "
            "sys.modules))",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return [m for m in out.split(",") if m]


def rows(repeat: int = 7) -> list[dict]:
    cmds = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "quantcli --help": _help_command(),
        "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    }
    times = {k: [] for k in cmds}
    for _ in range(repeat):  # interleaved: drift in the machine's speed touches every command alike
        for k, c in cmds.items():
            times[k].append(_wall(c))
    best = {k: min(v) for k, v in times.items()}
    heavy = heavy_modules_after_cli_import()
    ratio = best["quantcli --help"] / best["python -c 'import torch'"]
    out = [
        {"command": k, "fastest s": f"{v:.3f}", "median s": f"{sorted(times[k])[len(times[k]) // 2]:.3f}"}
        for k, v in best.items()
    ]
    out[1].update(
        {
            "vs import torch": f"{ratio:.2f}x",
            "target": f"<= {HELP_VS_TORCH_TARGET:.2f}x",
            "result": verdict(ratio <= HELP_VS_TORCH_TARGET),
        }
    )
    out.append(
        {
            "command": "import quantcli.cli loads",
            "fastest s": ", ".join(heavy) or "nothing heavy",
            "target": "no torch, onnx",
            "result": verdict(not {"torch", "onnx"} & set(heavy)),
        }
    )
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=7)
    a = p.parse_args(argv)
    r = rows(a.repeat)
    print(
        f"start-up (fresh processes, fastest of {a.repeat} interleaved; load average "
        f"{os.getloadavg()[0]:.1f})"
    )
    print(table(r, ["command", "fastest s", "median s", "vs import torch", "target", "result"]))
    return r


if __name__ == "__main__":
    main()
