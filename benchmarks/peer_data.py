"""The same calibration data for quantcli and onnxruntime's ``quantize_static``: whole arrays, one per input.

Every array has a fixed shape, so one ``.npz`` file feeds both ``quantcli calibrate --data`` and a numpy-only
``CalibrationDataReader``; both sides cut it into the same batches of 32 samples.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

#: model name -> the MODEL spec ``quantcli calibrate`` takes for it
SPECS = {
    "digits_cnn": "digits_cnn",
    "text_encoder": "text_encoder",
    "resnet_cnn": "sample_models.structured:resnet_cnn",
}
BATCH = 32


def build(name: str) -> nn.Module:
    """The float model, weights loaded, in eval mode."""
    from quantcli.inputs.loading import load_model

    return load_model(SPECS[name])[0].eval()


def arrays(name: str, n: int) -> dict[str, np.ndarray]:
    """``n`` samples of ``name``'s bundled data (repeated where it has fewer), one fixed-shape array per
    input.

    text_encoder's lines are padded to the longest line (token 0, mask 0), as one batch of them would be.
    """
    if name == "digits_cnn":
        from sample_models import digits_cnn

        x = torch.cat([b["x"] for b in digits_cnn.calibration_batches() + digits_cnn.evaluation_batches()])
        return {"x": _repeat(x, n).numpy()}
    if name == "resnet_cnn":
        from sample_models.structured import resnet_batches

        return {"x": torch.cat([b["x"] for b in resnet_batches(n)]).numpy()}
    if name == "text_encoder":
        from sample_models import text_encoder

        batches = text_encoder.calibration_batches() + text_encoder.evaluation_batches()
        width = max(b["input_ids"].shape[1] for b in batches)
        out = {}
        for key in ("input_ids", "attention_mask"):
            padded = [torch.nn.functional.pad(b[key], (0, width - b[key].shape[1])) for b in batches]
            out[key] = _repeat(torch.cat(padded), n).numpy()
        return out
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(SPECS)}")


def _repeat(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.repeat(1 + n // len(x), *([1] * (x.dim() - 1)))[:n]


def torch_batches(data: dict[str, np.ndarray]) -> list[dict[str, torch.Tensor]]:
    """The batches quantcli calibrates on (``--batch-size 32`` cuts the ``.npz`` the same way)."""
    n = len(next(iter(data.values())))
    return [{k: torch.from_numpy(v[i : i + BATCH]) for k, v in data.items()} for i in range(0, n, BATCH)]


def export_fp32(model: nn.Module, data: dict[str, np.ndarray], path: str) -> None:
    """The float ONNX graph the peer quantizes (opset 13, dynamic batch and sequence)."""
    import warnings

    example = tuple(torch.from_numpy(v[:2]) for v in data.values())
    axes = {k: ({0: "batch", 1: "seq"} if v.dtype == np.int64 else {0: "batch"}) for k, v in data.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, example, path, dynamo=False, opset_version=13, input_names=list(data), dynamic_axes=axes
        )
