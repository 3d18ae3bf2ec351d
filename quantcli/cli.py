"""The ``quantcli`` command line: parses, calls library functions, prints. Nothing else lives here.

Each command reads parse -> call the library -> render: options shared by several commands are declared once
(the ``Annotated`` aliases below), :func:`guarded` turns errors into exit codes, and ``render_*`` functions
print. Library code raises :class:`quantcli.errors.QuantCliError`; :func:`guarded` turns it into a one-line
error on stderr and exit code 2. A failed numerical check (``verify``) or a missed quality target
(``calibrate --min-cosine``) is exit code 1. Heavy imports happen inside the commands so that
``quantcli --help`` starts fast.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import warnings
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from calibrators.methods import AMAX_METHODS, CALIBRATION_METHODS
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

DEFAULT_BATCH_SIZE = 32  # --batch-size's default (the library's too)

# --------------------------------------------------------------------------------------------- choices

#: calibrate --method: an amax method for every quantizer, or auto
Method = Enum("Method", {m: m for m in CALIBRATION_METHODS}, type=str)


class Exporter(str, Enum):
    torchscript = "torchscript"
    dynamo = "dynamo"


class Provider(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class ExportProvider(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class Runtime(str, Enum):
    onnxruntime = "onnxruntime"


# --------------------------------------------------------------------------------------------- shared options
# One declaration (name, type, help) per option that several commands take with the same meaning. Options that
# share only a name (--out, --min-cosine, --provider, analyze's --num-samples, inspect's --trust-code) mean
# something else in each command and are declared where they are used.

CalibratedArg = Annotated[Path, typer.Argument(help="Calibrated checkpoint written by `quantcli calibrate`.")]
DataOpt = Annotated[Optional[Path], typer.Option(
    "--data", help="Inputs: .npz, .npy, .pt, or a directory of them; .txt/.jsonl text; a folder of JPEG/PNG "
    "images. Default: a sample model's own data (verify, analyze: its held-out set, else the checkpoint's "
    "example batch).")]
BatchSizeOpt = Annotated[Optional[int], typer.Option(
    "--batch-size", help=f"Re-batch whole arrays into batches of N (default {DEFAULT_BATCH_SIZE}).")]
NumSamplesOpt = Annotated[Optional[int], typer.Option("--num-samples", help="Use at most N samples.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print as JSON.")]
TrustCodeOpt = Annotated[bool, typer.Option(
    "--trust-code", help="Run model code stored in the checkpoint (a factory file's source when the file is not "
    "on disk unchanged, or a pickled whole module) or a module it names that is not from the installed "
    "distribution recorded at calibration. Only for checkpoints you trust.")]
# how text files and image folders become tensors (quantcli.data.DataOptions); verify repeats calibration's
TokenizerOpt = Annotated[Optional[Path], typer.Option(
    "--tokenizer", help="Text --data: tokenizer folder (default: the model folder; verify: the one calibration "
    "stored, else the model folder).")]
MaxLengthOpt = Annotated[Optional[int], typer.Option(
    "--max-length", help="Text --data: at most N tokens per example (default 128; verify: calibration's).")]
ImageSizeOpt = Annotated[Optional[str], typer.Option(
    "--image-size", help="Image --data: N or HxW pixels (default: preprocessor_config.json, else 224; verify: "
    "calibration's).")]
MeanOpt = Annotated[Optional[str], typer.Option(
    "--mean", help="Image --data: per-channel mean, e.g. 0.485,0.456,0.406 (default: preprocessor_config.json, "
    "else ImageNet's; verify: calibration's).")]
StdOpt = Annotated[Optional[str], typer.Option(
    "--std", help="Image --data: per-channel std (default: preprocessor_config.json, else ImageNet's; verify: "
    "calibration's).")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"quantcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """quantcli: calibrate -> export --onnx -> verify."""


# --------------------------------------------------------------------------------------------- errors

_quiet = False  # a torchrun rank other than 0: rank 0 reports for every rank
_signalled: int | None = None  # the exit code of the SIGINT/SIGTERM received (main's handlers), else None


def _fail(message: str, code: int = 2, as_json: bool = False, kind: str = "QuantCliError") -> None:
    """One line on stderr (with ``--json`` also ``{"error", "exit_code", "kind"}`` on stdout), then exit."""
    if _quiet:
        raise typer.Exit(code)
    if as_json:
        with contextlib.suppress(OSError):
            _print_json({"error": message, "exit_code": code, "kind": kind})
    err.print(f"[bold red]error:[/] {message}", markup=True, highlight=False) if err.is_terminal else print(
        f"error: {message}", file=sys.stderr
    )
    raise typer.Exit(code)


def _unexpected(e: BaseException) -> str:
    """The one line for an exception no library code turned into a QuantCliError: named where the cause is
    known (a full disk), else its type and first line."""
    from quantcli.errors import first_line
    from quantcli.files import no_space

    if no_space(e):
        where = f" writing {e.filename}" if isinstance(e, OSError) and e.filename else ""
        return (f"no space left on device{where}; free some space or write the output elsewhere (nothing was "
                "written)")
    return f"{type(e).__name__}: {first_line(e) if str(e).strip() else ''} (set QUANTCLI_DEBUG=1 for a traceback)"


def guarded(command):
    """A command's error guard. The command returns its exit code (``None``: 0). A QuantCliError becomes its
    first line on stderr and exit 2; Ctrl-C exit 130 (SIGTERM 143), whatever it interrupted (an import that
    turns the interrupt into an ImportError included); anything unexpected (a bug, an input we did not foresee)
    one line naming it and exit 2, with no traceback unless QUANTCLI_DEBUG is set. With ``--json`` the error is
    also a JSON object on stdout."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        from quantcli.errors import QuantCliError, first_line

        as_json = bool(kwargs.get("as_json"))
        try:
            with warnings.catch_warnings():  # a library's warnings are not the tool's: stderr stays one line
                if not os.environ.get("QUANTCLI_DEBUG"):
                    warnings.simplefilter("ignore")
                code = command(*args, **kwargs)
        except typer.Exit:
            raise
        except BaseException as e:
            if _signalled is not None or isinstance(e, KeyboardInterrupt):
                code = _signalled or 130
                _fail("interrupted" if code == 130 else "terminated", code, as_json, "Interrupted")
            if isinstance(e, QuantCliError):
                _fail(first_line(e), 2, as_json, type(e).__name__)
            if not isinstance(e, Exception) or os.environ.get("QUANTCLI_DEBUG"):
                raise
            _fail(_unexpected(e), 2, as_json, type(e).__name__)
        if code is not None:
            raise typer.Exit(code)

    return run


