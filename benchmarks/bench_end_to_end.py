"""End to end: memory of calibrating 64 vs 1024 samples, quantcli vs onnxruntime's quantize_static (a peer),
export time and verify throughput for each sample model.

    python -m benchmarks.bench_end_to_end
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import torch

from benchmarks.common import PEAK_RSS_SNIPPET, machine, peak_rss_from, peak_rss_of, setup_threads, table

_CALIB_MEM = """
import torch
torch.set_num_threads(1)
from quantcli.calibration import calibrate
from quantcli.loading import load_model
from quantcli.nn import quantize_model
from sample_models import digits_cnn
x = torch.cat([b["x"] for b in digits_cnn.calibration_batches()] + [b["x"] for b in digits_cnn.evaluation_batches()])
x = x.repeat(1 + {n} // len(x), 1, 1, 1)[:{n}]
m, _ = load_model("digits_cnn")
quantize_model(m)
calibrate(m, [{{"x": b}} for b in x.split(32)], "{method}", device="cpu")
"""


def memory_rows() -> list[dict]:
    rows = []
    for method in ("max", "entropy"):
        peaks = {n: peak_rss_of(_CALIB_MEM.format(n=n, method=method)) for n in (64, 1024)}
        rows.append({"method": method, "64 samples MiB": f"{peaks[64]:.1f}", "1024 samples MiB": f"{peaks[1024]:.1f}",
                     "ratio": f"{peaks[1024] / peaks[64]:.3f}x", "target": "within 10%"})
    return rows


_OURS = """
import torch
torch.set_num_threads(1)
import time
import warnings
t = time.perf_counter()
from quantcli.calibration import calibrate
from quantcli.loading import load_model
from quantcli.nn import quantize_model
from exporters import export_onnx
from sample_models import digits_cnn
x = torch.cat([b["x"] for b in digits_cnn.calibration_batches()])
x = x.repeat(1 + {n} // len(x), 1, 1, 1)[:{n}]
m, _ = load_model("digits_cnn")
quantize_model(m)
calibrate(m, [{{"x": b}} for b in x.split(32)], "{method}", device="cpu")
export_onnx(m, {{"x": x[:8]}}, "{out}")
print("SECONDS", time.perf_counter() - t)
"""

_PEER = """
import time, numpy as np, onnxruntime
t = time.perf_counter()
from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static
from sample_models import digits_cnn
import torch
x = torch.cat([b["x"] for b in digits_cnn.calibration_batches()])
x = x.repeat(1 + {n} // len(x), 1, 1, 1)[:{n}].numpy()
class Reader(CalibrationDataReader):
    def __init__(self):
        self.it = iter([{{"x": b}} for b in np.array_split(x, max(1, len(x) // 32))])
    def get_next(self):
        return next(self.it, None)
quantize_static("{fp32}", "{out}", Reader(), quant_format=QuantFormat.QDQ, activation_type=QuantType.QInt8,
                weight_type=QuantType.QInt8, per_channel=True, calibrate_method=CalibrationMethod.{method})
print("SECONDS", time.perf_counter() - t)
"""


def _run_timed(code: str) -> tuple[float, float]:
    """(seconds the code reports, its process's own peak RSS in MiB)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code + PEAK_RSS_SNIPPET], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"}).stdout
    secs = float(next(ln.split()[1] for ln in out.splitlines() if ln.startswith("SECONDS")))
    return secs, peak_rss_from(out)


def peer_rows(n: int = 512) -> list[dict]:
    try:
        import onnxruntime.quantization  # noqa: F401
    except ImportError:
        return [{"tool": "onnxruntime.quantization not installed"}]
    from sample_models.digits_cnn import build

    rows = []
    with tempfile.TemporaryDirectory() as d:
        fp32 = Path(d) / "fp32.onnx"
        model = build()
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.zeros(1, 1, 8, 8),), str(fp32), dynamo=False, opset_version=13,
                          input_names=["x"], dynamic_axes={"x": {0: "batch"}})
        for ours, peer in (("max", "MinMax"), ("entropy", "Entropy")):
            t_o, m_o = _run_timed(_OURS.format(n=n, method=ours, out=Path(d) / "ours.onnx"))
            t_p, m_p = _run_timed(_PEER.format(n=n, method=peer, fp32=fp32, out=Path(d) / "peer.onnx"))
            rows.append({"method": f"{ours} / {peer}", "samples": n, "quantcli s": f"{t_o:.2f}",
                         "onnxruntime s": f"{t_p:.2f}", "quantcli MiB": f"{m_o:.0f}", "onnxruntime MiB": f"{m_p:.0f}",
                         "time ratio": f"{t_p / t_o:.1f}x"})
    return rows


def export_verify_rows() -> list[dict]:
    from exporters import export_onnx
    from quantcli.calibration import calibrate
    from quantcli.checkpoint import save_calibrated
    from quantcli.loading import load_model
    from quantcli.nn import quantize_model
    from quantcli.verify import verify_onnx
    from sample_models import SAMPLES

    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, sample in SAMPLES.items():
            m, spec = load_model(name)
            quantize_model(m)
            batches = sample.calibration_batches()
            calibrate(m, batches, "max", device="cpu")
            ck = Path(d) / f"{name}.calib.pt"
            save_calibrated(ck, m, spec, batches[0])
            for exporter in ("torchscript", "dynamo"):
                t = time.perf_counter()
                export_onnx(m, {k: v[:8] for k, v in batches[0].items()}, Path(d) / f"{name}.onnx", exporter=exporter)
                t_export = time.perf_counter() - t
                t = time.perf_counter()
                rep = verify_onnx(Path(d) / f"{name}.onnx", ck)
                t_verify = time.perf_counter() - t
                rows.append({"model": name, "exporter": exporter, "export s": f"{t_export:.2f}",
                             "verify s": f"{t_verify:.2f}", "verify samples/s": f"{rep.num_samples / t_verify:.0f}",
                             "verdict": "pass" if rep.passed else "FAIL"})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    setup_threads(a.threads)
    print(f"end to end — {machine()}")
    print("\npeak RSS of calibrating digits_cnn (fresh process each)")
    print(table(memory_rows(), ["method", "64 samples MiB", "1024 samples MiB", "ratio", "target"]))
    print("\nvs onnxruntime quantize_static (calibrate + write Q/DQ ONNX, fresh process each, imports included)")
    print(table(peer_rows(), ["method", "samples", "quantcli s", "onnxruntime s", "quantcli MiB", "onnxruntime MiB", "time ratio"]))
    print("\nexport and verify (verify: every check, held-out data, CPU provider)")
    print(table(export_verify_rows(), ["model", "exporter", "export s", "verify s", "verify samples/s", "verdict"]))


if __name__ == "__main__":
    main()
