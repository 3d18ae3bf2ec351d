"""Turning a MODEL spec (and optional weights) into an ``nn.Module``.

MODEL is ``package.module:factory``, ``path/to/file.py:factory``, or a sample model name. Weights are a state
dict in ``.safetensors`` or ``.pt``/``.pth`` (read with ``torch.load(weights_only=True)``); a pickled whole
module is only read with ``trust_pickle=True``.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantcli.errors import ModelLoadError, QuantCliError, UntrustedCodeError, few, first_line
from quantcli.inputs.model_spec import ModelSpec
from quantcli.inputs.precision import to_float32
from quantcli.inputs.trust import module_provenance, require_installed, require_trust, sha256_hex


def parse_spec(spec: str, trust_pickle: bool = False, **hf_options: Any) -> ModelSpec:
    """MODEL text -> ModelSpec. A path without ``:factory`` is a Hugging Face folder or a whole-module file;
    ``hf_options`` (``pooling``) apply to Hugging Face folders."""
    from sample_models import SAMPLES

    if spec in SAMPLES:
        return ModelSpec("sample", spec)
    as_path = Path(spec)
    if as_path.is_dir():
        from quantcli.inputs.hf_model import hf_spec

        return hf_spec(as_path, **hf_options)
    if as_path.is_file() and not spec.endswith(".py"):
        from quantcli.inputs.whole_module import bytes_tensor, read_model_file

        data = read_model_file(as_path, trust_pickle)
        return ModelSpec(
            "pickle",
            spec,
            str(as_path.resolve()),
            None,
            {"sha256": sha256_hex(data), "pickle": bytes_tensor(data)},
        )
    if ":" not in spec:
        raise ModelLoadError(
            f"MODEL {spec!r} is not a sample model ({', '.join(SAMPLES)}), a Hugging Face model folder, a "
            "torch.save(model) file, nor has a ':factory'; use package.module:factory or "
            "path/to/file.py:factory"
        )
    target, factory = spec.rsplit(":", 1)
    if not factory.isidentifier():
        raise ModelLoadError(f"MODEL {spec!r}: {factory!r} is not a function name")
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target)
        if not path.is_file():
            raise ModelLoadError(f"MODEL file {target} does not exist")
        try:  # the exact bytes (no newline translation): a checkpoint's file is compared byte for byte
            source = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise ModelLoadError(f"MODEL file {target} is not UTF-8 Python source") from None
        return ModelSpec("file", spec, str(path.resolve()), source)
    if not all(part.isidentifier() for part in target.split(".")):
        raise ModelLoadError(f"MODEL {spec!r}: {target!r} is not a module name (package.module)")
    return ModelSpec("module", spec, extra=module_provenance(target))


def _file_source(spec: ModelSpec, trust_code: bool, origin: str | None) -> str:
    """The source to run for a file spec: the stored source, run without ``trust_code`` only when the file on
    disk holds exactly its bytes (the user has that code); otherwise it came inside the checkpoint.

    A spec that stores no source runs nothing, with or without ``trust_code``: the checkpoint would name a
    file without carrying the code the user approves. Nothing read from the file is quoted in an error."""
    if not isinstance(spec.source, str):
        where = f"{origin}: " if origin else ""
        raise ModelLoadError(
            f"{where}the checkpoint names the factory file {spec.path} but does not store "
            f"its "
            "source, so nothing is run (quantcli calibrate stores it); re-calibrate the "
            "model"
        )
    path = Path(spec.path) if spec.path else None
    on_disk = None
    if path is not None and path.is_file():
        try:
            on_disk = path.read_bytes()
        except OSError:
            on_disk = None
    if on_disk == spec.source.encode("utf-8"):
        return spec.source
    state = "changed on disk since calibration" if on_disk is not None else "not on disk"
    require_trust(
        trust_code, f"the factory source of a file {state}", spec.path, sha256_hex(spec.source), origin
    )
    return spec.source


def _load_file_module(spec: ModelSpec, trust_code: bool = False, origin: str | None = None):
    source = _file_source(spec, trust_code, origin)
    mod_name = f"quantcli_user_model_{sha256_hex(source)[:16]}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    import types

    module = types.ModuleType(mod_name)
    module.__file__ = spec.path
    sys.modules[mod_name] = module
    try:
        exec(compile(source, spec.path or "<checkpoint source>", "exec"), module.__dict__)
    except BaseException:
        del sys.modules[mod_name]
        raise
    return module


def _factory(spec: ModelSpec, trust_code: bool = False, origin: str | None = None):
    if spec.kind == "sample":
        from sample_models import SAMPLES

        if spec.spec not in SAMPLES:
            raise ModelLoadError(f"{spec.spec!r} is not a sample model ({', '.join(SAMPLES)})")
        return SAMPLES[spec.spec].build
    if spec.kind not in ("file", "module") or ":" not in spec.spec:
        raise ModelLoadError(f"model kind {spec.kind!r} with spec {spec.spec!r} cannot be rebuilt")
    target, name = spec.spec.rsplit(":", 1)
    if spec.kind == "module" and origin is not None:  # a module a checkpoint names: checked before importing
        require_installed(trust_code, target, spec.extra, origin)
    try:
        module = (
            _load_file_module(spec, trust_code, origin)
            if spec.kind == "file"
            else importlib.import_module(target)
        )
    except QuantCliError:
        raise
    except Exception as e:
        detail = f" (line {e.lineno})" if isinstance(e, SyntaxError) else f": {first_line(e, 200)}"
        raise ModelLoadError(f"cannot import {target}: {type(e).__name__}{detail}") from None
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        raise ModelLoadError(f"{target} has no callable {name!r}")
    return fn


def _unpickled(spec: ModelSpec, trust_code: bool, origin: str | None) -> nn.Module:
    from quantcli.inputs.whole_module import tensor_bytes, unpickle_module

    extra = spec.extra or {}
    require_trust(
        trust_code, "the pickled whole module read from", spec.path, extra.get("sha256", "?"), origin
    )
    return unpickle_module(tensor_bytes(extra["pickle"]), origin or spec.spec)


def build_model(spec: ModelSpec, trust_code: bool = False, origin: str | None = None) -> nn.Module:
    """Call the factory; it must return an ``nn.Module``.

    Code that came inside a checkpoint (``origin``) runs only with ``trust_code``; otherwise
    :class:`UntrustedCodeError` is raised before anything runs (see :mod:`quantcli.inputs.trust`). A
    half-precision model comes back in float32 (:mod:`quantcli.inputs.precision`).
    """
    if spec.kind == "pickle":
        return to_float32(_unpickled(spec, trust_code, origin))
    if spec.kind == "hf":
        from quantcli.inputs.hf_model import build_hf_model

        return to_float32(build_hf_model(spec))
    fn = _factory(spec, trust_code, origin)
    try:
        model = fn()
    except Exception as e:
        raise ModelLoadError(f"factory {spec.spec} raised {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise ModelLoadError(f"factory {spec.spec} returned {type(model).__name__}, not a torch.nn.Module")
    return to_float32(model)


def read_state_dict(path: str | Path, trust_pickle: bool = False) -> dict[str, torch.Tensor]:
    """A state dict from ``.safetensors`` or ``.pt``/``.pth`` (``{"state_dict": ...}`` wrappers accepted)."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"weights file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        try:
            from safetensors.torch import load_file

            return load_file(str(path))
        except Exception as e:
            raise ModelLoadError(f"cannot read {path} as safetensors: {first_line(e)}") from None
    if suffix not in (".pt", ".pth", ".bin"):
        raise ModelLoadError(f"weights {path}: unknown format {suffix!r}; use .safetensors, .pt or .pth")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        from quantcli.inputs.whole_module import needs_pickle, reason

        if not needs_pickle(e):  # a damaged or foreign file is not a pickle to trust
            raise ModelLoadError(f"cannot read {path}: {reason(e)}") from None
        if not trust_pickle:
            raise ModelLoadError(
                f"{path} is a pickled object (a whole module?), not a state dict; loading it runs code from "
                f"the "
                "file. Re-save it with torch.save(model.state_dict(), ...) or pass --trust-pickle if you "
                "trust it"
            ) from None
        obj = torch.load(path, map_location="cpu", weights_only=False)
    if isinstance(obj, nn.Module):
        return obj.state_dict()
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ModelLoadError(f"{path} does not hold a state dict (a mapping of names to tensors)")
    return obj


