"""The kernel-cost table latency placement decides from (exporters/onnxruntime/kernel_costs.json), measured on
this machine.

    python -m benchmarks.bench_kernel_costs            # print the rows for this CPU
    python -m benchmarks.bench_kernel_costs --write    # and store them as this CPU kind's table
    python -m benchmarks.bench_kernel_costs --ops stem --write   # only the stem rows, the others kept

Each row times, in onnxruntime's CPU provider (default session options, 1 thread), a chain of four identical
layers quantized as quantcli exports them for the onnxruntime target (uint8 activations after a ReLU, int8
weights per output channel, a Q on every output: onnxruntime fuses each into ``QLinearConv`` or
``QLinearMatMul``) against the same chain in float, batch 8, the two sessions interleaved, median of the
rounds. The ratio int8/float is the table's value; :mod:`exporters.onnxruntime.kernel_costs` predicts a
layer's from its nearest row. The rows are chains, not single ops, so a layer's Q/DQ at the graph's edges
does not weigh on them. A stem (a convolution of the graph input's 1-3 channels) is timed alone, as it runs:
the int8 side quantizes the float input and runs ``QLinearConv``, the float side runs the Conv and Relu and
quantizes their output for the next layer, both with a Q on the output.

Rows written with ``--ops`` replace that op's rows only, each stamped with its own machine, onnxruntime and
date where the table's others were measured elsewhere.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from benchmarks.common import machine, setup_threads, table
from exporters.onnxruntime.kernel_costs import CONV, DEPTHWISE, GEMM, STEM, TABLE, LayerShape
from quantcli.quant import cpu as cpu_kinds

BATCH = 8
LAYERS = 4
#: (op, channels (GEMM: features), kernel, spatial side (GEMM: rows per sample))
SHAPES = [
    *((CONV, c, k, hw) for c, k, hw in [
        (8, 3, 56), (16, 3, 56), (32, 3, 28), (64, 3, 28), (128, 3, 14), (256, 3, 14), (512, 3, 7),
        (32, 1, 56), (64, 1, 28), (256, 1, 14), (1024, 1, 7), (16, 3, 112),
    ]),
    *((DEPTHWISE, c, k, hw) for c, k, hw in [
        (16, 3, 112), (32, 3, 56), (64, 3, 56), (96, 3, 28), (128, 3, 14), (256, 3, 14), (512, 3, 7),
        (32, 5, 56), (128, 5, 14), (128, 7, 14), (384, 7, 7), (64, 7, 56),
    ]),
    *((GEMM, c, 1, m) for c, m in [
        (16, 1), (32, 1), (64, 1), (128, 1), (256, 1), (512, 1), (1024, 1),
        (32, 32), (64, 64), (128, 128), (256, 128), (768, 128),
    ]),
]  # fmt: skip
#: stems: (input channels, kernel, output channels, input side, stride); a kernel equal to its stride
#: (ConvNeXt's and ViT's patch embeddings) has no padding
STEMS = [
    (1, 3, 16, 28, 1), (1, 5, 32, 28, 1), (1, 3, 32, 64, 1), (3, 3, 16, 16, 1), (3, 3, 32, 32, 1),
    (3, 3, 16, 224, 2), (3, 3, 32, 224, 2), (3, 7, 64, 224, 2), (3, 4, 96, 224, 4), (3, 16, 192, 224, 16),
]  # fmt: skip


def _chain(op: str, c: int, k: int, side: int, quantized: bool, rng: np.random.Generator):
    """A chain of LAYERS layers and its input's shape."""
    nodes, inits = [], []
    scale = numpy_helper.from_array(np.array(0.05, np.float32), "s")
    zero = numpy_helper.from_array(np.array(0, np.uint8), "z")
    x = "x"
    if quantized:
        inits += [scale, zero]
        nodes.append(helper.make_node("QuantizeLinear", ["x", "s", "z"], ["x_q"]))
        x = "x_q"
    groups = c if op == DEPTHWISE else 1
    for i in range(LAYERS):
        w = (rng.standard_normal((c, c // groups, k, k) if op != GEMM else (c, c)) * 0.1).astype(np.float32)
        if op == GEMM:
            w = np.ascontiguousarray(w.T)  # [K, N] for MatMul, per output channel on axis 1
        axis = 0 if op != GEMM else 1
        if quantized:
            flat = np.moveaxis(np.abs(w), axis, 0).reshape(c, -1)
            ws = (flat.max(1) / 63).astype(np.float32)
            shape = [-1 if d == axis else 1 for d in range(w.ndim)]
            wq = np.clip(np.round(w / ws.reshape(shape)), -63, 63).astype(np.int8)
            inits += [
                numpy_helper.from_array(wq, f"w{i}"),
                numpy_helper.from_array(ws, f"ws{i}"),
                numpy_helper.from_array(np.zeros(c, np.int8), f"wz{i}"),
            ]
            nodes += [
                helper.make_node("DequantizeLinear", [x, "s", "z"], [f"xd{i}"]),
                helper.make_node("DequantizeLinear", [f"w{i}", f"ws{i}", f"wz{i}"], [f"wd{i}"], axis=axis),
            ]
            xin, wname = f"xd{i}", f"wd{i}"
        else:
            inits.append(numpy_helper.from_array(w, f"w{i}"))
            xin, wname = x, f"w{i}"
        if op == GEMM:
            nodes.append(helper.make_node("MatMul", [xin, wname], [f"c{i}"]))
        else:
            nodes.append(helper.make_node("Conv", [xin, wname], [f"c{i}"], pads=[k // 2] * 4, group=groups))
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"]))
        x = f"r{i}"
        if quantized:
            nodes.append(helper.make_node("QuantizeLinear", [x, "s", "z"], [f"q{i}"]))
            x = f"q{i}"
    nodes.append(
        helper.make_node("DequantizeLinear", [x, "s", "z"], ["y"])
        if quantized
        else helper.make_node("Identity", [x], ["y"])
    )
    shape = [BATCH * side, c] if op == GEMM else [BATCH, c, side, side]
    return _model("chain", nodes, inits, shape), shape


def _model(name: str, nodes, inits, shape: list[int]):
    """An opset-13 model of ``nodes`` from input ``x`` (``shape``) to output ``y``."""
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


def _stem(cin: int, k: int, cout: int, side: int, stride: int, quantized: bool, rng: np.random.Generator):
    """One stem convolution (then Relu) with a Q/DQ on its output, and its input's shape."""
    pad = 0 if k == stride else k // 2
    w = (rng.standard_normal((cout, cin, k, k)) * 0.1).astype(np.float32)
    inits = [
        numpy_helper.from_array(np.array(0.05, np.float32), "s"),
        numpy_helper.from_array(np.array(0, np.uint8), "z"),
        numpy_helper.from_array(np.array(0.05, np.float32), "xs"),
        numpy_helper.from_array(np.array(128, np.uint8), "xz"),
    ]
    nodes, x, wname = [], "x", "w"
    if quantized:
        ws = (np.abs(w).reshape(cout, -1).max(1) / 63).astype(np.float32)
        wq = np.clip(np.round(w / ws.reshape(-1, 1, 1, 1)), -63, 63).astype(np.int8)
        inits += [
            numpy_helper.from_array(wq, "wq"),
            numpy_helper.from_array(ws, "ws"),
            numpy_helper.from_array(np.zeros(cout, np.int8), "wz"),
        ]
        nodes += [
            helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["x_q"]),
            helper.make_node("DequantizeLinear", ["x_q", "xs", "xz"], ["x_d"]),
            helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=0),
        ]
        x = "x_d"
    else:
        inits.append(numpy_helper.from_array(w, "w"))
    nodes += [
        helper.make_node("Conv", [x, wname], ["c"], pads=[pad] * 4, strides=[stride, stride]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("QuantizeLinear", ["r", "s", "z"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
    ]
    shape = [BATCH, cin, side, side]
    return _model("stem", nodes, inits, shape), shape


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), for the table's ``measured_on``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _session(model):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _time(q, f, x: np.ndarray, min_seconds: float) -> tuple[float, float]:
    """Median ms of the int8 and the float session, interleaved run by run."""
    sessions = {"int8": _session(q), "float": _session(f)}
    times = {name: [] for name in sessions}
    for s in sessions.values():
        s.run(None, {"x": x})
    start = time.perf_counter()
    while time.perf_counter() - start < min_seconds or len(times["int8"]) < 5:
        for name, s in sessions.items():
            t = time.perf_counter()
            s.run(None, {"x": x})
            times[name].append(time.perf_counter() - t)
    return tuple(statistics.median(times[n]) * 1e3 for n in ("int8", "float"))


def measure(op: str, c: int, k: int, side: int, min_seconds: float) -> dict:
    rng = np.random.default_rng(0)
    (q, shape), (f, _) = _chain(op, c, k, side, True, rng), _chain(op, c, k, side, False, rng)
    x = np.abs(rng.standard_normal(shape)).astype(np.float32)
    int8_ms, float_ms = _time(q, f, x, min_seconds)
    if op == GEMM:
        layer = LayerShape(GEMM, c, c, side)
    elif op == DEPTHWISE:
        layer = LayerShape(DEPTHWISE, k * k, c, side * side)
    else:
        layer = LayerShape(CONV, c * k * k, c, side * side)
    return _row(layer, int8_ms, float_ms)


def measure_stem(cin: int, k: int, cout: int, side: int, stride: int, min_seconds: float) -> dict:
    rng = np.random.default_rng(0)
    (q, shape), (f, _) = (
        _stem(cin, k, cout, side, stride, True, rng),
        _stem(cin, k, cout, side, stride, False, rng),
    )
    x = rng.standard_normal(shape).astype(np.float32)
    int8_ms, float_ms = _time(q, f, x, min_seconds)
    out = (side + 2 * (0 if k == stride else k // 2) - k) // stride + 1
    return _row(LayerShape(STEM, cin * k * k, cout, out * out), int8_ms, float_ms)


def _row(layer: LayerShape, int8_ms: float, float_ms: float) -> dict:
    return {
        "op": layer.op,
        "reduction": layer.reduction,
        "outputs": layer.outputs,
        "positions": layer.positions,
        "int8_ms": round(int8_ms, 4),
        "float_ms": round(float_ms, 4),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="store the rows as this CPU kind's table")
    p.add_argument(
        "--out", type=Path, help="with --write: the JSON file to write (default: the shipped table)"
    )
    p.add_argument("--seconds", type=float, default=0.6, help="timed seconds per row, at least (default 0.6)")
    p.add_argument(
        "--ops",
        default=",".join((CONV, DEPTHWISE, GEMM, STEM)),
        help="the ops to measure, comma-separated (default: all); with --write only their rows are replaced",
    )
    args = p.parse_args(argv)
    setup_threads(1)
    ops = set(args.ops.split(","))
    kind = cpu_kinds.detect()
    print(f"kernel costs: {machine()}; CPU {cpu_kinds.flags()}; onnxruntime {ort.__version__}; 1 thread")
    rows = [measure(*s, args.seconds) for s in SHAPES if s[0] in ops]
    rows += [measure_stem(*s, args.seconds) for s in STEMS] if STEM in ops else []
    shown = [
        {
            **r,
            "ratio": f"{r['int8_ms'] / r['float_ms']:.2f}",
            "faster": "int8" if r["int8_ms"] < r["float_ms"] else "float",
        }
        for r in rows
    ]
    print(table(shown, list(shown[0])))
    if args.write:
        target = args.out or TABLE
        data = json.loads(target.read_text()) if target.exists() else {}
        here = {
            "measured_on": f"{cpu_model()} ({os.cpu_count()} cores), {cpu_kinds.flags()}",
            "onnxruntime": ort.__version__,
            "date": datetime.date.today().isoformat(),
        }
        old = data.get(kind)
        if old is None or ops >= {CONV, DEPTHWISE, GEMM, STEM}:
            data[kind] = {**here, "command": "python -m benchmarks.bench_kernel_costs --write", "rows": rows}
        else:  # these ops' rows replaced, each stamped where it differs from the table's own
            stamp = {k: v for k, v in here.items() if old.get(k) != v}
            kept = [r for r in old["rows"] if r["op"] not in ops]
            old["rows"] = kept + [{**r, **stamp} for r in rows]
        target.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {len(rows)} rows for {kind} to {target}")


if __name__ == "__main__":
    main()
