"""u8s8 saturation and its remedies: what 8-bit weights lose where an x86 CPU without VNNI runs them, what the
7-bit grid (``reduce_range: auto`` for such CPUs) costs instead, and why not uint8 weights.

    python -m benchmarks.bench_saturation

Accuracy, per model (the three samples, the structured ResNet and 6-layer encoder, and a ConvNeXt-style block;
each calibrated with ``max`` on its calibration data, judged on its held-out data): the cosine to the float
model of the fake-quant model with 8-bit weights and with the 7-bit grid where the kernel can saturate, and
of what an AVX2 CPU's deployed session computes with 8-bit weights (the kernels emulated,
:class:`quantcli.analysis.saturation.Emulation`: on an AVX2 CPU that is the deployed session itself; only the
layers onnxruntime fuses are emulated); top-1 agreement with the float model where the output is logits.

Speed, on this CPU (onnxruntime, default options, 1 thread): chains of four fused layers with int8 weights in
[-63, 63] (the 7-bit grid, u8s8 kernels) and with uint8 weights (zero point 128, u8u8 kernels: exact on
every CPU, the other remedy), against float. Prints the CPU flags; u8u8's cost is the figure that decides
between them.
"""

from __future__ import annotations

import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from onnx import numpy_helper

from benchmarks.bench_kernel_costs import _chain, _session
from benchmarks.common import machine, setup_threads, table
from exporters import export_onnx
from quantcli import calibrate, quantize_model
from quantcli.analysis.saturation import Emulation
from quantcli.inputs.data import flat_outputs
from quantcli.quant import cpu as cpu_kinds
from quantcli.verify.cpu_kernels import u8s8_layers


def _models():
    from sample_models import SAMPLES, structured

    for name in ("digits_cnn", "text_encoder", "tiny_lm"):
        s = SAMPLES[name]
        yield name, s.build, s.calibration_batches(), s.evaluation_batches()
    yield (
        "resnet_cnn",
        structured.resnet_cnn,
        structured.resnet_batches(128, 32),
        structured.resnet_batches(64, 32, split="eval"),
    )
    yield (
        "deep_encoder",
        structured.deep_encoder,
        structured.deep_encoder_batches("calib", 64),
        structured.deep_encoder_batches("eval", 32),
    )
    yield (
        "convnext_style",
        structured.convnext_style,
        structured.random_images(64),
        structured.random_images(64, seed=1),
    )


