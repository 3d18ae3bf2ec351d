"""The second zoo (``tests/user_models``: the models of issue 35's "Goals") against onnxruntime's own
quantization of the same float graph, with the CPU flags: per model, the integer kernels onnxruntime runs,
latency and cosine to the float model, and the goals as MET/MISSED.

quantcli: ``calibrate --placement all`` (every layer as configured, the goal's setting), ``export``
(TorchScript, onnxruntime target). The float graph: the factory's model exported by quantcli's exporter with
no quantizer (the same export passes, batch axes as calibration found them), which is also what onnxruntime's
quantizers are given. The peer: ``quant_pre_process`` then ``quantize_static`` (QDQ, QUInt8 activations, int8
weights per channel, MinMax: :func:`benchmarks.ort_peer.quantize`) for the ``cnn`` models;
``quantize_dynamic`` with its defaults (int8 weights per tensor: LSTMs as ``DynamicQuantizeLSTM``, Linears as
``DynamicQuantizeMatMul``) for the others. Latency: CPU provider, 1 thread, default options, the three
sessions of a model timed interleaved on its held-out batches
(:func:`exporters.onnxruntime.profile.time_interleaved`); ``A/A`` times the float graph against a second
session of itself, the run's noise band. Cosine: the lowest over outputs and batches. ``fused``: quantized
layers onnxruntime runs as integer kernels / quantized layers (``inspect --runtime``); ``eligible``: the
model's Conv/Linear modules and LSTM layers (onnxruntime has integer kernels for all of them) that are fused.

    python -m benchmarks.bench_user_models [--models unet,lstm_classifier] [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn
from typer.testing import CliRunner

from benchmarks.common import cpu_flags, machine, setup_threads, table, verdict
from exporters.onnxruntime.profile import time_interleaved
from quantcli.cli import app
from tests import user_models as um

_runner = CliRunner()
#: cosines this close are a tie: the same kernels on the same grid (the CNNs: both tools' u8 graphs) differ
#: in the fifth decimal by float rounding of their scales (docs/zoo.md, ``cos last-bit``)
COS_TIE = 1e-4


def cli(*args) -> tuple[int, str]:
    """The real CLI, in process: (exit code, stdout)."""
    r = _runner.invoke(app, [str(a) for a in args])
    return r.exit_code, r.stdout


def session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def run(sess: ort.InferenceSession, batches: list[dict]) -> list[list[np.ndarray]]:
    names = [i.name for i in sess.get_inputs()]
    return [sess.run(None, {n: b[n] for n in names}) for b in batches]


def min_cosine(outs: list[list[np.ndarray]], refs: list[list[np.ndarray]]) -> float:
    return min(um.cosine(g, r) for o, ref in zip(outs, refs) for g, r in zip(o, ref))


def float_graph(name: str, batch: dict[str, np.ndarray], path: Path) -> None:
    """The factory's model in float32, exported with quantcli's exporter and no quantizer."""
    from exporters import export_onnx

    model = um.module(name).make().float().eval()
    export_onnx(model, {k: torch.from_numpy(v) for k, v in batch.items()}, path)


def peer(name: str, fp32: Path, calib: Path, folder: Path) -> tuple[Path, str]:
    """onnxruntime's own quantization of ``fp32``: (its path, what it was)."""
    from onnxruntime.quantization import quant_pre_process, quantize_dynamic

    out = folder / f"{name}.ort.onnx"
    if um.available()[name] != "cnn":
        quantize_dynamic(str(fp32), str(out))
        return out, "quantize_dynamic"
    from benchmarks import ort_peer

    pre = folder / f"{name}.pre.onnx"
    quant_pre_process(str(fp32), str(pre), skip_symbolic_shape=True)
    batches = um.read_data(calib)  # a directory of batch files: its batches as they are
    data = batches if calib.is_dir() else batches[0]
    ort_peer.quantize(str(pre), data, str(out), "MinMax", "uint8")
    return out, "quantize_static u8"


def eligible(name: str) -> list[str]:
    """The layers onnxruntime has an integer kernel for: Conv/Linear modules, the layers a factory computes
    with products (``PRODUCT_LAYERS``), LSTM layers (``lstm.l0``)."""
    built = um.module(name).make()
    kinds = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    products = list(getattr(um.module(name), "PRODUCT_LAYERS", ()))
    return (
        [n for n, m in built.named_modules() if isinstance(m, kinds)]
        + products
        + [
            f"{n}.l{k}"
            for n, m in built.named_modules()
            if isinstance(m, nn.LSTM)
            for k in range(m.num_layers)
        ]
    )


