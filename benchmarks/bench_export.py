"""How long ``quantcli export`` takes against exporting the float model, on the model zoo.

For each model: the calibrated int8 model (``calibrate --placement all``) exported by quantcli
(:func:`exporters.export_onnx`: the probe forward, the trace, the graph passes, the checks, the session load
that counts fused layers) against ``torch.onnx.export`` of the same model as loaded (float, same exporter and
opset, same example batch): what a user runs before onnxruntime's ``quantize_static``. Both in this process,
imports done and the model built; the fastest of ``--repeats`` interleaved runs of each.

The target (issue 36, "placement that is cheap"): latency placement exports once, and may spend at most 10%
of calibrate or 10 s. Before quantize ops were traced as one node (``quantcli/quant/one_node.py``) the
exporter recorded every op of every quantizer and exported the zoo's EfficientNet-B0 in 68 s (float: 1 s).
The target printed is quantcli's export within 10 s.

    python -m benchmarks.bench_export [--models efficientnet_b0,mobilenet_v2,resnet,vit,bert] [--repeats 3]
        [--exporter torchscript|dynamo]
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch

from benchmarks.common import cpu_flags, machine, rows_per_model, setup_threads, table, verdict

TARGET_S = 10.0
DEFAULT_MODELS = "efficientnet_b0,mobilenet_v2,resnet,vit,bert"


def _float_export(model, example: dict, path: Path, opset: int, exporter: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (), str(path), kwargs=example, dynamo=exporter == "dynamo", opset_version=opset
        )


def measure(name: str, folder: Path, repeats: int, exporter: str) -> dict:
    from benchmarks.bench_placement import _job
    from exporters import export_onnx
    from tests.zoo import registry as zoo

    calib, _ = zoo.write_data(name, folder)
    job, _ = _job(zoo.spec(name), calib, "all", folder / f"{name}.calib.pt")
    example = {k: v[:2] for k, v in job.batches[0].items()}
    plain = zoo.module(name).make().eval()
    opset = export_onnx(job.model, example, folder / "warm.onnx", exporter=exporter).opset
    best = {"quantcli": float("inf"), "float": float("inf")}
    for _ in range(repeats):
        t = time.perf_counter()
        export_onnx(job.model, example, folder / "int8.onnx", exporter=exporter)
        best["quantcli"] = min(best["quantcli"], time.perf_counter() - t)
        t = time.perf_counter()
        _float_export(plain, example, folder / "float.onnx", opset, exporter)
        best["float"] = min(best["float"], time.perf_counter() - t)
    return {
        "model": name,
        "quantcli export s": f"{best['quantcli']:.2f}",
        "float export s": f"{best['float']:.2f}",
        "ratio": f"{best['quantcli'] / best['float']:.1f}x",
        f"within {TARGET_S:.0f} s": verdict(best["quantcli"] <= TARGET_S),
        "_met": best["quantcli"] <= TARGET_S,
    }


def _shown(rows: list[dict]) -> str:
    return table([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--exporter", default="torchscript", choices=["torchscript", "dynamo"])
    args = ap.parse_args(argv)
    setup_threads(1)
    print(f"export: {machine()}; CPU {cpu_flags()}; exporter {args.exporter}")

    def one(name: str, root: Path) -> list[dict]:
        folder = root / name  # each model's calibration data and graphs apart
        folder.mkdir()
        row = measure(name, folder, args.repeats, args.exporter)
        print(_shown([row]), flush=True)
        return [row]

    rows = rows_per_model(args.models.split(","), one)
    print(_shown(rows))
    met = sum(r["_met"] for r in rows)
    print(f"export within {TARGET_S:.0f} s: {met}/{len(rows)} {verdict(met == len(rows))}")


if __name__ == "__main__":
    main()
