"""The Typer application every command module registers on, and its root options (``--version``)."""

from __future__ import annotations

from typing import Annotated

import typer

from quantcli import __version__
from quantcli.cli import analyze, calibrate, export, generate, inspect, verify

app = typer.Typer(
    name="quantcli",
    help="Post-training quantization for PyTorch -> ONNX Runtime / TensorRT: calibrate, export Q/DQ ONNX, "
    "verify.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"quantcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """quantcli: calibrate -> export --onnx -> verify."""


#: the commands, in ``quantcli --help``'s order (the pipeline's)
COMMANDS = (
    calibrate.calibrate,
    export.export,
    verify.verify,
    generate.generate,
    inspect.inspect,
    analyze.analyze,
)
for _command in COMMANDS:
    app.command()(_command)
