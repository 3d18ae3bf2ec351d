"""INT4 weight-only latency at decoder shapes: ``python -m benchmarks.bench_int4_shapes``.

For each shape, a randomly initialised transformers ``LlamaForCausalLM`` (2 layers, nothing downloaded) goes
through quantcli's real path (``quantcli calibrate FILE:factory --config int4-weight-only`` and ``quantcli
export``, block 128 or ``--block``) and, from the same weights exported as a float ONNX graph, through
onnxruntime's own quantizer (``MatMulNBitsQuantizer``, its RTN default, the same block). Both run on
onnxruntime's CPU provider with 1 thread, in one process, interleaved (best of ``--rounds``), on batch 1 at a
prefill length and at one token.

Printed per shape and sequence length: the ratio quantcli / onnxruntime with default session options on both
sides (the issue's goal: <= 1.0x), and at equal MatMulNBits accuracy levels (float32 compute: quantcli's graph
in a session with ``session.qdq_matmulnbits_accuracy_level`` 1 against onnxruntime's graph as its quantizer
writes it; int8 compute: quantcli's graph at level 4 against onnxruntime's made with ``accuracy_level=4``),
and the relative RMS error of each int4 graph's logits against the float graph's (what the int8 compute
costs).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch

from benchmarks.common import best_interleaved, cpu_flags, machine, setup_threads, table, verdict
from exporters.aten_symbolics import register

BLOCK = 128
VOCAB = 1024
#: (hidden, intermediate, heads): Llama-style widths (SwiGLU intermediate ~2.7x hidden)
SHAPES = {"llama_h256": (256, 704, 4), "llama_h1024": (1024, 2816, 16), "llama_h2048": (2048, 5632, 32)}

FACTORY = """
import torch
import transformers


class LogitsOnly(torch.nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids, use_cache=False).logits


def build(hidden, inter, heads):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=hidden, intermediate_size=inter,
                                   num_attention_heads=heads, num_key_value_heads=heads, vocab_size={vocab},
                                   max_position_embeddings=256, bos_token_id=0, eos_token_id=0)
    return LogitsOnly(transformers.LlamaForCausalLM(cfg)).eval()
"""


def _session(path: Path, accuracy_level: int | None = None):
    """bench_int4's CPU session (1 thread), optionally with the MatMulNBits accuracy level set."""
    from benchmarks.bench_int4 import _session as int4_session

    return int4_session(path, accuracy_level=accuracy_level)


def _quantcli(folder: Path, name: str, seq: int, block: int) -> Path:
    from tests.helpers import cli

    config = folder / "int4.json"
    config.write_text(json.dumps({"preset": "int4-weight-only", "block_size": block}))
    ids = folder / "ids.npz"
    np.savez(ids, input_ids=np.random.default_rng(0).integers(0, VOCAB, (4, seq)))
    ck, out = folder / f"{name}.calib.pt", folder / f"{name}.onnx"
    r = cli("calibrate", f"{folder / 'lm.py'}:{name}", "--config", config, "--data", ids, "--out", ck)
    assert r.exit_code == 0, r.output
    r = cli("export", ck, "--onnx", out)
    assert r.exit_code == 0, r.output
    return out


def _onnxruntime(fp32: Path, out: Path, block: int, accuracy_level: int | None = None) -> Path:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    q = MatMulNBitsQuantizer(onnx.load(str(fp32)), block_size=block, accuracy_level=accuracy_level)
    q.process()
    q.model.save_model_to_file(str(out), use_external_data_format=False)
    return out


