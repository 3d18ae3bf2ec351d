"""Run pytest over the test files in N parallel processes (a machine with many cores): the files shared out by
their number of collected tests, largest first, each process's output in OUT/chunk-K.txt (the failing ones'
also in OUT/failures.txt), and one summary line per process. Exit code: 0 when every process passed. Usage:

    python .ci/parallel_pytest.py N OUT [pytest arguments, e.g. -m "not zoo"]
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time


def main() -> int:
    n, out, extra = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    os.makedirs(out, exist_ok=True)
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *extra],
        capture_output=True,
        text=True,
    ).stdout
    per_file = collections.Counter(line.split("::")[0] for line in listed.splitlines() if "::" in line)
    chunks: list[list[str]] = [[] for _ in range(n)]
    load = [0] * n
    for path, count in per_file.most_common():
        k = load.index(min(load))
        chunks[k].append(path)
        load[k] += count
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    procs = []
    for k, files in enumerate(chunks):
        if files:
            log = open(os.path.join(out, f"chunk-{k}.txt"), "w")
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, *files]
            procs.append((k, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    rc = 0
    for k, p, log in procs:
        p.wait()
        log.close()
        with open(log.name) as f:
            lines = f.read().splitlines()
        print(f"chunk {k}: exit {p.returncode}: {lines[-1] if lines else ''}")
        for line in lines:
            if line.startswith(("FAILED", "ERROR")):
                print("   ", line[:300])
        rc = rc or p.returncode
        if p.returncode:  # one file with every failing process's whole log (fewer files to bring back)
            with open(os.path.join(out, "failures.txt"), "a") as f:
                f.write(f"===== chunk {k}\n" + "\n".join(lines) + "\n")
    print(
        f"{sum(per_file.values())} tests in {len(per_file)} files, {len(procs)} processes, "
        f"{time.time() - t0:.0f} s"
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())
