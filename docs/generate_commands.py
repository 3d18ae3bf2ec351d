"""Write each command's ``--help`` into docs/cli-reference.md, so that the reference and the CLI never
disagree.

    python docs/generate_commands.py          # rewrite the generated sections
    python docs/generate_commands.py --check  # exit 1, naming each stale section, if the doc differs

The help is rendered by click from the Typer app (``rich_markup_mode=None``: click's own plain formatter, no
Rich panels), at a fixed width of 100 columns and without colour, so the text does not depend on the terminal.
Each command's help sits between ``<!-- BEGIN GENERATED: quantcli CMD --help -->`` and ``<!-- END GENERATED
-->``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent / "cli-reference.md"
WIDTH = 100
BEGIN = "<!-- BEGIN GENERATED: {} -->"
END = "<!-- END GENERATED -->"

HEADER = """# Command reference

Every option of every command, exactly as `--help` prints it. The sections between the `BEGIN GENERATED`
and `END GENERATED` markers are written by `python docs/generate_commands.py` from the CLI itself
(tests/test_docs.py fails when they are stale). What the commands are for, when to use which option, and
examples: [commands.md](commands.md).
"""


def _help(command, info_name: str, parent=None):
    """(click Context, the help text with trailing spaces removed)."""
    import click

    ctx = click.Context(
        command,
        info_name=info_name,
        parent=parent,
        terminal_width=WIDTH,
        max_content_width=WIDTH,
        color=False,
    )
    return ctx, "\n".join(line.rstrip() for line in command.get_help(ctx).splitlines()).strip()


def sections() -> dict[str, str]:
    """``{"quantcli --help": text, "quantcli calibrate --help": text, ...}`` in the CLI's command order."""
    import typer.main

    from quantcli.cli import app

    root = typer.main.get_command(app)
    root_ctx, root_help = _help(root, "quantcli")
    out = {"quantcli --help": root_help}
    for name in root.list_commands(root_ctx):
        _, text = _help(root.get_command(root_ctx, name), name, parent=root_ctx)
        out[f"quantcli {name} --help"] = text
    return out


def render_section(key: str, text: str) -> str:
    return f"{BEGIN.format(key)}\n```text\n{text}\n```\n{END}"


def render_doc(current: dict[str, str]) -> str:
    parts = [HEADER]
    for key, text in current.items():
        title = key.removesuffix(" --help")
        parts.append(f"## `{title}`\n\n{render_section(key, text)}\n")
    return "\n".join(parts)


_SECTION = re.compile(r"<!-- BEGIN GENERATED: (.+?) -->\n(.*?)<!-- END GENERATED -->", re.S)


def stale_sections(doc: str, current: dict[str, str]) -> list[str]:
    """The keys whose generated section in ``doc`` differs from the CLI's help, is missing, or is not a
    command."""
    found = {m.group(1): m.group(0) for m in _SECTION.finditer(doc)}
    stale = [key for key, text in current.items() if found.get(key) != render_section(key, text)]
    stale += [key for key in found if key not in current]
    return stale


def main(argv: list[str]) -> int:
    current = sections()
    if "--check" in argv:
        doc = DOC.read_text() if DOC.exists() else ""
        stale = stale_sections(doc, current)
        for key in stale:
            print(
                f"{DOC.name}: section '{key}' differs from the CLI; run python docs/generate_commands.py",
                file=sys.stderr,
            )
        return 1 if stale else 0
    doc = DOC.read_text() if DOC.exists() else ""
    found = [m.group(1) for m in _SECTION.finditer(doc)]
    if found == list(current):  # the same commands in the same order: rewrite the sections in place
        doc = _SECTION.sub(lambda m: render_section(m.group(1), current[m.group(1)]), doc)
    else:  # a command added, removed or reordered: the whole page again
        doc = render_doc(current)
    DOC.write_text(doc)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
