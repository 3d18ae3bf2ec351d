"""``quantcli export``: a calibrated checkpoint as a standard QuantizeLinear/DequantizeLinear ONNX graph."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from quantcli.cli.files import refuse_inputs
from quantcli.cli.guard import guarded
from quantcli.cli.options import CalibratedArg, Exporter, ExportProvider, JsonOpt, TrustCodeOpt
from quantcli.cli.output import err, key_value_table, out, print_json


@guarded
def export(
    calibrated: CalibratedArg,
    onnx_path: Annotated[Path, typer.Option("--onnx", help="ONNX file to write.")],
    opset: Annotated[
        Optional[int],
        typer.Option(
            "--opset",
            help="ONNX opset (default: the lowest the formats need, 13 int8, 19 fp8, 21 int4, 18 at least "
            "with dynamo, and at least 17 where the model has a LayerNorm).",
        ),
    ] = None,
    exporter: Annotated[
        Exporter, typer.Option("--exporter", help="torch exporter: torchscript or dynamo (torch.export).")
    ] = Exporter.torchscript,
    dynamic_axes: Annotated[
        bool,
        typer.Option(
            "--dynamic-axes/--static-shapes",
            help="Dynamic batch (and sequence, for token inputs) dimensions. Each input's batch axis is the "
            "one calibration found (axis 0 unless the data said otherwise).",
        ),
    ] = True,
    dynamic_dim: Annotated[
        Optional[list[str]],
        typer.Option(
            "--dynamic-dim",
            metavar="[NAME=]AXES",
            help="Also export these axes of an input with a symbolic size, e.g. image=2,3 (a fully "
            "convolutional net at any image size) or frames=1 (any sequence length); NAME may be left out "
            "for a model with one input. Repeatable.",
        ),
    ] = None,
    weights_qdq: Annotated[
        bool,
        typer.Option("--weights-qdq", help="Keep float weights with Q/DQ instead of storing them quantized."),
    ] = False,
    provider: Annotated[
        Optional[ExportProvider],
        typer.Option(
            "--provider",
            help="onnxruntime target: the execution provider the graph is for, cpu (default: residual and "
            "GELU-bias Adds written as Sum, so onnxruntime's CPU provider forms no slow "
            "SkipLayerNormalization/BiasGelu) or cuda (left to onnxruntime's fusions).",
        ),
    ] = None,
    kv_cache: Annotated[
        bool,
        typer.Option(
            "--kv-cache/--no-kv-cache",
            help="Causal LMs (Llama, Qwen2, Mistral, GPT-2 and the tiny_llama sample): a decode graph with a "
            "KV cache (past_key_values.{i}.key/value in, present.{i}.key/value out; one graph for the prompt "
            "and each new token). --no-kv-cache: the prefill graph, logits for every position.",
        ),
    ] = True,
    contrib_ops: Annotated[
        bool,
        typer.Option(
            "--contrib-ops/--standard-ops",
            help="Decode graphs: attention as onnxruntime's GroupQueryAttention where its CPU provider runs "
            "it (faster there); --standard-ops: standard ONNX ops only (any runtime).",
        ),
    ] = True,
    float_kv_cache: Annotated[
        bool,
        typer.Option(
            "--float-kv-cache",
            help="Decode graphs of a checkpoint calibrated with --kv-cache int8: keep a float32 KV cache "
            "(default: the int8 cache with the calibrated scales).",
        ),
    ] = False,
    embeddings: Annotated[
        str,
        typer.Option(
            "--embeddings",
            help="Decode graphs: the token embedding table. float (default), int4 or int8: onnxruntime's "
            "GatherBlockQuantized; with tied embeddings and an lm_head quantized weight-only at those bits, "
            "the lookup reads lm_head's own stored codes (no table of its own), else its own table "
            "(round-to-nearest, blocks of 32 along hidden).",
        ),
    ] = "float",
    genai_config: Annotated[
        bool,
        typer.Option(
            "--genai-config",
            help="Decode graphs: also write genai_config.json beside the graph, so that onnxruntime-genai's "
            "Model(folder) and Generator run it.",
        ),
    ] = False,
    as_json: JsonOpt = False,
    trust_code: TrustCodeOpt = False,
) -> None:
    """Export a calibrated checkpoint as a standard QuantizeLinear/DequantizeLinear ONNX graph."""
    from exporters.causal_lm.export import export_model
    from quantcli.inputs.checkpoint import load_calibrated

    embedding_bits = _embedding_bits(embeddings, kv_cache)
    _refuse_decode_options_without_cache(kv_cache, contrib_ops, float_kv_cache)
    if not onnx_path.name or onnx_path.name in (".", ".."):
        from quantcli.errors import DataError

        raise DataError(f"--onnx {str(onnx_path)!r} names no file; give the path of the .onnx file to write")
    refuse_inputs(onnx_path, [("the checkpoint", calibrated)], "--onnx", external_data=True)
    ckpt = load_calibrated(calibrated, trust_code=trust_code)
    refuse_inputs(onnx_path, [("the model's file", ckpt.spec.path)], "--onnx", external_data=True)
    if not hasattr(ckpt.model, "lm_head"):  # not a causal LM: its options would do nothing
        unused = [f for f, on in (("--no-kv-cache", not kv_cache), ("--standard-ops", not contrib_ops)) if on]
        if unused:
            from quantcli.errors import QuantCliError

            raise QuantCliError(
                f"{' and '.join(unused)} apply to causal LMs (a model with an lm_head); {calibrated}'s model "
                "has none: leave them out"
            )
    if float_kv_cache and not ckpt.kv_cache:
        from quantcli.errors import QuantCliError

        raise QuantCliError(
            f"--float-kv-cache: {calibrated} has no int8 KV cache to leave out (calibrate --kv-cache int8 "
            "makes one); its cache is float32 already"
        )
    meta = {  # read back by verify and inspect
        "quantcli.config": json.dumps(ckpt.config.to_plain()),
        "quantcli.model": ckpt.spec.spec,
        "quantcli.tokenizer": _tokenizer_folder(ckpt),
        "quantcli.inputs": json.dumps({"names": ckpt.input_names, "dtypes": ckpt.data["inputs"]["dtypes"]}),
    }
    standard_ops = kv_cache and not contrib_ops and hasattr(ckpt.model, "lm_head")
    if genai_config or standard_ops:  # options of decode graphs, checked before anything is written
        from exporters.causal_lm.export import decodable
        from quantcli.errors import ExportError

        why = decodable(ckpt.model)[1] if kv_cache else "--no-kv-cache writes a prefill graph"
        if why and genai_config:
            raise ExportError(f"--genai-config needs a decode graph with a KV cache: {why}")
        if why:  # a prefill graph holds no attention to write with standard ops: the flag would do nothing
            raise ExportError(
                f"--standard-ops applies to decode graphs, and this model gets none ({why}): leave it out"
            )
    dims = parse_dynamic_dims(dynamic_dim)
    res = export_model(
        ckpt.model,
        ckpt.example,
        onnx_path,
        opset,
        exporter.value,
        kv_cache=kv_cache,
        # TensorRT runs standard ONNX ops only (no com.microsoft GroupQueryAttention)
        contrib_ops=contrib_ops and ckpt.config.target != "tensorrt",
        cache_quant=None if float_kv_cache else _cache_quant(ckpt, calibrated),
        embedding_bits=embedding_bits,
        dynamic_axes=dynamic_axes,
        weights_qdq=weights_qdq,
        metadata=meta,
        provider=provider.value if provider else None,
        dynamic_dims=dims,
    )
    if genai_config:
        from exporters.causal_lm.export import write_genai_config

        res.genai_config = str(write_genai_config(onnx_path, res.decode))
    agreement = None
    if res.decode is None and not res.external_data:  # a decode graph: verify runs it step by step
        from exporters.onnx_export import check_dynamic_dims
        from quantcli.verify.export_check import graph_agreement

        asked = check_dynamic_dims(dims, ckpt.example, True)  # names resolved, as export_model did
        agreement = graph_agreement(onnx_path, ckpt.model, ckpt.example, asked)
        res.graph_agreement = agreement.to_dict() if agreement is not None else None
    if agreement is not None and agreement.error:
        err.print(
            f"warning: onnxruntime cannot run the exported graph on the example batch ({agreement.error}); "
            "verify will fail it: try the other --exporter, and please report this"
        )
    if res.decode is None and res.decode_note and kv_cache:
        # a causal LM quantcli writes no decode graph for: said on stderr too, so that a script sees it
        err.print(
            f"warning: {res.decode_note}; generate and onnxruntime-genai need a decode graph "
            "(docs/llm.md lists the supported families)"
        )
    for fixed in agreement.fixed if agreement is not None else ():
        remedy = (
            "Feed the graph that size, or export with the other --exporter (or --static-shapes: fixed sizes)"
            if fixed.model_runs
            else "Leave it out of --dynamic-dim"
        )
        err.print(f"warning: {fixed.text()}. {remedy}")
    if agreement is not None and not agreement.passed and not agreement.error:
        worst = agreement.worst
        err.print(
            f"warning: the graph does not compute what the model does: on the example batch its {worst} is "
            f"{agreement.outputs[worst]:.3g}x the quantization error away from the fake-quant model (verify "
            f"fails above {agreement.limit:g}x); `quantcli verify` says where, and the other --exporter may "
            "translate the model's ops as it computes them"
        )
    if as_json:
        print_json(res.to_dict())
    else:
        render_export(res, calibrated)


def parse_dynamic_dims(values: list[str] | None) -> dict[str, list[int]]:
    """``["image=2,3", "mask=1"]`` -> ``{"image": [2, 3], "mask": [1]}`` (``"2,3"``: ``{"": [2, 3]}``, the
    only input)."""
    from quantcli.errors import ExportError

    out: dict[str, list[int]] = {}
    for v in values or []:
        name, _, axes = v.rpartition("=")
        try:
            parsed = [int(a) for a in axes.split(",") if a.strip()]
        except ValueError:
            parsed = []
        if not parsed:
            raise ExportError(
                f"--dynamic-dim {v!r}: expected NAME=AXES, axes as integers separated by commas (image=2,3)"
            )
        out.setdefault(name.strip(), []).extend(parsed)
    return out


EMBEDDINGS = {"float": None, "int4": 4, "int8": 8}


def _refuse_decode_options_without_cache(kv_cache: bool, contrib_ops: bool, float_kv_cache: bool) -> None:
    """Options of decode graphs given with --no-kv-cache (a prefill graph) would do nothing: refused."""
    from quantcli.errors import QuantCliError, flags_apply

    unused = [
        f for f, on in (("--standard-ops", not contrib_ops), ("--float-kv-cache", float_kv_cache)) if on
    ]
    if unused and not kv_cache:
        raise QuantCliError(
            f"{flags_apply(unused, ' and ')} to decode graphs; "
            "--no-kv-cache writes a prefill graph, which has no attention cache: leave one or the other out"
        )


def _embedding_bits(choice: str, kv_cache: bool) -> int | None:
    from quantcli.errors import QuantCliError

    if choice not in EMBEDDINGS:
        raise QuantCliError(f"--embeddings must be one of {', '.join(EMBEDDINGS)}, got {choice!r}")
    if EMBEDDINGS[choice] is not None and not kv_cache:
        raise QuantCliError("--embeddings applies to decode graphs; leave out --no-kv-cache")
    return EMBEDDINGS[choice]


def _cache_quant(ckpt, calibrated: Path):
    """The checkpoint's int8 KV cache scales (``calibrate --kv-cache``), or None."""
    from exporters.causal_lm.kv_cache import KVCacheQuant
    from quantcli.errors import CheckpointError

    if ckpt.kv_cache is None:
        return None
    try:
        return KVCacheQuant.from_plain(ckpt.kv_cache)
    except ValueError as e:
        raise CheckpointError(
            f"{calibrated} is damaged: {e}; re-create it with `quantcli calibrate --kv-cache`, or export "
            "with --float-kv-cache"
        ) from None


