"""Whether to quantize a model's output (a classifier's logits), as onnxruntime's ``quantize_static`` does:
quantcli's graph as exported (the output in float) against the same graph with a uint8 Q/DQ on each output.

Per model: ``calibrate --target onnxruntime --placement all``, ``export``; then a copy of the graph with
QuantizeLinear -> DequantizeLinear on the graph's output (the first: the logits), its range its min and max
over the calibration data (widened to hold 0; scale ``(max - min) / 255``, zero point ``round(-min / scale)``,
as onnxruntime computes them). Both against the float model on held-out data: cosine (each output as one
vector), top-1 agreement (argmax over the last axis), and the share of held-out outputs the clip cuts. Models:
the trained sample models (digits_cnn, text_encoder, tiny_lm) and the zoo's image classifiers and encoders
(random init).

The decision it backs (docs/zoo.md#mobilenet_v2-against-quantize_static): quantcli keeps the output in float,
which must be at least as accurate on every trained model.

    python -m benchmarks.bench_output_quantization [--models digits_cnn,resnet]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from benchmarks.bench_zoo import cli, model_data, session
from benchmarks.common import machine, setup_threads, table, verdict
from quantcli.quant import arithmetic
from tests.zoo import registry as zoo

TRAINED = ("digits_cnn", "text_encoder", "tiny_lm")
ZOO = ("resnet", "mobilenet_v2", "convnext", "efficientnet", "vit", "swin", "mobilevit", "bert", "distilbert")


def _run(graph, batches: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    sess = session(graph)
    names = [i.name for i in sess.get_inputs()]
    outs = [sess.run(None, {n: b[n] for n in names}) for b in batches]
    return [np.concatenate(x) for x in zip(*outs)]


def with_quantized_outputs(graph: Path, ranges: dict[str, tuple[float, float]]) -> bytes:
    """``graph`` with a uint8 Q/DQ on each output named in ``ranges``, over its range, serialized."""
    m = onnx.load(str(graph))
    g = m.graph
    for name in ranges:
        pre = f"{name}__float"
        scale, zp = arithmetic.affine_qparams(*ranges[name], 8)  # onnxruntime's uint8 formula, float32
        for n in g.node:  # the producer and any other reader take the float value under a new name
            n.output[:] = [pre if o == name else o for o in n.output]
            n.input[:] = [pre if i == name else i for i in n.input]
        g.initializer.extend(
            [
                numpy_helper.from_array(scale.numpy(), f"{name}__scale"),
                numpy_helper.from_array(zp.numpy().astype(np.uint8), f"{name}__zp"),
            ]
        )
        qdq = [pre, f"{name}__scale", f"{name}__zp"]
        g.node.extend(
            [
                helper.make_node("QuantizeLinear", qdq, [f"{name}__q"]),
                helper.make_node("DequantizeLinear", [f"{name}__q", *qdq[1:]], [name]),
            ]
        )
    onnx.checker.check_model(m)
    return m.SerializeToString()


def _data(name: str, folder: Path):
    """(spec, --data arguments, calibration batches, held-out batches, float outputs on them)"""
    if name in TRAINED:
        from quantcli.inputs.loading import load_model
        from sample_models import SAMPLES

        s = SAMPLES[name]
        calib, held = (
            [{k: v.numpy() for k, v in b.items()} for b in bs]
            for bs in (s.calibration_batches(), s.evaluation_batches())
        )
        model, _ = load_model(name)
        with torch.inference_mode():
            outs = [model(**{k: torch.from_numpy(v) for k, v in b.items()}) for b in held]
        return name, [], calib, held, [np.concatenate([o.numpy() for o in outs])]  # one output: the logits
    calib_path, _, calib, held, ref = model_data(name, folder)
    return zoo.spec(name), ["--data", calib_path], [calib], [held], ref


def measure(name: str, folder: Path) -> dict:
    spec, data, calib, held, ref = _data(name, folder)
    ck, graph = folder / f"{name}.calib.pt", folder / f"{name}.onnx"
    for args in (
        ("calibrate", spec, *data, "--target", "onnxruntime", "--placement", "all", "--out", ck),
        ("export", ck, "--onnx", graph),
    ):
        code, out = cli(*args)
        if code:
            raise RuntimeError(f"{args[0]} failed ({code}): {out[-300:]}")
    output = onnx.load(str(graph), load_external_data=False).graph.output[0].name  # the logits
    out = _run(graph, calib)[0]
    lo, hi = float(out.min()), float(out.max())
    g, gq, r = _run(graph, held)[0], _run(with_quantized_outputs(graph, {output: (lo, hi)}), held)[0], ref[0]
    return {
        "model": name,
        "trained": "yes" if name in TRAINED else "no (random init)",
        "cos float output": zoo.cosine(g, r),
        "cos quantized output": zoo.cosine(gq, r),
        "difference": zoo.cosine(gq, r) - zoo.cosine(g, r),
        "top-1 float": float((g.argmax(-1) == r.argmax(-1)).mean()),
        "top-1 quantized": float((gq.argmax(-1) == r.argmax(-1)).mean()),
        "clipped": float(((g < min(lo, 0.0)) | (g > max(hi, 0.0))).mean()),
    }


def _cell(key: str, v):
    if not isinstance(v, float):
        return v
    return f"{v:+.6f}" if key == "difference" else f"{v:.6f}" if key.startswith("cos") else f"{v:.1%}"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(TRAINED + ZOO))
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    setup_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in a.models.split(","):
            folder = Path(d) / name
            folder.mkdir()
            rows.append(measure(name, folder))
    print(f"output quantization — {machine()}")
    fmt = [{k: _cell(k, v) for k, v in r.items()} for r in rows]
    print(table(fmt, list(rows[0])))
    trained = [r for r in rows if r["trained"] == "yes"]
    hurt = [r for r in rows if r["difference"] < 0]
    print(f"quantizing the output lowers the cosine on {len(hurt)}/{len(rows)} models")
    print(
        f"float output at least as accurate on every trained model "
        f"({sum(r['difference'] <= 0 for r in trained)}/"
        f"{len(trained)}): {verdict(bool(trained) and all(r['difference'] <= 0 for r in trained))}"
    )
    return rows


if __name__ == "__main__":
    main()