# --------------------------------------------------------------------------------------------- output helpers


def _print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


@contextlib.contextmanager
def _progress(total: int, label: str, enabled: bool):
    """A Rich progress bar on a TTY; yields its advance callback (``advance(i)``: item ``i`` done), or ``None``
    where there is no bar."""
    if not enabled or not err.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err, transient=True)
    task = prog.add_task(label, total=total)
    with prog:
        yield lambda i: prog.update(task, completed=i + 1)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "inf" if v == float("inf") else f"{v:.6g}"
    return str(v)


def _table(title: str, columns: tuple[str, ...], rows) -> Table:
    t = Table(title=title)
    for col in columns:
        t.add_column(col)
    for r in rows:
        t.add_row(*r)
    return t


def _key_value_table(title: str, rows) -> Table:
    t = Table(title=title, show_header=False)
    for r in rows:
        t.add_row(*r)
    return t


def _checkpoint_inputs(ckpt, data: Optional[Path], batch_size: Optional[int], num_samples: Optional[int],
                       options=None):
    """``--data`` read as calibration read it (the preprocessing the checkpoint stored, the model folder's
    tokenizer); ``None`` without ``--data``."""
    if data is None:
        return None
    from quantcli.data import DataOptions, load_data

    opts = options or DataOptions()
    opts.model_folder = ckpt.spec.path if ckpt.spec.kind == "hf" else None
    opts.stored = ckpt.data.get("preprocessing")
    batches, _ = load_data(data, ckpt.model, batch_size or DEFAULT_BATCH_SIZE, num_samples, opts)
    return batches


# --------------------------------------------------------------------------------------------- calibrate


@app.command()
@guarded
def calibrate(
    model: Annotated[str, typer.Argument(help="package.module:factory, path/to/file.py:factory, a sample model (digits_cnn, text_encoder), a Hugging Face model folder, or a torch.save(model) file (with --trust-pickle).")],
    weights: Annotated[Optional[Path], typer.Option("--weights", help="State dict: .safetensors, or .pt/.pth (read with weights_only=True).")] = None,
    data: DataOpt = None,
    config: Annotated[str, typer.Option("--config", help="Preset (int8, int8-per-tensor, uint8-asymmetric, fp8, int4-weight-only, int8-dynamic) or a YAML/JSON file.")] = "int8",
    target: Annotated[Optional[str], typer.Option("--target", help="Runtime the Q/DQ placement is for: onnxruntime (default) or tensorrt. Overrides the config file's target.")] = None,
    method: Annotated[Method, typer.Option("--method", help="Activation amax method; auto: per quantizer, the candidate (max, percentile, mse, entropy) with the smallest error of its layer's output.")] = Method("max"),
    percentile: Annotated[float, typer.Option("--percentile", help="Percentile for --method percentile.")] = 99.99,
    num_bins: Annotated[int, typer.Option("--num-bins", help="Histogram bins for entropy/mse/percentile.")] = 2048,
    batch_size: BatchSizeOpt = None,
    num_samples: NumSamplesOpt = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda[:i].")] = "auto",
    out_path: Annotated[Optional[Path], typer.Option("--out", help="Calibrated checkpoint to write (default <model>.calib.pt).")] = None,
    as_json: JsonOpt = False,
    trust_pickle: Annotated[bool, typer.Option("--trust-pickle", help="Allow a MODEL or --weights that is a pickled whole module, torch.save(model) (unpickling runs code from the file).")] = False,
    pooling: Annotated[str, typer.Option("--pooling", help="Hugging Face base model output: none (last_hidden_state) or mean (mean over unmasked tokens, 'embeddings').")] = "none",
    tokenizer: TokenizerOpt = None,
    max_length: MaxLengthOpt = None,
    image_size: ImageSizeOpt = None,
    mean: MeanOpt = None,
    std: StdOpt = None,
    min_cosine: Annotated[Optional[float], typer.Option("--min-cosine", help="Keep the fewest layers in float needed for this cosine to the float model on held-out data.")] = None,
    min_snr: Annotated[Optional[float], typer.Option("--min-snr", help="The same for an SNR target in dB.")] = None,
    holdout: Annotated[Optional[Path], typer.Option("--holdout", help="Held-out data for --min-cosine/--min-snr (default: a sample model's held-out split, else the last quarter of --data's batches).")] = None,
    max_float_layers: Annotated[Optional[int], typer.Option("--max-float-layers", help="With a target: at most N layers kept in float (default a quarter of the quantized layers); beyond it, exit 1.")] = None,
    fold_bn: Annotated[Optional[bool], typer.Option("--fold-bn/--no-fold-bn", help="Fold each BatchNorm into the Conv/ConvTranspose/Linear before it (default: the config's fold_batchnorm, true).")] = None,
    smoothquant: Annotated[Optional[float], typer.Option("--smoothquant", metavar="[ALPHA]", help="SmoothQuant: move activation outliers of Linear inputs into the weights, s = max|X|^ALPHA / max|W|^(1-ALPHA) per channel (ALPHA default 0.5), folded into the preceding LayerNorm/Linear where exact, else an explicit Mul.")] = None,
    weight_method: Annotated[str, typer.Option("--weight-method", help="How weight-only layers (int4-weight-only) round their weights: rtn (to nearest), gptq (second-order, from the calibration inputs' Hessian) or awq (activation-aware per-channel scales).")] = "rtn",
    placement: Annotated[str, typer.Option("--placement", envvar="QUANTCLI_PLACEMENT", show_envvar=True, help="onnxruntime target: auto (default) keeps in float the layers onnxruntime would not run faster quantized on this machine (not fused into an integer kernel, or an integer kernel with its Q/DQ more than 20% slower than float, timed with onnxruntime's profiler on the example batch); all quantizes every layer as configured.")] = "auto",
    dist_timeout: Annotated[float, typer.Option("--dist-timeout", help="Under torchrun: seconds a rank waits for the others at a step boundary (and to join) before the job stops, naming the rank that stalled.")] = 600.0,
) -> Optional[int]:
    """Insert quantizers into MODEL and calibrate every amax; write a calibrated checkpoint."""
    from quantcli.calibrate_job import CalibrationJob, CalibrationRequest
    from quantcli.data import DataOptions

    request = CalibrationRequest(
        model, weights, data, config, target, method.value, percentile, num_bins, batch_size, num_samples, device,
        out_path, trust_pickle, pooling, DataOptions(tokenizer, max_length, image_size, mean, std), fold_bn,
        smoothquant, min_cosine, min_snr, holdout, max_float_layers, weight_method, placement)
    with _torchrun_rank(device, dist_timeout) as rank:
        job = CalibrationJob.load(request, rank)
        smoothed = job.smooth()
        with _progress(len(job.batches), "calibrating", not as_json and not _quiet) as advance:
            summary = job.calibrate(advance)
        outcome = job.finish(summary, smoothed)
        return None if _quiet else render_calibrate(outcome, as_json)