def render_export(res, calibrated: Path) -> None:
    if not res.pairs_by_format and not res.dynamic_layers and not res.recurrent:
        err.print(
            "warning: the graph holds no quantizer: every layer is float (calibrate kept every layer float, "
            "or the config quantizes nothing; `quantcli inspect` on the checkpoint says which)"
        )
    if res.traced_branches:
        from exporters.graph import branch_note

        err.print(f"warning: {branch_note(res.traced_branches)}")
    if res.matmul_nbits_8bit:
        shown = ", ".join(res.matmul_nbits_8bit[:3]) + (" ..." if len(res.matmul_nbits_8bit) > 3 else "")
        err.print(
            f"warning: {len(res.matmul_nbits_8bit)} layer(s) with 8-bit blocked weights ({shown}) run as "
            "MatMulNBits, which onnxruntime computes at accuracy level 4 by default: it quantizes their "
            "activations to int8 too, an error as large as the 8-bit weights' own (verify's "
            "deployment.rms_ratio can fail it). Deploy with the session option "
            "session.qdq_matmulnbits_accuracy_level=1 (float32 activations), or use 4-bit weights"
        )
    out.print(key_value_table(f"quantcli export {calibrated}", _export_rows(res)))


def _input_text(res, name: str) -> str:
    """``image``, with its dynamic axes where they are more than axis 0: ``image (dynamic axes 0, 2, 3)``."""
    axes = res.dynamic_dims.get(name, [])
    return f"{name} (dynamic axes {', '.join(map(str, axes))})" if axes and axes != [0] else name


