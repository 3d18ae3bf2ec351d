"""INT4 weight-only on the sample decoder: ``python -m benchmarks.bench_int4``.

On ``tiny_lm`` (sample_models/tiny_lm.py), in one process, onnxruntime's CPU provider with 1 thread:

- **perplexity** on the held-out windows of the fp32 ONNX graph, of quantcli's int4 graphs
  (``--weight-method`` rtn, gptq, awq; ``int4-weight-only``, block 128) and of onnxruntime's own int4
  quantizer (``onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer``: its RTN default and its
  GPTQ config, block 128) applied to the same fp32 ONNX file. Goals: gptq or awq within 5% of fp32, and at or
  below both of onnxruntime's;
- every int4 layer fused into ``MatMulNBits`` (the optimized graph saved by onnxruntime and read back);
- the graph's size <= 0.3x the fp32 file;
- latency <= 1.0x onnxruntime's int4 graph (its RTN output), best of interleaved runs over the held-out
  batches;
- the time of GPTQ and AWQ against RTN's (calibration of the same model and data, best of a few runs);
- peak memory of ``quantcli calibrate tiny_lm --weight-method gptq`` at 64 and 256 samples (fresh processes).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import onnx
import torch

from benchmarks.common import (
    best_interleaved,
    cpu_flags,
    machine,
    peak_rss_of,
    run_all,
    setup_threads,
    table,
    verdict,
)

BLOCK = 128
METHODS = ("rtn", "gptq", "awq")


def _session(path, optimized: Path | None = None, accuracy_level: int | None = None):
    """A CPU session, 1 thread; ``accuracy_level``: the compute precision of the MatMulNBits onnxruntime makes
    of a DequantizeLinear -> MatMul (default 4: int8 activations; 1: float32, what an unset level means in a
    graph that holds MatMulNBits itself, as onnxruntime's quantizer writes it)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    if accuracy_level is not None:
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(accuracy_level))
    if optimized is not None:
        so.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _perplexity(sess, batches) -> float:
    from sample_models import tiny_lm

    name = sess.get_inputs()[0].name
    return tiny_lm.perplexity(lambda ids: sess.run(None, {name: ids})[0], batches)


def export_fp32(path: Path) -> None:
    """The trained model as a plain float ONNX graph (what onnxruntime's quantizer starts from)."""
    from sample_models import tiny_lm

    model = tiny_lm.build()
    ids = tiny_lm.calibration_batches()[0]["input_ids"][:2]
    torch.onnx.export(
        model,
        (ids,),
        str(path),
        dynamo=False,
        opset_version=17,
        input_names=["input_ids"],
        output_names=["logits"],
        dynamic_axes={"input_ids": {0: "batch"}, "logits": {0: "batch"}},
    )


def quantcli_int4(method: str, batches) -> tuple[torch.nn.Module, float]:
    """(the calibrated tiny_lm with ``method``, seconds of calibration + weight rounding)."""
    from quantcli import calibrate
    from quantcli.calibration.weight_rounding import awq, gptq
    from quantcli.inputs.loading import load_model
    from quantcli.nn import quantize_model

    model, _ = load_model("tiny_lm")
    quantize_model(model, {"preset": "int4-weight-only", "block_size": BLOCK})
    t0 = time.perf_counter()
    if method == "awq":
        awq(model, batches, device="cpu")
    calibrate(model, batches, device="cpu")
    if method == "gptq":
        gptq(model, batches)
    return model, time.perf_counter() - t0


class _Reader:
    """onnxruntime's CalibrationDataReader over the calibration batches."""

    def __init__(self, batches):
        self.feeds = [{"input_ids": b["input_ids"].numpy()} for b in batches]
        self.i = 0

    def get_next(self):
        self.i += 1
        return self.feeds[self.i - 1] if self.i <= len(self.feeds) else None

    def __iter__(self):
        return iter(self.feeds)

    def rewind(self):
        self.i = 0


