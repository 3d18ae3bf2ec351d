"""Options several commands take with one meaning, declared once.

Single options are ``Annotated`` aliases (``DataOpt``, ``JsonOpt``...). Options that belong together are an
:class:`OptionGroup` (:data:`PREPROCESSING`, :data:`THRESHOLDS`): the group adds its options to each command
that takes it, validates them, and hands the command the one object it builds from them, by keyword. Options
that share only a name (``--out``, ``--min-cosine``, ``--provider``, analyze's ``--num-samples``, inspect's
``--trust-code``) mean something else in each command and are declared where they are used. Defaults come from
:mod:`quantcli.defaults`, the library's, so ``--help`` shows what the library does.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from calibrators.methods import CALIBRATION_METHODS
from quantcli import defaults
from quantcli.quant import cpu as cpu_kinds

# --------------------------------------------------------------------------------------------- choices

#: calibrate --method: an amax method for every quantizer, or auto
Method = Enum("Method", {m: m for m in CALIBRATION_METHODS}, type=str)


class ComputeDtype(str, Enum):
    """calibrate --dtype: what the model runs in while its activations are observed."""

    model = "model"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


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


#: --cpu: the CPU a graph is made for / judged on (quantcli.quant.cpu)
Cpu = Enum("Cpu", {k: k for k in cpu_kinds.CHOICES}, type=str)


# --------------------------------------------------------------------------------------------- single options

CalibratedArg = Annotated[Path, typer.Argument(help="Calibrated checkpoint written by `quantcli calibrate`.")]
DataOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--data",
        help="Inputs: .npz, .npy, .pt, or a directory of them; .txt/.jsonl text; a folder of JPEG/PNG "
        "images. Default: a sample model's own data (verify, analyze: its held-out set, else the "
        "checkpoint's example batch).",
    ),
]
BatchSizeOpt = Annotated[
    Optional[int],
    typer.Option(
        "--batch-size",
        min=1,
        help=f"Re-batch whole arrays into batches of N (default {defaults.BATCH_SIZE}).",
    ),
]
NumSamplesOpt = Annotated[Optional[int], typer.Option("--num-samples", min=1, help="Use at most N samples.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print as JSON.")]
CpuOpt = Annotated[
    Optional[Cpu],
    typer.Option(
        "--cpu",
        help="The CPU the graph will run on: auto (the kind $QUANTCLI_CPU names if set, else this "
        "machine), x86-avx2 (x86 without VNNI: uint8 x int8 kernels can saturate), x86-vnni, arm64, or any "
        "(a fleet of several kinds).",
    ),
]
TrustCodeOpt = Annotated[
    bool,
    typer.Option(
        "--trust-code",
        help="Run model code stored in the checkpoint (a factory file's source when the file is not on disk "
        "unchanged, or a pickled whole module) or a module it names that is not from the installed "
        "distribution recorded at calibration. Only for checkpoints you trust.",
    ),
]


# --------------------------------------------------------------------------------------------- groups


@dataclass(frozen=True)
class OptionGroup:
    """Options that belong together. ``@GROUP.add`` on a command replaces its parameter named ``name`` by the
    group's options (in ``--help`` where that parameter stood) and calls the command with ``build(**values)``
    there, the values passed by keyword."""

    name: str
    options: dict[str, tuple[Any, Any]]  # parameter name -> (Annotated type with its typer.Option, default)
    build: Callable[..., Any]

    def add(self, command: Callable) -> Callable:
        signature = inspect.signature(command, eval_str=True)
        if self.name not in signature.parameters:
            raise TypeError(f"{command.__name__} has no parameter {self.name!r} for the option group")
        params: list[inspect.Parameter] = []
        for p in signature.parameters.values():
            if p.name != self.name:
                params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY))
                continue
            params += [
                inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=a, default=d)
                for n, (a, d) in self.options.items()
            ]

        @functools.wraps(command)
        def run(**kwargs):
            values = {n: kwargs.pop(n) for n in self.options}
            return command(**kwargs, **{self.name: self.build(**values)})

        run.__signature__ = signature.replace(parameters=params)
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run


def _data_options(**values):
    from quantcli.inputs.data import DataOptions

    return DataOptions(**values)


#: how text files and image folders become tensors (quantcli.inputs.data.DataOptions); verify and analyze
#: repeat calibration's unless told otherwise
PREPROCESSING = OptionGroup(
    "preprocessing",
    {
        "tokenizer": (
            Annotated[
                Optional[Path],
                typer.Option(
                    "--tokenizer",
                    help="Text --data: tokenizer folder (default: the model folder; verify: the one "
                    "calibration stored, else the model folder).",
                ),
            ],
            None,
        ),
        "max_length": (
            Annotated[
                Optional[int],
                typer.Option(
                    "--max-length",
                    help=f"Text --data: at most N tokens per example (default {defaults.MAX_LENGTH}; verify: "
                    "calibration's, and for a decode graph at least 128).",
                ),
            ],
            None,
        ),
        "image_size": (
            Annotated[
                Optional[str],
                typer.Option(
                    "--image-size",
                    help="Image --data: N or HxW pixels (default: preprocessor_config.json, else 224; "
                    "verify: calibration's).",
                ),
            ],
            None,
        ),
        "mean": (
            Annotated[
                Optional[str],
                typer.Option(
                    "--mean",
                    help="Image --data: per-channel mean, e.g. 0.485,0.456,0.406 (default: "
                    "preprocessor_config.json, else ImageNet's; verify: calibration's).",
                ),
            ],
            None,
        ),
        "std": (
            Annotated[
                Optional[str],
                typer.Option(
                    "--std",
                    help="Image --data: per-channel std (default: preprocessor_config.json, else ImageNet's; "
                    "verify: calibration's).",
                ),
            ],
            None,
        ),
    },
    _data_options,
)


def _thresholds(**given: Optional[float]) -> dict[str, float]:
    """verify_onnx's threshold arguments, by keyword: the ratios and differences must be >= 0; the optional
    checks left out are left out."""
    from quantcli.errors import QuantCliError

    for name in ("max_abs_diff", "max_rms_ratio", "max_deploy_ratio"):
        if given[name] is not None and not given[name] >= 0:
            raise QuantCliError(f"--{name.replace('_', '-')} must be a number >= 0, got {given[name]}")
    if given["min_cosine"] is not None or given["min_snr"] is not None:
        from quantcli.calibration.mixed_precision import check_target

        check_target(given["min_cosine"], given["min_snr"])  # as calibrate's: a cosine is in [-1, 1]
    return {k: v for k, v in given.items() if v is not None}


#: verify's pass/fail thresholds
THRESHOLDS = OptionGroup(
    "thresholds",
    {
        "max_abs_diff": (
            Annotated[
                Optional[float],
                typer.Option(
                    "--max-abs-diff",
                    help="Fidelity, optional: largest |onnxruntime - fake-quant| allowed per output, in the "
                    "output's units (optimizations off).",
                ),
            ],
            None,
        ),
        "max_rms_ratio": (
            Annotated[
                float,
                typer.Option(
                    "--max-rms-ratio",
                    help="Fidelity: largest RMS(onnxruntime - fake-quant) / RMS(fake-quant - float) allowed "
                    "per output, optimizations off (a gross bound; docs/verify-criteria.md).",
                ),
            ],
            defaults.MAX_RMS_RATIO,
        ),
        "max_deploy_ratio": (
            Annotated[
                float,
                typer.Option(
                    "--max-deploy-ratio",
                    help="Deployment: largest RMS(deployed - fake-quant) / RMS(fake-quant - float) allowed "
                    "per output for the session a user ships (default options, this machine), and for the "
                    "emulated kernels of a CPU that can saturate (--cpu); docs/verify-criteria.md.",
                ),
            ],
            defaults.MAX_DEPLOY_RATIO,
        ),
        "min_cosine": (
            Annotated[
                Optional[float],
                typer.Option(
                    "--min-cosine",
                    help="Quality of the deployed session: smallest cosine similarity to the float model "
                    "allowed.",
                ),
            ],
            None,
        ),
        "min_snr": (
            Annotated[
                Optional[float],
                typer.Option(
                    "--min-snr",
                    help="Quality of the deployed session: smallest SNR (dB) against the float model "
                    "allowed.",
                ),
            ],
            None,
        ),
    },
    _thresholds,
)
