"""Latency placement (``calibrate --placement auto``): what it costs, whether it decides the same twice, and
whether its graph is ever slower than ``--placement all``'s (issue 36's goals).

    python -m benchmarks.bench_placement                          # the samples and the model zoo
    python -m benchmarks.bench_placement --models digits_cnn,resnet --repeats 5 --rounds 30
    python -m benchmarks.bench_placement --lm                     # also a 135M-parameter Llama, INT4 RTN

Per model, in one process: the ``calibrate`` job (load, calibrate with ``max``, place) run ``--repeats`` times
with ``--placement auto``: the wall time of each whole job and the seconds placement took, and whether every
run made the same decisions; then the graphs of ``auto`` and of ``all`` exported and timed in onnxruntime (CPU
provider, default options, 1 thread) on the held-out data, interleaved run by run, ``all``'s graph in two
sessions whose spread is the A/A noise band. Goals: placement at most 10% of the calibrate time or 10 s,
whichever is larger; identical decisions in every repeat; ``auto``'s graph no slower than ``all``'s beyond the
band (met by construction where ``auto`` keeps nothing float and writes the very graph ``all`` writes: "same
graph"); the LLM's INT4 weight-only calibration under a minute in placement. The CPU flags decide the integer
kernels and the table placement reads: printed too.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from benchmarks.common import best_interleaved, cpu_flags, machine, setup_threads, table, verdict
from exporters import export_onnx
from quantcli.calibration.job import CalibrationJob, CalibrationRequest

SAMPLES = ("digits_cnn", "text_encoder", "tiny_lm")


def _job(model: str, data: Path | None, placement: str, out: Path, **kw) -> tuple[CalibrationJob, float]:
    t0 = time.perf_counter()
    job = CalibrationJob.load(CalibrationRequest(model, data=data, out=out, placement=placement, **kw), None)
    summary = job.calibrate()
    job.place_for_latency(summary)
    return job, time.perf_counter() - t0


def _spec(name: str, folder: Path) -> tuple[str, Path | None, dict[str, np.ndarray]]:
    """(MODEL, --data, held-out arrays) of a sample or a zoo model."""
    if name in SAMPLES:
        from sample_models import SAMPLES as S

        return name, None, {k: v.numpy() for k, v in S[name].evaluation_batches()[0].items()}
    from tests.zoo import registry as zoo

    calib, held = zoo.write_data(name, folder)
    with np.load(held) as z:
        return zoo.spec(name), calib, {k: z[k] for k in z.files}


def measure(name: str, folder: Path, repeats: int, rounds: int) -> dict:
    spec, data, held = _spec(name, folder)
    runs = [_job(spec, data, "auto", folder / f"{name}-{i}.calib.pt") for i in range(repeats)]
    decisions = {json.dumps([(d.layer, d.decision) for d in job.latency.layers]) for job, _ in runs}
    auto, wall = runs[0]
    placed = [job.latency.seconds for job, _ in runs]
    share = max(p / w for p, (_, w) in zip(placed, runs))
    every, _ = _job(spec, data, "all", folder / f"{name}-all.calib.pt")
    example = {k: v[:8] for k, v in auto.batches[0].items()}
    paths = {"auto": folder / f"{name}-auto.onnx", "all": folder / f"{name}-all.onnx"}
    export_onnx(auto.model, example, paths["auto"])
    export_onnx(every.model, example, paths["all"])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sessions = {
        "auto": ort.InferenceSession(str(paths["auto"]), so),
        "all": ort.InferenceSession(str(paths["all"]), so),
        "all A/A": ort.InferenceSession(str(paths["all"]), so),
    }
    feeds = {i.name: held[i.name] for i in sessions["all"].get_inputs()}
    best = best_interleaved({k: (lambda s=s: s.run(None, feeds)) for k, s in sessions.items()}, rounds, 2)
    band = abs(best["all A/A"] / best["all"] - 1)
    ratio = best["auto"] / best["all"]
    same = _same_graph(paths["auto"], paths["all"])  # nothing kept float: one graph timed twice
    kept = auto.latency.kept_float
    return {
        "model": name,
        "kept float": f"{len(kept)}/{len(auto.latency.layers)}",
        "placement s": f"{max(placed):.1f}",
        "calibrate s": f"{max(w for _, w in runs):.1f}",
        "share": f"{share:.0%}",
        "time goal": verdict(max(placed) <= max(10.0, 0.1 * max(w for _, w in runs))),
        "same decisions": f"{repeats - len(decisions) + 1}/{repeats}",
        "same goal": verdict(len(decisions) == 1),
        "auto/all": "same graph" if same else f"{ratio:.3f}",
        "A/A band": f"{band:.1%}",
        "speed goal": verdict(same or ratio <= 1 + band),
    }


def _same_graph(a: Path, b: Path) -> bool:
    """Whether two exported graphs hold the same nodes and initializers (metadata aside)."""
    import onnx

    ga, gb = onnx.load(str(a)).graph, onnx.load(str(b)).graph
    nodes = lambda g: [(n.op_type, list(n.input), list(n.output), str(n.attribute)) for n in g.node]  # noqa: E731
    return nodes(ga) == nodes(gb) and list(ga.initializer) == list(gb.initializer)


_LLAMA = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM


class Logits(torch.nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids, use_cache=False).logits


def make():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
    )
    return Logits(LlamaForCausalLM(config).eval())
"""