@contextlib.contextmanager
def _torchrun_rank(device: str, timeout: float):
    """Under ``torchrun``: join the job (yield this process's Rank), keep every rank but 0 quiet (an error every
    rank has while joining too), name a stalled or dead rank, leave at the end. Otherwise yield ``None``."""
    global _quiet
    from quantcli.process_group import JoinError, RankStalled, explain, join_from_environment, leave

    try:
        rank = join_from_environment(device, timeout)
    except JoinError as e:
        _quiet = e.every_rank and e.rank != 0
        raise
    _quiet = rank is not None and rank.rank != 0
    try:
        yield rank
    except RankStalled as e:
        _quiet = _quiet and not e.speak  # rank 0 stalled: another rank says so
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
    if as_json:
        _print_json(outcome.to_dict())
    else:
        _calibrate_warnings(outcome)
        rows = [*_calibrate_setup_rows(outcome), *_calibrate_result_rows(outcome)]
        out.print(_key_value_table(f"quantcli calibrate {outcome.job.request.model}", rows))
    _target_missed(outcome.mixed)
    return 0 if outcome.target_met else 1


def _calibrate_warnings(outcome) -> None:
    report = outcome.job.report
    for p in report.unmatched_patterns:
        err.print(f"warning: config pattern {p!r} matched no quantizer")
    if outcome.summary.not_called:
        err.print(f"warning: never called during calibration, left unquantized: {', '.join(outcome.summary.not_called)}")
    for bn, reason in report.batchnorm.skipped:
        err.print(f"warning: BatchNorm {bn} not folded: {reason}")


def _calibrate_setup_rows(outcome):
    """Rows saying what was calibrated how: method, device, data, target, BatchNorm folding."""
    from quantcli.data import describe_preprocessing

    job, summary, cfg = outcome.job, outcome.summary, outcome.job.config
    yield "method", f"{summary.method} ({cfg.source})"
    yield "device", summary.device if job.rank is None else f"{summary.device} ({job.rank.backend}, one per rank)"
    yield "data", (f"{summary.num_samples} samples in {summary.num_batches} batches"
                   + (f" over {summary.ranks} ranks" if summary.ranks > 1 else ""))
    if job.preprocessing is not None:
        yield "preprocessing", describe_preprocessing(job.preprocessing)
    yield "target", f"{cfg.target}: {outcome.info['placement']['text']}"
    latency = outcome.info["placement"].get("latency")
    if latency is not None:
        yield "latency placement", latency["text"]
    bn = job.report.batchnorm
    if bn.folded or bn.skipped:
        yield "BatchNorm folded", (f"{len(bn.folded)} of {len(bn.folded) + len(bn.skipped)}: "
                                   + (", ".join(f"{f.batchnorm} into {f.layer}" for f in bn.folded) or "none"))
    elif not cfg.fold_batchnorm:
        yield "BatchNorm folded", "off (--no-fold-bn / fold_batchnorm: false)"


