"""Consent before running code that came inside a checkpoint.

A calibrated checkpoint is data (``torch.load(weights_only=True)`` reads it), but rebuilding its model may need
code: the factory file's source stored at calibration, or the pickled whole module. Like Hugging Face's
``trust_remote_code``, that code runs only with ``trust_code=True`` (``--trust-code``). Code the user already has
runs without it: a factory file present on disk with exactly the stored source, an installed
``package.module:factory``, a sample model, a Hugging Face class from the installed ``transformers``.
"""

from __future__ import annotations

import hashlib

from quantcli.errors import UntrustedCodeError


def sha256_hex(data: bytes | str) -> str:
    return hashlib.sha256(data.encode("utf-8") if isinstance(data, str) else data).hexdigest()


def require_trust(trust_code: bool, what: str, file: str | None, digest: str, origin: str | None) -> None:
    """Raise :class:`UntrustedCodeError` (one line naming the file and its sha256) unless ``trust_code``.

    ``what`` says what would run ("the factory source stored in the checkpoint, ..."), ``file`` the file the code
    came from, ``digest`` its sha256, ``origin`` the checkpoint it is stored in.
    """
    if trust_code:
        return
    where = f"{origin}: " if origin else ""
    raise UntrustedCodeError(
        f"{where}rebuilding the model would run code stored in the checkpoint ({what}: {file or '<unnamed>'}, "
        f"sha256 {digest}); nothing was executed. Pass --trust-code (trust_code=True) only if you trust "
        "whoever made this checkpoint"
    )
