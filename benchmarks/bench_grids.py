"""Which activation grid and method calibrate the zoo most accurately for onnxruntime: symmetric int8 (the
``int8`` preset) or asymmetric uint8 with a zero point (what onnxruntime's own ``quantize_static`` uses),
under ``max`` and ``mse``, each as the cosine of the int8 graph to the float model on the held-out samples
(worst output), averaged over calibration draws: the 64 calibration samples, then each of bench_zoo's
``SUBSETS`` (without the first or last 8, the even or odd ones). One draw's cosine moves by up to 0.09 on a
random-init MobileNetV2 (bench_zoo's ``peer cos spread``); a mean over draws is what a choice of default can
be read from. Beside them, for CNNs and ViTs, onnxruntime's ``quantize_static`` u8 (MinMax, per-channel
weights, after ``quant_pre_process``) on the same draws.

Every graph: ``calibrate --target onnxruntime --placement all`` (every layer int8: the grid, not the latency
placement, is measured) and ``export`` with the default exporter. ``vs peer``: the mean over draws of the
cosine's difference to the peer's on the same draw, and the one-sided 95% t bound of that mean
(:func:`benchmarks.common.paired_difference`): a difference within it is a tie on these draws. The grids: the
``int8`` preset with ``asymmetric_activations: false`` (symmetric int8) and ``true`` (the onnxruntime target's
default: signed activations on uint8 with a zero point, tensors >= 0 on the unsigned grid).

    python -m benchmarks.bench_grids [--models resnet,bert] [--methods max,mse] [--draws 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.bench_zoo import (
    SUBSETS,
    cli,
    export_float,
    min_cosine,
    model_data,
    peer,
    peer_draw_cosines,
    session,
)
from benchmarks.common import machine, paired_difference, setup_threads, table
from tests.zoo import registry as zoo

PEER = "quantize_static u8"
GRIDS = {
    "symmetric": "preset: int8\nasymmetric_activations: false\n",
    "asymmetric": "preset: int8\nasymmetric_activations: true\n",  # the onnxruntime target's default
}


def draws(calib: dict[str, np.ndarray], n: int) -> list[dict[str, np.ndarray]]:
    """The first ``n`` calibration draws: all the samples, then :data:`SUBSETS`."""
    parts = [slice(None), *SUBSETS][:n]
    return [{k: v[p] for k, v in calib.items()} for p in parts]


def quantcli_cosine(name, data_path, held, ref, folder: Path, grid: str, method: str, tag: str) -> float:
    ck, graph = folder / f"{tag}.pt", folder / f"{tag}.onnx"
    args = ["calibrate", zoo.spec(name), "--data", data_path, "--out", ck, "--placement", "all"]
    args += ["--target", "onnxruntime", "--method", method]
    cfg = folder / f"{grid}.yaml"
    cfg.write_text(GRIDS[grid])
    args += ["--config", cfg]
    code, out = cli(*args)
    if code:
        raise RuntimeError(f"calibrate failed: {out[-300:]}")
    code, out = cli("export", ck, "--onnx", graph)
    if code:
        raise RuntimeError(f"export failed: {out[-300:]}")
    return min_cosine(session(graph), held, ref)


def measure(name: str, folder: Path, methods, n_draws: int) -> list[dict]:
    _, _, calib, held, ref = model_data(name, folder)
    sets = draws(calib, n_draws)
    paths = []
    for i, d in enumerate(sets):
        p = folder / f"{name}.draw{i}.npz"
        np.savez(p, **d)
        paths.append(p)
    rows = []
    for grid in GRIDS:
        for method in methods:
            cos = [
                quantcli_cosine(name, p, held, ref, folder, grid, method, f"{name}.{grid}.{method}.{i}")
                for i, p in enumerate(paths)
            ]
            rows.append({"model": name, "graph": f"quantcli {grid} {method}", "cosines": cos})
    if zoo.MODELS.get(name) != "transformer":
        fp32 = folder / f"{name}.fp32.onnx"
        export_float(name, calib, fp32)
        graph, _ = peer(name, fp32, calib, folder)
        first = min_cosine(session(graph), held, ref)
        cos = peer_draw_cosines(name, calib, held, ref, folder, first)[:n_draws] if n_draws > 1 else [first]
        rows.append({"model": name, "graph": PEER, "cosines": cos})
    peer_cos = next((r["cosines"] for r in rows if r["graph"] == PEER), None)
    for r in rows:
        c = r["cosines"]
        r.update({"mean cos": statistics.fmean(c), "min": min(c), "max": max(c), "draws": len(c)})
        if peer_cos is not None and r["graph"] != PEER and len(c) > 1:
            r["vs peer"] = "{:+.4f} ± {:.4f}".format(*paired_difference(c, peer_cos))
    return rows


def summary(rows: list[dict]) -> list[str]:
    """Per variant: the mean over models of its mean cosine's difference to symmetric max, and on how many
    models it is the best quantcli variant."""
    models = sorted({r["model"] for r in rows}, key=[r["model"] for r in rows].index)
    by = {(r["model"], r["graph"]): r["mean cos"] for r in rows}
    variants = [g for g in dict.fromkeys(r["graph"] for r in rows) if g.startswith("quantcli")]
    base = "quantcli symmetric max"
    lines = []
    for v in variants:
        diffs = [by[(m, v)] - by[(m, base)] for m in models if (m, v) in by and (m, base) in by]
        top = {m: max(by[(m, u)] for u in variants if (m, u) in by) for m in models}
        best = sum(1 for m in models if (m, v) in by and by[(m, v)] >= top[m])
        worst = min(diffs) if diffs else float("nan")
        lines.append(
            f"{v}: mean cosine {statistics.fmean(diffs):+.4f} against symmetric max over {len(diffs)} models "
            f"(worst model {worst:+.4f}); best quantcli variant on {best}"
        )
    peers = [m for m in models if (m, PEER) in by]
    for v in variants:
        ahead = [m for m in peers if (m, v) in by and by[(m, v)] >= by[(m, PEER)]]
        lines.append(f"{v}: mean cosine >= quantize_static u8's on {len(ahead)}/{len(peers)} image models")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(zoo.MODELS), help="comma-separated zoo models")
    ap.add_argument("--methods", default="max,mse", help="comma-separated calibrate methods")
    ap.add_argument("--draws", type=int, default=5, help=f"calibration draws, 1 to {1 + len(SUBSETS)}")
    a = ap.parse_args(argv)
    setup_threads(1)
    print(machine())
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_grids.") as d:
        for name in a.models.split(","):
            folder = Path(d) / name
            folder.mkdir()
            got = measure(name, folder, a.methods.split(","), a.draws)
            for r in got:
                print(f"{r['model']:16s} {r['graph']:28s} mean {r['mean cos']:.4f}", flush=True)
            rows += got
    cols = ("mean cos", "min", "max")
    shown = [{**r, **{k: f"{r[k]:.4f}" for k in cols}} for r in rows]
    print(table(shown, ["model", "graph", *cols, "draws", "vs peer"]))
    print("\n".join(summary(rows)))


if __name__ == "__main__":
    main()
