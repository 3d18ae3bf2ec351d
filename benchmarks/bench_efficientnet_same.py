"""quantcli ``--placement all`` against onnxruntime's ``quantize_static`` on an EfficientNet built the way
EfficientNet-PyTorch builds it ("same" padding in ``Conv2d`` subclasses' ``forward``; issue 35).

Both quantize the same float model from the same 64 calibration samples: onnxruntime's own quantization runs
``quant_pre_process`` then ``quantize_static`` on ``torch.onnx.export`` of the float model (QDQ, QUInt8
activations, int8 weights per channel, MinMax: what its guide recommends on x86); quantcli runs ``calibrate
--placement all``, ``export`` (each exporter) and ``verify``. For each deployed graph (onnxruntime, CPU
provider, default options, one thread): how many of the model's convolutions run as ``QLinearConv`` and of
its residual additions as ``QLinearAdd`` (read in the optimized graph onnxruntime saves), its latency on a
batch of 16 (best of interleaved rounds, against the float graph and the peer), and its cosine to the float
model on 32 held-out samples.

Goals (issue 35): every convolution a ``QLinearConv``, every residual Add a ``QLinearAdd``, at <= 1.0x
``quantize_static``'s latency and >= its cosine. Each is printed MET/MISSED with the CPU's flags; timings on a
shared machine are provisional.

    python -m benchmarks.bench_efficientnet_same [--rounds 30] [--short]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn
from typer.testing import CliRunner

from benchmarks.common import best_interleaved, machine, setup_threads, table, verdict
from exporters.onnxruntime.fusion import optimized_graph
from quantcli.cli import app
from quantcli.quant import cpu as cpu_kinds

MODEL = Path(__file__).resolve().parents[1] / "tests" / "user_models" / "efficientnet_same.py"
CALIBRATION, HELDOUT, BATCH = 64, 32, 16
EXPORTERS = ("torchscript", "dynamo")
_runner = CliRunner()


def _module():
    spec = importlib.util.spec_from_file_location("efficientnet_same", MODEL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cli(*args) -> tuple[int, str]:
    r = _runner.invoke(app, [str(a) for a in args])
    return r.exit_code, r.stdout


def session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))


def kernels(path: Path) -> Counter:
    """The op types of the graph onnxruntime runs for ``path`` (default options)."""
    return Counter(n.op_type for n in optimized_graph(path).graph.node)


def peer(fp32: Path, calib: dict[str, np.ndarray], folder: Path) -> Path:
    from onnxruntime.quantization import quant_pre_process

    from benchmarks import ort_peer

    pre, out = folder / "pre.onnx", folder / "ort.u8.onnx"
    quant_pre_process(str(fp32), str(pre), skip_symbolic_shape=True)
    ort_peer.quantize(str(pre), calib, str(out), "MinMax", "uint8")
    return out


def quantcli_graphs(factory: str, folder: Path, calib: Path, held: Path) -> dict[str, tuple[Path, str]]:
    """exporter -> (graph, verify's verdict)."""
    ck = folder / "m.calib.pt"
    code, out = cli("calibrate", f"{MODEL}:{factory}", "--data", calib, "--placement", "all", "--out", ck)
    if code:
        raise SystemExit(f"calibrate failed:\n{out}")
    graphs = {}
    for exporter in EXPORTERS:
        graph = folder / f"m.{exporter}.onnx"
        code, out = cli("export", ck, "--onnx", graph, "--exporter", exporter)
        if code:
            raise SystemExit(f"export --exporter {exporter} failed:\n{out}")
        code, out = cli("verify", graph, "--reference", ck, "--data", held, "--json")
        graphs[exporter] = (graph, {0: "PASS", 1: "FAIL"}.get(code, "ERROR"))
    return graphs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--short", action="store_true", help="the tests' shorter network (make_short)")
    args = ap.parse_args(argv)
    setup_threads(1)
    E = _module()
    factory = "make_short" if args.short else "make"
    model = getattr(E, factory)()
    convs = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    adds = sum(b.stride == 1 and b.inp == b.out for b in model._blocks)
    calib, held = E.samples(CALIBRATION, 1), E.samples(HELDOUT, 2)
    with torch.inference_mode():
        ref = model(**{k: torch.from_numpy(v) for k, v in held.items()}).numpy()
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        np.savez(folder / "calib.npz", **calib)
        np.savez(folder / "held.npz", **held)
        fp32 = folder / "fp32.onnx"
        torch.onnx.export(
            model,
            (torch.from_numpy(calib["inputs"][:2]),),
            str(fp32),
            dynamo=False,
            opset_version=17,
            input_names=["inputs"],
            dynamic_axes={"inputs": {0: "batch"}},
        )
        graphs = {"fp32": fp32, "quantize_static u8": peer(fp32, calib, folder)}
        verdicts = {}
        for exporter, (graph, v) in quantcli_graphs(
            factory, folder, folder / "calib.npz", folder / "held.npz"
        ).items():
            graphs[f"quantcli {exporter}"] = graph
            verdicts[f"quantcli {exporter}"] = v
        sessions = {k: session(p) for k, p in graphs.items()}
        feed = {"inputs": held["inputs"][:BATCH]}
        best = best_interleaved(
            {k: (lambda s=s: s.run(None, feed)) for k, s in sessions.items()}, args.rounds, 3
        )
        rows = []
        for label, path in graphs.items():
            ops = kernels(path)
            got = sessions[label].run(None, {"inputs": held["inputs"]})[0]
            rows.append(
                {
                    "graph": label,
                    "QLinearConv": f"{ops['QLinearConv']}/{convs}",
                    "QLinearAdd": f"{ops['QLinearAdd']}/{adds}",
                    "ms (batch 16)": round(best[label] * 1e3, 2),
                    "x fp32": round(best[label] / best["fp32"], 3),
                    "x peer": round(best[label] / best["quantize_static u8"], 3),
                    "cosine": round(cosine(got, ref), 5),
                    "verify": verdicts.get(label, ""),
                    "_convs": ops["QLinearConv"],
                    "_adds": ops["QLinearAdd"],
                }
            )
    print(
        f"bench_efficientnet_same ({factory}): {machine()}; CPU flags {cpu_kinds.flags()}; onnxruntime "
        f"{ort.__version__}; 1 thread; best of {args.rounds} interleaved rounds"
    )
    cols = ["graph", "QLinearConv", "QLinearAdd", "ms (batch 16)", "x fp32", "x peer", "cosine", "verify"]
    print(table(rows, cols))
    by = {r["graph"]: r for r in rows}
    ref_peer = by["quantize_static u8"]
    for exporter in EXPORTERS:
        r = by[f"quantcli {exporter}"]
        print(
            f"{exporter}: every conv QLinearConv ({r['_convs']}/{convs}): {verdict(r['_convs'] == convs)}; "
            f"every residual Add QLinearAdd ({r['_adds']}/{adds}): {verdict(r['_adds'] == adds)}; "
            f"<= 1.0x quantize_static's latency ({r['x peer']}x): {verdict(r['x peer'] <= 1.0)}; "
            f">= its cosine ({r['cosine']} vs {ref_peer['cosine']}): "
            f"{verdict(r['cosine'] >= ref_peer['cosine'])}"
        )
    print(json.dumps({r["graph"]: {k: v for k, v in r.items() if not k.startswith("_")} for r in rows}))


if __name__ == "__main__":
    main()
