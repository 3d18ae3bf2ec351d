"""Two ``bench_gpu_calibration --json`` runs side by side, row by row (issue 38): what a change did to each
model and method's ratio against the plain forward pass, and to its observing, weights and search times.

    python -m benchmarks.compare_gpu_runs BEFORE.json AFTER.json

For example the batch-by-batch run and the ``--cuda-graph`` run of ``benchmarks/gpu_check.sh``
(``$OUT/bench_gpu.json`` and ``$OUT/bench_gpu_graph.json``), or a run of the previous session against this
one's. Rows are matched by model and method; a row in one run only is listed with a dash for the other.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.common import table


def _rows(path: str) -> tuple[str, dict[tuple[str, str], dict]]:
    with open(path) as f:
        data = json.load(f)
    return data.get("device", "?"), {(r["model"], r["method"]): r for r in data["rows"]}


def _number(row: dict | None, key: str) -> float | None:
    if row is None or key not in row:
        return None
    try:
        return float(str(row[key]).rstrip("x"))
    except ValueError:
        return None


def compare(before: dict, after: dict) -> list[dict]:
    """One row per (model, method) of either run: each figure before -> after, and the ratio's change."""
    out = []
    for key in list(before) + [k for k in after if k not in before]:
        b, a = before.get(key), after.get(key)
        row = {"model": key[0], "method": key[1]}
        for column in ("ratio", "observe ratio", "weights ms", "search ms"):
            vb, va = _number(b, column), _number(a, column)
            row[column] = f"{'-' if vb is None else vb:} -> {'-' if va is None else va:}"
        rb, ra = _number(b, "ratio"), _number(a, "ratio")
        row["change"] = "-" if rb is None or ra is None else f"{100 * (ra / rb - 1):+.0f}%"
        row["target"] = (a or b).get("target", "-")
        row["after"] = (a or {}).get("result", "-")
        row["graph replays"] = (a or {}).get("graph replays", "-")
        out.append(row)
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before")
    p.add_argument("after")
    a = p.parse_args(argv)
    device_b, before = _rows(a.before)
    device_a, after = _rows(a.after)
    print(f"before: {a.before} ({device_b})\nafter:  {a.after} ({device_a})")
    rows = compare(before, after)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
