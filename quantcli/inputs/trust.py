"""Consent before running code that came inside a checkpoint.

A calibrated checkpoint is data (``torch.load(weights_only=True)`` reads it), but rebuilding its model may
need
code: the factory file's source stored at calibration, or the pickled whole module. Like Hugging Face's
``trust_remote_code``, that code runs only with ``trust_code=True`` (``--trust-code``). Code the user already
has runs without it: a factory file present on disk with exactly the stored source (byte for byte), a sample
model, a Hugging Face class from the installed ``transformers``, and a ``package.module:factory`` whose
top-level package belongs to an installed distribution -- the one calibration recorded (name and version),
found outside the working directory. That is checked *before* anything is imported: a module beside the user
(``cwdmod:make``), a standard-library module or a changed distribution is imported only with ``trust_code``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from quantcli.errors import UntrustedCodeError


def sha256_hex(data: bytes | str) -> str:
    return hashlib.sha256(data.encode("utf-8") if isinstance(data, str) else data).hexdigest()


def require_trust(trust_code: bool, what: str, file: str | None, digest: str, origin: str | None) -> None:
    """Raise :class:`UntrustedCodeError` (one line naming the file and its sha256) unless ``trust_code``.

    ``what`` says what would run ("the factory source stored in the checkpoint, ..."), ``file`` the file the
    code came from, ``digest`` its sha256, ``origin`` the checkpoint it is stored in.
    """
    if trust_code:
        return
    where = f"{origin}: " if origin else ""
    raise UntrustedCodeError(
        f"{where}rebuilding the model would run code stored in the checkpoint ({what}: "
        f"{file or '<unnamed>'}, sha256 {digest}); nothing was executed. Pass --trust-code "
        f"(trust_code=True) only if you trust "
        "whoever made this checkpoint"
    )


@contextlib.contextmanager
def _without_working_directory() -> Iterator[None]:
    """``sys.path`` without the working directory (``''``, ``.`` or its absolute path) while the block
    runs."""
    cwd = os.path.realpath(os.getcwd())
    saved = list(sys.path)
    sys.path[:] = [p for p in saved if p not in ("", ".") and os.path.realpath(p) != cwd]
    try:
        yield
    finally:
        sys.path[:] = saved


def _location(top: str) -> str | None:
    """Where importing the top-level package ``top`` would load it from, found without importing anything."""
    import importlib.machinery

    if top in sys.modules:
        spec = getattr(sys.modules[top], "__spec__", None)
    else:
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(top, None) if find is not None else None
            if spec is not None:
                break
    if spec is None:
        return None
    if isinstance(spec.loader, importlib.machinery.BuiltinImporter):
        return None  # compiled into the interpreter: no distribution provides it
    where = (
        spec.origin
        if spec.origin not in (None, "namespace")
        else next(iter(spec.submodule_search_locations or []), None)
    )
    return os.path.realpath(where) if where else None


def _installed(top: str) -> tuple[str, str] | None:
    """``(distribution, version)`` providing the top-level package ``top``, looked up outside the working
    directory; ``None`` when no installed distribution does (a file beside the user, the standard library)."""
    from importlib import metadata

    with _without_working_directory():
        names = metadata.packages_distributions().get(top) or []
        if not names:
            return None
        try:
            return names[0], metadata.version(names[0])
        except metadata.PackageNotFoundError:
            return None


def module_provenance(target: str) -> dict[str, Any] | None:
    """What calibration records about MODEL ``package.module``: the installed distribution its top-level
    package comes from, ``{"distribution", "version"}`` (``None`` when none does). Imports nothing."""
    found = _installed(target.split(".", 1)[0])
    return None if found is None else {"distribution": found[0], "version": found[1]}


def _module_refusal(target: str, recorded: dict[str, Any] | None) -> str | None:
    """Why the module a checkpoint names may not be imported without ``trust_code`` (``None``: it may)."""
    top = target.split(".", 1)[0]
    dist = (recorded or {}).get("distribution")
    if not isinstance(dist, str):
        return "the checkpoint records no installed distribution for it"
    found = _installed(top)
    if found is None:
        return f"no installed distribution provides {top!r} (the checkpoint says {dist})"
    if found != (dist, (recorded or {}).get("version")):
        return (
            f"calibrated with {dist} {(recorded or {}).get('version')}, but {top!r} now comes from "
            f"{found[0]} {found[1]}"
        )
    with _without_working_directory():
        installed = _location(top)
    if installed is None or _location(top) != installed:
        return f"{top!r} would be imported from the working directory, not from {dist}"
    return None


def require_installed(
    trust_code: bool, target: str, recorded: dict[str, Any] | None, origin: str | None
) -> None:
    """Raise :class:`UntrustedCodeError` unless the module ``target`` a checkpoint names may be imported: it
    comes from the installed distribution calibration ``recorded`` (same name and version), outside the
    working directory, or ``trust_code``. Checked before importing it, so a refused module runs nothing."""
    if trust_code:
        return
    reason = _module_refusal(target, recorded)
    if reason is None:
        return
    where = f"{origin}: " if origin else ""
    raise UntrustedCodeError(
        f"{where}the checkpoint names the module {target} ({reason}); importing it runs its code, so "
        f"nothing was "
        "imported. Pass --trust-code (trust_code=True) only if you trust that module and whoever made this "
        "checkpoint"
    )
