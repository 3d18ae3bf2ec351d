"""ONNX translations, for the TorchScript exporter, of aten ops that models call and torch has none for.

``aten::diff``: transformers' masks (``masking_utils.find_packed_sequence_indices``) call ``torch.diff``
whenever a decoder LM runs without an attention mask and without a KV cache, so every GPT-2/Llama/Qwen2 export
stopped at "Exporting the operator 'aten::diff' to ONNX opset version 17 is not supported". The translation is
the
definition: concatenate ``prepend``/``append`` along ``dim``, then ``n`` times ``x[1:] - x[:-1]`` (``Xor`` for
bool, as ``torch.diff`` does), in standard ``Concat``/``Slice``/``Sub``. ``aten::cumsum``: torch's translation
of the cumulative sum that follows (over a bool tensor) is corrected, and so is ``aten::floor_divide``
(Python's ``//``), which torch's translation truncates toward zero (:data:`CORRECTED`).

:func:`register` adds a translation only where torch has none, once per process; it is called by the export
driver before ``torch.onnx.export``. Opset 11 and newer (negative axes in ``Slice`` and ``Concat``).

:func:`unsupported_operator` turns either exporter's "no translation for this op" failure into one
:class:`~quantcli.errors.ExportError` naming the op and what to try (another opset, the other exporter, or
computing it with other ops), using :func:`torchscript_min_opset`, the lowest opset torch's TorchScript
exporter translates an op at.
"""

from __future__ import annotations

import importlib
import pkgutil
import re

import torch

MIN_OPSET = 11
_INT64_MAX = 2**63 - 1
_registered = False


def _helpers():
    """torch's TorchScript symbolic helpers and its scalar-type table, from where they are defined.

    ``torch.onnx.symbolic_helper`` is a backward-compatibility module since torch 2.9: it re-exports only the
    names in the real module's ``__all__`` (no ``_type_utils``, no ``_maybe_get_const``). Whether the name
    ``torch.onnx.symbolic_helper`` means that module or the real one depends on which import ran first (any
    ``import torch.onnx.symbolic_helper``, as torchvision's ops do, binds the shim), so the helpers are taken
    from their definition, and from the old place on a torch that has only that."""
    try:
        from torch.onnx._internal.torchscript_exporter import _type_utils
        from torch.onnx._internal.torchscript_exporter import symbolic_helper as sh
    except ImportError:  # torch < 2.9: the public module is the real one
        from torch.onnx import _type_utils
        from torch.onnx import symbolic_helper as sh
    return sh, _type_utils


def _const(g, values: list[int]):
    return g.op("Constant", value_t=torch.tensor(values, dtype=torch.int64))


def _diff(g, x, n, dim, prepend, append):
    sh, types = _helpers()

    n, dim = sh._maybe_get_const(n, "i"), sh._maybe_get_const(dim, "i")
    if not isinstance(n, int) or not isinstance(dim, int):
        return sh._unimplemented("diff", "n and dim must be constants")
    parts = [p for p in (prepend, x, append) if not sh._is_none(p)]
    if len(parts) > 1:
        x = g.op("Concat", *parts, axis_i=dim)
    is_bool = types.JitScalarType.from_value(x, types.JitScalarType.UNDEFINED) == types.JitScalarType.BOOL
    axes = _const(g, [dim])
    for _ in range(n):
        hi = g.op("Slice", x, _const(g, [1]), _const(g, [_INT64_MAX]), axes)
        lo = g.op("Slice", x, _const(g, [0]), _const(g, [-1]), axes)
        x = g.op("Xor" if is_bool else "Sub", hi, lo)
    return x


def _cumsum(g, x, dim, dtype):
    sh, types = _helpers()
    jit = types.JitScalarType
    dim = sh._maybe_get_const(dim, "i")
    if not isinstance(dim, int):
        return sh._unimplemented("cumsum", "dim must be a constant")
    target = None if sh._is_none(dtype) else sh._maybe_get_const(dtype, "i")
    if target is None and jit.from_value(x, jit.UNDEFINED) in _PROMOTED_TO_INT64:
        target = jit.INT64  # torch sums bool and narrow integers in int64; ONNX CumSum has no bool
    if target is not None:
        x = g.op("Cast", x, to_i=jit(target).onnx_type())
    return g.op("CumSum", x, g.op("Constant", value_t=torch.tensor(dim, dtype=torch.int64)))