def _export_rows(res):
    """The export summary's rows: what the graph holds, how onnxruntime will run it, the file."""
    yield "Q/DQ pairs", ", ".join(f"{v} {k}" for k, v in sorted(res.pairs_by_format.items())) or "none"
    if res.dynamic_layers:
        yield "dynamic layers", f"{res.dynamic_layers} (DynamicQuantizeLinear -> MatMulInteger, int8 weights)"
    if res.recurrent:
        layers = ", ".join(entry["layer"] for entry in res.recurrent.values())
        yield "recurrent layers", f"{len(res.recurrent)} as DynamicQuantizeLSTM (int8 weights): {layers}"
    yield "weights stored quantized", str(res.weights_stored_quantized)
    yield "opset", f"{res.opset} ({res.opset_reason})"
    if res.opset_note:
        yield "opset note", res.opset_note
    yield "exporter", res.exporter
    if res.provider:
        kept = res.placement.get("skip_layer_norm_avoided", 0) + res.placement.get("bias_gelu_avoided", 0)
        yield (
            "onnxruntime provider",
            res.provider
            + (
                f" ({kept} residual/GELU-bias Adds written as Sum: no SkipLayerNormalization/BiasGelu, "
                f"slower on CPU; "
                "--provider cuda leaves them)"
                if kept
                else ""
            ),
        )
    if res.decode is not None:
        yield "decode graph", _decode_row(res.decode)
    elif res.decode_note:
        yield "decode graph", res.decode_note
    yield (
        "inputs",
        _names([_input_text(res, n) for n in res.input_names])
        + (
            f"; not read by the model, so not in the graph: {', '.join(res.unread_inputs)}"
            if res.unread_inputs
            else ""
        ),
    )
    yield "outputs", _names(res.output_names)
    if res.fp8_guards:
        yield "fp8 guards", f"{res.fp8_guards} (so that onnxruntime loads it with default options)"
    if res.onnxruntime_disabled_optimizers:
        yield (
            "onnxruntime",
            (
                "fp8 in the form TensorRT fuses: onnxruntime loads it exactly only with "
                f"InferenceSession(path, disabled_optimizers={res.onnxruntime_disabled_optimizers})"
            ),
        )
    if res.pruned_quantizers:
        yield (
            "pruned (output unused)",
            (
                f"{len(res.pruned_quantizers)} quantizer(s) whose output reaches no model output: "
                f"{', '.join(res.pruned_quantizers[:4])}" + (" ..." if len(res.pruned_quantizers) > 4 else "")
            ),
        )
    if res.fusion_error:
        yield "onnxruntime", f"does not load with default options: {res.fusion_error}"
    elif res.quantized_layers is not None:
        yield (
            "unfused layers (onnxruntime)",
            (
                f"{res.unfused_layers} of {res.quantized_layers} quantized layers run in float"
                + (f" (quantcli inspect {res.path} --runtime onnxruntime)" if res.unfused_layers else "")
            ),
        )
        if res.runtime_quantized_layers:
            yield (
                "float layers onnxruntime quantizes",
                f"{', '.join(res.runtime_quantized_layers)}: between a DequantizeLinear and a QuantizeLinear "
                "it gives them per-tensor int8 weights of its own (quantcli inspect --runtime onnxruntime)",
            )
    if res.graph_agreement is not None and res.graph_agreement.get("error"):
        yield "graph vs model", f"onnxruntime cannot run the graph: {res.graph_agreement['error']}"
    elif res.graph_agreement is not None:
        worst = max(res.graph_agreement["outputs"].values())
        verdict = "within" if res.graph_agreement["passed"] else "OVER"
        yield (
            "graph vs model",
            f"{worst:.3g}x the quantization error on the example batch, exact session ({verdict} verify's "
            f"{res.graph_agreement['limit']:g}x)",
        )
    yield (
        "file size",
        f"{res.file_bytes / 1024:.1f} KiB" + (" (+ external data)" if res.external_data else ""),
    )
    if getattr(res, "genai_config", None):
        yield "onnxruntime-genai", f"{res.genai_config} (onnxruntime_genai.Model(folder) loads the graph)"
    yield "time", f"{res.seconds:.2f} s"
    yield "written", res.path


