"""The ``quantcli`` command line: parses, calls library functions, prints. Nothing else lives here.

Library code raises :class:`quantcli.errors.QuantCliError`; this module turns it into a one-line error on
stderr and exit code 2. A failed numerical check (``verify``) is exit code 1. Heavy imports happen inside
the commands so that ``quantcli --help`` starts fast.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from quantcli import __version__

app = typer.Typer(
    name="quantcli",
    help="Post-training quantization for PyTorch -> ONNX Runtime / TensorRT: calibrate, export Q/DQ ONNX, verify.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False, soft_wrap=True)


class Method(str, Enum):
    max = "max"
    entropy = "entropy"
    mse = "mse"
    percentile = "percentile"
    auto = "auto"


def _version(value: bool) -> None:
    if value:
        typer.echo(f"quantcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """quantcli: calibrate -> export --onnx -> verify."""


_quiet = False  # a torchrun rank other than 0: rank 0 reports for every rank


def _fail(message: str, code: int = 2) -> None:
    if _quiet:
        raise typer.Exit(code)
    err.print(f"[bold red]error:[/] {message}", markup=True, highlight=False) if err.is_terminal else print(
        f"error: {message}", file=sys.stderr
    )
    raise typer.Exit(code)


def _guard(fn, *args, **kwargs):
    """Run a command body: QuantCliError -> one line, exit 2; anything unexpected -> one line, exit 2."""
    from quantcli.errors import QuantCliError

    try:
        return fn(*args, **kwargs)
    except typer.Exit:
        raise
    except QuantCliError as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except Exception as e:  # a bug or an input we did not foresee: still one line, no traceback
        if os.environ.get("QUANTCLI_DEBUG"):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        _fail(f"{type(e).__name__}: {first} (set QUANTCLI_DEBUG=1 for a traceback)")


def _print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _progress(total: int, label: str, enabled: bool):
    """A Rich progress bar on a TTY; a no-op elsewhere. Returns (context manager, advance callback)."""
    import contextlib

    if not enabled or not err.is_terminal:
        return contextlib.nullcontext(), None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err, transient=True)
    task = prog.add_task(label, total=total)
    return prog, lambda i: prog.update(task, completed=i + 1)


# --------------------------------------------------------------------------------------------- calibrate


@app.command()
def calibrate(
    model: str = typer.Argument(..., help="package.module:factory, path/to/file.py:factory, a sample model (digits_cnn, text_encoder), a Hugging Face model folder, or a torch.save(model) file (with --trust-pickle)."),
    weights: Optional[Path] = typer.Option(None, "--weights", help="State dict: .safetensors, or .pt/.pth (read with weights_only=True)."),
    data: Optional[Path] = typer.Option(None, "--data", help="Calibration data: .npz, .npy, .pt, or a directory of them; .txt/.jsonl text; a folder of JPEG/PNG images. Sample models bring their own."),
    config: str = typer.Option("int8", "--config", help="Preset (int8, int8-per-tensor, uint8-asymmetric, fp8, int4-weight-only, int8-dynamic) or a YAML/JSON file."),
    target: Optional[str] = typer.Option(None, "--target", help="Runtime the Q/DQ placement is for: onnxruntime (default) or tensorrt. Overrides the config file's target."),
    method: Method = typer.Option(Method.max, "--method", help="Activation amax method; auto: per quantizer, the candidate (max, percentile, mse, entropy) with the smallest error of its layer's output."),
    percentile: float = typer.Option(99.99, "--percentile", help="Percentile for --method percentile."),
    num_bins: int = typer.Option(2048, "--num-bins", help="Histogram bins for entropy/mse/percentile."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Re-batch whole arrays into batches of N (default 32)."),
    num_samples: Optional[int] = typer.Option(None, "--num-samples", help="Use at most N samples."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda[:i]."),
    out_path: Optional[Path] = typer.Option(None, "--out", help="Calibrated checkpoint to write (default <model>.calib.pt)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    trust_pickle: bool = typer.Option(False, "--trust-pickle", help="Allow a MODEL or --weights that is a pickled whole module, torch.save(model) (unpickling runs code from the file)."),
    pooling: str = typer.Option("none", "--pooling", help="Hugging Face base model output: none (last_hidden_state) or mean (mean over unmasked tokens, 'embeddings')."),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="Folder with the tokenizer for text --data (default: the MODEL folder)."),
    max_length: Optional[int] = typer.Option(None, "--max-length", help="Text --data: at most N tokens per example (default 128)."),
    image_size: Optional[str] = typer.Option(None, "--image-size", help="Image --data: N or HxW pixels (default: preprocessor_config.json, else 224)."),
    mean: Optional[str] = typer.Option(None, "--mean", help="Image --data: per-channel mean, e.g. 0.485,0.456,0.406 (default: preprocessor_config.json, else ImageNet's)."),
    std: Optional[str] = typer.Option(None, "--std", help="Image --data: per-channel std (default: preprocessor_config.json, else ImageNet's)."),
    min_cosine: Optional[float] = typer.Option(None, "--min-cosine", help="Keep the fewest layers in float needed for this cosine to the float model on held-out data."),
    min_snr: Optional[float] = typer.Option(None, "--min-snr", help="The same for an SNR target in dB."),
    holdout: Optional[Path] = typer.Option(None, "--holdout", help="Held-out data for --min-cosine/--min-snr (default: a sample model's held-out split, else the last quarter of --data's batches)."),
    max_float_layers: Optional[int] = typer.Option(None, "--max-float-layers", help="With a target: at most N layers kept in float (default a quarter of the quantized layers); beyond it, exit 1."),
    fold_bn: Optional[bool] = typer.Option(None, "--fold-bn/--no-fold-bn", help="Fold each BatchNorm into the Conv/ConvTranspose/Linear before it (default: the config's fold_batchnorm, true)."),
    smoothquant: Optional[float] = typer.Option(None, "--smoothquant", metavar="[ALPHA]", help="SmoothQuant: move activation outliers of Linear inputs into the weights, s = max|X|^ALPHA / max|W|^(1-ALPHA) per channel (ALPHA default 0.5), folded into the preceding LayerNorm/Linear where exact, else an explicit Mul."),
) -> None:
    """Insert quantizers into MODEL and calibrate every amax; write a calibrated checkpoint."""
    from quantcli.data import DataOptions

    goal = (min_cosine, min_snr, holdout, max_float_layers)
    code = _guard(_calibrate, model, weights, data, config, method.value, percentile, num_bins, batch_size,
                  num_samples, device, out_path, as_json, trust_pickle, pooling,
                  DataOptions(tokenizer, max_length, image_size, mean, std), fold_bn, smoothquant, target, goal)
    raise typer.Exit(code or 0)


def _calibrate(model_spec, weights, data, config, method, percentile, num_bins, batch_size, num_samples, device,
               out_path, as_json, trust_pickle, pooling="none", data_options=None, fold_bn=None, smoothquant=None,
               target=None, goal=(None,) * 4):
    """One process, or (under ``torchrun``) one rank: each rank reads its own share of the data, the
    statistics are merged, rank 0 writes the checkpoint and prints; every rank ends with the same outcome."""
    global _quiet
    from quantcli.process_group import join_from_environment, leave

    job = join_from_environment(device)
    _quiet = job is not None and job.rank != 0
    try:
        return _calibrate_rank(job, model_spec, weights, data, config, method, percentile, num_bins, batch_size,
                               num_samples, device, out_path, as_json, trust_pickle, pooling, data_options, fold_bn,
                               smoothquant, target, goal)
    finally:
        if job is not None:
            leave()


def _calibrate_rank(job, model_spec, weights, data, config, method, percentile, num_bins, batch_size, num_samples,
                    device, out_path, as_json, trust_pickle, pooling, data_options, fold_bn=None, smoothquant=None,
                    target=None, goal=(None,) * 4):
    from quantcli.calibration import calibrate as run_calibration
    from quantcli.calibration import resolve_device
    from quantcli.checkpoint import save_calibrated
    from quantcli.data import DataOptions, cap_samples, describe_preprocessing, load_data
    from quantcli.errors import DataError, QuantCliError
    from quantcli.loading import load_model
    from quantcli.nn import load_config, quantize_model
    from quantcli.process_group import one_outcome
    from quantcli.shard import load_shard, strided

    with one_outcome():  # every rank loads; a failure on any rank stops all of them here
        if batch_size is not None and batch_size <= 0:
            raise QuantCliError(f"--batch-size must be positive, got {batch_size}")
        if smoothquant is not None and job is not None:
            raise QuantCliError("--smoothquant runs in one process; run calibrate without torchrun to smooth")
        if smoothquant is not None and not 0.0 <= smoothquant <= 1.0:
            raise QuantCliError(f"--smoothquant alpha must be in [0, 1], got {smoothquant}")
        cfg = load_config(config)
        if fold_bn is not None:
            cfg.fold_batchnorm = fold_bn
        if target is not None:
            cfg = dataclasses.replace(cfg, target=target)  # validated like a config file's target
        if job is None:
            resolve_device(device)
        model, spec = load_model(model_spec, weights, trust_pickle, pooling=pooling)
        if pooling != "none" and spec.kind != "hf":
            raise QuantCliError("--pooling applies to a Hugging Face model folder's base model")
        prep = None
        if data is not None:
            opts = data_options or DataOptions()
            opts.model_folder = spec.path if spec.kind == "hf" else None
            batches, prep = (load_data(data, model, batch_size or 32, num_samples, opts) if job is None else
                             load_shard(data, model, job.rank, job.world_size, batch_size or 32, num_samples, opts))
        elif spec.kind == "sample":
            from sample_models import SAMPLES

            batches = cap_samples(SAMPLES[spec.spec].calibration_batches(), num_samples)
            if job is not None:
                batches = strided(batches, job.rank, job.world_size)
        else:
            raise DataError(f"{model_spec} is not a sample model, so it needs calibration data: pass --data FILE")
        quantize_model(model, cfg, example=batches[0] if batches else None)
        report = model.quantcli_report
        if not report.layers:
            raise QuantCliError(f"{model_spec} has no Linear/Conv/ConvTranspose layers to quantize")
        batches, holdout = _holdout(goal, job, spec, model, batches, batch_size, data_options)
    min_cosine, min_snr, _, max_float_layers = goal
    target = out_path or Path(f"{spec.stem}.calib.pt")
    smoothed = None
    if smoothquant is not None:  # before calibration: the quantizers calibrate the smoothed tensors
        from quantcli.smoothquant import smooth_quant

        smoothed = smooth_quant(model, batches, smoothquant, device=device)
    ctx, advance = _progress(len(batches), "calibrating", not as_json and not _quiet)
    with ctx:
        summary = run_calibration(model, batches, method, percentile=percentile, num_bins=num_bins,
                                  device=device if job is None else job.device, progress=advance)
    model.to("cpu")
    mixed = None
    if holdout is not None:
        from quantcli.mixed_precision import meet_target

        mixed = meet_target(model, holdout[0], min_cosine=min_cosine, min_snr=min_snr,
                            max_float_layers=max_float_layers, holdout_name=holdout[1])
        summary.calibrated = [n for n in summary.calibrated if n not in mixed.quantizers_disabled]
        summary.skipped += mixed.quantizers_disabled
    info = summary.to_dict()
    if mixed is not None:
        info["mixed_precision"] = mixed.to_dict()
    info["config"] = cfg.source
    info["target"] = cfg.target
    info["placement"] = _placement_summary(report.placement, cfg.target)
    info["batchnorm"] = {"fold_batchnorm": cfg.fold_batchnorm, **report.batchnorm.to_dict()}
    if smoothed is not None:
        info["smoothquant"] = smoothed.to_dict()
    if prep is not None:
        info["preprocessing"] = describe_preprocessing(prep)
    with one_outcome():  # rank 0 writes (atomically); the others write nothing and learn whether it worked
        if job is None or job.rank == 0:
            save_calibrated(target, model, spec, batches[0], info, prep)
    if _quiet:
        return None
    info["out"] = str(target)
    info["unmatched_patterns"] = report.unmatched_patterns
    code = 1 if mixed is not None and not mixed.met else 0
    if as_json:
        _print_json(info)
        _target_missed(mixed)
        return code
    for p in report.unmatched_patterns:
        err.print(f"warning: config pattern {p!r} matched no quantizer")
    if summary.not_called:
        err.print(f"warning: never called during calibration, left unquantized: {', '.join(summary.not_called)}")
    for bn, reason in report.batchnorm.skipped:
        err.print(f"warning: BatchNorm {bn} not folded: {reason}")
    t = Table(title=f"quantcli calibrate {model_spec}", show_header=False)
    t.add_row("method", f"{summary.method} ({cfg.source})")
    t.add_row("device", summary.device if job is None else f"{summary.device} ({job.backend}, one per rank)")
    t.add_row("data", f"{summary.num_samples} samples in {summary.num_batches} batches"
              + (f" over {summary.ranks} ranks" if summary.ranks > 1 else ""))
    if prep is not None:
        t.add_row("preprocessing", describe_preprocessing(prep))
    t.add_row("target", f"{cfg.target}: {info['placement']['text']}")
    bn = report.batchnorm
    if bn.folded or bn.skipped:
        t.add_row("BatchNorm folded", f"{len(bn.folded)} of {len(bn.folded) + len(bn.skipped)}: "
                  + (", ".join(f"{f.batchnorm} into {f.layer}" for f in bn.folded) or "none"))
    elif not cfg.fold_batchnorm:
        t.add_row("BatchNorm folded", "off (--no-fold-bn / fold_batchnorm: false)")
    t.add_row("quantizers calibrated", str(len(summary.calibrated)))
    t.add_row("quantizers skipped", f"{len(summary.skipped)} (disabled or dynamic)")
    if summary.dynamic:
        t.add_row("dynamic activations", f"{len(summary.dynamic)} quantized at run time (uint8 from each tensor's "
                  "min and max, as DynamicQuantizeLinear): nothing to calibrate")
    if smoothed is not None:
        n = smoothed.counts()
        t.add_row("smoothquant", f"alpha {smoothed.alpha}: {len(smoothed.groups)} inputs smoothed; 1/s folded into "
                  f"{n['layernorm']} LayerNorm(s) and {n['linear']} Linear(s), {n['mul']} explicit Mul(s)"
                  + (f"; not smoothed: {', '.join(smoothed.skipped)}" if smoothed.skipped else ""))
    if summary.amax_min is not None:
        t.add_row("amax range", f"{summary.amax_min:.4g} .. {summary.amax_max:.4g}")
    if summary.auto:
        from collections import Counter

        picks = Counter(a["method"] for a in summary.auto.values())
        t.add_row("auto choices", ", ".join(f"{n} {m}" for m, n in picks.most_common())
                  + " (smallest layer-output MSE; per quantizer in --json)")
    if mixed is not None:
        t.add_row("quality target", _target_text(mixed))
        t.add_row("kept in float", ", ".join(mixed.kept_float) or "none")
    t.add_row("time", f"{summary.seconds:.2f} s" + (f" + {mixed.seconds:.2f} s target search" if mixed else ""))
    t.add_row("written", str(target))
    out.print(t)
    _target_missed(mixed)
    return code


def _target_missed(mixed) -> None:
    """Exit 1's explanation (stderr, also with --json): what the target needs and what the cap allowed."""
    if mixed is None or mixed.met:
        return
    err.print(f"target not met: it needs {mixed.needed} of {mixed.layers_total} layers in float, more than "
              f"--max-float-layers {mixed.cap}; the checkpoint keeps the {mixed.cap} most sensitive in float "
              f"(cosine {_fmt(mixed.after.cosine)}, SNR {_fmt(mixed.after.snr_db)} dB)")


