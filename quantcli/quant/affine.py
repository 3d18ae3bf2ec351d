"""Functional affine quantization: scale, zero point / offset, and ``block_size`` granularity.

Two reference APIs live here, with quantcli's one arithmetic underneath (:mod:`quantcli.quant.arithmetic`):

* torchao (``torchao.quantization``): :func:`quantize_affine`, :func:`dequantize_affine`,
  :func:`choose_qparams_affine`, :class:`ZeroPointDomain`, :class:`MappingType`, :class:`FakeQuantizeConfig`.
* AIMET (``aimet_torch.quantization.affine``): :func:`quantize`, :func:`dequantize`,
  :func:`quantize_dequantize` with ``bitwidth`` / ``num_steps`` / ``qmin, qmax`` overloads.

Where those libraries' implementations differ from ONNX, quantcli follows ONNX ``QuantizeLinear``: it divides
by the float32 scale (torchao multiplies by ``1/scale``), rounds half to even, then adds the integer zero
point and saturates. AIMET's ``offset`` is subtracted after rounding, i.e. ``offset = -zero_point``.

``block_size`` has one entry per input dimension: the number of consecutive elements sharing one scale.
Per-tensor is the input's shape, per-axis 0 is ``(1, n1, n2, ...)``, per-group along the last axis is
``(1, ..., group)``. In the AIMET functions an entry of -1 means "infer from the scale's shape".
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from quantcli.quant import arithmetic

__all__ = [
    "ZeroPointDomain",
    "MappingType",
    "quantize_affine",
    "dequantize_affine",
    "choose_qparams_affine",
    "quantize",
    "dequantize",
    "quantize_dequantize",
    "FakeQuantizeConfig",
    "PerTensor",
    "PerAxis",
    "PerGroup",
    "PerToken",
    "dtype_range",
]


class ZeroPointDomain(enum.Enum):
    """Where the zero point lives. INT: added to the rounded code. FLOAT: subtracted from x before
    dividing by the scale (``q = round((x - zp) / scale)``). NONE: no zero point."""

    INT = "int"
    FLOAT = "float"
    NONE = "none"


class MappingType(enum.Enum):
    SYMMETRIC = "symmetric"
    ASYMMETRIC = "asymmetric"


_SUB_BYTE = {getattr(torch, f"int{i}"): (i, True) for i in range(1, 8)}
_SUB_BYTE.update({getattr(torch, f"uint{i}"): (i, False) for i in range(1, 8)})


def dtype_range(dtype: torch.dtype) -> tuple[int, int]:
    """``(quant_min, quant_max)`` of an integer dtype, including torch's int1..int7 / uint1..uint7."""
    if dtype in _SUB_BYTE:
        bits, signed = _SUB_BYTE[dtype]
        return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    if dtype.is_floating_point or dtype == torch.bool:
        raise ValueError(f"{dtype} is not an integer dtype")
    info = torch.iinfo(dtype)
    return int(info.min), int(info.max)


def _container(dtype: torch.dtype) -> torch.dtype:
    """The dtype that stores codes of ``dtype`` (sub-byte types live in int8/uint8)."""
    if dtype in _SUB_BYTE:
        return torch.int8 if _SUB_BYTE[dtype][1] else torch.uint8
    return dtype


def _check_block_size(block_size, shape) -> tuple[int, ...]:
    block_size = tuple(int(b) for b in block_size)
    if len(block_size) != len(shape):
        raise ValueError(f"block_size {block_size} must have one entry per input dimension {tuple(shape)}")
    for d, (b, n) in enumerate(zip(block_size, shape)):
        if b <= 0 or n % b:
            raise ValueError(f"block_size[{d}] = {b} must be positive and divide the input size {n}")
    return block_size


