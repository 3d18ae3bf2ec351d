"""Where a zoo model's graphs spend their time, op type by op type: quantcli's int8 graph (``calibrate
--placement all`` unless ``--placement auto``, exported with ``--exporter``), the float model exported the
same way, and onnxruntime's own ``quantize_static`` with uint8 activations (bench_zoo's ``peer``).
onnxruntime's profiler (:func:`exporters.onnxruntime.profile.node_times`): CPU provider, default
optimizations, 1 thread, the three graphs interleaved, per node the median of ``--rounds`` runs, on the 32
held-out samples.

    python -m benchmarks.profile_zoo [--model resnet] [--exporter torchscript|dynamo] [--placement all|auto]
        [--rounds 50] [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.bench_zoo import cli, export_float, export_float_like, peer
from benchmarks.common import cpu_flags, machine, setup_threads
from exporters.onnxruntime.fusion import optimized_graph
from exporters.onnxruntime.profile import node_times
from tests.zoo import registry as zoo


def graphs(
    name: str, folder: Path, exporter: str = "torchscript", placement: str = "all"
) -> tuple[dict[str, Path], dict[str, np.ndarray]]:
    calib_path, held_path = zoo.write_data(name, folder)
    with np.load(calib_path) as z:
        calib = {k: z[k] for k in z.files}
    with np.load(held_path) as z:
        held = {k: z[k] for k in z.files}
    ck, int8 = folder / f"{name}.calib.pt", folder / f"{name}.int8.onnx"
    for args in (
        ("calibrate", zoo.spec(name), "--data", calib_path, "--placement", placement, "--out", ck),
        ("export", ck, "--onnx", int8, "--exporter", exporter),
    ):
        code, out = cli(*args)
        if code:
            raise SystemExit(f"{args[0]} failed: {out[-400:]}")
    fp32 = folder / f"{name}.fp32.onnx"
    export_float_like(name, calib, int8, exporter, fp32)
    base = folder / f"{name}.fp32.opset17.onnx"  # the peer quantizes the float model as bench_zoo exports it
    export_float(name, calib, base)
    return {"fp32": fp32, "quantcli int8": int8, "ort u8": peer(name, base, calib, folder)[0]}, held


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet")
    ap.add_argument("--exporter", choices=("torchscript", "dynamo"), default="torchscript")
    ap.add_argument("--placement", choices=("all", "auto"), default="all")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--top", type=int, default=12, help="op types shown per graph")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    setup_threads(1)
    what = f"{args.model} ({args.exporter}, --placement {args.placement})"
    print(f"profile of {what}: {machine()}; CPU flags: {cpu_flags()}", flush=True)
    with tempfile.TemporaryDirectory() as d:
        paths, held = graphs(args.model, Path(d), args.exporter, args.placement)
        times = node_times(list(paths.values()), held, args.rounds)
        for (label, path), t in zip(paths.items(), times):
            ops = {n.name: n.op_type for n in optimized_graph(path).graph.node}
            by = collections.defaultdict(lambda: [0, 0.0])
            for node, us in t.items():
                by[ops.get(node, "?")][0] += 1
                by[ops.get(node, "?")][1] += us
            total = sum(t.values())
            print(f"{label}: {total:.0f} us in {len(t)} nodes (sum of per-node medians)")
            for op, (count, us) in sorted(by.items(), key=lambda kv: -kv[1][1])[: args.top]:
                print(f"  {op:26s} {count:4d} nodes {us:9.1f} us {us / total:6.1%}")


if __name__ == "__main__":
    main()