def measure_lm(folder: Path) -> dict:
    """A Llama-architecture LM of the issue's size (30 layers, hidden 576, 9/3 heads, tied embeddings, 135M
    parameters; random weights), INT4 weight-only RTN: placement has nothing to decide and exports nothing."""
    (folder / "llama135m.py").write_text(_LLAMA)
    ids = np.random.default_rng(0).integers(0, 49152, (8, 128), dtype=np.int64)
    np.savez(folder / "ids.npz", input_ids=ids)
    job, wall = _job(
        f"{folder / 'llama135m.py'}:make",
        folder / "ids.npz",
        "auto",
        folder / "lm.calib.pt",
        config="int4-weight-only",
        weight_method="rtn",
        batch_size=4,
    )
    params = sum(p.numel() for p in job.model.parameters())
    return {
        "model": f"llama {params / 1e6:.0f}M int4 rtn",
        "placement s": f"{job.latency.seconds:.1f}",
        "calibrate s": f"{wall:.1f}",
        "note": job.latency.text[:70],
        "lm goal": verdict(job.latency.seconds < 60),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="samples,zoo", help="names, or 'samples' / 'zoo' for all of them")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--lm", action="store_true", help="also the 135M-parameter Llama (a few minutes)")
    args = ap.parse_args(argv)
    setup_threads(1)
    torch.manual_seed(0)
    names = []
    for m in args.models.split(","):
        if m == "samples":
            names += list(SAMPLES)
        elif m == "zoo":
            from tests.zoo.registry import MODELS

            names += list(MODELS)
        elif m:
            names.append(m)
    print(f"placement: {machine()}; CPU {cpu_flags()}; onnxruntime {ort.__version__}")
    with tempfile.TemporaryDirectory() as d:
        rows = []
        for n in names:
            try:
                rows.append(measure(n, Path(d), args.repeats, args.rounds))
            except Exception as e:  # one model's failure is a row
                rows.append({"model": n, "kept float": f"failed: {type(e).__name__}: {str(e)[:80]}"})
            print(table(rows[-1:]), flush=True)
        print(table(rows))
        for goal in ("time goal", "same goal", "speed goal"):
            met = [r.get(goal) == "MET" for r in rows]
            print(f"{goal}: {sum(met)}/{len(met)} {verdict(all(met))}")
        if args.lm:
            print(table([measure_lm(Path(d))]))


if __name__ == "__main__":
    main()
