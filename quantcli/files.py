"""Writing output files: a destination checked before any work is done, and no half-written file on failure.

Every file quantcli writes (the calibrated checkpoint, the ONNX graph and its external data, JSON and HTML
reports) is written under a temporary name in the destination's own directory and renamed over the
destination with :func:`os.replace`, which is atomic on one file system: a reader sees the old file or the
new one, never a part, and an error or interrupt leaves the old file (or nothing) in place.

This module imports nothing of quantcli but :mod:`quantcli.errors`, so every layer can use it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from quantcli.errors import QuantCliError


def writable_directory(path: str | Path, error: type[QuantCliError] = QuantCliError) -> Path:
    """The directory ``path`` is written in (``.`` for a bare file name), after checking it can be.

    Raises ``error`` (a :class:`QuantCliError` subclass, so the caller's command reports its own kind) when
    ``path`` is a directory, or its directory does not exist or is not writable.
    """
    path = Path(path)
    if path.is_dir():
        raise error(f"cannot write {path}: it is a directory; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise error(f"cannot write {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise error(f"cannot write {path}: directory {parent} is not writable")
    return parent


def atomic_write(path: str | Path, write: Callable[[str], object],
                 error: type[QuantCliError] = QuantCliError) -> None:
    """Call ``write(tmp_path)`` then rename over ``path``: no half-written file on failure.

    ``tmp_path`` is a fresh file beside ``path`` (same directory, so the rename is atomic); whatever
    ``write`` raises, it is removed and the exception propagates. The destination is checked first
    (:func:`writable_directory`, raising ``error``).
    """
    path = Path(path)
    parent = writable_directory(path, error)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def staging_directory(directory: str | Path, prefix: str = ".quantcli-") -> Iterator[Path]:
    """A fresh hidden directory inside ``directory``, removed with whatever is left in it when the block ends.

    For outputs of several files (an ONNX graph and its external data): write them here under their final
    names, then :func:`os.replace` each into ``directory`` (same file system, so each rename is atomic). An
    error before the renames leaves nothing behind.
    """
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=directory))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)
