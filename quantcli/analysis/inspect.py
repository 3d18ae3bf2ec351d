"""Tables of what a calibrated checkpoint or an exported ONNX file contains (plain data; the command line
prints)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantcli.quant.descriptor import format_name


def _amax_text(amax) -> str:
    from exporters.graph import values_text

    return "-" if amax is None else values_text(amax.detach().float().cpu().numpy())


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
    state = data.get("state_dict") or {}
    for name, q in data["quantizers"].items():
        d = q["descriptor"]
        amin = state.get(f"{name}.amin")  # an asymmetric quantizer's calibrated minimum (a buffer)
        rows.append(
            {
                "name": name,
                "enabled": q["enabled"],
                "format": _format(d),
                "axis": d.get("axis"),
                "block_sizes": {k: v for k, v in (d.get("block_sizes") or {}).items()},
                "amax": _amax_text(q["amax"]) if q["enabled"] else "-",
                "amax_values": None if q["amax"] is None else q["amax"].flatten().tolist(),
                "amin": _amax_text(amin) if q["enabled"] and amin is not None else None,
                "amin_values": None if amin is None else amin.flatten().tolist(),
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
    """The graph's quantizers: every Q/DQ pair (``pairs``; a stored weight's with the range of its codes,
    ``codes``, which shows a 7-bit grid held in int8) and every dynamic layer's two (``dynamic``: the input
    quantized at run time by DynamicQuantizeLinear, the stored weight codes of its MatMulInteger)."""
    from exporters.dynamic_linear import dynamic_layers
    from exporters.graph import initializer_map, qdq_pairs, read_onnx, to_numpy

    model = read_onnx(path)
    inits = initializer_map(model.graph)
    pairs = []
    for p in qdq_pairs(model):
        row = p.to_row()
        row["codes"] = _code_range(to_numpy(inits[p.tensor])) if p.stored == "initializer" else None
        pairs.append(row)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    meta = {p.key: p.value for p in model.metadata_props}
    return {
        "opset": opset,
        "target": meta.get("quantcli.target"),
        "pairs": pairs,
        "dynamic": [_dynamic_row(layer, inits) for layer in dynamic_layers(model)],
        "metadata": meta,
    }


def _code_range(codes) -> list[int] | None:
    """``[min, max]`` of stored integer codes (``None`` for float8 codes)."""
    import numpy as np

    if not np.issubdtype(codes.dtype, np.integer) or codes.size == 0:
        return None
    return [int(codes.min()), int(codes.max())]


def _dynamic_row(layer, inits) -> dict[str, Any]:
    from exporters.graph import plain_values, to_numpy, values_text
    from quantcli.quant import formats

    w = inits.get(layer.weight)
    codes = to_numpy(w) if w is not None else None
    fmt = formats.BY_ELEM_TYPE.get(w.data_type) if w is not None else None
    scale = layer.weight_scale
    zp = layer.weight_zero_point
    return {
        "node": layer.node,
        "input_quantizer": layer.input_quantizer,
        "weight_quantizer": layer.weight_quantizer,
        "input_format": "uint8 (scale and zero point computed per batch)",
        "weight_format": fmt.name if fmt is not None else None,
        "weight_axis": None if scale is None or scale.size == 1 else 1,
        "weight_scale": None if scale is None else values_text(scale),
        "weight_scale_values": None if scale is None else plain_values(scale.astype("float64")),
        "weight_zero_point_values": None if zp is None else plain_values(zp),
        "codes": None if codes is None else _code_range(codes),
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
