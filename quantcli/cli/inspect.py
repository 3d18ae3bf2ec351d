"""``quantcli inspect``: the quantizers of a calibrated checkpoint, the Q/DQ nodes of an ONNX file, or what
onnxruntime runs each quantized layer as (``--runtime``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from quantcli.cli.guard import guarded
from quantcli.cli.options import JsonOpt, Provider, Runtime
from quantcli.cli.output import out, print_json, table


@guarded
def inspect(
    path: Annotated[Path, typer.Argument(help="A calibrated checkpoint (.pt) or an exported ONNX file.")],
    runtime: Annotated[
        Optional[Runtime],
        typer.Option(
            "--runtime",
            help="ONNX file: per quantized layer, whether this runtime (default session options) runs it as "
            "an integer kernel, and why not.",
        ),
    ] = None,
    provider: Annotated[
        Optional[Provider],
        typer.Option(
            "--provider", help="With --runtime: the execution provider (default cpu; or cuda, auto)."
        ),
    ] = None,
    as_json: JsonOpt = False,
    trust_code: Annotated[
        bool,
        typer.Option(
            "--trust-code",
            help="Checkpoint: also rebuild the model (running the model code stored in it) and load its "
            "weights, to show that export and verify can use it. Without it, inspect only reads the "
            "file.",
        ),
    ] = False,
) -> None:
    """Show the quantizers of a calibrated checkpoint, or the Q/DQ nodes of an ONNX file."""
    from quantcli.analysis.inspect import inspect_checkpoint, inspect_onnx, inspect_runtime
    from quantcli.errors import QuantCliError

    onnx_file = path.suffix.lower() == ".onnx"
    if provider is not None and runtime is None:  # options that would do nothing are refused, not dropped
        raise QuantCliError("--provider chooses the execution provider of --runtime; give --runtime too")
    if trust_code and onnx_file:
        raise QuantCliError(
            f"--trust-code rebuilds a checkpoint's model; {path} is an ONNX file, which inspect reads "
            "without running code: leave it out"
        )
    if runtime is not None:
        if not onnx_file:
            raise QuantCliError(f"--runtime inspects an exported ONNX file; {path} is not one")
        rep, render = (
            inspect_runtime(path, runtime.value, _runtime_provider(provider or Provider.cpu)),
            render_inspect_runtime,
        )
    elif onnx_file:
        rep, render = inspect_onnx(path), render_inspect_onnx
    else:
        rep, render = inspect_checkpoint(path, trust_code=trust_code), render_inspect_checkpoint
    if as_json:
        print_json(rep)
    else:
        render(rep, path)


def _runtime_provider(provider: Provider) -> str:
    """``auto``: cuda where onnxruntime has it, else cpu."""
    if provider is not Provider.auto:
        return provider.value
    from quantcli.verify import choose_provider

    return "cuda" if choose_provider("auto") == "CUDAExecutionProvider" else "cpu"


def render_inspect_runtime(rep: dict, path: Path) -> None:
    rows = (
        (
            r["layer"],
            r["op_type"],
            r["kernel"] or "-",
            {True: "yes", False: "no", None: "?"}[r["fused"]],
            "; ".join(r["reasons"]),
        )
        for r in rep["layers"]
    )
    modules = {r["layer"].rsplit(" (call ", 1)[0] for r in rep["layers"]}
    several = len(modules) < len(rep["layers"])
    calls = f" ({len(modules)} modules, some called more than once)" if several else ""
    out.print(
        table(
            f"{path} in onnxruntime ({rep['provider']}, default session options): "
            f"{rep['unfused_layers']} of {rep['quantized_layers']} quantized layers in float{calls}",
            ("layer", "op", "runs as", "integer kernel", "why not"),
            rows,
        )
    )
    for r in rep.get("runtime_quantized") or ():
        out.print(
            f"[yellow]float layer onnxruntime quantizes itself:[/yellow] {r['layer']} runs as {r['kernel']}: "
            f"{r['reasons'][0]}"
        )
    if rep["load_error"]:
        out.print(f"onnxruntime cannot load it with default options: {rep['load_error']}")
    if rep["session_needs"]:
        out.print(
            f"for the results it computes with optimizations off, load it with "
            f"InferenceSession(path, disabled_optimizers={rep['disabled_optimizers']}) (or re-export "
            f"it for "
            "the onnxruntime target):"
        )
        for line in rep["session_needs"]:
            out.print(f"  {line}")


def render_inspect_onnx(rows: dict, path: Path) -> None:
    target = f", target {rows['target']}" if rows["target"] else ""
    pairs = (
        (
            r["quantizer"] or r["tensor"],
            r["format"],
            str(r["axis"]),
            str(r["block_size"] or ""),
            r["scale"],
            r["zero_point"],
            r["stored"],
            _codes_text(r["codes"]),
        )
        for r in rows["pairs"]
    )
    out.print(
        table(
            f"{path} — {len(rows['pairs'])} Q/DQ pairs, opset {rows['opset']}{target}",
            ("quantizer", "format", "axis", "block", "scale", "zero point", "stored", "codes"),
            pairs,
        )
    )
    from quantcli.nn.tensor_quantizer import owner

    dynamic = rows.get("dynamic") or []
    if dynamic:
        out.print(
            table(
                f"{len(dynamic)} dynamic layers (input quantized per batch by DynamicQuantizeLinear, uint8)",
                ("layer", "weight format", "weight axis", "weight scale", "codes"),
                (
                    (
                        owner(d["weight_quantizer"]) if d["weight_quantizer"] else d["node"],
                        d["weight_format"] or "-",
                        str(d["weight_axis"]),
                        d["weight_scale"] or "-",
                        _codes_text(d["codes"]),
                    )
                    for d in dynamic
                ),
            )
        )


def _codes_text(codes) -> str:
    """The stored codes' range (a 7-bit weight grid in int8 shows as -64 .. 63), or '-' for run-time codes."""
    return "-" if codes is None else f"{codes[0]} .. {codes[1]}"


def render_inspect_checkpoint(rows: dict, path: Path) -> None:
    # asymmetric quantizers (a [min, max] range with a zero point) add their calibrated minimum
    with_amin = any(r.get("amin") for r in rows["quantizers"])
    qs = (
        (
            r["name"],
            "yes" if r["enabled"] else "no",
            r["format"],
            str(r["axis"]),
            str(r["block_sizes"] or ""),
            *((r.get("amin") or "",) if with_amin else ()),
            r["amax"],
        )
        for r in rows["quantizers"]
    )
    out.print(
        table(
            f"{path} — {rows['model']} ({rows['config']}, target {rows['target']})",
            ("quantizer", "enabled", "num_bits", "axis", "block", *(("amin",) if with_amin else ()), "amax"),
            qs,
        )
    )
    if rows["batchnorm_folds"]:
        out.print(
            "BatchNorm folded: "
            + ", ".join(f"{f['batchnorm']} into {f['layer']}" for f in rows["batchnorm_folds"])
        )
    code = rows["model_code"]
    loads = rows["model_loads"]
    if loads is not None:
        out.print(
            f"model loads: {loads['class']}, {loads['parameters']:,} parameters, "
            f"{loads['quantizers']} quantizers (model code was run: --trust-code)"
        )
    elif not code.get("rebuildable", True):  # --trust-code would not help: say so, not that it would
        out.print(f"model code: {code['source']} ({code['file']})")
    elif code["needs_trust_code"]:
        out.print(
            f"model code: {code['source']} ({code['file']}, sha256 {code['sha256']}); "
            "export and verify run it only with --trust-code (inspect --trust-code checks that it "
            "loads)"
        )
