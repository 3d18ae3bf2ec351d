"""Typed exceptions. Library code raises these; only ``quantcli.cli`` turns them into exit codes.

Every message is one line that says what is wrong and, where there is one, how to fix it.
"""

from __future__ import annotations


def first_line(e: BaseException, limit: int | None = None) -> str:
    """The first non-blank line of ``str(e)`` (at most ``limit`` characters), or the exception's type name
    when the message is empty: how a foreign exception is quoted inside a one-line error."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return line[:limit] if limit is not None else line


def few(names: list[str], n: int = 5) -> str:
    """The first ``n`` of ``names``, comma-separated, and how many more: how a one-line error lists them."""
    more = f" (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def flags_apply(flags: list[str], sep: str = ", ") -> str:
    """``--x applies`` or ``--x, --y apply``: the subject and verb of a refusal of options that would do
    nothing."""
    return f"{sep.join(flags)} {'applies' if len(flags) == 1 else 'apply'}"


def whole_line(e: BaseException, limit: int = 1000) -> str:
    """All of ``str(e)`` on one line: its lines joined with spaces, terminal colour codes removed, runs of
    spaces collapsed; longer than ``limit`` characters, cut there with `` ...``. How a foreign message whose
    point is on a later line (onnx's checker names the node on its second line) is quoted in a one-line
    error."""
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    text = " ".join(text.split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 4].rstrip() + " ..."


class QuantCliError(Exception):
    """Base class: bad usage or bad input (exit code 2 on the command line)."""

    exit_code = 2


class ModelLoadError(QuantCliError):
    """The MODEL spec, its factory or its weights could not be turned into an ``nn.Module``."""


class DataError(QuantCliError):
    """Calibration or verification data is missing, malformed, or does not fit ``forward``."""


class ConfigError(QuantCliError):
    """A quant config (preset, YAML/JSON file, or rules) is invalid."""


class CalibrationError(QuantCliError):
    """Calibration could not produce an amax (non-finite activations, no data, ...)."""


class CheckpointError(QuantCliError):
    """A file is not a quantcli calibrated checkpoint, or is damaged."""


class ExportError(QuantCliError):
    """The model cannot be exported as asked (opset too low, amax missing, unwritable path, ...)."""


class VerifyError(QuantCliError):
    """Verification could not be carried out (corrupt ONNX, mismatched inputs, missing provider, ...)."""


class GraphRunError(VerifyError):
    """The graph loaded, and one of its nodes failed at run time on inputs the model ran on: the graph
    computes something the model does not (verify reports it as the failed check ``graph.runs``, exit 1)."""

    check = "graph.runs"


class GraphOutputError(GraphRunError):
    """The graph loaded and ran, but its outputs are not the model's (another count or shape): verify reports
    it as the failed check ``graph.outputs``, exit 1."""

    check = "graph.outputs"


class UntrustedCodeError(QuantCliError):
    """Building the model would run code that came inside a checkpoint, and the user did not allow it
    (``--trust-code`` / ``trust_code=True``). Raised before anything is executed."""


class MissingExtraError(QuantCliError):
    """An optional feature needs a package from an optional extra (``pip install 'quantcli[extra]'``)."""


class TransformationError(QuantCliError):
    """A transformation quantcli made to the float model (a placement rewrite, SmoothQuant) changed what a
    module computes, and could not be undone: the message names the first module whose output moved."""