def _calibrate_result_rows(outcome):
    """Rows saying what came out: quantizers, smoothing, amax, auto choices, the quality target, the file."""
    summary, smoothed, mixed = outcome.summary, outcome.smoothed, outcome.mixed
    yield "layers", outcome.info["layers"]["text"]
    yield "quantizers calibrated", str(len(summary.calibrated))
    yield "quantizers skipped", f"{len(summary.skipped)} (disabled or dynamic)"
    if summary.dynamic:
        yield "dynamic activations", (f"{len(summary.dynamic)} quantized at run time (uint8 from each tensor's "
                                      "min and max, as DynamicQuantizeLinear): nothing to calibrate")
    if smoothed is not None:
        n = smoothed.counts()
        yield "smoothquant", (f"alpha {smoothed.alpha}: {len(smoothed.groups)} inputs smoothed; 1/s folded into "
                              f"{n['layernorm']} LayerNorm(s) and {n['linear']} Linear(s), {n['mul']} explicit Mul(s)"
                              + (f"; not smoothed: {', '.join(smoothed.skipped)}" if smoothed.skipped else ""))
    if summary.amax_min is not None:
        yield "amax range", f"{summary.amax_min:.4g} .. {summary.amax_max:.4g}"
    if summary.auto:
        from collections import Counter

        picks = Counter(a["method"] for a in summary.auto.values())
        yield "auto choices", (", ".join(f"{n} {m}" for m, n in picks.most_common())
                               + " (smallest layer-output MSE; per quantizer in --json)")
    if mixed is not None:
        yield "quality target", _target_text(mixed)
        yield "kept in float", ", ".join(mixed.kept_float) or "none"
        if mixed.dynamic:
            yield "dynamic int8 (not float)", ", ".join(mixed.dynamic)
    yield "time", f"{summary.seconds:.2f} s" + (f" + {mixed.seconds:.2f} s target search" if mixed else "")
    yield "written", str(outcome.job.out)


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


# --------------------------------------------------------------------------------------------- export


@app.command()
@guarded
def export(
    calibrated: CalibratedArg,
    onnx_path: Annotated[Path, typer.Option("--onnx", help="ONNX file to write.")],
    opset: Annotated[Optional[int], typer.Option("--opset", help="ONNX opset (default: the lowest the formats need, 13 int8, 19 fp8, 21 int4, 18 at least with dynamo, and at least 17 where the model has a LayerNorm).")] = None,
    exporter: Annotated[Exporter, typer.Option("--exporter", help="torch exporter: torchscript or dynamo (torch.export).")] = Exporter.torchscript,
    dynamic_axes: Annotated[bool, typer.Option("--dynamic-axes/--static-shapes", help="Dynamic batch (and sequence, for token inputs) dimensions.")] = True,
    weights_qdq: Annotated[bool, typer.Option("--weights-qdq", help="Keep float weights with Q/DQ instead of storing them quantized.")] = False,
    provider: Annotated[Optional[ExportProvider], typer.Option("--provider", help="onnxruntime target: the execution provider the graph is for, cpu (default: residual and GELU-bias Adds written as Sum, so onnxruntime's CPU provider forms no slow SkipLayerNormalization/BiasGelu) or cuda (left to onnxruntime's fusions).")] = None,
    as_json: JsonOpt = False,
    trust_code: TrustCodeOpt = False,
) -> None:
    """Export a calibrated checkpoint as a standard QuantizeLinear/DequantizeLinear ONNX graph."""
    from exporters.onnx_export import export_onnx
    from quantcli.checkpoint import load_calibrated

    _refuse_inputs(onnx_path, [("the checkpoint", calibrated)], "--onnx", external_data=True)
    ckpt = load_calibrated(calibrated, trust_code=trust_code)
    _refuse_inputs(onnx_path, [("the model's file", ckpt.spec.path)], "--onnx", external_data=True)
    meta = {  # read back by verify and inspect
        "quantcli.config": json.dumps(ckpt.config.to_plain()),
        "quantcli.model": ckpt.spec.spec,
        "quantcli.inputs": json.dumps({"names": ckpt.input_names, "dtypes": ckpt.data["inputs"]["dtypes"]}),
    }
    res = export_onnx(ckpt.model, ckpt.example, onnx_path, opset, exporter.value, dynamic_axes=dynamic_axes,
                      weights_qdq=weights_qdq, metadata=meta, provider=provider.value if provider else None)
    if as_json:
        _print_json(res.to_dict())
    else:
        render_export(res, calibrated)


def render_export(res, calibrated: Path) -> None:
    out.print(_key_value_table(f"quantcli export {calibrated}", _export_rows(res)))


def _export_rows(res):
    """The export summary's rows: what the graph holds, how onnxruntime will run it, the file."""
    yield "Q/DQ pairs", ", ".join(f"{v} {k}" for k, v in sorted(res.pairs_by_format.items())) or "none"
    if res.dynamic_layers:
        yield "dynamic layers", f"{res.dynamic_layers} (DynamicQuantizeLinear -> MatMulInteger, int8 weights)"
    yield "weights stored quantized", str(res.weights_stored_quantized)
    yield "opset", f"{res.opset} ({res.opset_reason})"
    if res.opset_note:
        yield "opset note", res.opset_note
    yield "exporter", res.exporter
    if res.provider:
        kept = res.placement.get("skip_layer_norm_avoided", 0) + res.placement.get("bias_gelu_avoided", 0)
        yield "onnxruntime provider", res.provider + (
            f" ({kept} residual/GELU-bias Adds written as Sum: no SkipLayerNormalization/BiasGelu, slower on CPU; "
            "--provider cuda leaves them)" if kept else "")
    yield "inputs", ", ".join(res.input_names)
    yield "outputs", ", ".join(res.output_names)
    if res.fp8_guards:
        yield "fp8 guards", f"{res.fp8_guards} (so that onnxruntime loads it with default options)"
    if res.onnxruntime_disabled_optimizers:
        yield "onnxruntime", ("fp8 in the form TensorRT fuses: onnxruntime loads it exactly only with "
                              f"InferenceSession(path, disabled_optimizers={res.onnxruntime_disabled_optimizers})")
    if res.pruned_quantizers:
        yield "pruned (output unused)", (f"{len(res.pruned_quantizers)} quantizer(s) whose output reaches no model "
                                         f"output: {', '.join(res.pruned_quantizers[:4])}"
                                         + (" ..." if len(res.pruned_quantizers) > 4 else ""))
    if res.fusion_error:
        yield "onnxruntime", f"does not load with default options: {res.fusion_error}"
    elif res.quantized_layers is not None:
        yield "unfused layers (onnxruntime)", (
            f"{res.unfused_layers} of {res.quantized_layers} quantized layers run in float"
            + (f" (quantcli inspect {res.path} --runtime onnxruntime)" if res.unfused_layers else ""))
    yield "file size", f"{res.file_bytes / 1024:.1f} KiB" + (" (+ external data)" if res.external_data else "")
    yield "time", f"{res.seconds:.2f} s"
    yield "written", res.path


