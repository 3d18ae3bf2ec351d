"""The second zoo: plain PyTorch models of the kinds users bring (issue 35), randomly initialised, each a
factory file (``tests/user_models/<name>.py:make``) with its ``samples(n, seed)``.

Benchmarks import this registry too (``benchmarks/bench_user_models.py``). ``MODELS`` maps a name to its kind:
``cnn`` gets onnxruntime's ``quantize_static`` (QUInt8, per channel) as the peer, ``recurrent`` and
``transformer`` its ``quantize_dynamic``. A factory file may say how its data is laid out:

- ``BATCH``: the data is a directory of batch files of that many samples (inputs whose batch is not on axis
  0, or that have no batch axis, cannot be re-batched);
- ``OTHER_IMAGE``: the model runs at any image size; it is verified at ``samples(n, seed, size=OTHER_IMAGE)``
  too (exported with dynamic spatial axes).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import numpy as np

ROOT = Path(__file__).resolve().parent
CALIBRATION_SAMPLES, HELDOUT_SAMPLES = 64, 32
CALIBRATION_SEED, HELDOUT_SEED = 1, 2

MODELS: dict[str, str] = {
    "unet": "cnn",
    "super_resolution": "cnn",
    "lstm_classifier": "recurrent",
    "gru_classifier": "recurrent",
    "conv3d_clip": "cnn",
    "two_inputs": "cnn",
    "convnext_block": "cnn",
    "multihead_attention": "transformer",
    "transformer_encoder": "transformer",
    "keyword_spotter": "cnn",
    "fully_convolutional": "cnn",
    "half_precision": "cnn",
    "dlrm": "recurrent",
    "graph_convolution": "cnn",
}

#: models other work adds to this zoo: name -> (kind, who builds it). A slot is used once its file exists.
SLOTS: dict[str, tuple[str, str]] = {
    "efficientnet_same": ("cnn", "issue 35 items 1-3: the 'same'-padding EfficientNet-style CNN"),
}


def available() -> dict[str, str]:
    """The models whose factory file exists: ``MODELS`` and the filled slots."""
    filled = {n: kind for n, (kind, _) in SLOTS.items() if (ROOT / f"{n}.py").is_file()}
    return {**MODELS, **filled}


def spec(name: str) -> str:
    """The MODEL argument of ``quantcli calibrate``."""
    return f"{ROOT / name}.py:make"


def module(name: str) -> ModuleType:
    """The factory file as a module (imported once)."""
    return importlib.import_module(f"tests.user_models.{name}")


def write_data(name: str, folder: Path, size: int | None = None) -> tuple[Path, Path]:
    """The calibration and held-out samples (``size``: another image size), as one ``.npz`` each (one array
    per forward argument), or as directories of batch files where the model says ``BATCH``: their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    mod = module(name)
    tag = f"{name}.{size}" if size else name
    paths = []
    for part, n, seed in (
        ("calib", CALIBRATION_SAMPLES, CALIBRATION_SEED),
        ("heldout", HELDOUT_SAMPLES, HELDOUT_SEED),
    ):
        kw = {"size": size} if size else {}
        batch = getattr(mod, "BATCH", None)
        if batch is None:
            path = folder / f"{tag}.{part}.npz"
            np.savez(path, **mod.samples(n, seed, **kw))
        else:
            path = folder / f"{tag}.{part}"
            path.mkdir(exist_ok=True)
            for k in range(max(1, n // batch)):
                np.savez(path / f"batch{k:03d}.npz", **mod.samples(batch, seed * 1000 + k, **kw))
        paths.append(path)
    return paths[0], paths[1]


def read_data(path: Path) -> list[dict[str, np.ndarray]]:
    """The batches ``write_data`` wrote at ``path`` (one for an ``.npz``, one per file of a directory)."""
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    out = []
    for f in files:
        with np.load(f) as z:
            out.append({k: z[k] for k in z.files})
    return out


def float_outputs(name: str, data: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The model as its factory builds it (no quantcli involved), in float32, on ``data``: its outputs in the
    exporter's order (a dict's values, a tuple's items)."""
    import torch

    model = module(name).make().float()
    with torch.inference_mode():
        out = model(**{k: torch.from_numpy(v) for k, v in data.items()})
    if isinstance(out, dict):
        out = tuple(out.values())
    return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]


def onnx_outputs(path: Path, data: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The graph in onnxruntime (CPU, default options, as deployed) on ``data``."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: data[i.name] for i in sess.get_inputs()}
    return sess.run(None, feeds)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))
