"""The model zoo: standard architectures from ``transformers``' config classes, randomly initialised, each a
factory file a user could have written (``tests/zoo/models/<name>.py:make``) with its ``samples(n, seed)``.

``KNOWN_FAILURES`` is the one table of expected failures, each owned by the helper fixing it; the tests apply
it as ``xfail(strict=False)``, so flipping one is deleting its line.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path
from types import ModuleType

import numpy as np

ROOT = Path(__file__).resolve().parent / "models"
CALIBRATION_SAMPLES, HELDOUT_SAMPLES = 64, 32
CALIBRATION_SEED, HELDOUT_SEED = 1, 2
EXPORTERS = ("torchscript", "dynamo")
TARGETS = ("onnxruntime", "tensorrt")

#: name -> kind: "cnn" and "vit" get onnxruntime's quantize_static as the peer, "transformer" quantize_dynamic
MODELS: dict[str, str] = {
    "resnet": "cnn",
    "mobilenet_v2": "cnn",
    "mobilevit": "vit",
    "convnext": "cnn",
    "efficientnet": "cnn",
    "vit": "vit",
    "swin": "vit",
    "yolos": "vit",
    "segformer": "vit",
    "bert": "transformer",
    "distilbert": "transformer",
    "gpt2": "transformer",
    "llama": "transformer",
    "t5_encoder": "transformer",
    "whisper_encoder": "transformer",
    "wav2vec2": "transformer",
}

#: deeper models for the measurement of verify's criteria (benchmarks/bench_zoo.py --criteria), not in the
# test
CRITERIA_MODELS: dict[str, str] = {"vit_tiny": "vit", "efficientnet_b0": "cnn"}

#: (model, exporter, target) -> why it fails today and who owns the fix; "*" matches any exporter or target
#: (the layer-coverage test uses "layers" for the exporter)
KNOWN_FAILURES: dict[tuple[str, str, str], str] = {}


def known_failure(model: str, exporter: str, target: str) -> str | None:
    for (m, e, t), why in KNOWN_FAILURES.items():
        if m == model and e in ("*", exporter) and t in ("*", target):
            return why
    return None


def spec(name: str) -> str:
    """The MODEL argument of ``quantcli calibrate``."""
    return f"{ROOT / name}.py:make"


@cache
def module(name: str) -> ModuleType:
    """The factory file, imported as a user's script."""
    s = importlib.util.spec_from_file_location(f"zoo_{name}", ROOT / f"{name}.py")
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return mod


def write_data(name: str, folder: Path) -> tuple[Path, Path]:
    """The calibration and held-out samples as ``.npz`` (one array per forward argument): their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    calib, held = folder / f"{name}.calib.npz", folder / f"{name}.heldout.npz"
    np.savez(calib, **module(name).samples(CALIBRATION_SAMPLES, CALIBRATION_SEED))
    np.savez(held, **module(name).samples(HELDOUT_SAMPLES, HELDOUT_SEED))
    return calib, held


def float_outputs(name: str, data: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The model as the user's factory builds it (no quantcli involved), on ``data``: its outputs,
    flattened."""
    import torch

    model = module(name).make()
    with torch.inference_mode():
        out = model(**{k: torch.from_numpy(v) for k, v in data.items()})
    return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]


def onnx_outputs(path: Path, data: dict[str, np.ndarray], optimize: bool = True) -> list[np.ndarray]:
    """The graph in onnxruntime (CPU, default options, as deployed; ``optimize=False``: every optimization
    off, each node as ONNX defines it) on ``data``."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    feeds = {i.name: data[i.name] for i in sess.get_inputs()}
    return sess.run(None, feeds)


def linear_like_layers(model) -> list[str]:
    """The layers a user expects quantized, found here without quantcli: Linear, Conv, ConvTranspose
    (subclasses included) and transformers' ``Conv1D`` (a Linear with a transposed weight)."""
    from torch import nn

    kinds = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d)
    return [n for n, m in model.named_modules() if isinstance(m, kinds) or type(m).__name__ == "Conv1D"]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))
