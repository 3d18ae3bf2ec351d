"""Deployed latency and accuracy in onnxruntime: quantcli's int8 graph (default target) against the fp32 graph
and onnxruntime's own quantization of the same model.

    python -m benchmarks.bench_deploy [--repeat 15] [--models digits_cnn,resnet_cnn,...]

Per model, in one process, every graph loaded as a user would (``InferenceSession(path)``, default session
options, one intra-op thread): the fp32 ONNX export; quantcli's int8 graph (``int8`` preset, max calibration,
default target); onnxruntime's ``quantize_static`` (QDQ, per-channel int8 weights, its defaults otherwise,
after ``quant_pre_process``) for the CNNs and ``quantize_dynamic`` (per-channel) for the transformers, both
calibrated on the same batches as quantcli. Latency: best of ``--repeat`` runs on one held-out batch, the
graphs interleaved run by run. Accuracy on the held-out set against the fp32 graph: top-1 agreement
(classifiers), mean cosine (embeddings); the outputs' mean cosine to fp32's is printed for every model.
``unfused``: quantized layers onnxruntime leaves in float (:mod:`exporters.onnxruntime.fusion`). The ``b1``
columns time the same graphs on the batch's first sample alone, as an online service runs them (no goal:
where Q/DQ nodes and layout changes weigh most). quantcli's graph here is ``quantize_model`` + ``calibrate``
(the structural placement, no latency placement: that is the ``calibrate`` command's, for its ``--cpu``).

Goals, each printed MET or MISSED: quantcli <= 1.0x quantize_static's latency on every CNN and <= 0.8x
quantize_dynamic's on the transformers, at equal or better accuracy, with no unfused layer on the CNNs.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from benchmarks.common import cpu_flags, machine, setup_threads, table
from exporters import export_onnx
from exporters.onnxruntime.fusion import inspect_fusion
from quantcli import calibrate, quantize_model

CNN_GOAL = 1.0  # quantcli / quantize_static latency
TRANSFORMER_GOAL = 0.8  # quantcli / quantize_dynamic latency
# LayerNormalization is an op from 17 on: the fp32 and onnxruntime-quantized graphs get its fusions
FP32_OPSET = 17


@dataclass
class Case:
    name: str
    build: Callable[[], torch.nn.Module]
    calib: Callable[[], list[dict[str, torch.Tensor]]]
    held_out: Callable[[], list[dict[str, torch.Tensor]]]
    transformer: bool
    embedding: bool = False


def _cases() -> dict[str, Case]:
    from sample_models import digits_cnn, structured, text_encoder

    return {
        c.name: c
        for c in [
            Case(
                "digits_cnn",
                digits_cnn.build,
                digits_cnn.calibration_batches,
                lambda: digits_cnn.evaluation_batches(64),
                False,
            ),
            Case(
                "resnet_cnn",
                structured.resnet_cnn,
                lambda: structured.resnet_batches(256, 32),
                lambda: structured.resnet_batches(256, 32, split="eval"),
                False,
            ),
            Case(
                "bit_resnet",
                structured.bit_resnet,
                lambda: structured.resnet_batches(256, 32),
                lambda: structured.resnet_batches(256, 32, split="eval"),
                False,
            ),
            Case(
                "conv1d_bn",
                structured.conv1d_bn,
                lambda: structured.conv1d_batches(256, 32, seed=0),
                lambda: structured.conv1d_batches(256, 32, seed=1),
                False,
            ),
            Case(
                "text_encoder",
                text_encoder.build,
                text_encoder.calibration_batches,
                text_encoder.evaluation_batches,
                True,
            ),
            Case(
                "deep_encoder",
                structured.deep_encoder,
                lambda: structured.deep_encoder_batches("calib", 128),
                lambda: structured.deep_encoder_batches("eval", 192),
                True,
                embedding=True,
            ),
        ]
    }


# ------------------------------------------------------------------------------------------- graphs


def export_fp32(model: torch.nn.Module, example: dict[str, torch.Tensor], path: Path) -> None:
    """The float model as a user exports it: torch.onnx.export, dynamic batch (and sequence for token
    inputs)."""
    names = list(example)
    axes = {
        k: ({0: "batch", 1: "sequence"} if not v.dtype.is_floating_point else {0: "batch"})
        for k, v in example.items()
    }
    torch.onnx.export(
        model,
        (),
        str(path),
        kwargs=dict(example),
        dynamo=False,
        opset_version=FP32_OPSET,
        input_names=names,
        output_names=["output"],
        dynamic_axes={**axes, "output": {0: "batch"}},
    )


class _Reader:
    """onnxruntime's CalibrationDataReader over our batches."""

    def __init__(self, batches):
        self._it = iter([{k: v.numpy() for k, v in b.items()} for b in batches])

    def get_next(self):
        return next(self._it, None)