def _target_text(mixed) -> str:
    goal = " and ".join(x for x in (f"cosine >= {mixed.min_cosine}" if mixed.min_cosine is not None else "",
                                    f"SNR >= {mixed.min_snr} dB" if mixed.min_snr is not None else "") if x)
    return (f"{goal} on {mixed.holdout_samples} held-out samples ({mixed.holdout}): "
            f"{'met' if mixed.met else 'NOT met'}; cosine {_fmt(mixed.before.cosine)} -> {_fmt(mixed.after.cosine)}, "
            f"SNR {_fmt(mixed.before.snr_db)} -> {_fmt(mixed.after.snr_db)} dB with {len(mixed.kept_float)} of "
            f"{mixed.layers_total} layers in float")


def _holdout(goal, job, spec, model, batches, batch_size, data_options):
    """``(calibration batches, (held-out batches, where they came from) or None)`` for --min-cosine/--min-snr."""
    from quantcli.data import DataOptions, load_data, num_samples
    from quantcli.errors import QuantCliError
    from quantcli.mixed_precision import check_target, split_holdout

    min_cosine, min_snr, holdout, max_float_layers = goal
    if min_cosine is None and min_snr is None:
        if holdout is not None or max_float_layers is not None:
            raise QuantCliError("--holdout and --max-float-layers go with --min-cosine or --min-snr")
        return batches, None
    check_target(min_cosine, min_snr)
    if job is not None:
        raise QuantCliError("--min-cosine/--min-snr search in one process; run calibrate without torchrun")
    if holdout is not None:
        opts = data_options or DataOptions()
        opts.model_folder = spec.path if spec.kind == "hf" else None
        held, _ = load_data(holdout, model, batch_size or 32, None, opts)
        return batches, (held, str(holdout))
    if spec.kind == "sample":
        from sample_models import SAMPLES

        held = SAMPLES[spec.spec].evaluation_batches()
        return batches, (held, f"{spec.spec}'s held-out split")
    calib, held = split_holdout(batches)
    return calib, (held, f"the last {num_samples(held)} samples of --data")


