"""The ``quantcli`` command line: parses, calls library functions, prints. Nothing else lives here.

Library code raises :class:`quantcli.errors.QuantCliError`; this module turns it into a one-line error and
exit code 2. Numerical check failures are exit code 1.
"""

from __future__ import annotations

import sys

import typer

from quantcli import __version__

app = typer.Typer(
    name="quantcli",
    help="Post-training quantization for PyTorch -> ONNX Runtime / TensorRT: calibrate, export Q/DQ ONNX, verify.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"quantcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """quantcli: calibrate -> export --onnx -> verify."""


def main() -> None:
    app(prog_name="quantcli")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
