"""``int8-dynamic`` and ``--smoothquant`` on transformers, against onnxruntime's own ``quantize_dynamic``.

    python -m benchmarks.bench_int8_transformers [--rounds N] [--opset 17] \\
        [--models text_encoder,deep_encoder,gpt2]

Per model (``text_encoder``; ``sample_models.structured.deep_encoder``, 6 layers, hidden 384, outlier
channels; the zoo's ``gpt2``, transformers' GPT-2 with 2 layers of hidden 64, every projection a ``Conv1D``):
the fp32 model exported with ``torch.onnx.export``, onnxruntime's ``quantize_dynamic`` of that file
(per-channel int8 weights, the reference a user would otherwise run), and quantcli's ``int8-dynamic`` and
``int8`` presets, each with and without SmoothQuant (alpha 0.5), calibrated on the model's calibration lines
and exported with ``exporters.export_onnx`` at the same opset. Every graph runs in onnxruntime on the CPU
provider with default session options and 1 thread. Cosine: of all held-out outputs against the float PyTorch
model's, as ``quantcli verify`` computes it (for deep_encoder's unit-norm embeddings this is the mean
per-sentence cosine); "error vs ort dyn" is ``(1 - cosine) / (1 - cosine of quantize_dynamic)``. Latency: one
batch of 32 x 80 tokens, runs of every session interleaved round by round in this process, best of
``--rounds`` per session (the machine is shared: the load average is printed beside the figures).

Issue 15's goal applies to static int8 (rows ``int8``): cosine >= 0.995 and latency <= ``quantize_dynamic``'s;
each such row prints MET or MISSED. Dynamic rows print their ratios to ``quantize_dynamic`` only.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from benchmarks.common import best_interleaved, machine, rows_per_model, setup_threads, table
from exporters import export_onnx
from quantcli import calibrate, quantize_model
from quantcli.calibration.smoothquant import smooth_quant

GOAL_COSINE = 0.995
LATENCY_SHAPE = (32, 80)  # batch x tokens (80: both models' position table)
VARIANTS = (("int8-dynamic", None), ("int8-dynamic", 0.5), ("int8", None), ("int8", 0.5))


@dataclass
class Subject:
    name: str
    model: torch.nn.Module
    calib: list[dict[str, torch.Tensor]]
    evals: list[dict[str, torch.Tensor]]
    latency_shape: tuple[int, int] = LATENCY_SHAPE
    vocab: int = 258


def subject(name: str) -> Subject:
    if name == "text_encoder":
        from sample_models import text_encoder

        return Subject(
            name,
            text_encoder.build().eval(),
            text_encoder.calibration_batches(),
            text_encoder.evaluation_batches(),
        )
    if name == "deep_encoder":
        from sample_models.structured import deep_encoder, deep_encoder_batches

        return Subject(name, deep_encoder(), deep_encoder_batches("calib"), deep_encoder_batches("eval"))
    if name == "gpt2":  # transformers' GPT-2: every projection a Conv1D (x @ W + b), logits out
        from tests.zoo.models import gpt2

        def batches(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
            data = {k: torch.from_numpy(v) for k, v in gpt2.samples(n, seed).items()}
            return [{k: v[i : i + 32] for k, v in data.items()} for i in range(0, n, 32)]

        return Subject(name, gpt2.make(), batches(64, 1), batches(128, 2), (32, gpt2.TOKENS), gpt2.VOCAB)
    raise SystemExit(f"unknown model {name!r}; choose text_encoder, deep_encoder, gpt2")


def export_float(model: torch.nn.Module, example: dict[str, torch.Tensor], path: Path, opset: int) -> None:
    from exporters import aten_symbolics

    aten_symbolics.register()  # transformers' masks call torch.diff, which torch does not translate
    names = list(example)
    axes = {n: {0: "batch", 1: "tokens"} for n in names}
    axes["output"] = {0: "batch"}
    torch.onnx.export(
        model,
        tuple(example.values()),
        str(path),
        dynamo=False,
        opset_version=opset,
        input_names=names,
        output_names=["output"],
        dynamic_axes=axes,
    )


def session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()  # default graph optimizations
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def feeds(batch: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in batch.items()}


def cosine(got: np.ndarray, ref: np.ndarray) -> float:
    """Of the whole output tensors, as ``quantcli verify`` reports it."""
    g, r = got.astype(np.float64).ravel(), ref.astype(np.float64).ravel()
    return float(g @ r / np.sqrt((g @ g) * (r @ r)))


def best_latencies(
    sessions: dict[str, ort.InferenceSession], batch: dict[str, np.ndarray], rounds: int
) -> dict[str, float]:
    """Best-of-``rounds`` seconds per session, the sessions interleaved within each round, after 2 warm-up
    runs."""
    return best_interleaved(
        {name: functools.partial(s.run, None, batch) for name, s in sessions.items()}, rounds, 2
    )


def latency_batch(subject: Subject) -> dict[str, np.ndarray]:
    g = torch.Generator().manual_seed(0)
    b, t = subject.latency_shape
    ids = torch.randint(2, subject.vocab, (b, t), generator=g)
    ids[:, 0] = 1  # [CLS]
    return {"input_ids": ids.numpy(), "attention_mask": np.ones((b, t), np.int64)}


def measure(subject: Subject, workdir: Path, opset: int, rounds: int) -> list[dict]:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with torch.inference_mode():
        reference = np.concatenate([subject.model(**b).numpy() for b in subject.evals])
    paths: dict[str, Path] = {}
    paths["fp32"] = workdir / f"{subject.name}-fp32.onnx"
    export_float(subject.model, subject.calib[0], paths["fp32"], opset)
    paths["ort quantize_dynamic"] = workdir / f"{subject.name}-ort-dynamic.onnx"
    quantize_dynamic(
        str(paths["fp32"]), str(paths["ort quantize_dynamic"]), per_channel=True, weight_type=QuantType.QInt8
    )
    seconds: dict[str, float] = {}
    for config, alpha in VARIANTS:
        label = config + ("" if alpha is None else f" + smoothquant {alpha}")
        t0 = time.perf_counter()
        model = quantize_model(copy.deepcopy(subject.model), config)
        if alpha is not None:
            smooth_quant(model, subject.calib, alpha, device="cpu")
        calibrate(model, subject.calib, device="cpu")
        seconds[label] = time.perf_counter() - t0
        paths[label] = workdir / f"{subject.name}-{config}-{alpha}.onnx"
        export_onnx(model, subject.calib[0], paths[label], opset=opset)
    sessions = {label: session(p) for label, p in paths.items()}
    cos = {
        label: cosine(np.concatenate([s.run(None, feeds(b))[0] for b in subject.evals]), reference)
        for label, s in sessions.items()
    }
    lat = best_latencies(sessions, latency_batch(subject), rounds)
    ref_lat, ref_cos = lat["ort quantize_dynamic"], cos["ort quantize_dynamic"]
    rows = []
    for label in sessions:
        goal = "-"
        if label.startswith("int8 ") or label == "int8":
            ok_cos, ok_lat = cos[label] >= GOAL_COSINE, lat[label] <= ref_lat
            goal = (
                ("MET" if ok_cos and ok_lat else "MISSED")
                + f" (cosine {'>=' if ok_cos else '<'} {GOAL_COSINE}, latency {'<=' if ok_lat else '>'} "
                f"quantize_dynamic)"
            )
        rows.append(
            {
                "model": subject.name,
                "graph": label,
                "cosine vs fp32": f"{cos[label]:.5f}",
                "error vs ort dyn": f"{(1 - cos[label]) / (1 - ref_cos):.2f}x" if ref_cos < 1 else "-",
                "latency ms": f"{lat[label] * 1e3:.1f}",
                "vs ort dyn": f"{lat[label] / ref_lat:.2f}x",
                "vs fp32": f"{lat[label] / lat['fp32']:.2f}x",
                "calibrate s": f"{seconds[label]:.1f}" if label in seconds else "-",
                "issue 15 goal (static)": goal,
            }
        )
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20, help="latency: best of N interleaved runs per graph")
    p.add_argument(
        "--opset", type=int, default=17, help="opset of every exported graph (17: LayerNormalization)"
    )
    p.add_argument("--models", default="text_encoder,deep_encoder")
    a = p.parse_args(argv)
    setup_threads(1)
    print(
        f"int8-dynamic / smoothquant vs onnxruntime quantize_dynamic: {machine()}; onnxruntime "
        f"{ort.__version__}; opset {a.opset}; latency batch {LATENCY_SHAPE[0]}x{LATENCY_SHAPE[1]} tokens, 1 "
        f"thread, best of {a.rounds}"
    )
    rows = rows_per_model(a.models.split(","), lambda name, d: measure(subject(name), d, a.opset, a.rounds))
    print(table(rows))
    print(
        f"load average (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())} "
        "(2 cores shared: latency ratios are interleaved in one process, absolute ms are noisy)"
    )


if __name__ == "__main__":
    main()
