"""Writing output files: a destination checked before any work is done, and no half-written file on failure.

Every file quantcli writes (the calibrated checkpoint, the ONNX graph and its external data, JSON and HTML
reports) is written under a temporary name in the destination's own directory and renamed over the
destination with :func:`os.replace`, which is atomic on one file system: a reader sees the old file or the
new one, never a part, and an error or interrupt leaves the old file (or nothing) in place.

Temporary names carry the writing host and process id (``.x.calib.pt.<host>-<pid>-<random>.tmp``,
``.quantcli-export-<host>-<pid>-<random>/``): an interrupt removes them (SIGTERM included, see
``quantcli.cli``), and one left by a process that no longer runs (killed with SIGKILL, a power cut) is removed
by the next write to the same place. Files get the mode the umask gives (0644 with the usual 022), like any
other tool's.

This module imports nothing of quantcli but :mod:`quantcli.errors`, so every layer can use it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from quantcli.errors import QuantCliError

_OWNER = re.compile(r"\.(\w+)-(\d+)-[^.]*\.tmp$|^\.quantcli-(?:[a-z]+-)?(\w+)-(\d+)-")

#: whether a signal asked the process to stop (the CLI's SIGINT/SIGTERM handler, :func:`request_stop`)
_stopping = False


def request_stop() -> None:
    """From now on no output is renamed into place: :func:`commit` raises ``KeyboardInterrupt`` instead. The
    CLI's signal handler raises one itself, but Python ignores an exception raised while it runs a callback
    (a weakref's, an import lock's): the command would then finish and write its output, as if never
    interrupted."""
    global _stopping
    _stopping = True


def check_stop() -> None:
    """Raise ``KeyboardInterrupt`` if the process was asked to stop (:func:`request_stop`): called before
    the renames that put outputs into place."""
    if _stopping:
        raise KeyboardInterrupt


def commit(src: str | Path, dst: str | Path) -> None:
    """:func:`os.replace` of a finished temporary output over its destination, unless the process was asked
    to stop (:func:`request_stop`)."""
    check_stop()
    os.replace(src, dst)


def _writer() -> str:
    """``<host>-<pid>``: who writes a temporary name (the host: a shared file system sees other hosts'
    files)."""
    host = re.sub(r"\W", "_", socket.gethostname()) or "host"
    return f"{host}-{os.getpid()}"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill(pid, 0) sends CTRL_C_EVENT there: assume alive, remove nothing
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(directory: Path, prefixes: Iterable[str]) -> list[Path]:
    """Remove this tool's temporary files and folders in ``directory`` whose names start with one of
    ``prefixes`` and whose writing process no longer runs; returns what was removed."""
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _OWNER.search(entry.name)
        if not m or not any(entry.name.startswith(p) for p in prefixes):
            continue
        host, pid = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        if f"{host}-{pid}" == _writer() or host != _writer().rsplit("-", 1)[0] or _alive(int(pid)):
            continue  # ours, another host's (its process cannot be checked from here), or still running
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def no_space(e: BaseException) -> bool:
    """Whether ``e`` says the disk is full: ENOSPC/EDQUOT, or torch.save's errno-less ``file write
    failed``, or its zip writer's check after a short write (``unexpected pos``, measured on a full tmpfs)."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        s in text for s in ("file write failed", "No space left", "unexpected pos")
    )


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether ``a`` and ``b`` name one file (symlinks resolved, hard links included)."""
    try:
        if os.path.realpath(a) == os.path.realpath(b):
            return True
        return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
    except OSError:
        return False


def refuse_overwriting_inputs(
    out: str | Path,
    inputs: Iterable[tuple[str, str | Path | None]],
    option: str,
    error: type[QuantCliError] = QuantCliError,
) -> None:
    """Raise ``error`` when the output ``out`` is one of the files the command reads.

    ``inputs`` are ``(what, path)`` pairs (``None`` paths are skipped); a folder input (``--data images/``)
    also covers the files already in it."""
    for what, path in inputs:
        if path is None:
            continue
        inside = (
            Path(path).is_dir()
            and Path(out).exists()
            and Path(os.path.realpath(out)).is_relative_to(os.path.realpath(path))
        )
        if same_file(out, path) or inside:
            raise error(
                f"{option} {out} is {what} ({path}) this command reads; writing it would destroy the "
                "input: give another output path"
            )


def readable_file(path: Path, what: str, suffix: str, wanted: str, error: type[QuantCliError]) -> None:
    """Raise ``error`` unless ``path`` is a file: ``{what} {path} does not exist``, or, for a directory, that
    it is one, with ``wanted`` and the ``*{suffix}`` files it holds (``pass the .calib.pt file that `quantcli
    calibrate` wrote (m.calib.pt is there)``)."""
    if path.is_dir():
        held = sorted(p.name for p in path.glob(f"*{suffix}"))
        there = ""
        if held:
            shown = ", ".join(held[:3]) + (" ..." if len(held) > 3 else "")
            there = f" ({shown} is there)" if len(held) == 1 else f" (there: {shown})"
        raise error(f"{what} {path} is a directory; pass {wanted}{there}")
    if not path.is_file():
        raise error(f"{what} {path} does not exist")


def writable_directory(path: str | Path, error: type[QuantCliError] = QuantCliError) -> Path:
    """The directory ``path`` is written in (``.`` for a bare file name), after checking it can be.

    Raises ``error`` (a :class:`QuantCliError` subclass, so the caller's command reports its own kind) when
    ``path`` is a directory, or its directory does not exist or is not writable.
    """
    path = Path(path)
    if path.is_dir():
        raise error(f"cannot write {path}: it is a directory; give a file name")
    # a device (/dev/full), a FIFO: renaming over it would replace it
    if path.exists() and not path.is_file():
        raise error(f"cannot write {path}: it is not a regular file; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise error(f"cannot write {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise error(f"cannot write {path}: directory {parent} is not writable")
    return parent


def atomic_write(
    path: str | Path, write: Callable[[str], object], error: type[QuantCliError] = QuantCliError
) -> None:
    """Call ``write(tmp_path)`` then rename over ``path``: no half-written file on failure.

    ``tmp_path`` is a fresh file beside ``path`` (same directory, so the rename is atomic); whatever
    ``write`` raises, it is removed and the exception propagates. The destination is checked first
    (:func:`writable_directory`, raising ``error``).
    """
    path = Path(path)
    parent = writable_directory(path, error)
    remove_stale(parent, [f".{path.name}."])
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{_writer()}-", suffix=".tmp", dir=parent)
    except OSError as e:  # a directory that says it is writable and takes no file (/proc, a full inode table)
        raise error(_uncreatable(path, parent, e)) from None
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600
        write(tmp)
        commit(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if no_space(e):
            raise error(disk_full_message(path)) from None
        raise


def _uncreatable(path: Path, parent: Path, e: OSError) -> str:
    if no_space(e):
        return disk_full_message(path)
    where = f"cannot write {path}: {parent}" if path != parent else f"cannot write in {parent}: it"
    return f"{where} takes no new file ({e.strerror or e}); write it elsewhere"


def disk_full_message(path: str | Path) -> str:
    """One line for a write that ran out of space: where, how much is free, what to do."""
    parent = Path(path).parent if str(Path(path).parent) else Path(".")
    try:
        free = f"{shutil.disk_usage(parent).free / 2**20:.0f} MiB free"
    except OSError:
        free = "free space unknown"
    return (
        f"cannot write {path}: no space left on device ({free} in {parent}); free some space or write "
        "it elsewhere (nothing was written)"
    )


@contextlib.contextmanager
def staging_directory(directory: str | Path, prefix: str = ".quantcli-") -> Iterator[Path]:
    """A fresh hidden directory inside ``directory``, removed with whatever is left in it when the block ends.

    For outputs of several files (an ONNX graph and its external data): write them here under their final
    names, then :func:`os.replace` each into ``directory`` (same file system, so each rename is atomic). An
    error before the renames leaves nothing behind.
    """
    remove_stale(Path(directory), [prefix])
    try:
        work = Path(tempfile.mkdtemp(prefix=f"{prefix}{_writer()}-", dir=directory))
    except OSError as e:
        raise QuantCliError(_uncreatable(Path(directory), Path(directory), e)) from None
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_together(
    folder: str | Path, files: dict[str, str], error: type[QuantCliError] = QuantCliError
) -> None:
    """Write text ``files`` (name -> content) into ``folder``: all of them or none.

    They are written in a staging folder beside ``folder``, which becomes ``folder`` (one rename) when it does
    not exist; else in one inside it, whose files are renamed into place (renames need no space). A failure
    leaves ``folder`` as it was. Text that UTF-8 cannot encode (a non-UTF-8 file name, as Python decodes it)
    is written with backslash escapes."""
    folder = Path(folder)
    parent = folder if folder.is_dir() else (folder.parent if str(folder.parent) else Path("."))
    with staging_directory(parent, prefix=".quantcli-out-") as work:
        try:
            for name, text in files.items():
                # a file name that is not UTF-8 (its bytes decoded as lone surrogates) is written escaped
                (work / name).write_text(text, encoding="utf-8", errors="backslashreplace")
        except OSError as e:
            if no_space(e):
                raise error(disk_full_message(folder / name)) from None
            raise
        if not folder.exists():
            os.chmod(work, 0o777 & ~_umask())  # mkdtemp makes 0700
            commit(work, folder)
            return
        check_stop()  # all of them or none
        for name in files:
            os.replace(work / name, folder / name)
