"""Opset 13 vs 17 for transformers: what onnxruntime's optimizer makes of each graph, and how fast it runs.

    python -m benchmarks.bench_opset [--repeat 15] [--models text_encoder,deep_encoder]

Per model (int8 preset, max calibration): the same calibrated model exported at opset 13 (LayerNorm
decomposed) and at the default opset (17 for a model with a LayerNorm: ``LayerNormalization``). Both graphs
load in onnxruntime with default session options and 1 intra-op thread; op counts come from the optimized
graph onnxruntime saves (``SessionOptions.optimized_model_filepath``). Latency: four held-out batches, best of
interleaved runs in one process; the ratio is each variant's time over opset 13's. The onnxruntime target's
export writes the residual Adds into LayerNorms and the bias Adds into GELUs as ``Sum``
(:mod:`exporters.onnxruntime.cpu_fusions`), so onnxruntime forms no SkipLayerNormalization or BiasGelu, whose
CPU kernels are slower than what they replace; a third variant is the opset-17 graph with those ``Sum`` nodes
written back as ``Add`` (what onnxruntime fuses without that pass), which separates the fusions' cost from the
rest of the opset change. Each graph's largest output difference from the fake-quant PyTorch model is printed
beside it. Targets (computed): no SkipLayerNormalization or BiasGelu at 17; 17 is not slower than 13 (ratio <=
1.0). Last, the fused kernel alone: Add + LayerNormalization vs SkipLayerNormalization on one layer's tensor.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from benchmarks.common import best_interleaved, machine, rows_per_model, run_all, setup_threads, table
from exporters import export_onnx
from quantcli import calibrate, quantize_model

OPS = (
    "SkipLayerNormalization",
    "LayerNormalization",
    "ReduceMean",
    "Add",
    "Sum",
    "BiasGelu",
    "Gelu",
    "MatMulIntegerToFloat",
    "QuantizeLinear",
)


def _sums_as_adds(path: Path, out: Path) -> Path:
    """``path``'s graph with its two-input ``Sum`` nodes written back as ``Add``: the export without
    :func:`exporters.onnxruntime.cpu_fusions.keep_cpu_kernels` (the torch exporter writes no Sum for these
    models)."""
    m = onnx.load(str(path))
    for n in m.graph.node:
        if n.op_type == "Sum" and len(n.input) == 2:
            n.op_type = "Add"
    onnx.save(m, str(out))
    return out


def _options(optimized_path: Path | None = None) -> ort.SessionOptions:
    so = ort.SessionOptions()  # default graph optimizations
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    if optimized_path is not None:
        so.optimized_model_filepath = str(optimized_path)
    return so


def _session(path: Path, disabled: list[str], optimized_path: Path | None = None) -> ort.InferenceSession:
    kwargs = {"disabled_optimizers": disabled} if disabled else {}
    return ort.InferenceSession(
        str(path), _options(optimized_path), providers=["CPUExecutionProvider"], **kwargs
    )


def _model_and_batches(name: str):
    if name == "text_encoder":
        from sample_models import SAMPLES

        s = SAMPLES[name]
        return s.build().eval(), s.calibration_batches(), s.evaluation_batches()[:4]
    if name == "deep_encoder":
        from sample_models import structured

        return (
            structured.deep_encoder(),
            structured.deep_encoder_batches("calib", 64),
            structured.deep_encoder_batches("eval")[:4],
        )
    raise SystemExit(f"unknown model {name!r}; use text_encoder or deep_encoder")


def measure(name: str, workdir: Path, repeat: int) -> list[dict]:
    model, calib, evals = _model_and_batches(name)
    quantize_model(model, "int8")
    calibrate(model, calib, "max", device="cpu")
    graphs = {}
    for label, opset in (("13", 13), ("default", None)):
        path = workdir / f"{name}-{label}.onnx"
        res = export_onnx(model, evals[0], path, opset=opset)
        graphs[res.opset] = path
    feeds = [{k: v.numpy() for k, v in b.items()} for b in evals]
    with torch.inference_mode():
        want = [model(**b).numpy() for b in evals]
    top = max(graphs)
    variants = {
        "13": (graphs[13], []),
        str(top): (graphs[top], []),
        f"{top}, Sums as Adds": (_sums_as_adds(graphs[top], workdir / f"{name}-adds.onnx"), []),
    }
    sessions, counts, diffs = {}, {}, {}
    for i, (label, (path, disabled)) in enumerate(variants.items()):
        optimized = workdir / f"{path.stem}-{i}.opt.onnx"
        _session(path, disabled, optimized)
        counts[label] = collections.Counter(n.op_type for n in onnx.load(str(optimized)).graph.node)
        sessions[label] = _session(path, disabled)
        diffs[label] = max(
            float(np.abs(sessions[label].run(None, f)[0] - w).max()) for f, w in zip(feeds, want)
        )
    scale = max(float(np.abs(w).max()) for w in want)
    best = best_interleaved(
        {label: functools.partial(run_all, s, feeds) for label, s in sessions.items()}, repeat
    )
    rows = []
    ref = best["13"]
    for label in sessions:
        c = counts[label]
        row = {"model": name, "opset": label, "nodes (optimized)": str(sum(c.values()))}
        row.update({op: str(c.get(op, 0)) for op in OPS})
        row["ms (4 batches)"] = f"{best[label] * 1e3:.1f}"
        row["vs opset 13"] = f"{best[label] / ref:.3f}x"
        row["max|ort - fake-quant| / max|out|"] = f"{diffs[label] / scale:.2g}"
        rows.append(row)
    fused = counts[str(top)].get("SkipLayerNormalization", 0) + counts[str(top)].get("BiasGelu", 0)
    ratio = best[str(top)] / ref
    rows[1]["targets"] = (
        f"no SkipLayerNormalization/BiasGelu at {top}: {'MET' if fused == 0 else 'MISSED'}; <= 1.0x opset "
        f"13: {'MET' if ratio <= 1.0 else 'MISSED'} ({ratio:.3f}x)"
    )
    return rows


def kernel_rows(repeat: int = 200) -> list[dict]:
    """The residual Add + LayerNorm alone, as two ONNX ops and as the one SkipLayerNormalization that
    onnxruntime fuses them into: ``(50, 30, hidden)`` float32, optimizations off (each graph runs as
    written)."""
    from onnx import TensorProto, helper, numpy_helper

    def session(hidden: int, fused: bool) -> ort.InferenceSession:
        io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [None, None, hidden]) for n in ("x", "s")]
        out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
        rng = np.random.default_rng(0)
        inits = [numpy_helper.from_array(rng.random(hidden, dtype=np.float32), n) for n in ("g", "b")]
        if fused:
            nodes = [
                helper.make_node(
                    "SkipLayerNormalization",
                    ["x", "s", "g", "b"],
                    ["y"],
                    domain="com.microsoft",
                    epsilon=1e-5,
                )
            ]
        else:
            nodes = [
                helper.make_node("Add", ["x", "s"], ["a"]),
                helper.make_node("LayerNormalization", ["a", "g", "b"], ["y"], axis=-1, epsilon=1e-5),
            ]
        m = helper.make_model(
            helper.make_graph(nodes, "k", io, [out], inits),
            ir_version=8,
            opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
        )
        so = _options()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])

    rows = []
    for hidden in (64, 384):
        rng = np.random.default_rng(1)
        feeds = {n: rng.random((50, 30, hidden), dtype=np.float32) for n in ("x", "s")}
        sessions = {
            "Add + LayerNormalization": session(hidden, False),
            "SkipLayerNormalization": session(hidden, True),
        }
        best = best_interleaved(
            {label: functools.partial(s.run, None, feeds) for label, s in sessions.items()}, repeat
        )
        a, b = best["Add + LayerNormalization"], best["SkipLayerNormalization"]
        rows.append(
            {
                "hidden": str(hidden),
                "Add + LayerNormalization us": f"{a * 1e6:.0f}",
                "SkipLayerNormalization us": f"{b * 1e6:.0f}",
                "fused / unfused": f"{b / a:.2f}x",
            }
        )
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--models", default="text_encoder,deep_encoder")
    a = p.parse_args(argv)
    setup_threads(1)
    print(
        f"opset 13 vs default (17 with LayerNorm), onnxruntime {ort.__version__}: {machine()}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    rows = rows_per_model(a.models.split(","), lambda name, d: measure(name, d, a.repeat))
    print(table(rows))
    print("\nthe residual Add + LayerNorm of one layer, (50, 30, hidden), best of 200 interleaved runs:")
    print(table(kernel_rows()))
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
