"""The peer: onnxruntime's ``quantize_static`` on a float ONNX graph, fed from an ``.npz`` with numpy only.

Imports neither torch nor quantcli, as a user of onnxruntime's quantization would run it. The settings are the
nearest to quantcli's ``int8`` preset: QDQ format, int8 weights per output channel, symmetric int8 activations
per tensor. Run as a script it is the peer's whole command (what ``bench_end_to_end`` times end to end):

    python benchmarks/ort_peer.py FP32.onnx DATA.npz OUT.onnx MinMax|Entropy
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_static,
)
from onnxruntime.quantization.calibrate import create_calibrator
from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

BATCH = 32
OPTIONS = {"ActivationSymmetric": True, "WeightSymmetric": True}


class Reader(CalibrationDataReader):
    """Batches of ``BATCH`` samples cut from whole arrays, as ``quantcli calibrate --batch-size 32`` cuts
    them; or, given a list of batches (a directory of batch files, which cannot be re-batched), those."""

    def __init__(self, data: dict[str, np.ndarray] | list[dict[str, np.ndarray]]):
        if isinstance(data, list):
            self._it = iter(data)
            return
        n = len(next(iter(data.values())))
        self._it = iter([{k: v[i : i + BATCH] for k, v in data.items()} for i in range(0, n, BATCH)])

    def get_next(self):
        return next(self._it, None)


def calibrate(fp32: str, data: dict[str, np.ndarray], method: str) -> tuple[object, float]:
    """Calibration alone: the steps ``quantize_static`` runs before it quantizes. Returns the tensor ranges
    and the seconds of running the batches and computing the ranges; building the calibrator (the graph
    augmented with every quantizable op's outputs, its session) is left out, as building the quantized model
    is on quantcli's side."""
    ops = list(set(QLinearOpsRegistry) | set(QDQRegistry))
    with tempfile.TemporaryDirectory(prefix="ort.quant.") as d:
        calibrator = create_calibrator(
            Path(fp32),
            ops,
            augmented_model_path=str(Path(d) / "augmented.onnx"),
            calibrate_method=getattr(CalibrationMethod, method),
        )
        t = time.perf_counter()
        calibrator.collect_data(Reader(data))
        ranges = calibrator.compute_data()
        seconds = time.perf_counter() - t
        calibrator.clear_collected_data()
        return ranges, seconds


def quantize(
    fp32: str,
    data: dict[str, np.ndarray] | list[dict[str, np.ndarray]],
    out: str,
    method: str,
    activations: str = "int8",
) -> None:
    """Calibrate and write the Q/DQ graph: the peer's whole job.

    ``activations``: ``int8`` (symmetric, the settings nearest quantcli's ``int8`` preset) or ``uint8``
    (asymmetric ``QUInt8``, what onnxruntime's quantization guide recommends on x86-64 CPUs with AVX2/AVX-512
    VNNI: its u8s8 kernels then run without the s8-to-u8 conversion)."""
    unsigned = activations == "uint8"
    quantize_static(
        fp32,
        out,
        Reader(data),
        quant_format=QuantFormat.QDQ,
        activation_type=QuantType.QUInt8 if unsigned else QuantType.QInt8,
        weight_type=QuantType.QInt8,
        per_channel=True,
        calibrate_method=getattr(CalibrationMethod, method),
        extra_options={**OPTIONS, "ActivationSymmetric": not unsigned},
    )


def _hwm_mib() -> float:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024.0


if __name__ == "__main__":
    fp32, npz, out, method = sys.argv[1:5]
    with np.load(npz) as z:
        arrays = {k: z[k] for k in z.files}
    base = _hwm_mib()  # imports done, data in memory
    quantize(fp32, arrays, out, method)
    print("BASE_MIB", base)
    print("PEAK_MIB", _hwm_mib())
