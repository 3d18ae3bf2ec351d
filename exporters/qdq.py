"""ONNX graph pieces for the quantize ops' ``symbolic`` functions (TorchScript-based exporter).

Each piece turns one quantize op into ``[Max, Min] -> QuantizeLinear -> DequantizeLinear``. The scale, zero
point and clip bounds are computed here in PyTorch with :mod:`quantcli.arithmetic` and emitted as constants,
so the graph holds exactly the float32 numbers the fake-quant model uses.

The optional ``Max``/``Min`` pair appears only when the grid is narrower than the emitted type's saturation
range (``narrow_range``, or 2..7-bit grids in int8, see :func:`exporters.formats.emitted_type`) or a
channel is dead (amax 0): clipping ``x`` to
``fl(qmin * scale)`` before dividing gives the same code as clamping after rounding, since
``fl(qmin * s) / s`` is within a few ulps of ``qmin``.
"""

from __future__ import annotations

import torch

from exporters import formats as fm
from quantcli import arithmetic as ar
from quantcli.errors import ExportError
from quantcli.granularity import Granularity, expand_amax, flatten_for_onnx, granularity_of


def constant_value(v, what: str) -> torch.Tensor:
    """The value of a constant graph input to a symbolic function (amax, min/max range)."""
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, (int, float)):
        return torch.tensor(float(v), dtype=torch.float32)
    node = v.node()
    if node.kind() in ("onnx::Constant", "prim::Constant") and node.hasAttribute("value"):
        return node.t("value")
    raise ExportError(
        f"{what} must be known when exporting (a constant); quantize through quantcli.nn.TensorQuantizer, "
        "which passes its calibrated amax as a constant, or pass a Python number"
    )


def _input_shape(x) -> tuple[int, ...] | None:
    try:
        sizes = x.type().sizes()
    except Exception:
        return None
    return tuple(sizes) if sizes is not None else None


def _check_opset(g, need: int, fmt: str) -> None:
    if g.opset < need:
        raise ExportError(f"{fmt} quantization needs ONNX opset >= {need}, but the export uses opset {g.opset}; "
                          f"pass --opset {need} or leave --opset out")


def _zero_point_const(g, zp: torch.Tensor, qtype: fm.OnnxQuantType):
    if qtype is fm.FP8_E4M3:
        return g.op("Constant", value_t=zp.to(torch.float8_e4m3fn))
    native = {fm.INT8.name: torch.int8, fm.UINT8.name: torch.uint8, fm.INT16.name: torch.int16}
    return g.op("Constant", value_t=zp.to(native[qtype.name]))


def _qdq_attrs(gran: Granularity) -> dict:
    if gran.kind == "axis":
        return {"axis_i": gran.axis}
    if gran.kind == "block":
        return {"axis_i": gran.axis, "block_size_i": gran.block_size}
    return {}


def _clip(g, x, lo: torch.Tensor, hi: torch.Tensor):
    x = g.op("Max", x, g.op("Constant", value_t=lo.to(torch.float32)))
    return g.op("Min", x, g.op("Constant", value_t=hi.to(torch.float32)))


def _granularity(g, x, amax: torch.Tensor) -> tuple[Granularity, tuple[int, ...] | None]:
    shape = _input_shape(x)
    if amax.numel() == 1:
        return Granularity("tensor"), shape
    if shape is None or any(s is None for s in shape):
        shape = tuple(amax.shape)  # per-axis amax keeps the rank; blocked needs the static input shape
    try:
        gran = granularity_of(tuple(amax.shape), shape)
    except ValueError as e:
        raise ExportError(str(e)) from None
    if gran.kind == "block":
        _check_opset(g, fm.BLOCKED_MIN_OPSET, "blocked")
    return gran, shape


def _symmetric_pieces(g, x, amax, num_bits, unsigned, narrow_range):
    a = constant_value(amax, "amax").to(torch.float32)
    ar.check_num_bits(num_bits)
    ar.check_amax(a)
    final_type = fm.integer_type(num_bits, unsigned)
    try:
        qtype = fm.emitted_type(num_bits, unsigned)
    except ValueError as e:
        raise ExportError(str(e)) from None
    gran, shape = _granularity(g, x, a)
    _check_opset(g, max(final_type.min_opset, fm.MIN_OPSET), fm.format_name(num_bits, unsigned, gran.kind == "block"))
    bound = ar.symmetric_bound(num_bits, unsigned)
    scale = ar.symmetric_scale(a, bound)
    qmin, qmax = ar.integer_range(num_bits, unsigned, narrow_range)
    dead = ar.dead_mask(a)
    if (qmin, qmax) != (qtype.qmin, qtype.qmax) or dead.any():
        a_e = expand_amax(a, shape) if gran.kind == "block" else a
        s_e = ar.symmetric_scale(a_e, bound)
        d_e = ar.dead_mask(a_e)
        zero = torch.zeros((), dtype=torch.float32)
        lo = torch.where(d_e, zero, torch.tensor(float(qmin)) * s_e)
        hi = torch.where(d_e, zero, torch.tensor(float(qmax)) * s_e)
        x = _clip(g, x, lo, hi)
    scale_o = flatten_for_onnx(scale, gran)
    scale_c = g.op("Constant", value_t=scale_o)
    zp_c = _zero_point_const(g, torch.zeros(scale_o.shape), qtype)
    return x, scale_c, zp_c, _qdq_attrs(gran)


