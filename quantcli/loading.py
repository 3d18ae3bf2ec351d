"""Turning a MODEL spec (and optional weights) into an ``nn.Module``.

MODEL is ``package.module:factory``, ``path/to/file.py:factory``, or a sample model name. Weights are a state
dict in ``.safetensors`` or ``.pt``/``.pth`` (read with ``torch.load(weights_only=True)``); a pickled whole
module is only read with ``trust_pickle=True``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantcli.errors import ModelLoadError


@dataclass
class ModelSpec:
    kind: str  # "sample" | "file" | "module"
    spec: str
    path: str | None = None
    source: str | None = None

    def to_plain(self) -> dict[str, Any]:
        return {"kind": self.kind, "spec": self.spec, "path": self.path, "source": self.source}

    @classmethod
    def from_plain(cls, d: dict[str, Any]) -> ModelSpec:
        return cls(d["kind"], d["spec"], d.get("path"), d.get("source"))

    @property
    def stem(self) -> str:
        """A short name for default output files."""
        if self.kind == "sample":
            return self.spec
        target = self.spec.rsplit(":", 1)[0]
        return Path(target).stem if self.kind == "file" else target.rsplit(".", 1)[-1]


def parse_spec(spec: str) -> ModelSpec:
    from sample_models import SAMPLES

    if spec in SAMPLES:
        return ModelSpec("sample", spec)
    if ":" not in spec:
        raise ModelLoadError(
            f"MODEL {spec!r} is not a sample model ({', '.join(SAMPLES)}) and has no ':factory'; "
            "use package.module:factory or path/to/file.py:factory"
        )
    target, factory = spec.rsplit(":", 1)
    if not factory.isidentifier():
        raise ModelLoadError(f"MODEL {spec!r}: {factory!r} is not a function name")
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target)
        if not path.is_file():
            raise ModelLoadError(f"MODEL file {target} does not exist")
        return ModelSpec("file", spec, str(path.resolve()), path.read_text(encoding="utf-8"))
    return ModelSpec("module", spec)


def _load_file_module(spec: ModelSpec):
    path = Path(spec.path) if spec.path else None
    digest = hashlib.sha1((spec.source or spec.path or "").encode()).hexdigest()[:12]
    mod_name = f"quantcli_user_model_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    if path is not None and path.is_file() and (spec.source is None or path.read_text(encoding="utf-8") == spec.source):
        ispec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(ispec)
        sys.modules[mod_name] = module
        ispec.loader.exec_module(module)
        return module
    if spec.source is None:
        raise ModelLoadError(f"MODEL file {spec.path} does not exist")
    # the file moved or changed since calibration: run the source stored in the checkpoint
    import types

    module = types.ModuleType(mod_name)
    module.__file__ = spec.path
    sys.modules[mod_name] = module
    exec(compile(spec.source, spec.path or "<checkpoint source>", "exec"), module.__dict__)
    return module


def _factory(spec: ModelSpec):
    if spec.kind == "sample":
        from sample_models import SAMPLES

        return SAMPLES[spec.spec].build
    target, name = spec.spec.rsplit(":", 1)
    try:
        module = _load_file_module(spec) if spec.kind == "file" else importlib.import_module(target)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot import {target}: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        raise ModelLoadError(f"{target} has no callable {name!r}")
    return fn


def build_model(spec: ModelSpec) -> nn.Module:
    """Call the factory; it must return an ``nn.Module``."""
    fn = _factory(spec)
    try:
        model = fn()
    except Exception as e:
        raise ModelLoadError(f"factory {spec.spec} raised {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise ModelLoadError(f"factory {spec.spec} returned {type(model).__name__}, not a torch.nn.Module")
    return model


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
            raise ModelLoadError(f"cannot read {path} as safetensors: {str(e).splitlines()[0]}") from None
    if suffix not in (".pt", ".pth", ".bin"):
        raise ModelLoadError(f"weights {path}: unknown format {suffix!r}; use .safetensors, .pt or .pth")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        msg = str(e)
        if not ("weights_only" in msg or "Unsupported global" in msg or "GLOBAL" in msg):
            raise ModelLoadError(f"cannot read {path}: {msg.splitlines()[0]}") from None
        if not trust_pickle:
            raise ModelLoadError(
                f"{path} is a pickled object (a whole module?), not a state dict; loading it runs code from the "
                "file. Re-save it with torch.save(model.state_dict(), ...) or pass --trust-pickle if you trust it"
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
    shapes = [f"{k} {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
              for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    problems = []
    if missing:
        problems.append(f"missing {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected {_few(unexpected)}")
    if shapes:
        problems.append(f"shape mismatch {_few(shapes)}")
    if problems:
        raise ModelLoadError(f"{source} do not fit the model: " + "; ".join(problems))
    model.load_state_dict(state, strict=True)


def _few(items: list[str], n: int = 5) -> str:
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def load_model(spec: str | ModelSpec, weights: str | Path | None = None, trust_pickle: bool = False) -> tuple[nn.Module, ModelSpec]:
    """Build the model from its spec and load ``weights`` if given. Returns ``(model in eval mode, spec)``."""
    ms = spec if isinstance(spec, ModelSpec) else parse_spec(spec)
    model = build_model(ms)
    if weights is not None:
        load_weights(model, read_state_dict(weights, trust_pickle), f"weights {weights}")
    return model.eval(), ms
