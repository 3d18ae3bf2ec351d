"""Generation with decode graphs, against onnxruntime-genai's model builder:
``python -m benchmarks.bench_generate``.

On the ``tiny_llama`` sample (Llama architecture: RoPE, RMSNorm, SwiGLU, 4 query / 2 KV heads, tied
embeddings), in one process, onnxruntime's CPU provider, default session options, 1 thread:

- quantcli: ``calibrate tiny_llama --config int4 block 32 --weight-method rtn|gptq|awq --placement all`` and
  ``export`` (a decode graph, ``GroupQueryAttention``; RTN also with ``--standard-ops``);
- the builder: ``python -m onnxruntime_genai.models.builder -i HF_FOLDER -o OUT -p int4 -e cpu -c CACHE`` on
  the sample written as a Hugging Face ``LlamaForCausalLM`` folder (``tiny_llama.write_hf_folder``); its graph
  driven by the same plain loop (it has the same inputs and outputs);
- decode tokens/s for 64 new greedy tokens after a 128-token prompt, and that prompt's prefill latency (best
  of ``--rounds`` interleaved runs over ``--prompts`` held-out prompts);
- perplexity, teacher-forced, on the held-out windows (float PyTorch model vs each graph);
- greedy-token agreement with the float model: along the float model's 32 greedy tokens from each prompt, the
  fraction of steps where the graph's most likely token is the float model's.

Goals (issue 37): decode tokens/s >= 1.0x the builder's graph at a perplexity increase no worse than its;
prefill latency <= 1.0x; GPTQ or AWQ perplexity increase <= 0.5x RTN's; greedy-token agreement >= the
builder's. Needs ``onnxruntime-genai`` (``pip install onnxruntime-genai --no-deps`` beside onnxruntime-gpu:
its wheel asks for the ``onnxruntime`` package, which would replace onnxruntime-gpu; the builder runs on
either).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_reduce_range import cpu_flags
from benchmarks.common import machine, setup_threads, table, verdict

PROMPT, NEW_TOKENS, AGREE_STEPS, BLOCK = 128, 64, 32, 32


def _run(*cmd: str) -> None:
    r = subprocess.run([sys.executable, *cmd], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")


def build_quantcli(root: Path, method: str, contrib: bool = True) -> Path:
    """calibrate + export with the real CLI; returns the decode graph."""
    cfg = root / "int4_b32.json"
    cfg.write_text(json.dumps({"preset": "int4-weight-only", "block_size": BLOCK}))
    ck = root / f"{method}.calib.pt"
    if not ck.exists():
        _run(
            "-m",
            "quantcli",
            "calibrate",
            "tiny_llama",
            "--config",
            str(cfg),
            "--weight-method",
            method,
            "--placement",
            "all",
            "--out",
            str(ck),
        )
    out = root / f"quantcli-{method}{'' if contrib else '-standard'}.onnx"
    _run("-m", "quantcli", "export", str(ck), "--onnx", str(out), *([] if contrib else ["--standard-ops"]))
    return out


def build_genai(root: Path) -> tuple[Path, float]:
    """The builder's int4 graph of the sample's Hugging Face folder; (path, seconds)."""
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        raise SystemExit(
            "bench_generate compares with onnxruntime-genai's model builder: pip install onnxruntime-genai "
            "--no-deps (keeps onnxruntime-gpu)"
        ) from None
    from sample_models import tiny_llama

    hf = tiny_llama.write_hf_folder(root / "hf")
    t0 = time.perf_counter()
    _run(
        "-m",
        "onnxruntime_genai.models.builder",
        "-i",
        str(hf),
        "-o",
        str(root / "genai"),
        "-p",
        "int4",
        "-e",
        "cpu",
        "-c",
        str(root / "cache"),
    )
    return root / "genai" / "model.onnx", time.perf_counter() - t0


def session(path: Path, layout: dict | None):
    import onnxruntime as ort

    from exporters.causal_lm.runner import DecodeSession

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return DecodeSession(path, so, layout=layout)


def timings(sessions: dict, prompts: list[np.ndarray], rounds: int) -> dict[str, dict[str, float]]:
    """Best prefill seconds and decode tokens/s per graph, interleaved round by round."""
    from exporters.causal_lm.runner import generate

    best = {n: {"prefill_ms": float("inf"), "decode_tok_s": 0.0} for n in sessions}
    for _ in range(rounds):
        for name, s in sessions.items():
            for p in prompts:
                g = generate(s, p.tolist(), NEW_TOKENS, stop_at_eos=False)
                best[name]["prefill_ms"] = min(best[name]["prefill_ms"], g.prefill_seconds * 1e3)
                best[name]["decode_tok_s"] = max(best[name]["decode_tok_s"], g.tokens_per_second)
    return best


def agreement(s, float_model, prompts: list[np.ndarray]) -> float:
    from quantcli.verify.causal_lm import greedy_continuation

    same = total = 0
    for p in prompts:
        want = greedy_continuation(float_model, p, AGREE_STEPS)
        got = s.logits(np.concatenate([p, want])[None])[0, len(p) - 1 : -1].argmax(-1)
        same += int((got == np.asarray(want)).sum())
        total += AGREE_STEPS
    return same / total


def main(argv: list[str] | None = None) -> None:
    import onnxruntime as ort

    from quantcli.verify.causal_lm import perplexity, torch_logits
    from sample_models import tiny_llama

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--work", type=Path, default=None, help="keep the graphs here (default: a temp folder)")
    args = ap.parse_args(argv)
    setup_threads(1)
    root = args.work or Path(tempfile.mkdtemp(prefix="bench_generate-"))
    root.mkdir(parents=True, exist_ok=True)
    genai_path, genai_seconds = build_genai(root)
    graphs = {f"quantcli {m}": build_quantcli(root, m) for m in ("rtn", "gptq", "awq")}
    graphs["quantcli rtn, standard ops"] = build_quantcli(root, "rtn", contrib=False)
    layout = {"num_layers": 2, "num_kv_heads": 2, "head_size": 32, "eos_token_id": 0}
    sessions = {
        "genai builder": session(genai_path, layout),
        **{n: session(p, None) for n, p in graphs.items()},
    }

    windows = tiny_llama.evaluation_batches()
    rows_all = [r.numpy() for b in windows for r in b["input_ids"]]
    prompts = [r[:PROMPT] for r in rows_all[: args.prompts]]
    times = timings(sessions, prompts, args.rounds)
    float_model = tiny_llama.build()
    ppl_rows = rows_all[:32]
    ppl_float = perplexity(lambda ids: torch_logits(float_model, ids), ppl_rows)
    agree_prompts = [r[:64] for r in rows_all[:8]]
    rows = []
    for name, s in sessions.items():
        ppl = perplexity(s.logits, ppl_rows)
        rows.append(
            {
                "graph": name,
                "decode tok/s": round(times[name]["decode_tok_s"], 1),
                "prefill ms (128)": round(times[name]["prefill_ms"], 3),
                "perplexity": round(ppl, 4),
                "ppl increase": round(ppl / ppl_float - 1, 4),
                "greedy agreement": round(agreement(s, float_model, agree_prompts), 4),
            }
        )
    by = {r["graph"]: r for r in rows}
    print(
        f"bench_generate: tiny_llama, {machine()}; CPU flags {cpu_flags()}; onnxruntime {ort.__version__}, "
        f"CPU provider, 1 thread, default session options; int4 block {BLOCK}; float perplexity "
        f"{ppl_float:.4f} on {len(ppl_rows)} held-out windows of 256 bytes; "
        f"builder took {genai_seconds:.1f} s"
    )
    print(table(rows))
    g, best = (
        by["genai builder"],
        max((by[f"quantcli {m}"] for m in ("gptq", "awq")), key=lambda r: -r["ppl increase"]),
    )
    rtn = by["quantcli rtn"]
    print()
    for name in ("quantcli rtn", "quantcli gptq", "quantcli awq"):
        r = by[name]
        ratio = r["decode tok/s"] / g["decode tok/s"]
        ok = ratio >= 1.0 and r["ppl increase"] <= g["ppl increase"]
        print(
            f"decode {name}: {ratio:.2f}x the builder's tokens/s at ppl increase {r['ppl increase']:+.4f} vs "
            f"{g['ppl increase']:+.4f}: {verdict(ok)}"
        )
    pre = by["quantcli gptq"]["prefill ms (128)"] / g["prefill ms (128)"]
    print(f"prefill (gptq graph): {pre:.2f}x the builder's: {verdict(pre <= 1.0)}")
    half = best["ppl increase"] <= 0.5 * rtn["ppl increase"]
    print(
        f"{best['graph']} ppl increase {best['ppl increase']:+.4f} vs RTN's {rtn['ppl increase']:+.4f} "
        f"(<= 0.5x): {verdict(half)}"
    )
    print(
        f"greedy agreement {best['graph']} {best['greedy agreement']:.4f} vs the builder's "
        f"{g['greedy agreement']:.4f}: {verdict(best['greedy agreement'] >= g['greedy agreement'])}"
    )
    std = by["quantcli rtn, standard ops"]["decode tok/s"] / rtn["decode tok/s"]
    print(f"GroupQueryAttention vs standard ops (rtn): standard ops decode at {std:.2f}x")


if __name__ == "__main__":
    main()