def _expand(param, shape, block_size) -> torch.Tensor:
    """Broadcast a per-block parameter of shape ``shape // block_size`` to the full input shape."""
    if not isinstance(param, torch.Tensor):
        return torch.tensor(param, dtype=torch.float32)
    nblocks = tuple(n // b for n, b in zip(shape, block_size))
    if param.numel() == 1:
        return param.reshape(())
    if param.numel() != math.prod(nblocks):
        raise ValueError(
            f"parameter of shape {tuple(param.shape)} does not match {nblocks} blocks "
            f"(input {tuple(shape)}, block_size {tuple(block_size)})"
        )
    out = param.reshape(nblocks)
    for d, b in enumerate(block_size):
        if b > 1 and nblocks[d] > 1:
            out = out.repeat_interleave(b, dim=d)
    return out


def _block_reduce(x: torch.Tensor, block_size, fn) -> torch.Tensor:
    """Reduce ``x`` over each block with ``fn`` ("amin"/"amax"); returns shape ``shape // block_size``."""
    shape = x.shape
    split = []
    for n, b in zip(shape, block_size):
        split += [n // b, b]
    xv = x.reshape(split)
    dims = tuple(range(1, 2 * len(shape), 2))
    return getattr(xv, fn)(dim=dims)


def quantize_affine(
    input: torch.Tensor,
    block_size: tuple[int, ...],
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    output_dtype: torch.dtype,
    quant_min: int | float | None = None,
    quant_max: int | float | None = None,
    zero_point_domain: ZeroPointDomain = ZeroPointDomain.INT,
) -> torch.Tensor:
    """Quantize ``input`` with one ``scale``/``zero_point`` per block (torchao signature).

    ``scale`` and ``zero_point`` have ``input.shape[d] // block_size[d]`` entries along each dimension (any
    shape with that many elements). Returns codes in ``output_dtype`` (int8/uint8 containers for sub-byte
    dtypes). INT domain: ``clamp(round(x / scale) + zp)``; FLOAT domain: ``clamp(round((x - zp) / scale))``.
    """
    block_size = _check_block_size(block_size, input.shape)
    dmin, dmax = dtype_range(output_dtype)
    qmin = dmin if quant_min is None else int(quant_min)
    qmax = dmax if quant_max is None else int(quant_max)
    if not dmin <= qmin <= qmax <= dmax:
        raise ValueError(f"[{qmin}, {qmax}] is not inside the range [{dmin}, {dmax}] of {output_dtype}")
    s = _expand(scale, input.shape, block_size).to(input.device)
    if zero_point_domain is ZeroPointDomain.FLOAT:
        zp = _expand(zero_point, input.shape, block_size).to(input.device).to(torch.float32)
        q = arithmetic.quantize_linear(input.to(torch.float32) - zp, s, 0, qmin, qmax)
    elif zero_point_domain is ZeroPointDomain.NONE or zero_point is None:
        q = arithmetic.quantize_linear(input, s, 0, qmin, qmax)
    else:
        zp = _expand(zero_point, input.shape, block_size).to(input.device).to(torch.float32)
        q = arithmetic.quantize_linear(input, s, zp, qmin, qmax)
    return q.to(_container(output_dtype))


def dequantize_affine(
    input: torch.Tensor,
    block_size: tuple[int, ...],
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    input_dtype: torch.dtype | None = None,
    quant_min: int | float | None = None,
    quant_max: int | float | None = None,
    zero_point_domain: ZeroPointDomain = ZeroPointDomain.INT,
    *,
    output_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_affine`: ``(q - zp) * scale`` (INT) or ``q * scale + zp`` (FLOAT)."""
    block_size = _check_block_size(block_size, input.shape)
    s = _expand(scale, input.shape, block_size).to(input.device)
    if zero_point is None or zero_point_domain is ZeroPointDomain.NONE:
        out = arithmetic.dequantize_linear(input, s)
    elif zero_point_domain is ZeroPointDomain.FLOAT:
        zp = _expand(zero_point, input.shape, block_size).to(input.device).to(torch.float32)
        out = arithmetic.dequantize_linear(input, s) + zp
    else:
        zp = _expand(zero_point, input.shape, block_size).to(input.device).to(torch.float32)
        out = arithmetic.dequantize_linear(input, s, zp)
    return out.to(output_dtype)


def choose_qparams_affine(
    input: torch.Tensor,
    mapping_type: MappingType,
    block_size: tuple[int, ...],
    target_dtype: torch.dtype,
    quant_min: int | None = None,
    quant_max: int | None = None,
    eps: float | None = None,
    scale_dtype: torch.dtype | None = None,
    zero_point_dtype: torch.dtype | None = None,
    preserve_zero: bool = True,
    zero_point_domain: ZeroPointDomain = ZeroPointDomain.INT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero_point)`` per block, each of shape ``input.shape // block_size``.

    SYMMETRIC: ``zp = (qmin + qmax + 1) // 2`` (0 for signed types) and ``scale = max|x| / (qmax - zp)``:
    for int8 that is ``amax / 127``, quantcli's symmetric scale ``amax / bound`` (torchao divides by 127.5
    instead).
    ASYMMETRIC: the block's ``[min(x, 0), max(x, 0)]`` spread over ``[qmin, qmax]``, with the zero point
    (INT domain) the code of 0.0, or (FLOAT domain) the float value of code 0 offset so that ``min -> qmin``.
    ``eps`` floors the scale (default: the float32 machine epsilon); a dead block gets scale ``eps``.
    """
    block_size = _check_block_size(block_size, input.shape)
    dmin, dmax = dtype_range(target_dtype)
    qmin = dmin if quant_min is None else int(quant_min)
    qmax = dmax if quant_max is None else int(quant_max)
    eps = torch.finfo(torch.float32).eps if eps is None else float(eps)
    x = input.detach().to(torch.float32)
    mn = _block_reduce(x, block_size, "amin")
    mx = _block_reduce(x, block_size, "amax")
    if preserve_zero:
        mn, mx = mn.clamp(max=0.0), mx.clamp(min=0.0)
    if mapping_type is MappingType.SYMMETRIC:
        zp_int = (qmin + qmax + 1) // 2
        max_abs = torch.maximum(-mn, mx)
        scale = (max_abs / float(qmax - zp_int)).clamp(min=eps)
        zp = torch.full_like(scale, float(zp_int))
        if zero_point_domain is ZeroPointDomain.FLOAT:
            zp = -scale * zp_int
    elif mapping_type is MappingType.ASYMMETRIC:
        scale = ((mx - mn) / float(qmax - qmin)).clamp(min=eps)
        if zero_point_domain is ZeroPointDomain.FLOAT:
            zp = mn - scale * qmin
        else:
            zp = torch.clamp(qmin - torch.round(mn / scale), qmin, qmax)
    else:
        raise ValueError(f"unknown mapping_type {mapping_type!r}")
    if zero_point_domain is ZeroPointDomain.NONE:
        zp = torch.zeros_like(scale)
    scale = scale.to(scale_dtype or torch.float32)
    if zero_point_dtype is not None:
        zp = zp.to(zero_point_dtype)
    return scale, zp


# --------------------------------------------------------------------------------------------- AIMET style


def _aimet_range(bitwidth, num_steps, qmin, qmax, signed) -> tuple[int, int]:
    given = sum(v is not None for v in (bitwidth, num_steps)) + (qmin is not None or qmax is not None)
    if given != 1:
        raise TypeError("give exactly one of bitwidth, num_steps=, or qmin=/qmax=")
    if bitwidth is not None:
        if isinstance(bitwidth, bool) or not isinstance(bitwidth, int) or not 1 <= bitwidth <= 32:
            raise ValueError(f"bitwidth must be an int in 1..32, got {bitwidth!r}")
        return (-(1 << (bitwidth - 1)), (1 << (bitwidth - 1)) - 1) if signed else (0, (1 << bitwidth) - 1)
    if num_steps is not None:
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
        return (-math.ceil(num_steps / 2), num_steps // 2) if signed else (0, num_steps)
    if qmin is None or qmax is None or int(qmin) >= int(qmax):
        raise ValueError(f"need qmin < qmax, got qmin={qmin}, qmax={qmax}")
    return int(qmin), int(qmax)


def _aimet_block_size(tensor, scale, block_size):
    if block_size is None:
        if scale.numel() == 1:
            return tuple(tensor.shape)
        # per-channel style: scale broadcasts against the tensor
        s = scale.reshape((1,) * (tensor.dim() - scale.dim()) + tuple(scale.shape))
        return tuple(n if m == 1 else n // m for n, m in zip(tensor.shape, s.shape))
    block_size = tuple(block_size)
    if len(block_size) != tensor.dim():
        raise ValueError(
            f"block_size {block_size} must have one entry per dimension of {tuple(tensor.shape)}"
        )
    s_shape = (1,) * (tensor.dim() - scale.dim()) + tuple(scale.shape)
    out = []
    for d, (b, n, m) in enumerate(zip(block_size, tensor.shape, s_shape)):
        if b == -1:
            if n % m:
                raise ValueError(f"scale size {m} does not divide dimension {d} of size {n}")
            b = n // m
        out.append(b)
    return tuple(out)


def _aimet_params(tensor, scale, offset, block_size):
    scale = torch.as_tensor(scale, dtype=torch.float32, device=tensor.device)
    offset = torch.as_tensor(offset, dtype=torch.float32, device=tensor.device)
    bs = _aimet_block_size(tensor, scale, block_size)
    bs = _check_block_size(bs, tensor.shape)
    return _expand(scale, tensor.shape, bs), _expand(offset, tensor.shape, bs).to(tensor.device)


def quantize(
    tensor,
    scale,
    offset,
    bitwidth=None,
    signed=False,
    block_size=None,
    *,
    num_steps=None,
    qmin=None,
    qmax=None,
):
    """AIMET ``quantize``: ``clamp(round(x / scale) - offset, qmin, qmax)`` as a float tensor of codes.

    The range comes from ``bitwidth`` (with ``signed``), ``num_steps`` (with ``signed``) or ``qmin``/``qmax``.
    ``offset`` is AIMET's: the negated ONNX zero point. Ties round half to even and ``x`` is divided by
    the float32 scale, as in ONNX ``QuantizeLinear``.
    """
    lo, hi = _aimet_range(bitwidth, num_steps, qmin, qmax, signed)
    s, off = _aimet_params(tensor, scale, offset, block_size)
    return arithmetic.quantize_linear(tensor, s, -off, lo, hi).to(tensor.dtype)


def dequantize(tensor, scale, offset, block_size=None):
    """AIMET ``dequantize``: ``(q + offset) * scale``."""
    s, off = _aimet_params(tensor, scale, offset, block_size)
    return arithmetic.dequantize_linear(tensor, s, -off).to(
        tensor.dtype if tensor.dtype.is_floating_point else torch.float32
    )


def quantize_dequantize(
    tensor,
    scale,
    offset,
    bitwidth=None,
    signed=False,
    block_size=None,
    *,
    num_steps=None,
    qmin=None,
    qmax=None,
):
    """``dequantize(quantize(...))`` with the same arguments."""
    q = quantize(
        tensor, scale, offset, bitwidth, signed, block_size, num_steps=num_steps, qmin=qmin, qmax=qmax
    )
    return dequantize(q, scale, offset, block_size)


# ------------------------------------------------------------------------------------ FakeQuantizeConfig


@dataclass(frozen=True)
class PerTensor:
    pass


@dataclass(frozen=True)
class PerAxis:
    axis: int = 0


@dataclass(frozen=True)
class PerGroup:
    group_size: int


@dataclass(frozen=True)
class PerToken:
    """One scale per token: per row of the last dimension."""


_GRANULARITY_STRINGS = {"per_token", "per_channel", "per_group", "per_tensor"}


class FakeQuantizeConfig:
    """torchao's ``FakeQuantizeConfig`` (``torchao.quantization.qat``): how to fake-quantize weights or
    activations.

    ``granularity`` may be a string (``"per_token"``, ``"per_channel"`` = ``PerAxis(0)``, ``"per_group"`` with
    ``group_size``, ``"per_tensor"``) or an object; setting only ``group_size`` means per-group. Symmetric by
    default; ``is_symmetric`` may be given instead of ``mapping_type`` (not both, unless they agree).
    """

    def __init__(
        self,
        dtype: torch.dtype,
        granularity=None,
        mapping_type: MappingType | None = None,
        scale_precision: torch.dtype = torch.float32,
        zero_point_precision: torch.dtype = torch.int32,
        zero_point_domain: ZeroPointDomain = ZeroPointDomain.INT,
        is_dynamic: bool = True,
        range_learning: bool = False,
        eps: float | None = None,
        *,
        group_size: int | None = None,
        is_symmetric: bool | None = None,
    ):
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype such as torch.int8 or torch.int4, got {dtype!r}")
        self.quant_min, self.quant_max = dtype_range(dtype)
        self.dtype = dtype
        self.granularity = self._granularity(granularity, group_size)
        self.group_size = self.granularity.group_size if isinstance(self.granularity, PerGroup) else None
        if mapping_type is not None and is_symmetric is not None:
            implied = MappingType.SYMMETRIC if is_symmetric else MappingType.ASYMMETRIC
            if implied is not mapping_type:
                raise ValueError(f"mapping_type={mapping_type} contradicts is_symmetric={is_symmetric}")
        if mapping_type is None:
            mapping_type = MappingType.ASYMMETRIC if is_symmetric is False else MappingType.SYMMETRIC
        if not isinstance(mapping_type, MappingType):
            raise TypeError(f"mapping_type must be a MappingType, got {mapping_type!r}")
        self.mapping_type = mapping_type
        if range_learning and is_dynamic:
            raise ValueError("range_learning=True needs static scales: set is_dynamic=False")
        self.scale_precision = scale_precision
        self.zero_point_precision = zero_point_precision
        self.zero_point_domain = zero_point_domain
        self.is_dynamic = is_dynamic
        self.range_learning = range_learning
        self.eps = eps

    @staticmethod
    def _granularity(granularity, group_size):
        if isinstance(granularity, str):
            if granularity not in _GRANULARITY_STRINGS:
                raise ValueError(f"granularity {granularity!r} is not one of {sorted(_GRANULARITY_STRINGS)}")
            if granularity == "per_group":
                if group_size is None:
                    raise ValueError("granularity 'per_group' needs group_size=")
                granularity = PerGroup(group_size)
            elif group_size is not None:
                raise ValueError(f"group_size is only used with 'per_group', not {granularity!r}")
            else:
                granularity = {"per_token": PerToken(), "per_channel": PerAxis(0), "per_tensor": PerTensor()}[
                    granularity
                ]
        elif granularity is None:
            if group_size is None:
                raise ValueError("set granularity or group_size")
            granularity = PerGroup(group_size)
        elif isinstance(granularity, PerGroup):
            if group_size is not None and group_size != granularity.group_size:
                raise ValueError(f"group_size={group_size} contradicts {granularity}")
        elif not isinstance(granularity, (PerTensor, PerAxis, PerToken)):
            raise TypeError(f"unsupported granularity {granularity!r}")
        elif group_size is not None:
            raise ValueError(f"group_size is only used with per-group granularity, not {granularity}")
        if isinstance(granularity, PerGroup) and (
            isinstance(granularity.group_size, bool)
            or not isinstance(granularity.group_size, int)
            or granularity.group_size <= 0
        ):
            raise ValueError(f"group_size must be a positive int, got {granularity.group_size!r}")
        return granularity

    def block_size(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """torchao ``block_size`` for a tensor of ``shape`` under this granularity."""
        shape = tuple(shape)
        g = self.granularity
        if isinstance(g, PerTensor):
            return shape
        if isinstance(g, PerToken):
            return (1,) * (len(shape) - 1) + (shape[-1],)
        if isinstance(g, PerAxis):
            axis = g.axis % len(shape)
            return tuple(1 if d == axis else n for d, n in enumerate(shape))
        if shape[-1] % g.group_size:
            raise ValueError(f"group_size {g.group_size} does not divide the last dimension {shape[-1]}")
        return (1,) * (len(shape) - 1) + (g.group_size,)

    def to_descriptor(self, shape: tuple[int, ...] | None = None):
        """The :class:`~quantcli.quant.descriptor.QuantDescriptor` for symmetric configs (what quantize_model
        uses).

        Per-channel becomes ``axis``, per-group ``block_sizes={-1: group_size}``, per-token ``axis=(0..n-2)``
        (needs ``shape``). Asymmetric configs have no symmetric descriptor: use :meth:`fake_quantize`.
        """
        from quantcli.quant.descriptor import QuantDescriptor

        if self.mapping_type is not MappingType.SYMMETRIC:
            raise ValueError("an asymmetric FakeQuantizeConfig has no symmetric QuantDescriptor")
        signed = self.quant_min < 0
        num_bits = int(math.log2(self.quant_max - self.quant_min + 1))
        kw = {
            "num_bits": num_bits,
            "unsigned": not signed,
            "dynamic": self.is_dynamic,
            "learn_amax": self.range_learning,
        }
        g = self.granularity
        if isinstance(g, PerAxis):
            kw["axis"] = g.axis
        elif isinstance(g, PerGroup):
            kw["block_sizes"] = {-1: g.group_size}
        elif isinstance(g, PerToken):
            if shape is None:
                raise ValueError("per-token granularity needs the tensor shape")
            kw["axis"] = tuple(range(len(shape) - 1)) if len(shape) > 2 else 0
        return QuantDescriptor(**kw)

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Dynamic fake quantization of ``x``: choose qparams per block from ``x``, quantize, dequantize."""
        bs = self.block_size(tuple(x.shape))
        scale, zp = choose_qparams_affine(
            x,
            self.mapping_type,
            bs,
            self.dtype,
            self.quant_min,
            self.quant_max,
            self.eps,
            self.scale_precision,
            None,
            True,
            self.zero_point_domain,
        )
        q = quantize_affine(
            x, bs, scale, zp, self.dtype, self.quant_min, self.quant_max, self.zero_point_domain
        )
        return dequantize_affine(
            q,
            bs,
            scale,
            zp,
            self.dtype,
            self.quant_min,
            self.quant_max,
            self.zero_point_domain,
            output_dtype=x.dtype,
        )

    def __repr__(self) -> str:
        return (
            f"FakeQuantizeConfig(dtype={self.dtype}, granularity={self.granularity}, "
            f"mapping_type={self.mapping_type}, is_dynamic={self.is_dynamic})"
        )