def measure(
    folder: Path, name: str, dims: tuple[int, int, int], seqs: list[int], rounds: int, block: int = BLOCK
) -> list[dict]:
    import importlib.util

    (folder / "lm.py").write_text(
        FACTORY.replace("{vocab}", str(VOCAB))
        + "".join(f"\n\ndef {n}():\n    return build{d}\n" for n, d in SHAPES.items())
    )
    spec = importlib.util.spec_from_file_location("bench_lm", folder / "lm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = getattr(mod, name)()
    fp32 = folder / f"{name}_fp32.onnx"
    ids = torch.zeros(1, max(seqs), dtype=torch.long)
    register()  # aten::diff, which transformers' masks call (quantcli's exporter registers it too)
    torch.onnx.export(
        model,
        (ids,),
        str(fp32),
        dynamo=False,
        opset_version=17,
        input_names=["input_ids"],
        output_names=["logits"],
        dynamic_axes={"input_ids": {0: "batch", 1: "seq"}},
    )
    ours = _quantcli(folder, name, max(seqs), block)
    ort_default = _onnxruntime(fp32, folder / f"{name}_ort.onnx", block)
    ort_level4 = _onnxruntime(fp32, folder / f"{name}_ort4.onnx", block, accuracy_level=4)
    sessions = {
        "q_default": _session(ours),
        "q_level1": _session(ours, 1),
        "o_default": _session(ort_default),
        "o_level4": _session(ort_level4),
    }
    in_name = {k: s.get_inputs()[0].name for k, s in sessions.items()}
    fp32_session = _session(fp32)
    rows = []
    for seq in seqs:
        feed = np.random.default_rng(seq).integers(0, VOCAB, (1, seq))
        ref = fp32_session.run(None, {"input_ids": feed})[0]

        def err(key: str, feed=feed, ref=ref) -> float:
            """Relative RMS error of the logits against the float graph's."""
            out = sessions[key].run(None, {in_name[key]: feed})[0]
            return round(float(np.sqrt(np.mean((out - ref) ** 2) / np.mean(ref**2))), 4)

        lat = best_interleaved(
            {k: (lambda s=s, k=k, f=feed: s.run(None, {in_name[k]: f})) for k, s in sessions.items()},
            rounds,
            warmup=2,
        )
        rows.append(
            {
                "shape": name,
                "hidden": dims[0],
                "seq": seq,
                "quantcli_ms": round(lat["q_default"] * 1e3, 2),
                "ort_ms": round(lat["o_default"] * 1e3, 2),
                "default": round(lat["q_default"] / lat["o_default"], 3),
                "fp32_compute": round(lat["q_level1"] / lat["o_default"], 3),
                "int8_compute": round(lat["q_default"] / lat["o_level4"], 3),
                "q_level1_ms": round(lat["q_level1"] * 1e3, 2),
                "o_level4_ms": round(lat["o_level4"] * 1e3, 2),
                "err_q_default": err("q_default"),
                "err_q_level1": err("q_level1"),
                "err_o_default": err("o_default"),
            }
        )
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20, help="interleaved latency rounds")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--seqs", default="128,1", help="sequence lengths (batch 1)")
    p.add_argument("--block", type=int, default=BLOCK, help="block size, both quantizers")
    a = p.parse_args(argv)
    setup_threads(1)
    print(
        f"# bench_int4_shapes: block {a.block}, onnxruntime CPU provider, 1 thread; {machine()}; "
        f"CPU flags: {cpu_flags()}"
    )
    seqs = [int(s) for s in a.seqs.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in a.shapes.split(","):
            sub = Path(d) / name
            sub.mkdir()
            rows += measure(sub, name, SHAPES[name], seqs, a.rounds, a.block)
    print(
        table(
            rows,
            [
                "shape",
                "seq",
                "quantcli_ms",
                "ort_ms",
                "default",
                "fp32_compute",
                "int8_compute",
                "q_level1_ms",
                "o_level4_ms",
                "err_q_default",
                "err_q_level1",
                "err_o_default",
            ],
        )
    )
    for r in rows:
        print(
            f"{r['shape']} seq {r['seq']}: quantcli / onnxruntime int4, default session options "
            f"{r['default']:.2f}x: {verdict(r['default'] <= 1.0)}"
        )


if __name__ == "__main__":
    main()