def _outputs(model, batches) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([flat_outputs(model(**b))[0].flatten(1) for b in batches])


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def _agreement(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"{float((a.argmax(-1) == b.argmax(-1)).float().mean()):.3f}" if a.shape[-1] > 1 else "-"


def accuracy(name, build, cal, held, workdir: Path) -> dict:
    fp32 = build().eval()
    ref = _outputs(fp32, held)
    row = {"model": name}
    for label, cpu in (("8-bit", "x86-vnni"), ("7-bit grid", "x86-avx2")):
        m = quantize_model(copy.deepcopy(fp32), {"cpu": cpu}, example=cal[0])
        calibrate(m, cal, "max", device="cpu")
        m.eval()
        fq = _outputs(m, held)
        row[f"cos {label}"] = f"{_cosine(fq, ref):.5f}"
        if label == "8-bit":
            path = workdir / f"{name}.onnx"
            export_onnx(m, cal[0], path)
            with Emulation(m, u8s8_layers(path)) as emu:
                deployed = _outputs(m, held)
            saturated = sum(s.saturated for s in emu.layers.values())
            pairs = sum(s.pairs for s in emu.layers.values()) or 1
            row["cos 8-bit on x86-avx2"] = f"{_cosine(deployed, ref):.5f}"
            row["top-1 8-bit on x86-avx2"] = _agreement(deployed, ref)
            row["pairs saturated"] = f"{saturated / pairs:.1e}"
    row["7-bit cost"] = f"{float(row['cos 8-bit']) - float(row['cos 7-bit grid']):+.5f}"
    row.update(default_graph(name, cal, held, workdir))
    return row


def default_graph(name: str, cal, held, workdir: Path) -> dict:
    """calibrate (defaults: this machine's CPU, max; --placement all), export, verify on the held-out data,
    through the real CLI: the deployed session's ratio and cosine beside the exact session's (the figures
    verify's deployment bound comes from, docs/verify-criteria.md)."""
    from typer.testing import CliRunner

    from quantcli.cli import app
    from sample_models import SAMPLES

    def cli(*args):
        r = CliRunner().invoke(app, [str(a) for a in args])
        return r.exit_code, r.stdout

    if name in SAMPLES:
        model, data, held_arg = name, (), ()
    else:
        model = f"sample_models.structured:{name}"
        for split, batches in (("cal", cal), ("held", held)):  # a folder of .pt batches: lengths may differ
            (workdir / f"{name}.{split}").mkdir(exist_ok=True)
            for i, b in enumerate(batches):
                torch.save(b, workdir / f"{name}.{split}" / f"{i:03d}.pt")
        data, held_arg = ("--data", workdir / f"{name}.cal"), ("--data", workdir / f"{name}.held")
    ck, graph = workdir / f"{name}.calib.pt", workdir / f"{name}.default.onnx"
    code, _ = cli("calibrate", model, *data, "--placement", "all", "--out", ck)
    code = code or cli("export", ck, "--onnx", graph)[0]
    if code:
        return {"verify": f"exit {code}"}
    code, out = cli("verify", graph, "--reference", ck, *held_arg, "--json")
    rep = json.loads(out)
    gaps = rep["quality"]["cosine_gap"].values()
    return {
        "verify": {0: "PASS", 1: "FAIL"}.get(code, f"exit {code}"),
        "exact ratio": f"{max(o['rms_ratio'] for o in rep['fidelity']['outputs'].values()):.3g}",
        "deployed ratio": f"{max(o['rms_ratio'] for o in rep['deployment']['outputs'].values()):.3g}",
        # the exact session's cosine to float less the deployed one's, on the inputs both ran (the sample)
        "cos gap": f"{max((g for g in gaps if g is not None), default=0):.2e}",
    }


def _u8_weights(model):
    """The chain with uint8 weights: int8 codes + 128, zero point 128 (u8u8 kernels)."""
    for t in model.graph.initializer:
        a = numpy_helper.to_array(t)
        if a.dtype == np.int8:
            t.CopyFrom(numpy_helper.from_array((a.astype(np.int16) + 128).astype(np.uint8), t.name))
    return model


def speed(op: str, c: int, k: int, side: int, seconds: float = 0.6) -> dict:
    rng = np.random.default_rng(0)
    (q, shape), (f, _) = _chain(op, c, k, side, True, rng), _chain(op, c, k, side, False, rng)
    u8 = _u8_weights(_chain(op, c, k, side, True, np.random.default_rng(0))[0])
    x = np.abs(rng.standard_normal(shape)).astype(np.float32)
    sessions = {"u8s8 (7-bit)": _session(q), "u8u8": _session(u8), "float": _session(f)}
    times = {n: [] for n in sessions}
    for s in sessions.values():
        s.run(None, {"x": x})
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(times["float"]) < 5:
        for n, s in sessions.items():
            t = time.perf_counter()
            s.run(None, {"x": x})
            times[n].append(time.perf_counter() - t)
    ms = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    return {
        "chain": f"{op} {c}ch k{k} {side}" if op != "gemm" else f"gemm {c}x{c} rows {side}",
        **{f"{n} ms": f"{v:.3f}" for n, v in ms.items()},
        "u8u8 / u8s8": f"{ms['u8u8'] / ms['u8s8 (7-bit)']:.2f}",
    }


def main(argv=None) -> None:
    import argparse

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    setup_threads(1)
    torch.manual_seed(0)
    print(f"u8s8 saturation: {machine()}; CPU {cpu_kinds.flags()}; onnxruntime {ort.__version__}")
    with tempfile.TemporaryDirectory() as d:
        rows = []
        for m in _models():
            try:
                rows.append(accuracy(*m, Path(d)))
            except ImportError as e:  # deep_encoder needs transformers: a row saying so, not the end
                rows.append({"model": m[0], "cos 8-bit": f"not run: {e}"})
    print(table(rows))
    shapes = [("conv", 64, 3, 28), ("conv", 256, 1, 14), ("gemm", 768, 1, 128), ("gemm", 256, 1, 1)]
    print(table([speed(*s) for s in shapes]))


if __name__ == "__main__":
    main()