def ort_int4(fp32: Path, out: Path, algo: str, batches, accuracy_level: int | None = None) -> float:
    """onnxruntime's MatMulNBitsQuantizer on ``fp32`` (its RTN default, or its GPTQ config); returns
    seconds."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        GPTQWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    t0 = time.perf_counter()
    cfg = GPTQWeightOnlyQuantConfig(calibration_data_reader=_Reader(batches)) if algo == "gptq" else None
    q = MatMulNBitsQuantizer(
        onnx.load(str(fp32)), block_size=BLOCK, algo_config=cfg, accuracy_level=accuracy_level
    )
    try:
        q.process()
    except ValueError as e:
        # its GPTQ path packs asymmetric zero points wrongly where a layer's input is one block (K ==
        # block_size): "cannot reshape array of size 64 into shape (128,newaxis)"; the symmetric grid has no
        # zero point
        print(f"onnxruntime {algo} (asymmetric, its default) failed: {e}; symmetric instead")
        cfg = GPTQWeightOnlyQuantConfig(calibration_data_reader=_Reader(batches)) if algo == "gptq" else None
        q = MatMulNBitsQuantizer(onnx.load(str(fp32)), block_size=BLOCK, is_symmetric=True, algo_config=cfg)
        q.process()
    q.model.save_model_to_file(str(out), use_external_data_format=False)
    return time.perf_counter() - t0


def _fusion(path: Path, folder: Path) -> tuple[int, int]:
    """(layers quantcli exported as int4 weight-only, MatMulNBits nodes in onnxruntime's optimized graph)."""
    from exporters.onnxruntime.fusion import inspect_fusion

    rep = inspect_fusion(path)
    _session(path, folder / "optimized.onnx")
    ops = [n.op_type for n in onnx.load(str(folder / "optimized.onnx")).graph.node]
    return len(rep.layers) - len(rep.unfused), ops.count("MatMulNBits") if len(rep.layers) else 0


def _memory(samples: int) -> float:
    code = (
        "import torch; torch.set_num_threads(1)\nfrom tests.helpers import cli\n"
        f"r = cli('calibrate', 'tiny_lm', '--config', 'int4-weight-only', '--weight-method', 'gptq', "
        f"'--num-samples', '{samples}', '--out', '/dev/null/x.pt')\n"
    )
    return peak_rss_of(
        code.replace("'/dev/null/x.pt'", f"'{tempfile.gettempdir()}/bench_int4_{samples}.calib.pt'")
    )


def measure(folder: Path, rounds: int) -> tuple[list[dict], dict]:
    from exporters import export_onnx
    from sample_models import tiny_lm

    calib, held = tiny_lm.calibration_batches(), tiny_lm.evaluation_batches()
    fp32 = folder / "fp32.onnx"
    export_fp32(fp32)
    rows = [{"graph": "fp32", "ppl": _perplexity(_session(fp32), held), "bytes": fp32.stat().st_size}]
    facts: dict = {"fp32_ppl": rows[0]["ppl"], "fp32_bytes": rows[0]["bytes"], "seconds": {}, "fused": {}}
    for method in METHODS:
        times = []
        for _ in range(3):
            model, sec = quantcli_int4(method, calib)
            times.append(sec)
        path = folder / f"quantcli_{method}.onnx"
        example = {"input_ids": calib[0]["input_ids"][:2]}
        res = export_onnx(copy.deepcopy(model), example, path)
        facts["fused"][method] = (res.quantized_layers, *_fusion(path, folder))
        facts["seconds"][method] = min(times)
        rows.append(
            {
                "graph": f"quantcli {method}",
                "ppl": _perplexity(_session(path), held),
                "bytes": path.stat().st_size,
                "seconds": round(min(times), 3),
            }
        )
    for algo in ("rtn", "gptq"):
        path = folder / f"ort_{algo}.onnx"
        sec = ort_int4(fp32, path, algo, calib)
        rows.append(
            {
                "graph": f"onnxruntime {algo}",
                "ppl": _perplexity(_session(path), held),
                "bytes": path.stat().st_size,
                "seconds": round(sec, 3),
            }
        )
    feeds = [{"input_ids": b["input_ids"].numpy()} for b in held]
    ours = folder / "quantcli_gptq.onnx"
    ort_int4(fp32, folder / "ort_rtn_level4.onnx", "rtn", calib, accuracy_level=4)
    sessions = {
        "quantcli": _session(ours, accuracy_level=1),
        "quantcli_default": _session(ours),
        "onnxruntime": _session(folder / "ort_rtn.onnx"),
        "onnxruntime_level4": _session(folder / "ort_rtn_level4.onnx"),
    }
    facts["ppl_level1"] = _perplexity(sessions["quantcli"], held)
    facts["latency"] = best_interleaved(
        {k: (lambda s=s: run_all(s, feeds)) for k, s in sessions.items()}, rounds, warmup=1
    )
    for r in rows:
        r["ppl_vs_fp32"] = round(r["ppl"] / facts["fp32_ppl"], 4)
        r["size_vs_fp32"] = round(r["bytes"] / facts["fp32_bytes"], 3)
        r["ppl"] = round(r["ppl"], 4)
    return rows, facts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15, help="interleaved latency rounds")
    p.add_argument("--skip-memory", action="store_true", help="skip the two fresh-process memory runs")
    a = p.parse_args(argv)
    setup_threads(1)
    print(
        f"# bench_int4: tiny_lm, block {BLOCK}, onnxruntime CPU provider, 1 thread; {machine()}; "
        f"CPU flags: {cpu_flags()}"
    )
    with tempfile.TemporaryDirectory() as d:
        rows, facts = measure(Path(d), a.rounds)
    print(table(rows, ["graph", "ppl", "ppl_vs_fp32", "bytes", "size_vs_fp32", "seconds"]))
    ppl = {r["graph"]: r["ppl"] for r in rows}
    best = min(ppl["quantcli gptq"], ppl["quantcli awq"])
    fp32 = facts["fp32_ppl"]
    print(f"perplexity gptq/awq within 5% of fp32 ({best:.4f} vs {fp32:.4f}): {verdict(best <= 1.05 * fp32)}")
    for algo in ("rtn", "gptq"):
        ref = ppl[f"onnxruntime {algo}"]
        print(f"perplexity at or below onnxruntime {algo} ({best:.4f} vs {ref:.4f}): {verdict(best <= ref)}")
    for method, (layers, fused, nbits) in facts["fused"].items():
        print(
            f"{method}: {fused} of {layers} int4 layers fused, {nbits} MatMulNBits in onnxruntime's graph: "
            f"{verdict(layers > 0 and fused == layers == nbits)}"
        )
    size = max(r["size_vs_fp32"] for r in rows if r["graph"].startswith("quantcli"))
    print(f"graph size <= 0.3x fp32 ({size:.3f}x): {verdict(size <= 0.3)}")
    lat = facts["latency"]
    ratio = lat["quantcli"] / lat["onnxruntime"]
    print(
        f"latency vs onnxruntime's int4 graph (its accuracy_level unset: float32 compute), both float32 "
        f"compute (session.qdq_matmulnbits_accuracy_level 1 for quantcli's; gptq perplexity then "
        f"{facts['ppl_level1']:.4f}), best of {a.rounds} interleaved over the 8 held-out batches of 32x64: "
        f"{lat['quantcli'] * 1e3:.1f} ms vs {lat['onnxruntime'] * 1e3:.1f} ms = {ratio:.2f}x: "
        f"{verdict(ratio <= 1.0)}"
    )
    dflt = lat["quantcli_default"] / lat["onnxruntime"]
    print(
        f"  with default session options (level 4: int8 activations in MatMulNBits) quantcli's graph takes "
        f"{lat['quantcli_default'] * 1e3:.1f} ms = {dflt:.2f}x: {verdict(dflt <= 1.0)} on tiny_lm (K = "
        f"128..384, where int8 compute does not pay); at decoder widths see python -m "
        f"benchmarks.bench_int4_shapes"
    )
    l4 = lat["quantcli_default"] / lat["onnxruntime_level4"]
    print(
        f"  against onnxruntime's int4 graph made with accuracy_level=4 "
        f"({lat['onnxruntime_level4'] * 1e3:.1f} ms), "
        f"both int8-activation compute: {l4:.2f}x: {verdict(l4 <= 1.0)}"
    )
    s = facts["seconds"]
    print(
        f"weight rounding time vs rtn (calibration included, best of 3): gptq {s['gptq'] / s['rtn']:.2f}x "
        f"({s['gptq']:.2f} s), awq {s['awq'] / s['rtn']:.2f}x ({s['awq']:.2f} s), rtn {s['rtn']:.2f} s"
    )
    if not a.skip_memory:
        m64, m256 = _memory(64), _memory(256)
        print(
            f"peak RSS of calibrate --weight-method gptq: 64 samples {m64:.0f} MiB, 256 samples {m256:.0f} "
            f"MiB ({m256 / m64:.3f}x): flat {verdict(m256 <= 1.05 * m64)}"
        )


if __name__ == "__main__":
    main()