def quantize_with_onnxruntime(fp32: Path, work: Path, calib, dynamic: bool) -> Path:
    from onnxruntime.quantization import QuantFormat, quantize_dynamic, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = work / "pre.onnx"
    try:
        quant_pre_process(str(fp32), str(pre))
    # its symbolic shape inference gives up on some graphs (text_encoder): the ONNX one then
    except Exception:
        quant_pre_process(str(fp32), str(pre), skip_symbolic_shape=True)
    out = work / ("dynamic.onnx" if dynamic else "static.onnx")
    if dynamic:
        quantize_dynamic(str(pre), str(out), per_channel=True)
    else:
        quantize_static(str(pre), str(out), _Reader(calib), quant_format=QuantFormat.QDQ, per_channel=True)
    return out


def quantize_with_quantcli(model: torch.nn.Module, calib, path: Path) -> int:
    """Returns how many quantized layers onnxruntime leaves in float."""
    # the structure read from a forward on the first batch, as `quantcli calibrate` reads it
    q = quantize_model(copy.deepcopy(model), "int8", example=calib[0])
    calibrate(q, calib, method="max", device="cpu")
    export_onnx(q, calib[0], path)
    return len(inspect_fusion(path).unfused)


def session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _feeds(sess, batch) -> dict[str, np.ndarray]:
    names = [i.name for i in sess.get_inputs()]
    return {k: v.numpy() for k, v in batch.items() if k in names}


# ------------------------------------------------------------------------------------------- measuring


def best_latency(
    sessions: dict[str, ort.InferenceSession],
    batch,
    repeat: int,
    min_seconds: float = 3.0,
    max_rounds: int = 400,
) -> dict[str, float]:
    """Best run of each session (seconds), the sessions interleaved run by run after one warm-up each: at
    least ``repeat`` rounds, and more (up to ``max_rounds``) until ``min_seconds`` have passed, so that
    millisecond graphs get enough runs for one not to be pre-empted on a shared machine."""
    feeds = {k: _feeds(s, batch) for k, s in sessions.items()}
    for k, s in sessions.items():
        s.run(None, feeds[k])
    best = {k: float("inf") for k in sessions}
    start, rounds = time.perf_counter(), 0
    while rounds < repeat or (time.perf_counter() - start < min_seconds and rounds < max_rounds):
        for k, s in sessions.items():
            t = time.perf_counter()
            s.run(None, feeds[k])
            best[k] = min(best[k], time.perf_counter() - t)
        rounds += 1
    return best


def accuracy(sess, ref_sess, batches) -> dict[str, float]:
    """Against the fp32 graph on ``batches``: top-1 agreement and the mean per-sample cosine of the
    outputs."""
    agree, cos, total = 0.0, 0.0, 0
    for b in batches:
        got = sess.run(None, _feeds(sess, b))[0]
        ref = ref_sess.run(None, _feeds(ref_sess, b))[0]
        num = (got * ref).sum(-1)
        den = np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1)
        cos += float((num / np.maximum(den, 1e-12)).sum())
        agree += float((got.argmax(-1) == ref.argmax(-1)).sum())
        total += got.shape[0]
    return {"top1": agree / total, "cosine": cos / total}