def _placement_summary(placement, target: str) -> dict:
    """What the target's placement did (quantcli.nn.placement), as JSON data and one line of text."""
    if placement is None:
        return {"analysed": False, "text": "no placement analysis"}
    d = placement.to_dict()
    if target == "tensorrt":
        d["text"] = ("quantized inputs and weights of every layer, no output quantizers, "
                     f"{len(placement.residual_quantized)} residual skip inputs quantized (NVIDIA's placement)")
        if not placement.analysed:
            d["text"] = f"{placement.note}: quantized inputs and weights of every layer, skip inputs not quantized"
    elif not placement.analysed:
        d["text"] = (f"{placement.note}: per-layer placement (inputs and weights of every layer, int32 biases); "
                     "post-ReLU inputs and Convs that need an output quantizer are not detected, so such Convs "
                     "may stay in float in onnxruntime")
    else:
        d["text"] = (f"{len(placement.unsigned_inputs)} post-ReLU inputs on the uint8 grid, "
                     f"{len(placement.output_quantized)} Conv output quantizers, int32 biases")
    return d


# --------------------------------------------------------------------------------------------- export


TRUST_CODE_HELP = ("Run model code stored in the checkpoint (a factory file's source when the file is not on disk "
                   "unchanged, or a pickled whole module). Only for checkpoints you trust.")