def measure(name: str, folder: Path, rounds: int) -> dict:
    calib, held = um.write_data(name, folder)
    batches = um.read_data(held)
    ck, graph, fp32 = folder / f"{name}.calib.pt", folder / f"{name}.onnx", folder / f"{name}.fp32.onnx"
    row: dict = {"model": name}
    code, out = cli("calibrate", um.spec(name), "--data", calib, "--out", ck, "--placement", "all", "--json")
    if code:
        return {**row, "error": f"calibrate exit {code}"}
    code, _ = cli("export", ck, "--onnx", graph)
    if code:
        return {**row, "error": f"export exit {code}"}
    code, out = cli("verify", graph, "--reference", ck, "--data", held, "--json")
    row["verify"] = "PASS" if code == 0 else f"exit {code}"
    _, out = cli("inspect", graph, "--runtime", "onnxruntime", "--json")
    layers = json.loads(out)["layers"]
    fused = {x["layer"] for x in layers if x["fused"]}
    want = eligible(name)
    row["fused"] = f"{len(fused)}/{len(layers)}"
    row["eligible fused"] = f"{sum(n in fused for n in want)}/{len(want)}"
    row["all eligible"] = all(n in fused for n in want)
    float_graph(name, batches[0], fp32)
    ref_graph, row["peer"] = peer(name, fp32, calib, folder)
    refs = [um.float_outputs(name, b) for b in batches]
    sessions = {"int8": session(graph), "peer": session(ref_graph), "fp32": session(fp32), "A": session(fp32)}
    outs = {k: run(s, batches) for k, s in sessions.items()}
    row["cos"] = round(min_cosine(outs["int8"], refs), 5)
    row["peer cos"] = round(min_cosine(outs["peer"], refs), 5)
    times = dict(
        zip(sessions, time_interleaved([lambda s=s: run(s, batches) for s in sessions.values()], rounds))
    )
    row["int8 ms"] = round(times["int8"] * 1e3, 3)
    row["int8/peer"] = round(times["int8"] / times["peer"], 3)
    row["int8/fp32"] = round(times["int8"] / times["fp32"], 3)
    row["peer/fp32"] = round(times["peer"] / times["fp32"], 3)
    row["A/A"] = round(times["A"] / times["fp32"], 3)
    return row


def goals(rows: list[dict]) -> list[str]:
    """Issue 35's goals over the rows: every eligible layer fused; latency <= 1.0x the peer (within the A/A
    noise band) at a cosine >= the peer's."""
    ok = [r for r in rows if "error" not in r]
    band = max((abs(r["A/A"] - 1) for r in ok), default=0.0)
    fused = [r["model"] for r in ok if not r["all eligible"]]
    slow = [r["model"] for r in ok if r["int8/peer"] > 1.0 + band]
    worse = [r["model"] for r in ok if r["cos"] < r["peer cos"] - COS_TIE]
    lstm = [r for r in ok if r["model"] == "lstm_classifier"]
    out = [
        f"every layer onnxruntime has an integer kernel for is fused: {verdict(not fused)}"
        + (f" (not on {', '.join(fused)})" if fused else ""),
        f"latency <= 1.0x the peer (noise band {band:.3f}): {verdict(not slow)}"
        + (f" (over on {', '.join(slow)})" if slow else ""),
        f"cosine to float >= the peer's (ties within {COS_TIE}): {verdict(not worse)}"
        + (f" (below on {', '.join(worse)})" if worse else ""),
    ]
    if lstm:
        r = lstm[0]
        out.append(
            f"LSTM: {r['int8/peer']}x quantize_dynamic's latency at cosine {r['cos']} vs {r['peer cos']}: "
            f"{verdict(r['int8/peer'] <= 1.0 + band and r['cos'] >= r['peer cos'] - COS_TIE)}"
        )
    errors = [r["model"] for r in rows if "error" in r]
    if errors:
        out.append(f"models that did not go through the CLI: {', '.join(errors)}: MISSED")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(um.available()))
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args(argv)
    setup_threads(1)
    print(machine())
    print("CPU flags:", cpu_flags())
    print(f"onnxruntime {ort.__version__}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-user-models-") as d:
        for name in args.models.split(","):
            folder = Path(d) / name
            folder.mkdir()
            rows.append(measure(name, folder, args.rounds))
            print(json.dumps(rows[-1]), flush=True)
    cols = [
        "model", "verify", "fused", "eligible fused", "peer", "cos", "peer cos", "int8 ms", "int8/peer",
        "int8/fp32", "peer/fp32", "A/A", "error",
    ]  # fmt: skip
    print(table(rows, cols))
    for line in goals(rows):
        print(line)


if __name__ == "__main__":
    main()