# --------------------------------------------------------------------------------------------- verify


@app.command()
@guarded
def verify(
    onnx_path: Annotated[Path, typer.Argument(help="The exported ONNX file.")],
    reference: Annotated[Path, typer.Option("--reference", help="The calibrated checkpoint it was exported from.")],
    data: DataOpt = None,
    provider: Annotated[Provider, typer.Option("--provider", help="onnxruntime execution provider.")] = Provider.auto,
    max_abs_diff: Annotated[Optional[float], typer.Option("--max-abs-diff", help="Fidelity, optional: largest |onnxruntime - fake-quant| allowed per output, in the output's units (optimizations off).")] = None,
    max_rms_ratio: Annotated[Optional[float], typer.Option("--max-rms-ratio", help="Fidelity: largest RMS(onnxruntime - fake-quant) / RMS(fake-quant - float) allowed per output, optimizations off (default 2.0: a gross bound; docs/verify-criteria.md).")] = None,
    max_deploy_ratio: Annotated[Optional[float], typer.Option("--max-deploy-ratio", help="Deployment, optional: the same ratio for the deployed session (default options).")] = None,
    min_cosine: Annotated[Optional[float], typer.Option("--min-cosine", help="Quality of the deployed session: smallest cosine similarity to the float model allowed.")] = None,
    min_snr: Annotated[Optional[float], typer.Option("--min-snr", help="Quality of the deployed session: smallest SNR (dB) against the float model allowed.")] = None,
    per_layer: Annotated[bool, typer.Option("--per-layer", help="Rank quantized layers by their local quantization error.")] = False,
    report_path: Annotated[Optional[Path], typer.Option("--report", help="Write every metric as JSON to this file.")] = None,
    batch_size: BatchSizeOpt = None,
    num_samples: NumSamplesOpt = None,
    as_json: JsonOpt = False,
    trust_code: TrustCodeOpt = False,
    tokenizer: TokenizerOpt = None,
    max_length: MaxLengthOpt = None,
    image_size: ImageSizeOpt = None,
    mean: MeanOpt = None,
    std: StdOpt = None,
) -> int:
    """Check an exported graph in onnxruntime. Exit 0: every check passed; 1: a numerical check failed; 2: bad input."""
    from quantcli.checkpoint import load_calibrated
    from quantcli.data import DataOptions, cap_samples
    from quantcli.files import atomic_write, writable_directory
    from quantcli.verify import verify_onnx

    thresholds = _thresholds(max_abs_diff=max_abs_diff, max_rms_ratio=max_rms_ratio,
                             max_deploy_ratio=max_deploy_ratio, min_cosine=min_cosine, min_snr=min_snr)
    if report_path is not None:
        writable_directory(report_path)  # before the work, not after it
        _refuse_inputs(report_path, [("the graph", onnx_path), ("the graph's external data", _external(onnx_path)),
                                     ("the reference checkpoint", reference), ("--data", data)], "--report")
    ckpt = load_calibrated(reference, trust_code=trust_code)
    if report_path is not None:
        _refuse_inputs(report_path, [("the model's file", ckpt.spec.path)], "--report")
    batches = _checkpoint_inputs(ckpt, data, batch_size, num_samples,
                                 DataOptions(tokenizer, max_length, image_size, mean, std))
    if batches is None and num_samples is not None:
        batches = cap_samples(ckpt.evaluation_batches() or [ckpt.example], num_samples)
    rep = verify_onnx(onnx_path, ckpt, batches, provider=provider.value, per_layer=per_layer, **thresholds)
    d = rep.to_dict()
    if report_path is not None:
        atomic_write(report_path, lambda tmp: Path(tmp).write_text(json.dumps(d, indent=2, default=str) + "\n"))
    if as_json:
        _print_json(d)
    else:
        render_verify(rep, onnx_path, reference)
    return 0 if rep.passed else 1


def _thresholds(**given: Optional[float]) -> dict[str, Optional[float]]:
    """verify_onnx's threshold arguments: the ratios and differences must be >= 0; --max-rms-ratio left out
    takes the library's default."""
    from quantcli.errors import QuantCliError

    for name in ("max_abs_diff", "max_rms_ratio", "max_deploy_ratio"):
        if given[name] is not None and not given[name] >= 0:
            raise QuantCliError(f"--{name.replace('_', '-')} must be a number >= 0, got {given[name]}")
    return {k: v for k, v in given.items() if v is not None or k != "max_rms_ratio"}


