"""How a command ends: :func:`guarded` turns every error into one line and an exit code.

Library code raises :class:`quantcli.errors.QuantCliError`; here it becomes its first line on stderr and exit
2 (with ``--json`` also ``{"error", "exit_code", "kind"}`` on stdout). A failed numerical check (``verify``)
or a missed quality target (``calibrate --min-cosine``) is a command's own exit code 1. Ctrl-C is 130, SIGTERM
143. What the machine refuses (an ``OSError``: a full disk, a permission, a missing file; ``MemoryError``) is
exit 2 too, named. Any other exception is an internal error: a bug in quantcli or in a library it calls, not a
fault in the user's input, so it is exit 3 (:data:`INTERNAL_ERROR`) and its line says to report it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from dataclasses import dataclass

import typer

from quantcli.cli.output import err, json_written, new_document, print_json


@dataclass
class RunState:
    """What this process's run of a command knows beyond its arguments."""

    quiet: bool = False  # a torchrun rank other than 0: rank 0 reports for every rank
    signalled: int | None = None  # the exit code of the SIGINT/SIGTERM received (entry's handlers), else None


STATE = RunState()
INTERNAL_ERROR = 3  # an exception nothing in quantcli expected: a bug, not bad input (README, exit codes)


def fail(message: str, code: int = 2, as_json: bool = False, kind: str = "QuantCliError") -> None:
    """One line on stderr (with ``--json`` also ``{"error", "exit_code", "kind"}`` on stdout), then exit."""
    if STATE.quiet:
        raise typer.Exit(code)
    if as_json and not json_written():
        with contextlib.suppress(OSError):
            print_json({"error": message, "exit_code": code, "kind": kind})
    if err.is_terminal:
        err.print(f"[bold red]error:[/] {message}", markup=True, highlight=False)
    else:
        print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code)


def unexpected(e: BaseException) -> tuple[str, int]:
    """(the one line, the exit code) for an exception no library code turned into a QuantCliError.

    What the machine refused (a full disk, named as such; any other ``OSError``; ``MemoryError``) is exit 2,
    as bad input is: the user can act on it. Anything else is an internal error, exit
    :data:`INTERNAL_ERROR`, said to be one, with its type and first line."""
    from quantcli.errors import first_line
    from quantcli.files import no_space

    if no_space(e):
        where = f" writing {e.filename}" if isinstance(e, OSError) and e.filename else ""
        return (
            f"no space left on device{where}; free some space or write the output elsewhere "
            "(nothing was written)"
        ), 2
    message = first_line(e) if str(e).strip() else ""
    if isinstance(e, (OSError, MemoryError)):
        return f"{type(e).__name__}: {message} (set QUANTCLI_DEBUG=1 for a traceback)", 2
    return (
        f"internal error, not a problem with your input: {type(e).__name__}: {message} (a bug in quantcli "
        "or a library it calls; please report it with the traceback QUANTCLI_DEBUG=1 prints)"
    ), INTERNAL_ERROR


def interrupted_text(code: int) -> str:
    return "interrupted" if code == 130 else "terminated"


def guarded(command):
    """A command's error guard. The command returns its exit code (``None``: 0). A QuantCliError becomes its
    first line on stderr and exit 2; Ctrl-C exit 130 (SIGTERM 143), whatever it interrupted (an import that
    turns the interrupt into an ImportError included); anything unexpected one line naming it (exit 2 for
    what the machine refused, 3 for an internal error: :func:`unexpected`), with no traceback unless
    QUANTCLI_DEBUG is set. With ``--json`` the error is also a JSON object on stdout."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        from quantcli.errors import QuantCliError, first_line

        as_json = bool(kwargs.get("as_json"))
        new_document()
        try:
            with warnings.catch_warnings():  # a library's warnings are not the tool's: stderr stays one line
                if not os.environ.get("QUANTCLI_DEBUG"):
                    warnings.simplefilter("ignore")
                code = command(*args, **kwargs)
        except typer.Exit:
            raise
        except BaseException as e:
            if STATE.signalled is not None or isinstance(e, KeyboardInterrupt):
                code = STATE.signalled or 130
                fail(interrupted_text(code), code, as_json, "Interrupted")
            if isinstance(e, QuantCliError):
                fail(first_line(e), 2, as_json, type(e).__name__)
            if not isinstance(e, Exception) or os.environ.get("QUANTCLI_DEBUG"):
                raise
            fail(*unexpected(e), as_json, type(e).__name__)
        if STATE.signalled is not None:  # the interrupt was swallowed (raised in a callback) and the command
            # went on: it wrote nothing (quantcli.files.request_stop), and exits as interrupted
            fail(interrupted_text(STATE.signalled), STATE.signalled, as_json, "Interrupted")
        if code is not None:
            raise typer.Exit(code)

    return run
