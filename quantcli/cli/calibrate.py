"""``quantcli calibrate``: insert quantizers into a model and calibrate every amax; write a calibrated
checkpoint."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Optional

import typer

from quantcli import defaults
from quantcli.cli.guard import STATE, guarded
from quantcli.cli.options import (
    PREPROCESSING,
    BatchSizeOpt,
    ComputeDtype,
    CpuOpt,
    DataOpt,
    JsonOpt,
    Method,
    NumSamplesOpt,
)
from quantcli.cli.output import err, fmt, key_value_table, out, print_json, progress
from quantcli.quant import cpu as cpu_kinds


@guarded
@PREPROCESSING.add
def calibrate(
    model: Annotated[
        str,
        typer.Argument(
            help="package.module:factory, path/to/file.py:factory, a sample "
            "model (digits_cnn, text_encoder, tiny_lm, tiny_llama), a Hugging Face "
            "model folder, or a torch.save(model) file (with "
            "--trust-pickle)."
        ),
    ],
    weights: Annotated[
        Optional[Path],
        typer.Option(
            "--weights", help="State dict: .safetensors, or .pt/.pth (read with weights_only=True)."
        ),
    ] = None,
    data: DataOpt = None,
    config: Annotated[
        str,
        typer.Option(
            "--config",
            help="Preset (int8, int8-per-tensor, uint8-asymmetric, fp8, int4-weight-only, int8-dynamic) or "
            "a YAML/JSON file.",
        ),
    ] = defaults.CONFIG,
    target: Annotated[
        Optional[str],
        typer.Option(
            "--target",
            help="Runtime the Q/DQ placement is for: onnxruntime (default) or tensorrt. Overrides the "
            "config file's target.",
        ),
    ] = None,
    method: Annotated[
        Method,
        typer.Option(
            "--method",
            help="Activation amax method; auto: per quantizer, the candidate (max, percentile, mse, "
            "entropy) with the smallest error of its layer's output.",
        ),
    ] = Method(defaults.METHOD),
    percentile: Annotated[
        float, typer.Option("--percentile", help="Percentile for --method percentile.")
    ] = defaults.PERCENTILE,
    num_bins: Annotated[
        int, typer.Option("--num-bins", help="Histogram bins for entropy/mse/percentile/auto.")
    ] = defaults.NUM_BINS,
    batch_size: BatchSizeOpt = None,
    num_samples: NumSamplesOpt = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda[:i].")] = defaults.DEVICE,
    cpu: CpuOpt = None,
    dtype: Annotated[
        ComputeDtype,
        typer.Option(
            "--dtype",
            help="What the model computes in while activations are observed: model (its own dtype), "
            "float32, bfloat16 or float16, as LLMs run on a GPU. Statistics stay float32; the checkpoint "
            "keeps the model's own weights.",
        ),
    ] = ComputeDtype(defaults.DTYPE),
    cuda_graph: Annotated[
        bool,
        typer.Option(
            "--cuda-graph/--no-cuda-graph",
            help="On a GPU, observe the batches after the first by replaying a CUDA graph of the pass, where "
            "every activation quantizer is per tensor (any method but auto) and the batches have one shape; "
            "the same amax. Not yet run on a GPU: off unless given.",
        ),
    ] = False,
    out_path: Annotated[
        Optional[Path],
        typer.Option("--out", help="Calibrated checkpoint to write (default <model>.calib.pt)."),
    ] = None,
    as_json: JsonOpt = False,
    trust_pickle: Annotated[
        bool,
        typer.Option(
            "--trust-pickle",
            help="Allow a MODEL or --weights that is a pickled whole module, torch.save(model) (unpickling "
            "runs code from the file).",
        ),
    ] = False,
    pooling: Annotated[
        str,
        typer.Option(
            "--pooling",
            help="Hugging Face base model output: none (last_hidden_state) or mean (mean over unmasked "
            "tokens, 'embeddings').",
        ),
    ] = defaults.POOLING,
    preprocessing=None,
    min_cosine: Annotated[
        Optional[float],
        typer.Option(
            "--min-cosine",
            help="Keep the fewest layers in float needed for this cosine to the float model on held-out "
            "data.",
        ),
    ] = None,
    min_snr: Annotated[
        Optional[float], typer.Option("--min-snr", help="The same for an SNR target in dB.")
    ] = None,
    holdout: Annotated[
        Optional[Path],
        typer.Option(
            "--holdout",
            help="Held-out data for --min-cosine/--min-snr (default: a sample model's held-out split, else "
            "the last quarter of --data's batches).",
        ),
    ] = None,
    max_float_layers: Annotated[
        Optional[int],
        typer.Option(
            "--max-float-layers",
            help="With a target: at most N layers kept in float (default a quarter of the quantized "
            "layers); beyond it, exit 1.",
        ),
    ] = None,
    fold_bn: Annotated[
        Optional[bool],
        typer.Option(
            "--fold-bn/--no-fold-bn",
            help="Fold each BatchNorm into the Conv/ConvTranspose/Linear before it (default: the config's "
            "fold_batchnorm, true).",
        ),
    ] = None,
    smoothquant: Annotated[
        Optional[float],
        typer.Option(
            "--smoothquant",
            metavar="[ALPHA]",
            help="SmoothQuant: move activation outliers of Linear inputs into the weights, s = max|X|^ALPHA "
            "/ max|W|^(1-ALPHA) per channel (ALPHA default 0.5), folded into the preceding "
            "LayerNorm/Linear where exact, else an explicit Mul.",
        ),
    ] = None,
    smoothquant_min_gain: Annotated[
        Optional[float],
        typer.Option(
            "--smoothquant-min-gain",
            help="With --smoothquant: smooth only the layers whose quantization error (relative, of their "
            "output) it divides by at least this much (default 2: inputs with outlier channels; 0: every "
            "layer).",
        ),
    ] = None,
    weight_method: Annotated[
        str,
        typer.Option(
            "--weight-method",
            help="How weight-only layers (int4-weight-only) round their weights: rtn (to nearest), gptq "
            "(second-order, from the calibration inputs' Hessian) or awq (activation-aware per-channel "
            "scales).",
        ),
    ] = defaults.WEIGHT_METHOD,
    placement: Annotated[
        str,
        typer.Option(
            "--placement",
            envvar="QUANTCLI_PLACEMENT",
            show_envvar=True,
            help="onnxruntime target: auto (default) keeps in float the layers that would not run faster "
            "quantized on the --cpu: those onnxruntime does not fuse into an integer kernel, and those "
            "whose kernel a measured table (docs/targets.md) finds more than 25% slower than float there, "
            "unless that costs a neighbour its integer kernel; nothing is timed. all quantizes every layer "
            "as configured.",
        ),
    ] = defaults.PLACEMENT,
    kv_cache: Annotated[
        str,
        typer.Option(
            "--kv-cache",
            help="Causal LMs: the decode graph's KV cache. float (default), or int8 with scales calibrated "
            "from the calibration data (largest magnitude of each cached key/value channel): int8 or "
            "int8-channel (a scale per kv head and channel), int8-head (per kv head), int8-tensor (per "
            "layer). onnxruntime's GroupQueryAttention reads it directly (a quarter of the float32 cache's "
            "memory); --standard-ops graphs quantize and dequantize around it.",
        ),
    ] = defaults.KV_CACHE,
    dist_timeout: Annotated[
        float,
        typer.Option(
            "--dist-timeout",
            help="Under torchrun: seconds a rank waits for the others at a step boundary (and to join) "
            "before the job stops, naming the rank that stalled.",
        ),
    ] = defaults.DIST_TIMEOUT,
) -> Optional[int]:
    """Insert quantizers into MODEL and calibrate every amax; write a calibrated checkpoint."""
    from quantcli.calibration.job import CalibrationJob, CalibrationRequest

    if percentile != defaults.PERCENTILE and method.value not in ("percentile", "auto"):
        from quantcli.errors import ConfigError

        # a setting that does nothing under another method is refused, not dropped in silence
        raise ConfigError(f"--percentile applies to --method percentile (or auto), not {method.value}")
    if num_bins != defaults.NUM_BINS and method.value == "max":
        from quantcli.errors import ConfigError

        raise ConfigError(
            "--num-bins applies to the histogram methods (entropy, mse, percentile, auto), not max"
        )
    request = CalibrationRequest(
        model=model,
        weights=weights,
        data=data,
        config=config,
        target=target,
        method=method.value,
        percentile=percentile,
        num_bins=num_bins,
        batch_size=batch_size,
        num_samples=num_samples,
        device=device,
        dtype=dtype.value,
        cuda_graph=cuda_graph,
        out=out_path,
        trust_pickle=trust_pickle,
        pooling=pooling,
        data_options=preprocessing,
        fold_bn=fold_bn,
        smoothquant=smoothquant,
        smoothquant_min_gain=smoothquant_min_gain,
        min_cosine=min_cosine,
        min_snr=min_snr,
        holdout=holdout,
        max_float_layers=max_float_layers,
        weight_method=weight_method,
        placement=placement,
        cpu=cpu.value if cpu is not None else None,
        kv_cache=kv_cache,
    )
    with torchrun_rank(device, dist_timeout) as rank:
        if rank is None and dist_timeout != defaults.DIST_TIMEOUT:
            from quantcli.errors import ConfigError

            raise ConfigError(
                "--dist-timeout applies to a calibration run by torchrun in more than one process; this one "
                "runs in one: leave it out"
            )
        job = CalibrationJob.load(request, rank)
        smoothed = job.smooth()
        with progress(len(job.batches), "calibrating", not as_json and not STATE.quiet) as advance:
            summary = job.calibrate(advance)
        outcome = job.finish(summary, smoothed)
        return None if STATE.quiet else render_calibrate(outcome, as_json)


@contextlib.contextmanager
def torchrun_rank(device: str, timeout: float):
    """Under ``torchrun``: join the job (yield this process's Rank), keep every rank but 0 quiet (an error
    every rank has while joining too), name a stalled or dead rank, leave at the end. Otherwise yield
    ``None``."""
    from quantcli.calibration.process_group import (
        JoinError,
        RankStalled,
        explain,
        join_from_environment,
        leave,
    )

    try:
        rank = join_from_environment(device, timeout)
    except JoinError as e:
        STATE.quiet = e.every_rank and e.rank != 0
        raise
    STATE.quiet = rank is not None and rank.rank != 0
    try:
        yield rank
    except RankStalled as e:
        STATE.quiet = STATE.quiet and not e.speak  # rank 0 stalled: another rank says so
        raise
    except RuntimeError as e:  # a collective outside a step boundary: a rank died or stalled there
        why = explain(e) if rank is not None else None
        if why is None:
            raise
        raise why from None
    finally:
        if rank is not None:
            leave()


def render_calibrate(outcome, as_json: bool) -> int:
    """The summary (a table, or ``--json``) and its warnings; exit 1 when a quality target was missed."""
    _calibrate_warnings(outcome)  # on stderr, --json or not (as export's): stdout keeps one document
    if as_json:
        print_json(outcome.to_dict())
    else:
        rows = [*_calibrate_setup_rows(outcome), *_calibrate_result_rows(outcome)]
        out.print(key_value_table(f"quantcli calibrate {outcome.job.request.model}", rows))
    _target_missed(outcome.mixed)
    return 0 if outcome.target_met else 1


def _calibrate_warnings(outcome) -> None:
    report, info = outcome.job.report, outcome.info
    if info["quantized_layers"] == 0:
        err.print(
            "warning: no layer is quantized: the checkpoint computes the float model "
            f"({info['layers']['text']})"
        )
    cpu = info["cpu"]
    if cpu["saturating_layers"]:
        shown = ", ".join(cpu["saturating_layers"][:5]) + (
            " ..." if len(cpu["saturating_layers"]) > 5 else ""
        )
        err.print(
            f"warning: on {cpu['kind']} onnxruntime's uint8 x int8 kernels can saturate with the 8-bit "
            f"weights of {shown} (reduce_range: false) where pairs of activations are large; `verify` "
            "emulates those kernels on your data and fails the graph where they move its outputs more "
            "than quantization does. Leave reduce_range at auto (7-bit weights, which never saturate), "
            f"or name a CPU with VNNI (--cpu x86-vnni) if the graph never runs without it "
            f"({cpu_kinds.remedy_link()})"
        )
    missing_mask = _mask_not_given(outcome.job)
    if missing_mask:
        err.print(
            f"warning: the model's forward takes {missing_mask}, but the data has none, so the graph takes "
            f"none either: a padded batch would attend to its padding; give {missing_mask} with the data (an "
            ".npz key), or pad nothing"
        )
    mixed = outcome.mixed
    if mixed is not None and mixed.unfused:
        err.print(
            f"warning: {', '.join(mixed.unfused)} run(s) in float in onnxruntime, between Q/DQ: the layers "
            f"kept float for the quality target ({', '.join(mixed.kept_float)}) took the Q on their output "
            "that their integer kernel needs, and neither keeping that Q nor keeping them float too met the "
            "target"
        )
    latency = outcome.job.latency
    if latency is not None and not latency.measured and latency.note.startswith("not decided"):
        err.print(
            f"warning: latency placement {latency.note}; every layer stays quantized as configured "
            "(as with --placement all)"
        )
    for p in report.unmatched_patterns:
        err.print(f"warning: config pattern {p!r} matched no quantizer")
    if outcome.summary.not_called:
        err.print(
            f"warning: never called during calibration, left unquantized: "
            f"{', '.join(outcome.summary.not_called)}"
        )
    zero = outcome.summary.zero_amax
    if zero:
        shown = ", ".join(zero[:5]) + (" ..." if len(zero) > 5 else "")
        err.print(
            f"warning: {len(zero)} activation quantizer(s) saw only zeros in the calibration data (amax 0; "
            "a range below 2^-64, denormals, is taken as 0), "
            f"so their layers' inputs quantize to 0: {shown}; check that the data is the model's real input"
        )
    for w in outcome.summary.widened:
        by = f"up to {w.ratio:.3g}x" if w.ratio is not None else "from 0"
        if w.underflowed == w.channels:
            err.print(
                f"warning: {w.layer}: the weights of {w.channels} output channel(s) are so small (subnormal) "
                "that input scale x weight scale, their int32 bias's scale, underflows float32, so their "
                f"weight range was widened {by} to a normal scale; those weights quantize to 0"
            )
            continue
        err.print(
            f"warning: {w.layer}: the bias of {w.channels} output channel(s) is too large for int32 codes of "
            f"input scale x weight scale (its weights, or the layer's inputs, are tiny beside it), so their "
            f"weight range was widened {by}, as onnxruntime's quantize_static does, instead "
            "of clamping the bias"
        )
    for bn, reason in report.batchnorm.skipped:
        err.print(f"warning: BatchNorm {bn} not folded: {reason}")
    for r in report.float_check.get("reverted", []):
        err.print(f"warning: float check: {r['cause']}")
    summary = outcome.summary
    if summary.method_unused():
        err.print(
            f"warning: --method {summary.method} chooses activation ranges, and "
            f"{outcome.job.config.source} calibrates none (every amax is its tensor's max), so it and "
            "--percentile/--num-bins changed nothing"
        )
    ignored = outcome.summary.method_ignored_by()
    if ignored:
        err.print(
            f"warning: --method {outcome.summary.method} applies to symmetric grids only; the {len(ignored)} "
            f"asymmetric activation quantizer(s) were calibrated from their min and max (mse and percentile "
            f"search an asymmetric range): {', '.join(ignored)}"
        )


def _min_graph_batches() -> int:
    from quantcli.calibration.cuda_graph import MIN_BATCHES

    return MIN_BATCHES


def _calibrate_setup_rows(outcome):
    """Rows saying what was calibrated how: method, device, data, target, BatchNorm folding."""
    from quantcli.inputs.data import describe_preprocessing

    job, summary, cfg = outcome.job, outcome.summary, outcome.job.config
    ignored = summary.method_ignored_by()
    request, settings = job.request, []
    if summary.method == "percentile":
        settings.append(f"{request.percentile:g}")
    elif summary.method == "auto" and request.percentile != defaults.PERCENTILE:
        settings.append(f"percentile candidate {request.percentile:g}")
    if summary.method != "max" and request.num_bins != defaults.NUM_BINS:
        settings.append(f"{request.num_bins} bins")
    yield (
        "method",
        f"{summary.method}{' ' + ', '.join(settings) if settings else ''} ({cfg.source})"
        + (f"; {len(ignored)} asymmetric activation quantizer(s) from their min and max" if ignored else "")
        + ("; unused: no activation range to choose" if summary.method_unused() else ""),
    )
    graph = ""
    if request.cuda_graph:
        graph = (
            f"; {summary.graph_replays} batches replayed from a CUDA graph"
            if summary.graph_replays
            else "; --cuda-graph did not apply (it needs a GPU, one process, batches of one shape, at least "
            f"{_min_graph_batches()}, per-tensor activation quantizers and a method other than auto)"
        )
    yield (
        "device",
        (summary.device if job.rank is None else f"{summary.device} ({job.rank.backend}, one per rank)")
        + graph,
    )
    yield (
        "data",
        (
            f"{summary.num_samples} samples in {summary.num_batches} batches"
            + (f" over {summary.ranks} ranks" if summary.ranks > 1 else "")
        ),
    )
    if job.preprocessing is not None:
        yield "preprocessing", describe_preprocessing(job.preprocessing)
    if outcome.info.get("precision"):
        yield "precision", outcome.info["precision"]
    if outcome.info.get("batch_axes"):
        yield "batch axis", f"{outcome.info['batch_axes']} (the others: axis 0)"
    yield "target", f"{cfg.target}: {outcome.info['placement']['text']}"
    yield "cpu", outcome.info["cpu"]["text"]
    latency = outcome.info["placement"].get("latency")
    if latency is not None:
        yield "latency placement", latency["text"]
    bn = job.report.batchnorm
    if bn.folded or bn.skipped:
        yield (
            "BatchNorm folded",
            (
                f"{len(bn.folded)} of {len(bn.folded) + len(bn.skipped)}: "
                + (", ".join(f"{f.batchnorm} into {f.layer}" for f in bn.folded) or "none")
            ),
        )
    elif not cfg.fold_batchnorm:
        yield "BatchNorm folded", "off (--no-fold-bn / fold_batchnorm: false)"
    check = outcome.info.get("float_check") or {}
    if check.get("checked"):
        reverted = check.get("reverted") or []
        yield (
            "float check",
            f"{check.get('modules', 0)} modules compared with the model as loaded, quantizers off: "
            + (
                "every transformation kept their outputs"
                if not reverted
                else f"{len(reverted)} transformation(s) undone: " + "; ".join(r["cause"] for r in reverted)
            ),
        )


def _calibrate_result_rows(outcome):
    """Rows saying what came out: quantizers, smoothing, amax, auto choices, the quality target, the file."""
    summary, smoothed, mixed = outcome.summary, outcome.smoothed, outcome.mixed
    yield "layers", outcome.info["layers"]["text"]
    yield "quantizers calibrated", str(len(summary.calibrated))
    yield "quantizers skipped", f"{len(summary.skipped)} (disabled or dynamic)"
    if summary.dynamic:
        yield (
            "dynamic activations",
            (
                f"{len(summary.dynamic)} quantized at run time (uint8 from each "
                f"tensor's "
                "min and max, as DynamicQuantizeLinear): nothing to calibrate"
            ),
        )
    if smoothed is not None:
        n = smoothed.counts()
        yield (
            "smoothquant",
            (
                f"alpha {smoothed.alpha}: {len(smoothed.groups)} inputs smoothed; 1/s folded into "
                f"{n['layernorm']} LayerNorm(s) and {n['linear']} Linear(s), {n['mul']} explicit Mul(s)"
                + (f"; not smoothed: {', '.join(smoothed.skipped)}" if smoothed.skipped else "")
            ),
        )
    rounding = outcome.info.get("weight_rounding") or {}
    if "layers" in rounding:  # --weight-method gptq or awq ran
        skipped = rounding.get("skipped") or {}
        yield (
            "weight rounding",
            f"{rounding['method']}: {rounding['layers']} layer(s)"
            + (
                f"; rounded to nearest: {'; '.join(f'{n} ({why})' for n, why in list(skipped.items())[:3])}"
                + (" ..." if len(skipped) > 3 else "")
                if skipped
                else ""
            ),
        )
    if summary.amax_min is not None:
        yield "amax range", f"{summary.amax_min:.4g} .. {summary.amax_max:.4g}"
    if summary.auto:
        from collections import Counter

        picks = Counter(a["method"] for a in summary.auto.values())
        yield (
            "auto choices",
            (
                ", ".join(f"{n} {m}" for m, n in picks.most_common())
                + " (smallest layer-output MSE; per quantizer in --json)"
            ),
        )
    if mixed is not None:
        yield "quality target", _target_text(mixed)
        yield "kept in float", ", ".join(mixed.kept_float) or "none"
        if mixed.inputs_kept:
            yield (
                "inputs kept quantized",
                f"{', '.join(mixed.inputs_kept)} (float weights; the Q of their input is the layer before's "
                "output Q, which its integer kernel needs)",
            )
        if mixed.float_too:
            yield (
                "float with them",
                f"{', '.join(mixed.float_too)} (a layer kept float took the Q on their output that their "
                "integer kernel needs: quantized, they would run float between Q/DQ)",
            )
        if mixed.dynamic:
            yield "dynamic int8 (not float)", ", ".join(mixed.dynamic)
    kv = outcome.info.get("kv_cache")
    if kv:
        yield (
            "KV cache",
            f"int8 per {kv['granularity']}, key scales {kv['key_scale_range'][0]:.4g} .. "
            f"{kv['key_scale_range'][1]:.4g}, value scales {kv['value_scale_range'][0]:.4g} .. "
            f"{kv['value_scale_range'][1]:.4g}; {kv['bytes_per_token']} bytes per token (float32: "
            f"{kv['float32_bytes_per_token']})",
        )
    latency = outcome.job.latency
    yield (
        "time",
        f"{summary.seconds:.2f} s"
        + (f" + {latency.seconds:.2f} s placement" if latency is not None and latency.seconds else "")
        + (f" + {mixed.seconds:.2f} s target search" if mixed else ""),
    )
    yield "written", str(outcome.job.out)


def _mask_not_given(job) -> str:
    """``attention_mask`` where the model's forward takes one and the calibration data has none ("" else)."""
    import inspect

    example = job.example or {}
    if not example or "attention_mask" in example:
        return ""
    try:
        params = inspect.signature(job.model.forward).parameters
    except (TypeError, ValueError):
        return ""
    return "attention_mask" if "attention_mask" in params and "input_ids" in example else ""


