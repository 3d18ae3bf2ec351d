"""What MODEL names: a sample model, a factory in a file or an importable module, a pickled whole module, or a
Hugging Face folder (:class:`ModelSpec`). Stored in calibrated checkpoints as plain data, so the model is
rebuilt the same way (:mod:`quantcli.inputs.loading`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class ModelSpec:
    kind: str  # "sample" | "file" | "module" | "pickle" (torch.save(model)) | "hf" (Hugging Face folder)
    spec: str
    path: str | None = None
    source: str | None = None
    # per kind: the pickle's bytes and sha256; the HF config, class, outputs
    extra: dict[str, Any] | None = None

    def to_plain(self) -> dict[str, Any]:
        d = {"kind": self.kind, "spec": self.spec, "path": self.path, "source": self.source}
        if self.extra is not None:
            d["extra"] = self.extra
        return d

    @classmethod
    def from_plain(cls, d: dict[str, Any]) -> ModelSpec:
        return cls(d["kind"], d["spec"], d.get("path"), d.get("source"), d.get("extra"))

    @property
    def stem(self) -> str:
        """A short name for default output files."""
        if self.kind == "sample":
            return self.spec
        if self.kind == "hf":  # a folder: its whole name (``bert.v2/`` -> ``bert.v2``)
            return Path(self.spec.rstrip("/\\")).name or "model"
        if self.kind == "pickle":
            return Path(self.spec).stem
        target = self.spec.rsplit(":", 1)[0]
        return Path(target).stem if self.kind == "file" else target.rsplit(".", 1)[-1]