def render_verify(rep, onnx_path: Path, reference: Path) -> None:
    """The checks, the quality of every output, the per-layer ranking (--per-layer), then PASS or FAIL."""
    out.print(f"verify {onnx_path} against {reference} — {rep.num_samples} samples, {rep.provider}")
    if rep.provider_note:
        err.print(f"warning: {rep.provider_note}")
    st = rep.structure
    out.print(_table("checks", ("check", "threshold", "measured", "result", "where"), _check_rows(rep)))
    for p in st["problems"][:20]:
        out.print(f"  structure: {p}")
    for note in st["notes"]:
        out.print(f"  structure (info): {note}")
    for c in rep.checks:
        if not c.passed and c.detail and len(c.detail) > 120:
            out.print(f"  {c.name}: {c.detail}")
    out.print(_quality_table(rep))
    if rep.deployment.get("error"):
        out.print(f"  deployment: {rep.deployment['error']}")
    for note in rep.deployment.get("notes", []):
        out.print(f"  deployment: {note}")
    out.print(f"  per-quantizer evidence on {rep.fidelity['sample_size']} samples; {rep.seconds:.1f} s")
    if rep.layers:
        out.print(_layers_table(rep.layers))
    out.print("[bold green]PASS[/]" if rep.passed else "[bold red]FAIL[/]", markup=True)


def _check_rows(rep):
    st = rep.structure
    pruned = f", {len(st['pruned'])} pruned (unused)" if st["pruned"] else ""
    yield ("structure", f"{st['quantizers_expected']} quantizers",
           f"{st['quantizers_found']} found{pruned}, {len(st['problems'])} problem(s)",
           "pass" if st["passed"] else "FAIL", ", ".join(st["layers_with_problems"][:3]) or "")
    for c in rep.checks:
        yield (c.name, ("<= " if c.kind == "max" else ">= ") + _fmt(c.threshold), _fmt(c.value),
               "pass" if c.passed else "FAIL", "" if c.passed or not c.detail else c.detail[:120])


def _quality_table(rep) -> Table:
    dep = rep.deployment.get("outputs", {})
    rows = ((name, _fmt(m["cosine"]), _fmt(m["snr_db"]), _fmt(m["max_abs_error"]), _fmt(m.get("top1_agreement")),
             _fmt(rep.fidelity["outputs"][name]["rms_ratio"]), _fmt(dep.get(name, {}).get("rms_ratio")))
            for name, m in rep.quality["outputs"].items())
    return _table(f"quality vs the float model ({rep.quality['session']} session), deployment vs fake-quant",
                  ("output", "cosine", "SNR dB", "max abs err", "top-1 agree", "exact rms ratio",
                   "deployed rms ratio"), rows)


def _layers_table(layers: list[dict]) -> Table:
    rows = ((str(r["rank"]), r["quantizer"], r["kind"], _fmt(r["snr_db"]), _fmt(r["max_abs_error"]),
             _fmt(r["identical_codes"]), _fmt(r["identical_codes_end_to_end"]), _fmt(r.get("replay_steps")))
            for r in layers)
    return _table("layers, worst local quantization error first",
                  ("rank", "quantizer", "kind", "SNR dB", "max abs err", "identical codes", "end to end",
                   "replay steps"), rows)


def _external(onnx_path: Path) -> Path:
    """The external data file quantcli export writes beside a large graph."""
    return onnx_path.with_name(onnx_path.name + ".data")


def _refuse_inputs(out_path: Path, inputs, option: str, external_data: bool = False) -> None:
    """Exit 2 (before any work) when ``out_path`` (and, for a graph, its ``.data`` file) is a file read."""
    from quantcli.files import refuse_overwriting_inputs

    refuse_overwriting_inputs(out_path, inputs, option)
    if external_data:
        refuse_overwriting_inputs(_external(out_path), inputs, f"{option}'s external data")


# --------------------------------------------------------------------------------------------- inspect


@app.command()
@guarded
def inspect(
    path: Annotated[Path, typer.Argument(help="A calibrated checkpoint (.pt) or an exported ONNX file.")],
    runtime: Annotated[Optional[Runtime], typer.Option("--runtime", help="ONNX file: per quantized layer, whether this runtime (default session options) runs it as an integer kernel, and why not.")] = None,
    provider: Annotated[Provider, typer.Option("--provider", help="With --runtime: the execution provider (cpu or cuda).")] = Provider.cpu,
    as_json: JsonOpt = False,
    trust_code: Annotated[bool, typer.Option("--trust-code", help="Checkpoint: also rebuild the model (running the model code stored in it) and load its weights, to show that export and verify can use it. Without it, inspect only reads the file.")] = False,
) -> None:
    """Show the quantizers of a calibrated checkpoint, or the Q/DQ nodes of an ONNX file."""
    from quantcli.errors import QuantCliError
    from quantcli.inspect import inspect_checkpoint, inspect_onnx, inspect_runtime

    if runtime is not None:
        if path.suffix.lower() != ".onnx":
            raise QuantCliError(f"--runtime inspects an exported ONNX file; {path} is not one")
        rep, render = inspect_runtime(path, runtime.value, _runtime_provider(provider)), render_inspect_runtime
    elif path.suffix.lower() == ".onnx":
        rep, render = inspect_onnx(path), render_inspect_onnx
    else:
        rep, render = inspect_checkpoint(path, trust_code=trust_code), render_inspect_checkpoint
    if as_json:
        _print_json(rep)
    else:
        render(rep, path)


