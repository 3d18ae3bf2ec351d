"""The quantize ops' ONNX definition: a :class:`QdqSpec` per op, and the nodes their ``symbolic`` functions
build.

A spec holds the float32 scale, the zero point, the storage type, the granularity and optional clip bounds,
all computed here in PyTorch with :mod:`quantcli.quant.arithmetic`, so the graph holds exactly the numbers the
fake-quant model uses. :func:`emit` writes ``[Max, Min] -> QuantizeLinear -> DequantizeLinear`` (ONNX
QuantizeLinear/DequantizeLinear-13, -19 for float8, -21 for blocks and 4/16-bit types) for the TorchScript
exporter's ``symbolic`` functions of :mod:`quantcli.quant.tensor_quant`; :mod:`exporters.dynamo` writes the
same nodes from the same spec for the torch.export-based exporter.

The optional ``Max``/``Min`` pair appears only when the grid is narrower than the emitted type's saturation
range (``narrow_range``, or 2..7-bit grids in int8, see :func:`quantcli.quant.formats.emitted_type`) or a
channel is dead (amax 0): clipping ``x`` to ``fl(qmin * scale)`` before dividing gives the same code as
clamping after rounding, since ``fl(qmin * s) / s`` is within a few ulps of ``qmin``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantcli.errors import ExportError
from quantcli.quant import arithmetic, formats
from quantcli.quant.granularity import Granularity, expand_amax, flatten_for_onnx, granularity_of
from quantcli.quant.one_node import untraced


@dataclass
class QdqSpec:
    scale: torch.Tensor  # float32, ONNX layout: scalar, 1-D per-axis, or same-rank blocked
    zero_point: torch.Tensor  # float32 values of the zero point, same layout
    qtype: formats.OnnxQuantType  # the type emitted (int8/uint8/int16/fp8)
    granularity: Granularity
    lo: torch.Tensor | None = None  # float clip bounds broadcastable against x, or None
    hi: torch.Tensor | None = None
    min_opset: int = formats.MIN_OPSET
    format: str = "int8"

    @property
    def axis(self) -> int:
        return self.granularity.axis if self.granularity.axis is not None else 1

    @property
    def block_size(self) -> int:
        return self.granularity.block_size or 0


def export_amax(amax: torch.Tensor) -> torch.Tensor:
    """amax as a graph constant: the TorchScript exporter hands constants (not parameters) to ``symbolic``;
    made with the tracer off, so the trace records the constant and not the reads that made it."""
    with untraced():
        return torch.tensor(amax.detach().cpu().tolist(), dtype=torch.float32)


def constant_value(v, what: str) -> torch.Tensor:
    """The value of a constant input to a symbolic function (amax, min/max range)."""
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


def _granularity(amax: torch.Tensor, x_shape) -> tuple[Granularity, tuple[int, ...]]:
    if amax.numel() == 1:
        return Granularity("tensor"), tuple(x_shape or ())
    shape = (
        tuple(x_shape) if x_shape is not None and all(s is not None for s in x_shape) else tuple(amax.shape)
    )
    try:
        return granularity_of(tuple(amax.shape), shape), shape
    except ValueError as e:
        raise ExportError(str(e)) from None


def _dead_clip(a: torch.Tensor, gran: Granularity, shape, lo_code: float, hi_code: float, bound: float):
    a_e = expand_amax(a, shape) if gran.kind == "block" else a
    s_e = arithmetic.symmetric_scale(a_e, bound)
    d_e = arithmetic.dead_mask(a_e)
    zero = torch.zeros((), dtype=torch.float32)
    lo = torch.where(d_e, zero, torch.tensor(lo_code, dtype=torch.float32) * s_e)
    hi = torch.where(d_e, zero, torch.tensor(hi_code, dtype=torch.float32) * s_e)
    return lo, hi


def symmetric_spec(amax: torch.Tensor, x_shape, num_bits: int, unsigned: bool, narrow_range: bool) -> QdqSpec:
    a = amax.detach().cpu().to(torch.float32)
    arithmetic.check_num_bits(num_bits)
    arithmetic.check_amax(a)
    try:
        qtype = formats.emitted_type(num_bits, unsigned)
    except ValueError as e:
        raise ExportError(str(e)) from None
    gran, shape = _granularity(a, x_shape)
    bound = arithmetic.symmetric_bound(num_bits, unsigned)
    qmin, qmax = arithmetic.integer_range(num_bits, unsigned, narrow_range)
    lo = hi = None
    if (qmin, qmax) != (qtype.qmin, qtype.qmax) or arithmetic.dead_mask(a).any():
        lo, hi = _dead_clip(a, gran, shape, float(qmin), float(qmax), bound)
    scale = flatten_for_onnx(arithmetic.symmetric_scale(a, bound), gran)
    blocked = gran.kind == "block"
    return QdqSpec(
        scale,
        torch.zeros(scale.shape),
        qtype,
        gran,
        lo,
        hi,
        formats.required_opset(num_bits, unsigned, blocked),
        formats.format_name(num_bits, unsigned, blocked),
    )


def affine_spec(min_range: torch.Tensor, max_range: torch.Tensor, num_bits: int) -> QdqSpec:
    scale, zp = arithmetic.affine_qparams(min_range.detach().cpu(), max_range.detach().cpu(), num_bits)
    if scale.numel() != 1:
        raise ExportError("affine quantization is exported per-tensor only")
    qtype = formats.emitted_type(num_bits, True)
    scale, zp = scale.reshape(()), zp.reshape(())
    qmax = (1 << num_bits) - 1
    lo = hi = None
    if qmax != qtype.qmax:
        lo, hi = (0.0 - zp) * scale, (qmax - zp) * scale
    return QdqSpec(
        scale,
        zp,
        qtype,
        Granularity("tensor"),
        lo,
        hi,
        formats.required_opset(num_bits, True, False),
        formats.format_name(num_bits, True),
    )


def e4m3_spec(amax: torch.Tensor | None, x_shape) -> QdqSpec:
    if amax is None:
        one = torch.ones(())
        return QdqSpec(
            one, torch.zeros(()), formats.FP8_E4M3, Granularity("tensor"), min_opset=19, format="fp8-e4m3"
        )
    a = amax.detach().cpu().to(torch.float32)
    arithmetic.check_amax(a)
    gran, shape = _granularity(a, x_shape)
    lo = hi = None
    if arithmetic.dead_mask(a).any():
        inf = float("inf")
        lo, hi = _dead_clip(a, gran, shape, -inf, inf, arithmetic.FP8_E4M3_MAX)
        lo, hi = torch.nan_to_num(lo, neginf=-inf), torch.nan_to_num(hi, posinf=inf)
    scale = flatten_for_onnx(arithmetic.symmetric_scale(a, arithmetic.FP8_E4M3_MAX), gran)
    return QdqSpec(scale, torch.zeros(scale.shape), formats.FP8_E4M3, gran, lo, hi, 19, "fp8-e4m3")


def check_opset(opset: int, spec: QdqSpec) -> None:
    if opset < spec.min_opset:
        raise ExportError(
            f"{spec.format} quantization needs ONNX opset >= {spec.min_opset}, but the export uses opset "
            f"{opset}; pass --opset {spec.min_opset} or leave --opset out"
        )


# --------------------------------------------------------------------------- TorchScript emission


def _input_shape(x):
    try:
        sizes = x.type().sizes()
    except Exception:
        return None
    return tuple(sizes) if sizes is not None else None


def _zero_point_const(g, spec: QdqSpec):
    if spec.qtype is formats.FP8_E4M3:
        return g.op("Constant", value_t=spec.zero_point.to(torch.float8_e4m3fn))
    native = {formats.INT8.name: torch.int8, formats.UINT8.name: torch.uint8, formats.INT16.name: torch.int16}
    return g.op("Constant", value_t=spec.zero_point.to(native[spec.qtype.name]))


def _attrs(spec: QdqSpec) -> dict:
    if spec.granularity.kind == "axis":
        return {"axis_i": spec.axis}
    if spec.granularity.kind == "block":
        return {"axis_i": spec.axis, "block_size_i": spec.block_size}
    return {}


def emit(g, x, spec: QdqSpec, dequantize: bool = True):
    """``[Max, Min] -> QuantizeLinear [-> DequantizeLinear]`` in a TorchScript graph context."""
    check_opset(g.opset, spec)
    if spec.lo is not None:
        x = g.op("Max", x, g.op("Constant", value_t=spec.lo.to(torch.float32)))
        x = g.op("Min", x, g.op("Constant", value_t=spec.hi.to(torch.float32)))
    scale_c = g.op("Constant", value_t=spec.scale.to(torch.float32))
    zp_c = _zero_point_const(g, spec)
    q = g.op("QuantizeLinear", x, scale_c, zp_c, **_attrs(spec))
    return g.op("DequantizeLinear", q, scale_c, zp_c, **_attrs(spec)) if dequantize else q


def symmetric_qdq(g, x, amax, num_bits=8, unsigned=False, narrow_range=True):
    """``FakeTensorQuantFunction.symbolic``."""
    a = constant_value(amax, "amax")
    return emit(g, x, symmetric_spec(a, _input_shape(x), num_bits, unsigned, narrow_range))


def symmetric_quantize(g, x, amax, num_bits=8, unsigned=False, narrow_range=True):
    """``TensorQuantFunction.symbolic``: the codes (as float) and the reference-API scale ``bound / amax``."""
    a = constant_value(amax, "amax").to(torch.float32)
    q = emit(g, x, symmetric_spec(a, _input_shape(x), num_bits, unsigned, narrow_range), dequantize=False)
    bound = arithmetic.symmetric_bound(num_bits, unsigned)
    quant_scale = torch.where(a > 0, bound / torch.where(a > 0, a, 1.0), torch.ones_like(a))
    return g.op("Cast", q, to_i=1), g.op("Constant", value_t=quant_scale)


def affine_qdq(g, x, min_range, max_range, num_bits=8):
    """``FakeAffineTensorQuantFunction.symbolic``: uint grid with the zero point in the graph."""
    lo = constant_value(min_range, "min_range")
    hi = constant_value(max_range, "max_range")
    return emit(g, x, affine_spec(torch.as_tensor(lo), torch.as_tensor(hi), num_bits))


def e4m3_qdq(g, x, amax=None, E=4, M=3):
    """``ScaledE4M3Function.symbolic``: float8e4m3fn zero point (saturating), opset >= 19."""
    if (E, M) != (4, 3):
        raise ExportError(f"only FP8 E4M3 exports to ONNX, got E={E}, M={M}")
    if amax is None or (hasattr(amax, "node") and amax.node().mustBeNone()):
        return emit(g, x, e4m3_spec(None, None))
    return emit(g, x, e4m3_spec(constant_value(amax, "amax"), _input_shape(x)))


def int32_bias_dq(g, codes, scale):
    """``Int32BiasFunction.symbolic``: ``DequantizeLinear`` of int32 bias codes, per output channel (axis
    0)."""
    c = constant_value(codes, "bias codes").to(torch.float32)
    s = constant_value(scale, "bias scale").to(torch.float32).reshape(-1)
    codes_c = g.op("Constant", value_t=c.to(torch.int32))
    scale_c = g.op("Constant", value_t=s)
    zp_c = g.op("Constant", value_t=torch.zeros(s.shape, dtype=torch.int32))
    return g.op("DequantizeLinear", codes_c, scale_c, zp_c, axis_i=0)