def _target_missed(mixed) -> None:
    """Exit 1's explanation (stderr, also with --json): what the target needs and what the cap allowed."""
    if mixed is None or mixed.met:
        return
    err.print(
        f"target not met: it needs {mixed.needed} of {mixed.layers_total} layers in float, more than "
        f"--max-float-layers {mixed.cap}; the checkpoint keeps the {mixed.cap} most sensitive in float "
        f"(cosine {fmt(mixed.after.cosine)}, SNR {fmt(mixed.after.snr_db)} dB)"
    )


def _target_text(mixed) -> str:
    goal = " and ".join(
        x
        for x in (
            f"cosine >= {mixed.min_cosine}" if mixed.min_cosine is not None else "",
            f"SNR >= {mixed.min_snr} dB" if mixed.min_snr is not None else "",
        )
        if x
    )
    return (
        f"{goal} on {mixed.holdout_samples} held-out samples ({mixed.holdout}): "
        f"{'met' if mixed.met else 'NOT met'}; cosine {fmt(mixed.before.cosine)} -> "
        f"{fmt(mixed.after.cosine)}, SNR {fmt(mixed.before.snr_db)} -> {fmt(mixed.after.snr_db)} dB with "
        f"{len(mixed.kept_float)} of {mixed.layers_total} layers in float"
        + (f" (and {len(mixed.float_too)} with them)" if mixed.float_too else "")
    )
