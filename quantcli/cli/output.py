"""Where commands print: the stdout and stderr consoles, JSON, progress bars and tables."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from typing import NoReturn

from rich.console import Console
from rich.table import Table


def exit_broken_pipe() -> NoReturn:
    """The reader went away (`quantcli verify ... | head`): exit 141 (128 + SIGPIPE), quietly, with stdout
    pointed at /dev/null so that nothing more is flushed into the closed pipe at exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    raise SystemExit(141)


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """As the entry point does (:func:`exit_broken_pipe`), not rich's exit 1, which a CI script would read
        as FAIL."""
        exit_broken_pipe()


out = _Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = _Console(stderr=True, highlight=False, soft_wrap=True)


def json_text(data, indent: int = 2) -> str:
    """Strict JSON: a non-finite float (an SNR of a quantizer that adds no error is ``inf``) is written as the
    string ``"inf"``, ``"-inf"`` or ``"nan"``, not as the ``Infinity`` that JSON parsers other than Python's
    refuse."""

    def strict(v):
        if isinstance(v, float) and not math.isfinite(v):
            return "nan" if v != v else ("inf" if v > 0 else "-inf")
        if isinstance(v, dict):
            return {k: strict(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [strict(x) for x in v]
        return v

    return json.dumps(strict(data), indent=indent, default=str, allow_nan=False)


#: whether this run's one JSON document (its result, or its error) has gone to stdout
_json_written = False


def print_json(data) -> None:
    """``data`` as this run's JSON document on stdout. A command writes one, last: a signal after it is not an
    interrupt (:func:`json_written`), so stdout never holds a second document."""
    global _json_written
    text = json_text(data) + "\n"
    _json_written = True
    sys.stdout.write(text)


def new_document() -> None:
    """A command starts: no JSON document written yet (the tests run many commands in one process)."""
    global _json_written
    _json_written = False


def json_written() -> bool:
    """Whether :func:`print_json` wrote this run's document: a Ctrl-C or SIGTERM that lands after it (a CI job
    cancelled as the command finished) is ignored, and the run exits as the document says."""
    return _json_written


@contextlib.contextmanager
def progress(total: int, label: str, enabled: bool):
    """A Rich progress bar on a TTY; yields its advance callback (``advance(i)``: item ``i`` done), or
    ``None`` where there is no bar."""
    if not enabled or not err.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err, transient=True
    )
    task = bar.add_task(label, total=total)
    with bar:
        yield lambda i: bar.update(task, completed=i + 1)


def fmt(v) -> str:
    """A number as a table shows it: 6 significant digits, ``inf``, ``-`` for none."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return "inf" if v == float("inf") else f"{v:.6g}"
    return str(v)


def table(title: str, columns: tuple[str, ...], rows) -> Table:
    t = Table(title=title)
    for col in columns:
        t.add_column(col)
    for r in rows:
        t.add_row(*r)
    return t


def key_value_table(title: str, rows) -> Table:
    t = Table(title=title, show_header=False)
    for r in rows:
        t.add_row(*r)
    return t
