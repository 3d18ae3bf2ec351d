"""Tables of what a calibrated checkpoint or an exported ONNX file contains (plain data; the command line
prints)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantcli.quant.descriptor import format_name


def _amax_text(amax) -> str:
    if amax is None:
        return "-"
    if amax.numel() == 1:
        return f"{float(amax):.6g}"
    return f"[{float(amax.min()):.4g} .. {float(amax.max()):.4g}] ({amax.numel()})"


def _format(desc: dict[str, Any]) -> str:
    """The format name of a descriptor as the checkpoint stores it (a dict of the non-default fields)."""
    return format_name(
        desc.get("num_bits", 8), bool(desc.get("unsigned")), asymmetric=bool(desc.get("asymmetric"))
    )


def inspect_checkpoint(path: str | Path, trust_code: bool = False) -> dict[str, Any]:
    """The checkpoint's quantizers, read without running any model code.

    With ``trust_code=True`` the model is also rebuilt from the checkpoint (running its code) and its stored
    weights loaded, so ``model_loads`` says whether ``export``/``verify`` will be able to use it.
    """
    from quantcli.inputs.checkpoint import read_checkpoint
    from quantcli.inputs.loading import model_code
    from quantcli.inputs.model_spec import ModelSpec

    data = read_checkpoint(path)
    rows = []
    for name, q in data["quantizers"].items():
        d = q["descriptor"]
        rows.append(
            {
                "name": name,
                "enabled": q["enabled"],
                "format": _format(d),
                "axis": d.get("axis"),
                "block_sizes": {k: v for k, v in (d.get("block_sizes") or {}).items()},
                "amax": _amax_text(q["amax"]) if q["enabled"] else "-",
                "amax_values": None if q["amax"] is None else q["amax"].flatten().tolist()[:16],
            }
        )
    return {
        "model": data["model"]["spec"],
        "model_code": model_code(ModelSpec.from_plain(data["model"])),
        "config": data["quant_config"].get("source", data["quant_config"].get("preset")),
        # checkpoints from before targets existed were placed as the tensorrt target places (no output
        # quantizers)
        "target": data["quant_config"].get("target", "onnxruntime (legacy placement)"),
        "inputs": {
            "names": data["inputs"]["names"],
            "dtypes": data["inputs"]["dtypes"],
            "shapes": data["inputs"]["shapes"],
        },
        "calibration": {k: v for k, v in data["calibration"].items() if k not in ("calibrated", "skipped")},
        "quantizers": rows,
        "batchnorm_folds": list(data.get("batchnorm_folds", [])),
        "model_loads": _model_loads(path) if trust_code else None,
    }


def _model_loads(path: str | Path) -> dict[str, Any]:
    from quantcli.inputs.checkpoint import load_calibrated
    from quantcli.nn import quantizers

    ck = load_calibrated(path, trust_code=True)
    return {
        "class": type(ck.model).__name__,
        "parameters": sum(p.numel() for p in ck.model.parameters()),
        "quantizers": len(quantizers(ck.model)),
    }


def inspect_onnx(path: str | Path) -> dict[str, Any]:
    from exporters.graph import qdq_pairs, read_onnx

    model = read_onnx(path)
    pairs = qdq_pairs(model)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    meta = {p.key: p.value for p in model.metadata_props}
    return {
        "opset": opset,
        "target": meta.get("quantcli.target"),
        "pairs": [p.to_row() for p in pairs],
        "metadata": {p.key: p.value for p in model.metadata_props},
    }


def inspect_runtime(path: str | Path, runtime: str = "onnxruntime", provider: str = "cpu") -> dict[str, Any]:
    """Per quantized layer of an ONNX file: whether ``runtime`` runs it as an integer kernel, and why not.

    Keys: ``runtime``, ``provider``, ``load_error``, ``quantized_layers``, ``unfused_layers``,
        ``session_needs``
    (why the graph needs non-default session options, if it does), ``disabled_optimizers`` (those options),
    and ``layers``: ``{layer, node, op_type, quantizers, kernel, fused, reasons}`` each.
    """
    from exporters.onnxruntime.fusion import inspect_fusion
    from quantcli.errors import QuantCliError

    if runtime != "onnxruntime":
        raise QuantCliError(f"unknown runtime {runtime!r}; onnxruntime is the one quantcli can inspect")
    return inspect_fusion(path, provider).to_dict()
