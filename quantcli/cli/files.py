"""The files a command reads and writes: ``--data`` read as calibration read it, and outputs that must never
overwrite an input (checked before any work)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from quantcli import defaults


def checkpoint_inputs(
    ckpt, data: Optional[Path], batch_size: Optional[int], num_samples: Optional[int], options=None
):
    """``--data`` read as calibration read it (the preprocessing the checkpoint stored, the model folder's
    tokenizer); ``None`` without ``--data``, where a preprocessing flag would do nothing and is refused."""
    from quantcli.inputs.data import DataOptions, load_data, refuse_without_data

    if data is None:
        refuse_without_data(
            options or DataOptions(),
            batch_size is not None,
            "without --data the checkpoint's own batches, tensors already, are used",
        )
        return None

    opts = options or DataOptions()
    opts.model_folder = ckpt.spec.path if ckpt.spec.kind == "hf" else None
    opts.stored = ckpt.data.get("preprocessing")
    opts.batch_size_given = batch_size is not None
    batches, _ = load_data(data, ckpt.model, batch_size or defaults.BATCH_SIZE, num_samples, opts)
    return batches


def external(onnx_path: Path) -> Path:
    """The external data file quantcli export writes beside a large graph."""
    return onnx_path.with_name(onnx_path.name + ".data")


def refuse_inputs(out_path: Path, inputs, option: str, external_data: bool = False) -> None:
    """Exit 2 (before any work) when ``out_path`` (and, for a graph, its ``.data`` file) is a file read."""
    from quantcli.files import refuse_overwriting_inputs

    refuse_overwriting_inputs(out_path, inputs, option)
    if external_data:
        refuse_overwriting_inputs(external(out_path), inputs, f"{option}'s external data")