def _runtime_provider(provider: Provider) -> str:
    """``auto``: cuda where onnxruntime has it, else cpu."""
    if provider is not Provider.auto:
        return provider.value
    from quantcli.verify import choose_provider

    return "cuda" if choose_provider("auto") == "CUDAExecutionProvider" else "cpu"


def render_inspect_runtime(rep: dict, path: Path) -> None:
    rows = ((r["layer"], r["op_type"], r["kernel"] or "-", {True: "yes", False: "no", None: "?"}[r["fused"]],
             "; ".join(r["reasons"])) for r in rep["layers"])
    out.print(_table(f"{path} in onnxruntime ({rep['provider']}, default session options): "
                     f"{rep['unfused_layers']} of {rep['quantized_layers']} quantized layers in float",
                     ("layer", "op", "runs as", "integer kernel", "why not"), rows))
    if rep["load_error"]:
        out.print(f"onnxruntime cannot load it with default options: {rep['load_error']}")
    if rep["session_needs"]:
        out.print(f"for the results it computes with optimizations off, load it with "
                  f"InferenceSession(path, disabled_optimizers={rep['disabled_optimizers']}) (or re-export it for "
                  "the onnxruntime target):")
        for line in rep["session_needs"]:
            out.print(f"  {line}")


def render_inspect_onnx(rows: dict, path: Path) -> None:
    target = f", target {rows['target']}" if rows["target"] else ""
    pairs = ((r["quantizer"] or r["tensor"], r["format"], str(r["axis"]), str(r["block_size"] or ""), r["scale"],
              str(r["zero_point"]), r["stored"]) for r in rows["pairs"])
    out.print(_table(f"{path} — {len(rows['pairs'])} Q/DQ pairs, opset {rows['opset']}{target}",
                     ("quantizer", "format", "axis", "block", "scale", "zero point", "stored"), pairs))


def render_inspect_checkpoint(rows: dict, path: Path) -> None:
    qs = ((r["name"], "yes" if r["enabled"] else "no", r["format"], str(r["axis"]), str(r["block_sizes"] or ""),
           r["amax"]) for r in rows["quantizers"])
    out.print(_table(f"{path} — {rows['model']} ({rows['config']}, target {rows['target']})",
                     ("quantizer", "enabled", "num_bits", "axis", "block", "amax"), qs))
    if rows["batchnorm_folds"]:
        out.print("BatchNorm folded: " + ", ".join(f"{f['batchnorm']} into {f['layer']}" for f in rows["batchnorm_folds"]))
    code = rows["model_code"]
    loads = rows["model_loads"]
    if loads is not None:
        out.print(f"model loads: {loads['class']}, {loads['parameters']:,} parameters, "
                  f"{loads['quantizers']} quantizers (model code was run: --trust-code)")
    elif not code.get("rebuildable", True):  # --trust-code would not help: say so, not that it would
        out.print(f"model code: {code['source']} ({code['file']})")
    elif code["needs_trust_code"]:
        out.print(f"model code: {code['source']} ({code['file']}, sha256 {code['sha256']}); "
                  "export and verify run it only with --trust-code (inspect --trust-code checks that it loads)")


# --------------------------------------------------------------------------------------------- analyze


@app.command()
@guarded
def analyze(
    calibrated: CalibratedArg,
    data: DataOpt = None,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="Folder for report.html and analysis.json (default <checkpoint>.analysis).")] = None,
    num_samples: Annotated[int, typer.Option("--num-samples", help="Samples the sensitivity passes use (two passes per quantizer); statistics use all the data.")] = 64,
    batch_size: BatchSizeOpt = None,
    as_json: JsonOpt = False,
    trust_code: TrustCodeOpt = False,
    mean: MeanOpt = None,
    std: StdOpt = None,
) -> None:
    """Rank quantizers by sensitivity, with statistics and plots: an HTML report and JSON."""
    from quantcli.analyze import analyze as run_analysis
    from quantcli.checkpoint import load_calibrated
    from quantcli.data import DataOptions
    from quantcli.files import write_together
    from quantcli.report_html import render

    out_dir = _analysis_folder(out_dir or Path(f"{calibrated.with_suffix('').name}.analysis"),
                               [("the checkpoint", calibrated), ("--data", data)])
    ckpt = load_calibrated(calibrated, trust_code=trust_code)
    _analysis_folder(out_dir, [("the model's file", ckpt.spec.path)])
    batches = _checkpoint_inputs(ckpt, data, batch_size, None, DataOptions(mean=mean, std=std))
    if batches is None:
        batches = ckpt.evaluation_batches() or [ckpt.example]
    with _progress(100, "analyzing", not as_json) as advance:
        rep = run_analysis(ckpt, batches, sample_samples=num_samples,
                           progress=None if advance is None else (lambda stage, k, n: advance(int(99 * k / n))))
    d = rep.to_dict()
    write_together(out_dir, {"analysis.json": json.dumps(d, indent=1) + "\n", "report.html": render(d)})
    html_path, json_path = out_dir / "report.html", out_dir / "analysis.json"
    if as_json:
        _print_json({**d, "report": str(html_path), "json": str(json_path)})
    else:
        render_analyze(d, calibrated, html_path, json_path)


def _analysis_folder(out_dir: Path, inputs) -> Path:
    """``--out``, checked before the analysis runs: a writable folder (existing or not) in an existing
    directory, whose report files are none of the files read."""
    from quantcli.errors import QuantCliError
    from quantcli.files import writable_directory

    if out_dir.exists() and not out_dir.is_dir():
        raise QuantCliError(f"--out {out_dir} is a file; give a folder")
    writable_directory(out_dir / "report.html" if out_dir.is_dir() else out_dir)
    for name in ("report.html", "analysis.json"):
        _refuse_inputs(out_dir / name, inputs, "--out")
    return out_dir


