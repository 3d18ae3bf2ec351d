"""MODEL as a checkpoint file that is the model itself.

``torch.save(model)`` pickles the whole module: unpickling it imports and runs whatever the file names, so it
is read only with ``trust_pickle`` (``--trust-pickle``). The calibrated checkpoint keeps that file's bytes
verbatim (a uint8 tensor, so the checkpoint stays readable with ``weights_only=True``) with their sha256;
rebuilding the model later unpickles them again, which needs ``--trust-code`` like any code stored in a
checkpoint.

A TorchScript archive (``torch.jit.save``) is refused: its ``forward`` is compiled TorchScript that calls its
submodules' compiled code, so quantizers (which replace Python layers) cannot be inserted into it faithfully.
"""

from __future__ import annotations

import io
import pickle
import re
import zipfile
from pathlib import Path

import torch
from torch import nn

from quantcli.errors import ModelLoadError, first_line

STATE_DICT_HINT = (
    "pass the model's code as package.module:factory or path/to/file.py:factory with --weights {p}"
)


def is_torchscript(path: Path) -> bool:
    """A ``torch.jit.save`` archive: a zip holding compiled ``code/`` and ``constants.pkl`` (``torch.save``
    zips hold ``data.pkl`` and tensor storages only)."""
    if not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError):
        return False
    return any(n.endswith("/constants.pkl") or "/code/" in n for n in names)


def needs_pickle(err: Exception) -> bool:
    """The safe reader stopped at a class or function to import: the file is a pickle of Python objects."""
    return "Unsupported global" in str(err)


def reason(err: Exception) -> str:
    msg = str(err)
    if "WeightsUnpickler error:" in msg:
        msg = msg.split("WeightsUnpickler error:", 1)[1]
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    return lines[0][:200] if lines else type(err).__name__


def read_model_file(path: Path, trust_pickle: bool) -> bytes:
    """The bytes of a ``torch.save(model)`` file, after checking what the file is without running any code.

    Raises ModelLoadError (one line) for a TorchScript archive, a plain state dict, an unreadable file, and a
    pickled module without ``trust_pickle``.
    """
    p = str(path)
    if is_torchscript(path):
        raise ModelLoadError(
            f"MODEL {p} is a TorchScript archive (torch.jit.save): its forward is compiled code that calls "
            f"its layers' "
            "compiled code, so quantizers cannot be inserted into those layers faithfully; pass the Python "
            "model instead: torch.save(model) with --trust-pickle, or package.module:factory / "
            "file.py:factory with --weights (torch.save(model.state_dict()))"
        )
    data = path.read_bytes()
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        if not needs_pickle(e):
            raise ModelLoadError(f"cannot read MODEL {p} as a torch.save file: {reason(e)}") from None
        if not trust_pickle:
            raise ModelLoadError(
                f"MODEL {p} is a pickled whole module (torch.save(model)); unpickling it can run any code "
                f"the file "
                "names. Pass --trust-pickle only if you trust where it came from (or save "
                "model.state_dict() and use a factory with --weights)"
            ) from None
        return data
    kind = "a state dict (weights only)" if isinstance(obj, dict) else f"a {type(obj).__name__}"
    raise ModelLoadError(f"MODEL {p} holds {kind}, not a model; {STATE_DICT_HINT.format(p=p)}")


def unpickle_module(data: bytes, where: str) -> nn.Module:
    """Unpickle a whole module (runs code named in the pickle: call only after consent)."""
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except (AttributeError, ModuleNotFoundError, ImportError, pickle.UnpicklingError) as e:
        msg = first_line(e)
        m = re.search(r"Can't get attribute '([^']+)' on <module '([^']+)'", msg)
        if m:
            msg = (
                f"its class {m.group(2)}.{m.group(1)} cannot be imported here (a class defined in the "
                f"script "
                "that saved it cannot be found again); make it importable, or save model.state_dict() and "
                "use a factory with --weights"
            )
        elif isinstance(e, ModuleNotFoundError) and e.name:
            msg = (
                f"its class comes from the module '{e.name}', which cannot be imported here; run from the "
                f"folder that holds {e.name.split('.')[0]} (or put it on PYTHONPATH), or save "
                "model.state_dict() and use a factory with --weights"
            )
        raise ModelLoadError(f"cannot unpickle the model in {where}: {msg}") from None
    except Exception as e:
        raise ModelLoadError(
            f"cannot unpickle the model in {where}: {type(e).__name__}: {str(e).strip()[:200]}"
        ) from None
    if not isinstance(obj, nn.Module):
        raise ModelLoadError(
            f"{where} unpickles to {type(obj).__name__}, not a torch.nn.Module; "
            "save the model itself with torch.save(model) or its state dict for --weights"
        )
    if isinstance(obj, torch.jit.ScriptModule):
        raise ModelLoadError(
            f"{where} holds a TorchScript module; quantizers cannot be inserted into compiled code"
        )
    return obj


def bytes_tensor(data: bytes) -> torch.Tensor:
    """Bytes as a uint8 tensor (what ``torch.load(weights_only=True)`` can read back)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()
