"""Attributes of a package that import their module on first use (PEP 562 module ``__getattr__``).

``quantcli`` and ``calibrators`` expose their public names this way, so that importing the package (as
``quantcli --help`` does) loads neither torch nor onnx.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_getattr(package: str, table: dict[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``package``: ``name`` is looked up in ``table`` (name -> the module
    that defines it), imported, cached in the package's namespace, and returned; other names raise
    AttributeError."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
