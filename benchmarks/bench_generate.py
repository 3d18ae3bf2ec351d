"""Generation with decode graphs, against onnxruntime-genai's model builder:
``python -m benchmarks.bench_generate``.

On the ``tiny_llama`` sample (Llama architecture: RoPE, RMSNorm, SwiGLU, 4 query / 2 KV heads, tied
embeddings), in one process, onnxruntime's CPU provider, default session options, 1 thread:

- quantcli: ``calibrate tiny_llama --config int4 block 32 --weight-method rtn|gptq|awq --placement all`` and
  ``export`` (a decode graph in onnxruntime's fused form: GroupQueryAttention,
  SkipSimplifiedLayerNormalization, packed q/k/v and gate/up); RTN also with ``--standard-ops`` and without
  each fusion; GPTQ also with an int8 KV cache (``calibrate --kv-cache int8``), a GatherBlockQuantized
  embedding (``export --embeddings int4``) and an 8-bit lm_head; int8 graphs: 8-bit weights (per-token
  activation scales in MatMulNBits), static int8 with SmoothQuant, int8-dynamic;
- the builder: ``python -m onnxruntime_genai.models.builder -i HF_FOLDER -o OUT -p int4 -e cpu -c CACHE`` on
  the sample written as a Hugging Face ``LlamaForCausalLM`` folder (``tiny_llama.write_hf_folder``); its graph
  driven by the same plain loop (it has the same inputs and outputs);
- decode tokens/s for 64 new greedy tokens after a 128-token prompt and that prompt's prefill latency (best
  of ``--rounds`` rounds over ``--prompts`` held-out prompts, the graphs in a new random order each round);
  the decode step's CPU time (``session.run`` of one token after 128-191 cached ones, 10th percentile,
  the graphs interleaved call by call);
- perplexity, teacher-forced, on 32 held-out windows of 256 bytes (float PyTorch model vs each graph);
- greedy-token agreement with the float model: along the float model's 32 greedy tokens from 8 prompts, the
  fraction of steps where the graph's most likely token is the float model's;
- decode/prefill parity: prefill of 64 tokens + one step per later token vs one prefill of 128, ``max |a - b|
  / max |b|``, MatMulNBits at float32 compute (as ``verify`` measures it).

Then a larger random Llama-shaped model (hidden 576, 9 query / 3 KV heads, 6 layers, intermediate 1536,
vocabulary 8192: the shape of a 135M chat model, fewer layers), where the matmul kernels rather than the
per-node cost set the pace: decode tokens/s of the builder's int4 graph against quantcli's (``--skip-large``
leaves it out).

Goals (issue 37): decode tokens/s >= 1.0x the builder's graph at a perplexity increase no worse than its;
prefill latency <= 1.0x; GPTQ or AWQ perplexity increase <= 0.5x RTN's; greedy-token agreement >= the
builder's; decode and prefill agree; the cache holds the KV heads only. Needs ``onnxruntime-genai`` (``pip
install onnxruntime-genai --no-deps`` beside onnxruntime-gpu: its wheel asks for the ``onnxruntime``
package, which would replace onnxruntime-gpu; the builder runs on either).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.common import cpu_flags, machine, setup_threads, table, verdict

PROMPT, NEW_TOKENS, AGREE_STEPS, BLOCK = 128, 64, 32, 32
INT4 = {"preset": "int4-weight-only", "block_size": BLOCK}
LM_HEAD_INT8 = {
    **INT4,
    "reduce_range": False,
    "rules": [{"pattern": "lm_head.weight_quantizer", "num_bits": 8}],
}
INT8_WEIGHTS = {**INT4, "reduce_range": False, "rules": [{"pattern": "*.weight_quantizer", "num_bits": 8}]}
LARGE = dict(
    vocab_size=8192,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=6,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    rms_norm_eps=1e-5,
)


@dataclass
class Graph:
    """One decode graph to measure: how quantcli made it (or the builder's), and what was measured."""

    name: str
    config: dict | str | None = None  # calibrate --config (None: the builder's graph)
    method: str = "rtn"
    calibrate: tuple[str, ...] = ()
    export: tuple[str, ...] = ()
    fusions: tuple[str, ...] | None = None  # export through the library with these fusions only
    path: Path | None = None
    ckpt: Path | None = None
    row: dict = field(default_factory=dict)


def _run(*cmd: str) -> str:
    r = subprocess.run([sys.executable, *cmd], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r.stdout


def _calibrate(root: Path, g: Graph, model: str, data: tuple[str, ...] = ()) -> Path:
    key = json.dumps([model, g.config, g.method, g.calibrate], sort_keys=True)
    ck = root / f"calib-{hashlib.sha256(key.encode()).hexdigest()[:12]}.calib.pt"
    if not ck.exists():
        cfg = g.config
        if isinstance(cfg, dict):
            (root / f"{ck.stem}.json").write_text(json.dumps(cfg))
            cfg = str(root / f"{ck.stem}.json")
        _run(
            "-m", "quantcli", "calibrate", model, *data, "--config", cfg, "--weight-method", g.method,
            "--placement", "all", *g.calibrate, "--out", str(ck),
        )  # fmt: skip
    return ck


def build_quantcli(root: Path, g: Graph, model: str = "tiny_llama", data: tuple[str, ...] = ()) -> Graph:
    """calibrate + export with the real CLI (with ``fusions``: export through the library)."""
    g.ckpt = _calibrate(root, g, model, data)
    g.path = root / f"{g.name.replace(' ', '_').replace(',', '').replace('/', '-')}.onnx"
    if g.fusions is None:
        _run("-m", "quantcli", "export", str(g.ckpt), "--onnx", str(g.path), *g.export)
    else:
        from exporters.causal_lm.export import export_model
        from quantcli import load_calibrated

        ck = load_calibrated(g.ckpt)
        export_model(ck.model, ck.example, g.path, fusions=list(g.fusions))
    return g


def build_genai(root: Path, hf: Path, name: str = "genai") -> tuple[Path, float]:
    """The builder's int4 graph of a Hugging Face folder; (path, seconds)."""
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        raise SystemExit(
            "bench_generate compares with onnxruntime-genai's model builder: pip install onnxruntime-genai "
            "--no-deps (keeps onnxruntime-gpu)"
        ) from None
    t0 = time.perf_counter()
    _run(
        "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(root / name), "-p", "int4",
        "-e", "cpu", "-c", str(root / "cache"),
    )  # fmt: skip
    return root / name / "model.onnx", time.perf_counter() - t0


def builder_layout(path: Path) -> dict:
    cfg = json.loads((path.parent / "genai_config.json").read_text())["model"]["decoder"]
    return {
        "num_layers": cfg["num_hidden_layers"],
        "num_kv_heads": cfg["num_key_value_heads"],
        "head_size": cfg["head_size"],
        "eos_token_id": None,
    }


def session(path: Path, layout: dict | None = None, exact: bool = False):
    """A plain-loop session, 1 thread; ``exact``: MatMulNBits at float32 compute (accuracy level 1)."""
    import onnxruntime as ort

    from exporters.causal_lm.runner import DecodeSession

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    if exact:
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    return DecodeSession(path, so, layout=layout)


def timings(sessions: dict, prompts: list[np.ndarray], rounds: int) -> dict[str, dict[str, float]]:
    """Best and median decode tokens/s and best prefill ms per graph, the graphs in a new random order each
    round (a fixed order favours the graph that runs twice in a row across a round boundary)."""
    from exporters.causal_lm.runner import generate

    rng = np.random.default_rng(0)
    tok: dict[str, list[float]] = {n: [] for n in sessions}
    pre: dict[str, list[float]] = {n: [] for n in sessions}
    names = list(sessions)
    for _ in range(rounds):
        for i in rng.permutation(len(names)):
            name = names[i]
            for p in prompts:
                g = generate(sessions[name], p.tolist(), NEW_TOKENS, stop_at_eos=False)
                tok[name].append(g.tokens_per_second)
                pre[name].append(g.prefill_seconds * 1e3)
    return {
        n: {"decode_tok_s": max(tok[n]), "median_tok_s": float(np.median(tok[n])), "prefill_ms": min(pre[n])}
        for n in sessions
    }


def step_cpu_us(sessions: dict, ids: np.ndarray, calls: int) -> dict[str, float]:
    """10th percentile of one decode step's thread CPU time (``session.run`` of one token after 128 to 191
    cached positions), the graphs interleaved call by call in a random order."""
    rng = np.random.default_rng(1)
    feeds: dict[str, list[dict]] = {}
    for name, s in sessions.items():
        _, cache = s.prefill(ids[:, :PROMPT])
        steps = []
        for t in range(PROMPT, PROMPT + NEW_TOKENS):
            f = {"input_ids": ids[:, t : t + 1], "attention_mask": np.ones((1, t + 1), np.int64)}
            if "position_ids" in s.input_names:
                f["position_ids"] = np.array([[t]], np.int64)
            f.update(zip(s.past_names, cache.past))
            steps.append(f)
            out = dict(zip(s.output_names, s.session.run(None, f)))
            cache.past = [out[n] for n in s.present_names]
        feeds[name] = steps
    times: dict[str, list[float]] = {n: [] for n in sessions}
    names = list(sessions)
    for i in range(calls):
        for k in rng.permutation(len(names)):
            name = names[k]
            t0 = time.thread_time()
            sessions[name].session.run(None, feeds[name][i % NEW_TOKENS])
            times[name].append(time.thread_time() - t0)
    return {n: float(np.percentile(v, 10) * 1e6) for n, v in times.items()}


def agreement(s, wants: list[tuple[np.ndarray, list[int]]]) -> float:
    same = total = 0
    for prompt, want in wants:
        got = s.logits(np.concatenate([prompt, want])[None])[0, len(prompt) - 1 : -1].argmax(-1)
        same += int((got == np.asarray(want)).sum())
        total += len(want)
    return same / total


def parity(s, rows: list[np.ndarray]) -> float:
    worst = 0.0
    for r in rows:
        a, b = s.stepwise_logits(r[None, :PROMPT], PROMPT // 2), s.logits(r[None, :PROMPT])
        worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
    return worst


def cache_shape(path: Path) -> list:
    import onnx

    g = onnx.load(str(path), load_external_data=False).graph
    t = next(i for i in g.input if i.name == "past_key_values.0.key").type.tensor_type
    return [d.dim_value or d.dim_param for d in t.shape.dim]


def graph_bytes(path: Path) -> int:
    extra = path.parent / (path.name + ".data")
    return path.stat().st_size + (extra.stat().st_size if extra.exists() else 0)


def tiny_graphs() -> list[Graph]:
    return [
        Graph("genai builder"),
        Graph("quantcli rtn", INT4),
        Graph("quantcli gptq", INT4, "gptq"),
        Graph("quantcli awq", INT4, "awq"),
        Graph("rtn, standard ops", INT4, export=("--standard-ops",)),
        Graph("rtn, no packing", INT4, fusions=("group_query_attention", "skip_norm")),
        Graph("rtn, no skip-norm", INT4, fusions=("group_query_attention", "pack_projections")),
        Graph("gptq, int8 KV cache", INT4, "gptq", calibrate=("--kv-cache", "int8")),
        Graph("gptq, int8-head KV cache", INT4, "gptq", calibrate=("--kv-cache", "int8-head")),
        Graph("gptq, int4 embeddings", INT4, "gptq", export=("--embeddings", "int4")),
        Graph("gptq, lm_head int8", LM_HEAD_INT8, "gptq"),
        Graph("rtn, lm_head int8", LM_HEAD_INT8),
        Graph("int8 weights (per-token)", INT8_WEIGHTS),
        Graph("int8 static + smoothquant", "int8", calibrate=("--smoothquant", "0.5")),
        Graph("int8-dynamic", "int8-dynamic"),
    ]


def measure_tiny(
    root: Path, rounds: int, prompts_n: int, calls: int
) -> tuple[dict[str, Graph], float, float]:
    from quantcli.verify.causal_lm import greedy_continuation, perplexity, torch_logits
    from sample_models import tiny_llama

    graphs = tiny_graphs()
    genai_path, genai_seconds = build_genai(root, tiny_llama.write_hf_folder(root / "hf"))
    for g in graphs:
        if g.config is None:
            g.path = genai_path
        else:
            build_quantcli(root, g)
    layouts = {g.name: builder_layout(g.path) if g.config is None else None for g in graphs}
    sessions = {g.name: session(g.path, layouts[g.name]) for g in graphs}
    rows = [r.numpy() for b in tiny_llama.evaluation_batches() for r in b["input_ids"]]
    prompts = [r[:PROMPT] for r in rows[:prompts_n]]
    times = timings(sessions, prompts, rounds)
    steps = step_cpu_us(sessions, rows[0][None, : PROMPT + NEW_TOKENS], calls)
    float_model = tiny_llama.build()
    ppl_rows = rows[:32]
    ppl_float = perplexity(lambda ids: torch_logits(float_model, ids), ppl_rows)
    wants = [(r[:64], greedy_continuation(float_model, r[:64], AGREE_STEPS)) for r in rows[:8]]
    for g in graphs:
        s = sessions[g.name]
        ppl = perplexity(s.logits, ppl_rows)
        info = {} if g.config is None else json.loads(_decode_meta(g.path))
        kv = info.get("kv_cache") or {}
        lo = layouts[g.name] or info["layout"]
        float_cache = 2 * lo["num_layers"] * lo["num_kv_heads"] * lo["head_size"] * 4
        g.row = {
            "graph": g.name,
            "decode tok/s": round(times[g.name]["decode_tok_s"], 1),
            "median tok/s": round(times[g.name]["median_tok_s"], 1),
            "step cpu us": round(steps[g.name], 1),
            "prefill ms": round(times[g.name]["prefill_ms"], 3),
            "perplexity": round(ppl, 4),
            "ppl increase": round(ppl / ppl_float - 1, 4),
            "agreement": round(agreement(s, wants), 4),
            "parity": float(f"{parity(session(g.path, layouts[g.name], exact=True), rows[:2]):.2e}"),
            "KV bytes/token": kv.get("bytes_per_token", float_cache),
            "file KiB": round(graph_bytes(g.path) / 1024, 1),
        }
    return {g.name: g for g in graphs}, ppl_float, genai_seconds


def _decode_meta(path: Path) -> str:
    import onnx

    from exporters.causal_lm.decode_info import LAYOUT_KEY

    m = onnx.load(str(path), load_external_data=False)
    return next(p.value for p in m.metadata_props if p.key == LAYOUT_KEY)


def measure_large(root: Path, rounds: int, calls: int) -> list[dict]:
    """The larger random Llama-shaped model: decode tokens/s and prefill of the builder's graph and quantcli's
    (RTN int4 block 32; also with int4 embeddings and with an int8 KV cache)."""
    import torch
    import transformers

    from sample_models import tiny_llama

    hf = root / "large-hf"
    if not (hf / "config.json").exists():
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**LARGE)).eval().save_pretrained(str(hf))
        for f in tiny_llama.write_hf_folder(root / "hf-tok").glob("tokenizer*"):
            shutil.copy(f, hf / f.name)  # the builder wants tokenizer files; it only copies them
    rng = np.random.default_rng(0)
    ids_file = root / "large-ids.npz"
    np.savez(ids_file, input_ids=rng.integers(0, LARGE["vocab_size"], (8, 64)))
    genai, _ = build_genai(root, hf, "large-genai")
    graphs = [
        Graph("quantcli rtn", INT4),
        Graph("rtn, int4 embeddings", INT4, export=("--embeddings", "int4")),
        Graph("rtn, int8 KV cache", INT4, calibrate=("--kv-cache", "int8")),
    ]
    for g in graphs:
        g.name = "large " + g.name
        build_quantcli(root, g, str(hf), ("--data", str(ids_file)))
    sessions = {"large genai builder": session(genai, builder_layout(genai))}
    sessions.update({g.name: session(g.path) for g in graphs})
    paths = {"large genai builder": genai, **{g.name: g.path for g in graphs}}
    prompts = [rng.integers(0, LARGE["vocab_size"], PROMPT) for _ in range(2)]
    times = timings(sessions, prompts, rounds)
    steps = step_cpu_us(sessions, rng.integers(0, LARGE["vocab_size"], (1, PROMPT + NEW_TOKENS)), calls)
    return [
        {
            "graph": n,
            "decode tok/s": round(times[n]["decode_tok_s"], 1),
            "median tok/s": round(times[n]["median_tok_s"], 1),
            "step cpu us": round(steps[n], 1),
            "prefill ms": round(times[n]["prefill_ms"], 2),
            "file MiB": round(graph_bytes(paths[n]) / 2**20, 2),
        }
        for n in sessions
    ]


def report(by: dict[str, Graph], ppl_float: float, large: list[dict]) -> None:
    rows = {n: g.row for n, g in by.items()}
    g, rtn = rows["genai builder"], rows["quantcli rtn"]
    print()
    for name in ("quantcli rtn", "quantcli gptq", "quantcli awq"):
        r = rows[name]
        ratio = r["decode tok/s"] / g["decode tok/s"]
        ok = ratio >= 1.0 and r["ppl increase"] <= g["ppl increase"]
        print(
            f"decode {name}: {ratio:.2f}x the builder's tokens/s (median "
            f"{r['median tok/s'] / g['median tok/s']:.2f}x, step CPU time "
            f"{g['step cpu us'] / r['step cpu us']:.2f}x) at ppl increase {r['ppl increase']:+.4f} "
            f"vs {g['ppl increase']:+.4f}: {verdict(ok)}"
        )
    pre = rows["quantcli gptq"]["prefill ms"] / g["prefill ms"]
    print(f"prefill (gptq graph): {pre:.2f}x the builder's: {verdict(pre <= 1.0)}")
    best = min((rows["quantcli gptq"], rows["quantcli awq"]), key=lambda r: r["ppl increase"])
    half = best["ppl increase"] <= 0.5 * rtn["ppl increase"]
    print(
        f"{best['graph']} ppl increase {best['ppl increase']:+.4f} vs RTN's {rtn['ppl increase']:+.4f} "
        f"(<= 0.5x): {verdict(half)}"
    )
    print(
        f"greedy agreement {best['graph']} {best['agreement']:.4f} vs the builder's {g['agreement']:.4f}: "
        f"{verdict(best['agreement'] >= g['agreement'])}"
    )
    ours = [r for n, r in rows.items() if n != "genai builder"]
    worst = max(ours, key=lambda r: r["parity"])
    print(
        f"decode/prefill parity (exact session), worst quantcli graph {worst['graph']}: "
        f"{worst['parity']:.2e} (<= 1e-4): {verdict(worst['parity'] <= 1e-4)}"
    )
    shape = cache_shape(by["quantcli rtn"].path)
    print(f"KV cache [batch, kv heads, past, head]: {shape} (4 query heads): {verdict(shape[1] == 2)}")
    print()
    kv, base = rows["gptq, int8 KV cache"], rows["quantcli gptq"]
    print(
        f"int8 KV cache (per channel): {kv['KV bytes/token']} bytes per token vs {base['KV bytes/token']}, "
        f"ppl {kv['perplexity']} vs {base['perplexity']} ({kv['perplexity'] / base['perplexity'] - 1:+.4f}), "
        f"agreement {kv['agreement']} vs {base['agreement']}, decode "
        f"{kv['decode tok/s'] / base['decode tok/s']:.2f}x"
    )
    emb = rows["gptq, int4 embeddings"]
    print(
        f"int4 embeddings (lm_head's codes): {emb['file KiB']} KiB vs {base['file KiB']} KiB, ppl "
        f"{emb['perplexity']} vs {base['perplexity']}, agreement {emb['agreement']} vs {base['agreement']}"
    )
    for name in ("rtn, lm_head int8", "gptq, lm_head int8"):
        r, b = rows[name], rows["quantcli " + name.split(",")[0]]
        print(
            f"{name}: ppl increase {r['ppl increase']:+.4f} vs {b['ppl increase']:+.4f} with an int4 "
            f"lm_head, {r['file KiB']} vs {b['file KiB']} KiB, decode "
            f"{r['decode tok/s'] / b['decode tok/s']:.2f}x"
        )
    for name in ("rtn, standard ops", "rtn, no packing", "rtn, no skip-norm"):
        print(f"{name}: decode {rows[name]['decode tok/s'] / rtn['decode tok/s']:.2f}x the fused RTN graph's")
    i8 = {n: rows[n] for n in ("int8 weights (per-token)", "int8 static + smoothquant", "int8-dynamic")}
    for n, r in i8.items():
        print(
            f"{n}: ppl increase {r['ppl increase']:+.4f}, agreement {r['agreement']}, exact parity "
            f"{r['parity']:.1e}, decode {r['decode tok/s'] / g['decode tok/s']:.2f}x the builder's"
        )
    if large:
        lg = large[0]
        print()
        print(table(large))
        for r in large[1:]:
            print(
                f"{r['graph']}: decode {r['decode tok/s'] / lg['decode tok/s']:.2f}x the builder's tokens/s "
                f"(step CPU time {lg['step cpu us'] / r['step cpu us']:.2f}x), prefill "
                f"{r['prefill ms'] / lg['prefill ms']:.2f}x: "
                f"{verdict(r['decode tok/s'] >= lg['decode tok/s'])}"
            )


def main(argv: list[str] | None = None) -> None:
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--calls", type=int, default=1000, help="decode steps per graph for the step CPU time")
    ap.add_argument(
        "--skip-large", action="store_true", help="leave out the larger random Llama-shaped model"
    )
    ap.add_argument("--work", type=Path, default=None, help="keep the graphs here (default: a temp folder)")
    args = ap.parse_args(argv)
    setup_threads(1)
    root = args.work or Path(tempfile.mkdtemp(prefix="bench_generate-"))
    root.mkdir(parents=True, exist_ok=True)
    by, ppl_float, genai_seconds = measure_tiny(root, args.rounds, args.prompts, args.calls)
    large = [] if args.skip_large else measure_large(root, args.rounds, max(100, args.calls // 5))
    print(
        f"bench_generate: tiny_llama, {machine()}; CPU flags {cpu_flags()}; onnxruntime {ort.__version__}, "
        f"CPU provider, 1 thread, default session options; int4 block {BLOCK}; float perplexity "
        f"{ppl_float:.4f} on 32 held-out windows of 256 bytes; builder took {genai_seconds:.1f} s"
    )
    print(table([g.row for g in by.values()]))
    report(by, ppl_float, large)


if __name__ == "__main__":
    main()
