"""ONNX emission: the graph pieces the quantize ops' ``symbolic`` functions build, and the export driver."""

from __future__ import annotations


def __getattr__(name):
    if name in ("export_onnx", "ExportResult"):
        from exporters import onnx_export

        return getattr(onnx_export, name)
    raise AttributeError(name)