def load_weights(model: nn.Module, state: dict[str, torch.Tensor], source: str = "weights") -> None:
    """Strict load with every missing / unexpected / mis-shaped key named."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k} {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in state and tuple(state[k].shape) != tuple(own[k].shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing {few(missing)}")
    if unexpected:
        problems.append(f"unexpected {few(unexpected)}")
    if shapes:
        problems.append(f"shape mismatch {few(shapes)}")
    if problems:
        raise ModelLoadError(f"{source} do not fit the model: " + "; ".join(problems))
    model.load_state_dict(state, strict=True)


def load_model(
    spec: str | ModelSpec, weights: str | Path | None = None, trust_pickle: bool = False, **hf_options: Any
) -> tuple[nn.Module, ModelSpec]:
    """Build the model from its spec and load ``weights`` if given. Returns ``(model in eval mode, spec)``.

    ``trust_pickle`` allows a pickled whole module, as MODEL or as ``weights``; ``hf_options`` (``pooling``)
    apply to a Hugging Face folder.
    """
    ms = spec if isinstance(spec, ModelSpec) else parse_spec(spec, trust_pickle, **hf_options)
    if ms.kind == "hf":
        from quantcli.inputs.hf_model import load_hf_folder

        model = to_float32(load_hf_folder(ms))
    else:
        model = build_model(ms, trust_code=trust_pickle)
    if weights is not None:
        load_weights(model, read_state_dict(weights, trust_pickle), f"weights {weights}")
    return model.eval(), ms


def model_code(spec: ModelSpec) -> dict[str, Any]:
    """Where the code that rebuilds ``spec``'s model comes from, without running anything.

    ``needs_trust_code`` is what ``load_calibrated`` would demand now (a factory file is checked against
    disk).
    """
    if spec.kind == "sample":
        return {"source": "sample model", "file": None, "sha256": None, "needs_trust_code": False}
    if spec.kind == "module":
        target = spec.spec.rsplit(":", 1)[0]
        try:
            require_installed(False, target, spec.extra, None)
            needs = False
        except UntrustedCodeError:
            needs = True
        return {
            "source": "module the checkpoint names, not from the installed distribution it recorded"
            if needs
            else "installed module",
            "file": target,
            "sha256": None,
            "needs_trust_code": needs,
            "distribution": (spec.extra or {}).get("distribution"),
        }
    if spec.kind == "file":
        stored = isinstance(spec.source, str)
        try:
            _file_source(spec, False, None)
            needs, what = False, "factory file on disk"
        except UntrustedCodeError:
            needs, what = True, "factory file source stored in the checkpoint"
        except QuantCliError:  # no source stored: nothing may run, not even with --trust-code
            needs, what = True, "a factory file whose source the checkpoint does not store: cannot be rebuilt"
        return {
            "source": what,
            "file": spec.path,
            "sha256": sha256_hex(spec.source) if stored else None,
            "needs_trust_code": needs,
            "rebuildable": stored,
        }
    if spec.kind == "pickle":
        return {
            "source": "pickled whole module stored in the checkpoint",
            "file": spec.path,
            "sha256": (spec.extra or {}).get("sha256"),
            "needs_trust_code": True,
        }
    return {
        "source": "transformers class " + str((spec.extra or {}).get("architecture")),
        "file": spec.path,
        "sha256": None,
        "needs_trust_code": False,
    }