def _floor_divide(g, x, y):
    """``x // y`` as torch computes it since 1.13: rounded toward minus infinity, for integers and floats.

    torch's translation of ``aten::floor_divide`` still truncates (its comment: "Deprecated behavior,
    floor_divide actually truncates"), although its own ``_floor_divide`` helper, used for ``torch.div(...,
    rounding_mode="floor")``, floors; so every ``//`` that meets a negative value was exported wrong. The
    common casualty is TensorFlow's "same" padding written ``-(-size // stride)`` in a convolution's
    ``forward``: ``ceil`` became ``floor`` and the pads came out short or zero."""
    try:
        from torch.onnx._internal.torchscript_exporter import symbolic_opset9 as opset9
    except ImportError:  # torch < 2.9
        from torch.onnx import symbolic_opset9 as opset9
    return opset9._floor_divide(g, x, y)


def _promoted_to_int64():
    jit = _helpers()[1].JitScalarType
    return (jit.BOOL, jit.UINT8, jit.INT8, jit.INT16, jit.INT)


_PROMOTED_TO_INT64: tuple = ()
#: ops torch has no translation for
MISSING = {"aten::diff": _diff}
#: ops whose torch translation is wrong for some inputs: ``cumsum`` of a bool tensor (the same masks: ``(diff
# != : 1).cumsum(-1)``) became an ONNX ``CumSum`` of bool, which the checker rejects; and a constant ``dtype``
# was ignored; ``floor_divide`` (Python's ``//`` on tensors and on sizes the tracer records) truncated
CORRECTED = {"aten::cumsum": _cumsum, "aten::floor_divide": _floor_divide, "aten::floordiv": _floor_divide}


def _load_torch_symbolics() -> None:
    """Import torch's ``symbolic_opsetN`` modules: its registry fills as they load (an export loads them
    too)."""
    import torch.onnx._internal.torchscript_exporter as te

    for m in pkgutil.iter_modules(te.__path__):
        if m.name.startswith("symbolic_opset"):
            importlib.import_module(f"{te.__name__}.{m.name}")


def torchscript_min_opset(op: str) -> int | None:
    """The lowest opset at which torch's TorchScript exporter translates ``op`` (``aten::col2im`` -> 18), or
    None when it has no translation at all (or the installed torch keeps its registry elsewhere)."""
    try:
        from torch.onnx._internal.torchscript_exporter import registration

        _load_torch_symbolics()
        group = registration.registry.get_function_group(op)
        return None if group is None else group.get_min_supported()
    except (ImportError, AttributeError, ValueError):
        return None


def register() -> None:
    """Register the translations torch lacks (never replacing one it has) and the corrected ones (once per
    process)."""
    global _registered, _PROMOTED_TO_INT64
    if _registered:
        return
    _PROMOTED_TO_INT64 = _promoted_to_int64()
    for op, fn in MISSING.items():
        if torchscript_min_opset(op) is None:
            torch.onnx.register_custom_op_symbolic(op, fn, MIN_OPSET)
    for op, fn in CORRECTED.items():
        torch.onnx.register_custom_op_symbolic(op, fn, MIN_OPSET)
    _registered = True


_TORCHSCRIPT_UNSUPPORTED = re.compile(
    r"Exporting the operator '([\w:.]+)' to ONNX opset version (\d+) is "
    r"not supported"
)
_DYNAMO_UNSUPPORTED = re.compile(r"No ONNX function found for <OpOverload\(op='([\w.]+)'")


def _dynamo_op(e: BaseException) -> str | None:
    """``aten::cummax`` from torch.export's ``DispatchError`` anywhere in ``e``'s chain of causes."""
    seen = 0
    while e is not None and seen < 20:
        m = _DYNAMO_UNSUPPORTED.search(str(e))
        if m is not None:
            return m.group(1).replace(".", "::", 1)
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def unsupported_operator(e: BaseException, exporter: str, opset: int):
    """The :class:`~quantcli.errors.ExportError` for an op ``exporter`` has no ONNX translation for at
    ``opset`` (the op's name and what to try, in place of torch's message and IR dump), or None for other
    failures."""
    from quantcli.errors import ExportError

    if exporter == "torchscript":
        m = _TORCHSCRIPT_UNSUPPORTED.search(str(e))
        op = None if m is None else m.group(1)
    else:
        op = _dynamo_op(e)
    if op is None:
        return None
    since = torchscript_min_opset(op)
    if exporter == "torchscript":
        if since is not None and opset < since <= 21:
            fix = f"torch translates it from opset {since}: pass --opset {since}, or try --exporter dynamo"
        else:
            fix = (
                "torch has no ONNX translation for it at any opset: try --exporter dynamo (torch.export "
                "translates more ops), or compute it with other ops in the model's forward"
            )
        return ExportError(f"the TorchScript exporter cannot export operator {op} at opset {opset}; {fix}")
    if since is not None and since <= 21:
        fix = f"try --exporter torchscript (it translates {op} from opset {since})"
    else:
        fix = "neither torch exporter translates it: compute it with other ops in the model's forward"
    return ExportError(
        f"the dynamo exporter has no ONNX translation for operator {op} (opset {opset}); {fix}"
    )