def render_analyze(d: dict, calibrated: Path, html_path: Path, json_path: Path) -> None:
    """The 20 most sensitive quantizers, with each amax method's amax, the time, the files written."""
    ov = d["overall"]
    rows = ((str(r["rank"]), r["quantizer"], _fmt(r["only_enabled"]["cosine"]), _fmt(r["only_enabled"]["snr_db"]),
             _fmt((r["only_disabled"] or {}).get("cosine")), _fmt(r["outlier_ratio"]), _fmt(r["amax"]),
             *(_fmt((r["method_amax"] or {}).get(m)) for m in AMAX_METHODS))
            for r in d["quantizers"][:20])
    out.print(_table(f"quantcli analyze {calibrated}: {d['num_samples']} samples, sensitivity on "
                     f"{d['sensitivity_samples']}; all on: cosine {_fmt(ov['cosine'])}, SNR {_fmt(ov['snr_db'])} dB",
                     ("rank", "quantizer", "cos only on", "SNR only on", "cos only off", "outlier ratio", "amax",
                      *AMAX_METHODS), rows))
    if len(d["quantizers"]) > 20:
        out.print(f"... {len(d['quantizers']) - 20} more in the report")
    sec = d["seconds"]
    out.print(f"time {sec['total']:.2f} s (statistics {sec['statistics']:.2f} s, sensitivity {sec['sensitivity']:.2f} s, "
              f"{sec['passes']} forward passes)")
    out.print(f"written {html_path} and {json_path}")


# --------------------------------------------------------------------------------------------- entry point

#: options whose value may be left out, and the value they then take (typer has no optional-value options)
OPTIONAL_VALUES = {"--smoothquant": "0.5"}


def optional_values(args: list[str]) -> list[str]:
    """Give ``--smoothquant`` its default value where it is followed by nothing, another option or a word that
    is not a number (``calibrate M --smoothquant`` == ``calibrate M --smoothquant 0.5``)."""
    completed = []
    for i, a in enumerate(args):
        completed.append(a)
        if a in OPTIONAL_VALUES:
            nxt = args[i + 1] if i + 1 < len(args) else None
            if nxt is None or not _is_number(nxt):
                completed.append(OPTIONAL_VALUES[a])
    return completed


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _on_signal(signum, _frame) -> None:
    """SIGINT/SIGTERM: remember which (exit 128 + signal) and unwind like Ctrl-C, so that every ``finally``
    removes its temporary files and the destination keeps its previous content."""
    global _signalled
    if _signalled is not None:
        return  # already unwinding: let the clean-up finish
    _signalled = 128 + signum
    raise KeyboardInterrupt


def _click_errors() -> tuple[type, type, type]:
    """``(UsageError, ClickException, Abort)`` of the click this typer uses (its vendored copy in recent typer,
    the click package in older ones), found from classes every typer exports."""
    by_name = {c.__name__: c for c in typer.BadParameter.__mro__}
    return by_name["UsageError"], by_name["ClickException"], typer.Abort


def _error_exit(message: str, code: int, argv: list[str], kind: str) -> None:
    """An error outside any command (usage, aborts, output failures): one line, JSON too with ``--json``."""
    if "--json" in argv:
        with contextlib.suppress(OSError):
            _print_json({"error": message, "exit_code": code, "kind": kind})
            sys.stdout.flush()
    with contextlib.suppress(OSError):
        print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def _run(argv: list[str]) -> int:
    usage_error, click_error, abort = _click_errors()
    try:
        code = app(args=optional_values(argv), prog_name="quantcli", standalone_mode=False)
        sys.stdout.flush()
    except usage_error as e:
        hint = f" (see: {e.ctx.command_path} --help)" if e.ctx is not None else ""
        if os.environ.get("RANK", "0") != "0":  # under torchrun every rank got the same arguments: rank 0 tells
            sys.exit(2)
        _error_exit(f"{e.format_message()}{hint}", 2, argv, "UsageError")
    except click_error as e:
        _error_exit(e.format_message(), e.exit_code, argv, type(e).__name__)
    except (abort, KeyboardInterrupt):
        _error_exit("interrupted" if (_signalled or 130) == 130 else "terminated", _signalled or 130, argv,
                    "Interrupted")
    except BrokenPipeError:  # `quantcli ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    except Exception as e:  # outside a command's guard: printing --help or output to a full disk
        if _signalled is not None:  # an interrupt some import turned into another error
            _error_exit("interrupted" if _signalled == 130 else "terminated", _signalled, argv, "Interrupted")
        if os.environ.get("QUANTCLI_DEBUG"):
            import traceback

            traceback.print_exc()
        _error_exit(_unexpected(e), 2, argv, type(e).__name__)
    return code if isinstance(code, int) else 0


def main() -> None:
    """Entry point: Click's usage errors become one line too (``error: ... (see: quantcli CMD --help)``)."""
    import signal

    # The working directory is on sys.path, so MODEL `mymodule:make` and a torch.save(model) file whose class is
    # defined beside it load; last (`python -m` puts it first): a file or folder in the working directory never
    # shadows an installed package (quantcli's own `sample_models`, `exporters` included).
    cwd = os.path.realpath(os.getcwd())
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.realpath(p) != cwd] + [os.getcwd()]
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    if not os.environ.get("QUANTCLI_DEBUG"):  # torch's C++ log lines (Gloo's errors): quantcli reports them itself
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    code = _run(sys.argv[1:])
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    except OSError as e:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        _error_exit(_unexpected(e), 2, [], type(e).__name__)
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
