"""``reduce_range`` (7-bit weights) on digits_cnn and text_encoder: accuracy against fp32, and how far
onnxruntime's deployed session (default options) is from the fake-quant model, with and without it.

    python -m benchmarks.bench_reduce_range

Per model and setting: held-out top-1 accuracy of the fp32 and fake-quant models and their logits' cosine; the
quantized layers onnxruntime runs as integer kernels (the only ones a kernel can make deviate); the default
session's largest logit deviation from the fake-quant model and top-1 agreement with it on this CPU; and the
same with the non-VNNI u8s8 kernel emulated (:class:`quantcli.analysis.saturation.Emulation`), with the
fraction of product pairs it saturates. On a CPU with VNNI the measured deviation has no saturation in it;
the emulated one is what an AVX2-only CPU computes. Layers onnxruntime leaves in float cannot saturate, so
the figures follow whatever the export's placement makes onnxruntime fuse.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from benchmarks.common import machine, setup_threads, table
from exporters import export_onnx
from exporters.onnxruntime.fusion import inspect_fusion
from quantcli import calibrate, quantize_model
from quantcli.analysis.saturation import Emulation
from sample_models import SAMPLES

U8S8_KERNELS = ("QLinearConv", "QGemm", "QLinearMatMul", "MatMulIntegerToFloat", "DynamicQuantizeMatMul")


def cpu_flags() -> str:
    """The flags that decide the kernel: AVX2, AVX-512, VNNI (AVX512_VNNI or AVX_VNNI)."""
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    flags = set(line.split(":", 1)[1].split())
    have = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    vnni = "VNNI" if {"avx512_vnni", "avx_vnni"} & flags else "no VNNI"
    return f"{', '.join(have)} ({vnni})"


def _logits(model, batches) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([model(**b) for b in batches])


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def measure(name: str, reduce_range: bool, workdir: Path) -> dict:
    sample = SAMPLES[name]
    fp32 = sample.build().eval()
    model = quantize_model(copy.deepcopy(fp32), {"preset": "int8", "reduce_range": reduce_range})
    calibrate(model, sample.calibration_batches(), "max", device="cpu")
    model.eval()
    batches = sample.evaluation_batches()
    labels = sample.evaluation_labels()
    ref, fq = _logits(fp32, batches), _logits(model, batches)
    path = workdir / f"{name}-{int(reduce_range)}.onnx"
    export_onnx(model, batches[0], path)
    fusion = inspect_fusion(path)
    fused = [r.layer for r in fusion.layers if r.fused and r.kernel in U8S8_KERNELS]
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    deployed = torch.cat(
        [torch.from_numpy(sess.run(None, {k: v.numpy() for k, v in b.items()})[0]) for b in batches]
    )
    with Emulation(model) as emu:
        emulated = _logits(model, batches)
    saturated = sum(s.saturated for s in emu.layers.values())
    pairs = sum(s.pairs for s in emu.layers.values())
    scale = float(fq.abs().max())

    def dev(got):
        return (
            f"{float((got - fq).abs().max()) / scale:.2e}",
            f"{float((got.argmax(1) == fq.argmax(1)).float().mean()):.4f}",
        )

    d_max, d_agree = dev(deployed)
    e_max, e_agree = dev(emulated)
    return {
        "model": name,
        "weights": "int7 (reduce_range)" if reduce_range else "int8",
        "top-1 fp32": f"{float((ref.argmax(1) == labels).float().mean()):.4f}",
        "top-1 quant": f"{float((fq.argmax(1) == labels).float().mean()):.4f}",
        "cosine vs fp32": f"{_cosine(fq, ref):.5f}",
        "u8s8 layers": f"{len(fused)}/{len(fusion.layers)}",
        "deployed max dev": d_max,
        "deployed top-1 agree": d_agree,
        "non-VNNI max dev": e_max,
        "non-VNNI top-1 agree": e_agree,
        "pairs saturated": f"{saturated / pairs:.2e}" if pairs else "-",
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.parse_args(argv)
    setup_threads(1)
    torch.manual_seed(0)
    np.random.seed(0)
    print(f"reduce_range: {machine()}; CPU flags: {cpu_flags()}; onnxruntime {ort.__version__}")
    print("deviations: largest |logit - fake-quant logit| / largest |fake-quant logit| on the held-out set")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in ("digits_cnn", "text_encoder"):
            for rr in (False, True):
                rows.append(measure(name, rr, Path(d)))
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
