"""The docs are true: their examples run, the command reference is the CLI's own --help, and every link
resolves.

Examples: every ```bash block of docs/*.md runs, line by line, through the real Typer app in this process (one
temporary folder per page, so a later block uses an earlier block's files), and every ```python block is
executed there too; a block that should not run says so, and why, in an HTML comment on the line before it:
``<!-- example: not run (REASON) -->``. A ```yaml (or other) block after ``<!-- example: file NAME -->`` is
written to NAME in that folder first, for the commands after it. Output belongs in ```text or ```console
blocks.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
NOT_RUN = re.compile(r"<!-- example: not run \((.+)\) -->")
FILE = re.compile(r"<!-- example: file (\S+)")
FENCE = re.compile(r"^```(\S*)\s*$")


def blocks(path: Path) -> list[dict]:
    """Fenced blocks in order: ``{"lang", "code", "line", "skip": reason or None, "file": name or None}``."""
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        before = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
        j = i + 1
        while not lines[j].startswith("```"):
            j += 1
        skip, file = NOT_RUN.search(before), FILE.search(before)
        out.append(
            {
                "lang": m.group(1),
                "code": "\n".join(lines[i + 1 : j]) + "\n",
                "line": i + 1,
                "skip": skip and skip.group(1),
                "file": file and file.group(1),
            }
        )
        i = j + 1
    return out


def commands(code: str) -> list[list[str]]:
    """A bash block's commands as argv lists: comments dropped, backslash continuations joined."""
    return [
        argv
        for argv in (shlex.split(line, comments=True) for line in code.replace("\\\n", " ").splitlines())
        if argv
    ]


def _runnable(path: Path) -> list[dict]:
    return [b for b in blocks(path) if not b["skip"] and (b["lang"] in ("bash", "python") or b["file"])]


def test_every_bash_block_is_quantcli_or_says_why_it_is_not_run():
    """A shell block that is not quantcli commands (torchrun, a benchmark, a loop) carries its reason not to
    run."""
    for path in DOCS:
        for b in blocks(path):
            if b["lang"] in ("bash", "sh", "shell") and not b["skip"]:
                assert b["lang"] == "bash", f"{path.name}:{b['line']}: use ```bash"
                for argv in commands(b["code"]):
                    assert argv[0] == "quantcli" and not {"|", ">", "&&", ";"} & set(argv), (
                        f"{path.name}:{b['line']}: {shlex.join(argv)!r} is not a plain quantcli command: "
                        f"make it one, "
                        "or mark the block <!-- example: not run (why; what covers it) -->"
                    )
            if b["skip"]:
                assert len(b["skip"].strip()) > 10, f"{path.name}:{b['line']}: say why the example is not run"


@pytest.mark.parametrize("path", [p for p in DOCS if _runnable(p)], ids=lambda p: p.name)
def test_doc_examples_run(path, tmp_path, monkeypatch):
    from tests.helpers import cli

    monkeypatch.chdir(tmp_path)
    for b in _runnable(path):
        where = f"{path.name}:{b['line']}"
        if b["file"]:
            (tmp_path / b["file"]).write_text(b["code"])
        elif b["lang"] == "bash":
            for argv in commands(b["code"]):
                r = cli(*argv[1:])
                assert r.exit_code == 0, (where, shlex.join(argv), r.output)
        else:
            exec(compile(b["code"], where, "exec"), {"__name__": "__doc_example__"})
    if path.name == "python-api.md":
        assert (tmp_path / "digits.onnx").is_file()
    if path.name == "commands.md":
        assert (tmp_path / "text_encoder.calib.analysis" / "report.html").is_file()


def _generator():
    spec = importlib.util.spec_from_file_location("generate_commands", ROOT / "docs" / "generate_commands.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_the_current_help():
    gen = _generator()
    stale = gen.stale_sections(gen.DOC.read_text(), gen.sections())
    assert not stale, f"stale sections {stale}: run python docs/generate_commands.py"


def test_generator_check_names_a_stale_section(tmp_path, monkeypatch, capsys):
    gen = _generator()
    doc = tmp_path / "cli-reference.md"
    doc.write_text(gen.DOC.read_text().replace("--num-bins <int>", "--num-bins <float>", 1))
    monkeypatch.setattr(gen, "DOC", doc)
    assert gen.main(["--check"]) == 1
    assert "'quantcli calibrate --help'" in capsys.readouterr().err
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0  # regenerated in place


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_relative_links_resolve():
    """Every relative link of README.md and docs/*.md names a file that exists, and a heading of it if it has
    #."""
    broken = []
    for path in [ROOT / "README.md", *DOCS]:
        text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{path.name}: {target} (no such heading)")
    assert not broken, broken
