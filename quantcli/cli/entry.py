"""The ``quantcli`` entry point: every command registered on the app (in ``--help``'s order), Click's own
errors (usage, aborts) as one line too, signals, a closed pipe, and the working directory on ``sys.path``."""

from __future__ import annotations

import contextlib
import os
import sys

import typer

from quantcli.cli.application import app
from quantcli.cli.guard import STATE, unexpected
from quantcli.cli.output import exit_broken_pipe, json_written, new_document, print_json
from quantcli.files import request_stop

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
    if STATE.signalled is not None or json_written():
        return  # already unwinding: let the clean-up finish; or the result is written: exit as it says
    STATE.signalled = 128 + signum
    request_stop()  # should the KeyboardInterrupt be swallowed (raised in a callback), no output is written
    raise KeyboardInterrupt


def _click_errors() -> tuple[type, type, type]:
    """``(UsageError, ClickException, Abort)`` of the click this typer uses (its vendored copy in recent
    typer, the click package in older ones), found from classes every typer exports."""
    by_name = {c.__name__: c for c in typer.BadParameter.__mro__}
    return by_name["UsageError"], by_name["ClickException"], typer.Abort


def _error_exit(message: str, code: int, argv: list[str], kind: str) -> None:
    """An error outside any command (usage, aborts, output failures): one line, JSON too with ``--json``."""
    if "--json" in argv and not json_written():
        with contextlib.suppress(OSError):
            print_json({"error": message, "exit_code": code, "kind": kind})
            sys.stdout.flush()
    with contextlib.suppress(OSError):
        print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def _run(argv: list[str]) -> int:
    usage_error, click_error, abort = _click_errors()
    new_document()
    try:
        code = app(args=optional_values(argv), prog_name="quantcli", standalone_mode=False)
        sys.stdout.flush()
    except usage_error as e:
        hint = f" (see: {e.ctx.command_path} --help)" if e.ctx is not None else ""
        # under torchrun every rank got the same arguments: rank 0 tells
        if os.environ.get("RANK", "0") != "0":
            sys.exit(2)
        _error_exit(f"{e.format_message()}{hint}", 2, argv, "UsageError")
    except click_error as e:
        _error_exit(e.format_message(), e.exit_code, argv, type(e).__name__)
    except (abort, KeyboardInterrupt):
        _error_exit(
            "interrupted" if (STATE.signalled or 130) == 130 else "terminated",
            STATE.signalled or 130,
            argv,
            "Interrupted",
        )
    except BrokenPipeError:  # `quantcli ... | head`: the reader has what it wanted
        exit_broken_pipe()
    except Exception as e:  # outside a command's guard: printing --help or output to a full disk
        if STATE.signalled is not None:  # an interrupt some import turned into another error
            _error_exit(
                "interrupted" if STATE.signalled == 130 else "terminated",
                STATE.signalled,
                argv,
                "Interrupted",
            )
        if os.environ.get("QUANTCLI_DEBUG"):
            import traceback

            traceback.print_exc()
        _error_exit(*unexpected(e), argv, type(e).__name__)
    return code if isinstance(code, int) else 0


def main() -> None:
    """Entry point: Click's usage errors become one line too (``error: ... (see: quantcli CMD --help)``)."""
    import signal

    # The working directory is on sys.path, so MODEL `mymodule:make` and a torch.save(model) file whose class
    # is defined beside it load; last (`python -m` puts it first): a file or folder in the working directory
    # never shadows an installed package (quantcli's own `sample_models`, `exporters` included).
    cwd = os.path.realpath(os.getcwd())
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.realpath(p) != cwd] + [os.getcwd()]
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    # torch's C++ log lines (Gloo's errors): quantcli reports them itself
    if not os.environ.get("QUANTCLI_DEBUG"):
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    code = _run(sys.argv[1:])
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        exit_broken_pipe()
    except OSError as e:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        _error_exit(*unexpected(e), [], type(e).__name__)
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