class Exporter(str, Enum):
    torchscript = "torchscript"
    dynamo = "dynamo"


@app.command()
def export(
    calibrated: Path = typer.Argument(..., help="Calibrated checkpoint written by `quantcli calibrate`."),
    onnx_path: Path = typer.Option(..., "--onnx", help="ONNX file to write."),
    opset: Optional[int] = typer.Option(None, "--opset", help="ONNX opset (default: the lowest the formats need, 13 int8, 19 fp8, 21 int4, 18 at least with dynamo, and at least 17 where the model has a LayerNorm)."),
    exporter: Exporter = typer.Option(Exporter.torchscript, "--exporter", help="torch exporter: torchscript or dynamo (torch.export)."),
    dynamic_axes: bool = typer.Option(True, "--dynamic-axes/--static-shapes", help="Dynamic batch (and sequence, for token inputs) dimensions."),
    weights_qdq: bool = typer.Option(False, "--weights-qdq", help="Keep float weights with Q/DQ instead of storing them quantized."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    trust_code: bool = typer.Option(False, "--trust-code", help=TRUST_CODE_HELP),
) -> None:
    """Export a calibrated checkpoint as a standard QuantizeLinear/DequantizeLinear ONNX graph."""
    _guard(_export, calibrated, onnx_path, opset, exporter.value, dynamic_axes, weights_qdq, as_json, trust_code)


def _export(calibrated, onnx_path, opset, exporter, dynamic_axes, weights_qdq, as_json, trust_code=False):
    from exporters.onnx_export import export_onnx
    from quantcli.checkpoint import load_calibrated

    ckpt = load_calibrated(calibrated, trust_code=trust_code)
    meta = {
        "quantcli.config": json.dumps(ckpt.config.to_plain()),
        "quantcli.model": ckpt.spec.spec,
        "quantcli.inputs": json.dumps({"names": ckpt.input_names, "dtypes": ckpt.data["inputs"]["dtypes"]}),
    }
    res = export_onnx(ckpt.model, ckpt.example, onnx_path, opset, exporter, dynamic_axes=dynamic_axes,
                      weights_qdq=weights_qdq, metadata=meta)
    if as_json:
        _print_json(res.to_dict())
        return
    t = Table(title=f"quantcli export {calibrated}", show_header=False)
    t.add_row("Q/DQ pairs", ", ".join(f"{v} {k}" for k, v in sorted(res.pairs_by_format.items())) or "none")
    if res.dynamic_layers:
        t.add_row("dynamic layers", f"{res.dynamic_layers} (DynamicQuantizeLinear -> MatMulInteger, int8 weights)")
    t.add_row("weights stored quantized", str(res.weights_stored_quantized))
    t.add_row("opset", f"{res.opset} ({res.opset_reason})")
    if res.opset_note:
        t.add_row("opset note", res.opset_note)
    t.add_row("exporter", res.exporter)
    t.add_row("inputs", ", ".join(res.input_names))
    t.add_row("outputs", ", ".join(res.output_names))
    if res.fp8_guards:
        t.add_row("fp8 guards", f"{res.fp8_guards} (so that onnxruntime loads it with default options)")
    if res.onnxruntime_disabled_optimizers:
        t.add_row("onnxruntime", "fp8 in the form TensorRT fuses: onnxruntime loads it exactly only with "
                  f"InferenceSession(path, disabled_optimizers={res.onnxruntime_disabled_optimizers})")
    if res.pruned_quantizers:
        t.add_row("pruned (output unused)", f"{len(res.pruned_quantizers)} quantizer(s) whose output reaches no model "
                  f"output: {', '.join(res.pruned_quantizers[:4])}" + (" ..." if len(res.pruned_quantizers) > 4 else ""))
    if res.fusion_error:
        t.add_row("onnxruntime", f"does not load with default options: {res.fusion_error}")
    elif res.quantized_layers is not None:
        t.add_row("unfused layers (onnxruntime)", f"{res.unfused_layers} of {res.quantized_layers} quantized layers run in "
                  "float" + (f" (quantcli inspect {res.path} --runtime onnxruntime)" if res.unfused_layers else ""))
    t.add_row("file size", f"{res.file_bytes / 1024:.1f} KiB" + (" (+ external data)" if res.external_data else ""))
    t.add_row("time", f"{res.seconds:.2f} s")
    t.add_row("written", res.path)
    out.print(t)


# --------------------------------------------------------------------------------------------- verify


class Provider(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


@app.command()
def verify(
    onnx_path: Path = typer.Argument(..., help="The exported ONNX file."),
    reference: Path = typer.Option(..., "--reference", help="The calibrated checkpoint it was exported from."),
    data: Optional[Path] = typer.Option(None, "--data", help="Inputs (calibrate's formats). Default: the sample model's held-out set, else the checkpoint's example batch."),
    provider: Provider = typer.Option(Provider.auto, "--provider", help="onnxruntime execution provider."),
    max_abs_diff: Optional[float] = typer.Option(None, "--max-abs-diff", help="Fidelity, optional: largest |onnxruntime - fake-quant| allowed per output, in the output's units (optimizations off)."),
    max_rms_ratio: Optional[float] = typer.Option(None, "--max-rms-ratio", help="Fidelity: largest RMS(onnxruntime - fake-quant) / RMS(fake-quant - float) allowed per output, optimizations off (default 0.5)."),
    max_deploy_ratio: Optional[float] = typer.Option(None, "--max-deploy-ratio", help="Deployment, optional: the same ratio for the deployed session (default options)."),
    min_cosine: Optional[float] = typer.Option(None, "--min-cosine", help="Quality of the deployed session: smallest cosine similarity to the float model allowed."),
    min_snr: Optional[float] = typer.Option(None, "--min-snr", help="Quality of the deployed session: smallest SNR (dB) against the float model allowed."),
    per_layer: bool = typer.Option(False, "--per-layer", help="Rank quantized layers by their local quantization error."),
    report_path: Optional[Path] = typer.Option(None, "--report", help="Write every metric as JSON to this file."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Re-batch whole arrays from --data (default 32)."),
    num_samples: Optional[int] = typer.Option(None, "--num-samples", help="Use at most N samples."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    trust_code: bool = typer.Option(False, "--trust-code", help=TRUST_CODE_HELP),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="Text --data: tokenizer folder (default: the one calibration stored, else the model folder)."),
    max_length: Optional[int] = typer.Option(None, "--max-length", help="Text --data: at most N tokens (default: calibration's)."),
    image_size: Optional[str] = typer.Option(None, "--image-size", help="Image --data: N or HxW pixels (default: calibration's)."),
    mean: Optional[str] = typer.Option(None, "--mean", help="Image --data: per-channel mean (default: calibration's)."),
    std: Optional[str] = typer.Option(None, "--std", help="Image --data: per-channel std (default: calibration's)."),
) -> None:
    """Check an exported graph in onnxruntime. Exit 0: every check passed; 1: a numerical check failed; 2: bad input."""
    from quantcli.data import DataOptions

    thresholds = {"max_abs_diff": max_abs_diff, "max_rms_ratio": max_rms_ratio, "max_deploy_ratio": max_deploy_ratio,
                  "min_cosine": min_cosine, "min_snr": min_snr}
    code = _guard(_verify, onnx_path, reference, data, provider.value, thresholds, per_layer,
                  report_path, batch_size, num_samples, as_json, trust_code,
                  DataOptions(tokenizer, max_length, image_size, mean, std))
    raise typer.Exit(code)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "inf" if v == float("inf") else f"{v:.6g}"
    return str(v)


def _verify(onnx_path, reference, data, provider, thresholds, per_layer, report_path,
            batch_size, num_samples, as_json, trust_code=False, data_options=None) -> int:
    from quantcli.checkpoint import atomic_write, load_calibrated
    from quantcli.data import DataOptions, cap_samples, load_data
    from quantcli.errors import QuantCliError
    from quantcli.verify import verify_onnx

    for name in ("max_abs_diff", "max_rms_ratio", "max_deploy_ratio"):
        if thresholds[name] is not None and not thresholds[name] >= 0:
            raise QuantCliError(f"--{name.replace('_', '-')} must be a number >= 0, got {thresholds[name]}")
    ckpt = load_calibrated(reference, trust_code=trust_code)
    batches = None
    if data is not None:
        opts = data_options or DataOptions()
        opts.model_folder = ckpt.spec.path if ckpt.spec.kind == "hf" else None
        opts.stored = ckpt.data.get("preprocessing")
        batches, _ = load_data(data, ckpt.model, batch_size or 32, num_samples, opts)
    elif num_samples is not None:
        batches = cap_samples(ckpt.evaluation_batches() or [ckpt.example], num_samples)
    given = {k: v for k, v in thresholds.items() if v is not None or k != "max_rms_ratio"}  # None: the default
    rep = verify_onnx(onnx_path, ckpt, batches, provider=provider, per_layer=per_layer, **given)
    d = rep.to_dict()
    if report_path is not None:
        atomic_write(report_path, lambda tmp: Path(tmp).write_text(json.dumps(d, indent=2, default=str) + "\n"))
    if as_json:
        _print_json(d)
        return 0 if rep.passed else 1
    out.print(f"verify {onnx_path} against {reference} — {rep.num_samples} samples, {rep.provider}")
    if rep.provider_note:
        err.print(f"warning: {rep.provider_note}")
    t = Table(title="checks")
    for col in ("check", "threshold", "measured", "result", "where"):
        t.add_column(col)
    st = rep.structure
    pruned = f", {len(st['pruned'])} pruned (unused)" if st["pruned"] else ""
    t.add_row("structure", f"{st['quantizers_expected']} quantizers",
              f"{st['quantizers_found']} found{pruned}, {len(st['problems'])} problem(s)",
              "pass" if st["passed"] else "FAIL", ", ".join(st["layers_with_problems"][:3]) or "")
    for c in rep.checks:
        t.add_row(c.name, ("<= " if c.kind == "max" else ">= ") + _fmt(c.threshold), _fmt(c.value),
                  "pass" if c.passed else "FAIL", "" if c.passed or not c.detail else c.detail[:120])
    out.print(t)
    for p in st["problems"][:20]:
        out.print(f"  structure: {p}")
    for note in st["notes"]:
        out.print(f"  structure (info): {note}")
    for c in rep.checks:
        if not c.passed and c.detail and len(c.detail) > 120:
            out.print(f"  {c.name}: {c.detail}")
    q = Table(title=f"quality vs the float model ({rep.quality['session']} session), deployment vs fake-quant")
    for col in ("output", "cosine", "SNR dB", "max abs err", "top-1 agree", "exact rms ratio", "deployed rms ratio"):
        q.add_column(col)
    dep = rep.deployment.get("outputs", {})
    for name, m in rep.quality["outputs"].items():
        q.add_row(name, _fmt(m["cosine"]), _fmt(m["snr_db"]), _fmt(m["max_abs_error"]), _fmt(m.get("top1_agreement")),
                  _fmt(rep.fidelity["outputs"][name]["rms_ratio"]), _fmt(dep.get(name, {}).get("rms_ratio")))
    out.print(q)
    if rep.deployment.get("error"):
        out.print(f"  deployment: {rep.deployment['error']}")
    for note in rep.deployment.get("notes", []):
        out.print(f"  deployment: {note}")
    out.print(f"  per-quantizer evidence on {rep.fidelity['sample_size']} samples; {rep.seconds:.1f} s")
    if rep.layers:
        lt = Table(title="layers, worst local quantization error first")
        for col in ("rank", "quantizer", "kind", "SNR dB", "max abs err", "identical codes", "end to end", "replay steps"):
            lt.add_column(col)
        for r in rep.layers:
            lt.add_row(str(r["rank"]), r["quantizer"], r["kind"], _fmt(r["snr_db"]), _fmt(r["max_abs_error"]),
                       _fmt(r["identical_codes"]), _fmt(r["identical_codes_end_to_end"]), _fmt(r.get("replay_steps")))
        out.print(lt)
    out.print("[bold green]PASS[/]" if rep.passed else "[bold red]FAIL[/]", markup=True)
    return 0 if rep.passed else 1


# --------------------------------------------------------------------------------------------- inspect


class Runtime(str, Enum):
    onnxruntime = "onnxruntime"


@app.command()
def inspect(
    path: Path = typer.Argument(..., help="A calibrated checkpoint (.pt) or an exported ONNX file."),
    runtime: Optional[Runtime] = typer.Option(None, "--runtime", help="ONNX file: per quantized layer, whether this runtime (default session options) runs it as an integer kernel, and why not."),
    provider: Provider = typer.Option(Provider.cpu, "--provider", help="With --runtime: the execution provider (cpu or cuda)."),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
    trust_code: bool = typer.Option(False, "--trust-code", help="Checkpoint: also rebuild the model (running the "
                                    "model code stored in it) and load its weights, to show that export and verify "
                                    "can use it. Without it, inspect only reads the file."),
) -> None:
    """Show the quantizers of a calibrated checkpoint, or the Q/DQ nodes of an ONNX file."""
    _guard(_inspect, path, as_json, runtime, provider.value, trust_code)


def _inspect_runtime(path: Path, provider: str, as_json: bool) -> None:
    from quantcli.errors import QuantCliError
    from quantcli.inspect import inspect_runtime

    if path.suffix.lower() != ".onnx":
        raise QuantCliError(f"--runtime inspects an exported ONNX file; {path} is not one")
    if provider == "auto":
        from quantcli.verify import choose_provider

        provider = "cuda" if choose_provider("auto") == "CUDAExecutionProvider" else "cpu"
    rep = inspect_runtime(path, "onnxruntime", provider)
    if as_json:
        _print_json(rep)
        return
    t = Table(title=f"{path} in onnxruntime ({rep['provider']}, default session options): "
                    f"{rep['unfused_layers']} of {rep['quantized_layers']} quantized layers in float")
    for col in ("layer", "op", "runs as", "integer kernel", "why not"):
        t.add_column(col)
    for r in rep["layers"]:
        fused = {True: "yes", False: "no", None: "?"}[r["fused"]]
        t.add_row(r["layer"], r["op_type"], r["kernel"] or "-", fused, "; ".join(r["reasons"]))
    out.print(t)
    if rep["load_error"]:
        out.print(f"onnxruntime cannot load it with default options: {rep['load_error']}")
    if rep["session_needs"]:
        out.print(f"for the results it computes with optimizations off, load it with "
                  f"InferenceSession(path, disabled_optimizers={rep['disabled_optimizers']}) (or re-export it for "
                  "the onnxruntime target):")
        for line in rep["session_needs"]:
            out.print(f"  {line}")


def _inspect(path: Path, as_json: bool, runtime=None, provider: str = "cpu", trust_code: bool = False) -> None:
    from quantcli.inspect import inspect_checkpoint, inspect_onnx

    if runtime is not None:
        _inspect_runtime(path, provider, as_json)
        return
    if path.suffix.lower() == ".onnx":
        rows = inspect_onnx(path)
        if as_json:
            _print_json(rows)
            return
        target = f", target {rows['target']}" if rows["target"] else ""
        t = Table(title=f"{path} — {len(rows['pairs'])} Q/DQ pairs, opset {rows['opset']}{target}")
        for col in ("quantizer", "format", "axis", "block", "scale", "zero point", "stored"):
            t.add_column(col)
        for r in rows["pairs"]:
            t.add_row(r["quantizer"] or r["tensor"], r["format"], str(r["axis"]), str(r["block_size"] or ""),
                      r["scale"], str(r["zero_point"]), r["stored"])
        out.print(t)
        return
    rows = inspect_checkpoint(path, trust_code=trust_code)
    if as_json:
        _print_json(rows)
        return
    t = Table(title=f"{path} — {rows['model']} ({rows['config']}, target {rows['target']})")
    for col in ("quantizer", "enabled", "num_bits", "axis", "block", "amax"):
        t.add_column(col)
    for r in rows["quantizers"]:
        t.add_row(r["name"], "yes" if r["enabled"] else "no", r["format"], str(r["axis"]), str(r["block_sizes"] or ""),
                  r["amax"])
    out.print(t)
    if rows["batchnorm_folds"]:
        out.print("BatchNorm folded: " + ", ".join(f"{f['batchnorm']} into {f['layer']}" for f in rows["batchnorm_folds"]))
    code = rows["model_code"]
    loads = rows["model_loads"]
    if loads is not None:
        out.print(f"model loads: {loads['class']}, {loads['parameters']:,} parameters, "
                  f"{loads['quantizers']} quantizers (model code was run: --trust-code)")
    elif code["needs_trust_code"]:
        out.print(f"model code: {code['source']} ({code['file']}, sha256 {code['sha256']}); "
                  "export and verify run it only with --trust-code (inspect --trust-code checks that it loads)")


# --------------------------------------------------------------------------------------------- analyze


@app.command()
def analyze(
    calibrated: Path = typer.Argument(..., help="Calibrated checkpoint written by `quantcli calibrate`."),
    data: Optional[Path] = typer.Option(None, "--data", help="Inputs (calibrate's formats). Default: the sample model's held-out set, else the checkpoint's example batch."),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="Folder for report.html and analysis.json (default <checkpoint>.analysis)."),
    num_samples: int = typer.Option(64, "--num-samples", help="Samples the sensitivity passes use (two passes per quantizer); statistics use all the data."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Re-batch whole arrays from --data (default 32)."),
    as_json: bool = typer.Option(False, "--json", help="Print the analysis as JSON."),
    trust_code: bool = typer.Option(False, "--trust-code", help=TRUST_CODE_HELP),
) -> None:
    """Rank quantizers by sensitivity, with statistics and plots: an HTML report and JSON."""
    _guard(_analyze, calibrated, data, out_dir, num_samples, batch_size, as_json, trust_code)


def _analyze(calibrated, data, out_dir, sample_samples, batch_size, as_json, trust_code) -> None:
    from quantcli.analyze import analyze as run_analysis
    from quantcli.checkpoint import atomic_write, load_calibrated
    from quantcli.data import DataOptions, load_data
    from quantcli.errors import QuantCliError
    from quantcli.report_html import render

    ckpt = load_calibrated(calibrated, trust_code=trust_code)
    out_dir = out_dir or Path(f"{calibrated.with_suffix('').name}.analysis")
    if out_dir.exists() and not out_dir.is_dir():
        raise QuantCliError(f"--out {out_dir} is a file; give a folder")
    if not out_dir.parent.is_dir():
        raise QuantCliError(f"cannot write {out_dir}: directory {out_dir.parent} does not exist")
    if data is not None:
        opts = DataOptions(model_folder=ckpt.spec.path if ckpt.spec.kind == "hf" else None,
                           stored=ckpt.data.get("preprocessing"))
        batches, _ = load_data(data, ckpt.model, batch_size or 32, None, opts)
    else:
        batches = ckpt.evaluation_batches() or [ckpt.example]
    ctx, advance = _progress(100, "analyzing", not as_json)
    with ctx:
        rep = run_analysis(ckpt, batches, sample_samples=sample_samples,
                           progress=None if advance is None else (lambda stage, k, n: advance(int(99 * k / n))))
    d = rep.to_dict()
    out_dir.mkdir(exist_ok=True)
    html_path, json_path = out_dir / "report.html", out_dir / "analysis.json"
    atomic_write(json_path, lambda tmp: Path(tmp).write_text(json.dumps(d, indent=1) + "\n"))
    atomic_write(html_path, lambda tmp: Path(tmp).write_text(render(d), encoding="utf-8"))
    if as_json:
        _print_json({**d, "report": str(html_path), "json": str(json_path)})
        return
    ov = d["overall"]
    t = Table(title=f"quantcli analyze {calibrated}: {d['num_samples']} samples, sensitivity on "
                    f"{d['sensitivity_samples']}; all on: cosine {_fmt(ov['cosine'])}, SNR {_fmt(ov['snr_db'])} dB")
    for col in ("rank", "quantizer", "cos only on", "SNR only on", "cos only off", "outlier ratio", "amax",
                "max", "percentile", "mse", "entropy"):
        t.add_column(col)
    for r in d["quantizers"][:20]:
        ma = r["method_amax"] or {}
        t.add_row(str(r["rank"]), r["quantizer"], _fmt(r["only_enabled"]["cosine"]), _fmt(r["only_enabled"]["snr_db"]),
                  _fmt((r["only_disabled"] or {}).get("cosine")), _fmt(r["outlier_ratio"]), _fmt(r["amax"]),
                  *(_fmt(ma.get(m)) for m in ("max", "percentile", "mse", "entropy")))
    out.print(t)
    if len(d["quantizers"]) > 20:
        out.print(f"... {len(d['quantizers']) - 20} more in the report")
    sec = d["seconds"]
    out.print(f"time {sec['total']:.2f} s (statistics {sec['statistics']:.2f} s, sensitivity {sec['sensitivity']:.2f} s, "
              f"{sec['passes']} forward passes)")
    out.print(f"written {html_path} and {json_path}")


#: options whose value may be left out, and the value they then take (typer has no optional-value options)
OPTIONAL_VALUES = {"--smoothquant": "0.5"}


def optional_values(args: list[str]) -> list[str]:
    """Give ``--smoothquant`` its default value where it is followed by nothing, another option or a word that
    is not a number (``calibrate M --smoothquant`` == ``calibrate M --smoothquant 0.5``)."""
    out = []
    for i, a in enumerate(args):
        out.append(a)
        if a in OPTIONAL_VALUES:
            nxt = args[i + 1] if i + 1 < len(args) else None
            if nxt is None or not _is_number(nxt):
                out.append(OPTIONAL_VALUES[a])
    return out


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def main() -> None:
    """Entry point: Click's usage errors become one line too (``error: ... (see: quantcli CMD --help)``)."""
    try:  # recent typer vendors its own click; older ones use the click package
        from typer._click import exceptions as click_exc
    except ImportError:  # pragma: no cover
        from click import exceptions as click_exc

    # `python -m quantcli` has the working directory on sys.path, so MODEL `mymodule:make` and a torch.save(model)
    # file whose class is defined beside it load; the console script's sys.path[0] is its bin/ folder instead.
    # Appended (not prepended): a file in the working directory never shadows an installed package.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        code = app(args=optional_values(sys.argv[1:]), prog_name="quantcli", standalone_mode=False)
    except click_exc.UsageError as e:
        hint = f" (see: {e.ctx.command_path} --help)" if e.ctx is not None else ""
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank got the same arguments: rank 0 tells
            print(f"error: {e.format_message()}{hint}", file=sys.stderr)
        sys.exit(2)
    except click_exc.ClickException as e:
        print(f"error: {e.format_message()}", file=sys.stderr)
        sys.exit(e.exit_code)
    except click_exc.Abort:
        print("error: aborted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