def run_case(case: Case, repeat: int) -> dict:
    model = case.build().eval()
    calib, held_out = case.calib(), case.held_out()
    with tempfile.TemporaryDirectory(prefix="bench-deploy-") as d:
        work = Path(d)
        fp32 = work / "fp32.onnx"
        export_fp32(model, calib[0], fp32)
        ours = work / "quantcli.onnx"
        unfused = quantize_with_quantcli(model, calib, ours)
        theirs = quantize_with_onnxruntime(fp32, work, calib, dynamic=case.transformer)
        sessions = {"fp32": session(fp32), "quantcli": session(ours), "onnxruntime": session(theirs)}
        lat = best_latency(sessions, held_out[0], repeat)
        # one sample, as an online service runs: where Q/DQ and layout changes weigh most (not a goal)
        lat1 = best_latency(sessions, {k: v[:1] for k, v in held_out[0].items()}, repeat)
        full = {k: accuracy(s, sessions["fp32"], held_out) for k, s in sessions.items() if k != "fp32"}
    metric = "cosine" if case.embedding else "top1"  # the goal's metric; the other is printed beside it
    acc = {k: v[metric] for k, v in full.items()}
    ratio = lat["quantcli"] / lat["onnxruntime"]
    goal = TRANSFORMER_GOAL if case.transformer else CNN_GOAL
    checks = {
        f"latency <= {goal}x": ratio <= goal,
        "accuracy >= theirs": acc["quantcli"] >= acc["onnxruntime"],
    }
    if not case.transformer:
        checks["no unfused layer"] = unfused == 0
    shape = "x".join(str(s) for s in next(iter(held_out[0].values())).shape)
    return {
        "model": case.name,
        "batch": shape,
        "reference": "quantize_dynamic" if case.transformer else "quantize_static",
        "fp32 ms": f"{lat['fp32'] * 1e3:.2f}",
        "quantcli ms": f"{lat['quantcli'] * 1e3:.2f}",
        "theirs ms": f"{lat['onnxruntime'] * 1e3:.2f}",
        "quantcli/theirs": f"{ratio:.2f}x",
        "quantcli/fp32": f"{lat['quantcli'] / lat['fp32']:.2f}x",
        "b1 quantcli/theirs": f"{lat1['quantcli'] / lat1['onnxruntime']:.2f}x",
        "b1 quantcli/fp32": f"{lat1['quantcli'] / lat1['fp32']:.2f}x",
        "acc quantcli": f"{acc['quantcli']:.4f}",
        "acc theirs": f"{acc['onnxruntime']:.4f}",
        "cos quantcli": f"{full['quantcli']['cosine']:.5f}",
        "cos theirs": f"{full['onnxruntime']['cosine']:.5f}",
        "unfused": str(unfused),
        "goals": ", ".join(f"{k}: {'MET' if v else 'MISSED'}" for k, v in checks.items()),
        "_met": all(checks.values()),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=15, help="timed runs per graph (best is kept)")
    p.add_argument("--models", default=",".join(_cases()), help="comma-separated: " + ", ".join(_cases()))
    a = p.parse_args(argv)
    setup_threads(1)
    cases = _cases()
    unknown = [m for m in a.models.split(",") if m not in cases]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; choose from {', '.join(cases)}")
    print(
        f"bench_deploy: {machine()}; CPU flags: {cpu_flags()}; onnxruntime {ort.__version__}, 1 thread, "
        f"default session options; load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    rows = [run_case(cases[m], a.repeat) for m in a.models.split(",")]
    cols = [
        "model",
        "batch",
        "reference",
        "fp32 ms",
        "quantcli ms",
        "theirs ms",
        "quantcli/theirs",
        "quantcli/fp32",
        "b1 quantcli/theirs",
        "b1 quantcli/fp32",
        "acc quantcli",
        "acc theirs",
        "cos quantcli",
        "cos theirs",
        "unfused",
        "goals",
    ]
    print(table(rows, cols))
    print(
        f"acc: top-1 agreement with the fp32 graph on held-out data (deep_encoder: mean cosine of the "
        f"embeddings), the goal's metric; cos: mean cosine of the outputs to fp32's; load average after: "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    print(f"all goals: {'MET' if all(r['_met'] for r in rows) else 'MISSED'}")


if __name__ == "__main__":
    main()
