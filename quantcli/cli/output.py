"""Where commands print: the stdout and stderr consoles, JSON, progress bars and tables."""

from __future__ import annotations

import contextlib
import json
import os
import sys

from rich.console import Console
from rich.table import Table


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """The reader went away (`quantcli verify ... | head`): exit 141 as the entry point does for a broken
        pipe (128 + SIGPIPE), not rich's 1, which a CI script would read as FAIL."""
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(141)


out = _Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = _Console(stderr=True, highlight=False, soft_wrap=True)


def print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


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