def symmetric_qdq(g, x, amax, num_bits=8, unsigned=False, narrow_range=True):
    """Fake quantization as ``QuantizeLinear -> DequantizeLinear`` (int types, per-tensor/axis/block)."""
    x, scale_c, zp_c, attrs = _symmetric_pieces(g, x, amax, num_bits, unsigned, narrow_range)
    q = g.op("QuantizeLinear", x, scale_c, zp_c, **attrs)
    return g.op("DequantizeLinear", q, scale_c, zp_c, **attrs)


def symmetric_quantize(g, x, amax, num_bits=8, unsigned=False, narrow_range=True):
    """``TensorQuantFunction``: the codes (as float) and the reference-API scale ``bound / amax``."""
    x, scale_c, zp_c, attrs = _symmetric_pieces(g, x, amax, num_bits, unsigned, narrow_range)
    q = g.op("QuantizeLinear", x, scale_c, zp_c, **attrs)
    a = constant_value(amax, "amax").to(torch.float32)
    bound = ar.symmetric_bound(num_bits, unsigned)
    quant_scale = torch.where(a > 0, bound / torch.where(a > 0, a, 1.0), torch.ones_like(a))
    return g.op("Cast", q, to_i=1), g.op("Constant", value_t=quant_scale)


def affine_qdq(g, x, min_range, max_range, num_bits=8):
    """Asymmetric fake quantization: uint grid with the zero point in the graph."""
    from quantcli.tensor_quant import affine_qparams

    lo_v = constant_value(min_range, "min_range")
    hi_v = constant_value(max_range, "max_range")
    scale, zp = affine_qparams(lo_v, hi_v, num_bits)
    if scale.numel() != 1:
        raise ExportError("affine quantization is exported per-tensor only")
    _check_opset(g, max(fm.integer_type(num_bits, True).min_opset, fm.MIN_OPSET), fm.format_name(num_bits, True))
    qtype = fm.emitted_type(num_bits, True)
    qmax = (1 << num_bits) - 1
    scale, zp = scale.reshape(()), zp.reshape(())
    if qmax != qtype.qmax:
        x = _clip(g, x, (0.0 - zp) * scale, (qmax - zp) * scale)
    scale_c = g.op("Constant", value_t=scale)
    zp_c = _zero_point_const(g, zp, qtype)
    q = g.op("QuantizeLinear", x, scale_c, zp_c)
    return g.op("DequantizeLinear", q, scale_c, zp_c)


def e4m3_qdq(g, x, amax=None, E=4, M=3):
    """FP8 E4M3: ``QuantizeLinear`` with a float8e4m3fn zero point (saturating), opset >= 19."""
    if (E, M) != (4, 3):
        raise ExportError(f"only FP8 E4M3 exports to ONNX, got E={E}, M={M}")
    _check_opset(g, fm.FP8_E4M3.min_opset, "fp8-e4m3")
    if amax is None or (hasattr(amax, "node") and amax.node().mustBeNone()):
        a = torch.ones(())
        scale = torch.ones(())
        gran = Granularity("tensor")
    else:
        a = constant_value(amax, "amax").to(torch.float32)
        ar.check_amax(a)
        gran, shape = _granularity(g, x, a)
        scale = ar.symmetric_scale(a, ar.FP8_E4M3_MAX)
        dead = ar.dead_mask(a)
        if dead.any():
            a_e = expand_amax(a, shape) if gran.kind == "block" else a
            d_e = ar.dead_mask(a_e)
            big = torch.full(d_e.shape, float("inf"))
            x = _clip(g, x, torch.where(d_e, 0.0, -big), torch.where(d_e, 0.0, big))
    scale_o = flatten_for_onnx(scale, gran)
    scale_c = g.op("Constant", value_t=scale_o)
    zp_c = _zero_point_const(g, torch.zeros(scale_o.shape), fm.FP8_E4M3)
    attrs = _qdq_attrs(gran)
    q = g.op("QuantizeLinear", x, scale_c, zp_c, **attrs)
    return g.op("DequantizeLinear", q, scale_c, zp_c, **attrs)
