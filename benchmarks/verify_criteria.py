"""Where verify's ``fidelity.rms_ratio`` criterion comes from: its value on correct exports (both exporters,
both targets) of the deeper ViT-Tiny- and EfficientNet-B0-sized models and the campaign's six zoo models
(every zoo model's value: ``python -m benchmarks.bench_zoo``, column rms_ratio), and, for every mutation of
the campaign (tests/zoo/campaign.py) on six zoo models, its value and which checks fail.
docs/verify-criteria.md records a run.

    python -m benchmarks.verify_criteria [--models resnet,vit] [--mutations resnet,bert]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import onnx

from benchmarks.bench_zoo import cli, quantcli_graph
from benchmarks.common import machine, setup_threads, table
from tests.zoo import campaign
from tests.zoo import registry as zoo

CAMPAIGN_MODELS = ["resnet", "efficientnet", "vit", "segformer", "bert", "whisper_encoder"]


def correct_exports(names: list[str], folder: Path) -> list[dict]:
    rows = []
    for name in names:
        calib, held = zoo.write_data(name, folder)
        for target in zoo.TARGETS:
            for exporter in zoo.EXPORTERS:
                r = quantcli_graph(name, target, exporter, folder, calib, held)
                r.pop("graph", None)
                rows.append({"model": name, "exporter": exporter, "target": target, **r})
        print(f"  {name} done", flush=True)
    return rows


def mutations(names: list[str], folder: Path) -> list[dict]:
    rows = []
    for name in names:
        ck, held = folder / f"{name}.onnxruntime.calib.pt", folder / f"{name}.heldout.npz"
        graph = onnx.load(str(folder / f"{name}.onnxruntime.torchscript.onnx"))
        for label, edit in campaign.ARITHMETIC + campaign.EQUIVALENT:
            m = onnx.ModelProto()
            m.CopyFrom(graph)
            if edit(m) is None:
                continue
            path = folder / "mutated.onnx"
            onnx.save(m, str(path))
            code, out = cli("verify", path, "--reference", ck, "--data", held, "--json")
            row = {"model": name, "mutation": label, "exit": code}
            if code in (0, 1):
                rep = json.loads(out)
                failed = [c["name"] for c in rep["checks"] if not c["passed"]]
                if not rep["structure"]["passed"]:
                    failed.insert(0, "structure")
                row["rms_ratio"] = max(
                    (o["rms_ratio"] for o in rep["fidelity"]["outputs"].values()), default=float("nan")
                )
                row["failed"] = ", ".join(failed)
                row["caught without rms_ratio"] = "yes" if set(failed) - {"fidelity.rms_ratio"} else "no"
            rows.append(row)
        print(f"  {name} mutations done", flush=True)
    return rows


def _fmt(rows):
    return [{k: f"{v:.3g}" if isinstance(v, float) else v for k, v in r.items()} for r in rows]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--models",
        default=",".join(zoo.CRITERIA_MODELS),
        help="correct exports to measure besides the campaign's models (the whole zoo's values: bench_zoo)",
    )
    ap.add_argument("--mutations", default=",".join(CAMPAIGN_MODELS), help="models the campaign mutates")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    setup_threads(1)
    names, mutated = args.models.split(","), args.mutations.split(",")
    print(f"verify criteria: {machine()}", flush=True)
    with tempfile.TemporaryDirectory() as d:
        correct = correct_exports(list(dict.fromkeys(names + mutated)), Path(d))
        broken = mutations(mutated, Path(d))
    print(table(_fmt(correct), ["model", "exporter", "target", "verify", "rms_ratio", "failed"]))
    print(
        table(_fmt(broken), ["model", "mutation", "exit", "rms_ratio", "failed", "caught without rms_ratio"])
    )
    ok = [r["rms_ratio"] for r in correct if "rms_ratio" in r]
    arithmetic = {label for label, _ in campaign.ARITHMETIC}
    only_rms = [
        r for r in broken if r["mutation"] in arithmetic and r.get("caught without rms_ratio") == "no"
    ]
    print(f"correct exports: rms_ratio max {max(ok, default=float('nan')):.3g} over {len(ok)} graphs")
    print(
        f"arithmetic mutations caught only by rms_ratio: {len(only_rms)} "
        f"(their smallest rms_ratio: {min((r['rms_ratio'] for r in only_rms), default=float('nan')):.3g})"
    )


if __name__ == "__main__":
    main()