def _names(names: list[str]) -> str:
    """Graph input/output names, a decode graph's per-layer cache names folded to one pattern."""
    per_layer = [n for n in names if n.startswith(("past_key_values.", "present."))]
    if not per_layer:
        return ", ".join(names)
    layers = len(per_layer) // 2
    prefix = "past_key_values" if per_layer[0].startswith("past") else "present"
    rest = [n for n in names if n not in per_layer]
    return ", ".join([*rest, f"{prefix}.{{0..{layers - 1}}}.key/value"])


def _decode_row(decode: dict) -> str:
    lo = decode["layout"]
    ops = decode["contrib_ops"]
    text = (
        f"{lo['model_type']}, {lo['num_layers']} layers, KV cache: batch x {lo['num_kv_heads']} kv heads x "
        f"sequence x {lo['head_size']} ({lo['num_heads']} query heads); "
        + (f"onnxruntime contrib ops: {', '.join(ops)}" if ops else "standard ONNX ops only")
    )
    if decode.get("fusions"):
        text += f"; fused: {', '.join(decode['fusions'])}"
    emb = decode.get("embeddings")
    if emb:
        text += (
            f"; embeddings int{emb['bits']} "
            + ("(lm_head's codes, no table of their own)" if emb["shared_with_lm_head"] else
               f"({emb['table_bytes']} bytes, float32: {emb['float32_table_bytes']})")
        )  # fmt: skip
    kv = decode.get("kv_cache")
    if kv:
        text += (
            f"; KV cache int8 per {kv['granularity']} ({kv['bytes_per_token']} bytes per token, float32: "
            f"{kv['float32_bytes_per_token']})"
        )
    return text + (f"; {decode['note']}" if decode.get("note") else "")


def _tokenizer_folder(ckpt) -> str:
    """The absolute folder of the tokenizer the checkpoint's texts were tokenized with (``generate`` reads it
    from the graph), else a Hugging Face model's own folder, else ""."""
    from pathlib import Path

    prep = ckpt.data.get("preprocessing") or {}
    used = prep.get("tokenizer") if prep.get("kind") == "text" else None
    if used and Path(used).is_absolute() and Path(used).is_dir():
        return str(used)
    if ckpt.spec.kind == "hf" and ckpt.spec.path and Path(ckpt.spec.path).is_dir():
        return str(Path(ckpt.spec.path).resolve())
    return ""
