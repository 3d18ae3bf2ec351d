"""``QuantDescriptor`` (alias ``ScaledQuantDescriptor``): how one tensor is quantized.

Fields and semantics follow NVIDIA pytorch-quantization's ``tensor_quant.ScaledQuantDescriptor``. A descriptor
is immutable; ``dict()`` returns only the fields that differ from their defaults and
``QuantDescriptor(**d.dict())`` rebuilds an equal descriptor; ``to_yaml``/``from_yaml`` round-trip through
human-readable YAML.
"""

from __future__ import annotations

import math
from typing import Any

from quantcli.quant.arithmetic import check_num_bits

_DEFAULTS: dict[str, Any] = {
    "num_bits": 8,
    "name": None,
    "fake_quant": True,
    "axis": None,
    "block_sizes": None,
    "amax": None,
    "learn_amax": False,
    "scale_amax": None,
    "calib_method": "max",
    "unsigned": False,
    "narrow_range": False,
    "dynamic": False,
    "asymmetric": False,
}
FIELDS = tuple(_DEFAULTS)
_BLOCK_SPECIAL = ("type", "scale_bits", "scale_block_sizes")
CALIB_METHODS = ("max", "histogram")


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {v!r}")
    return v


def _num_bits(v: Any) -> int | tuple[int, int]:
    if isinstance(v, (list, tuple)):
        if len(v) != 2 or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
            raise TypeError(f"num_bits as a tuple must be (E, M) integers, got {v!r}")
        if tuple(v) != (4, 3):
            raise ValueError(f"the only floating-point format is FP8 E4M3, num_bits=(4, 3); got {tuple(v)}")
        return (4, 3)
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"num_bits must be an int or an (E, M) tuple, got {v!r}")
    return check_num_bits(v)


def format_name(num_bits, unsigned: bool = False, blocked: bool = False, asymmetric: bool = False) -> str:
    """Human name of a quantization format, as summaries, errors, ``inspect`` and module reprs print it:
    ``int8``, ``uint4``, ``fp8-e4m3``; an asymmetric grid (unsigned, with a zero point) adds `` asymmetric``
    and a blocked integer grid `` blocked``. ``num_bits``: an int, or ``(E, M)`` (FP8 E4M3, the only float
    format)."""
    if isinstance(num_bits, (list, tuple)):
        return "fp8-e4m3"
    name = f"{'uint' if unsigned or asymmetric else 'int'}{num_bits}"
    return name + (" asymmetric" if asymmetric else "") + (" blocked" if blocked else "")


def to_plain(x: Any) -> Any:
    """``x`` with every tuple turned into a list, through nested dicts, lists and tuples: what YAML
    ``safe_dump``, JSON and a ``weights_only`` checkpoint hold (``num_bits: (4, 3)``, axis tuples...)."""
    if isinstance(x, (tuple, list)):
        return [to_plain(i) for i in x]
    if isinstance(x, dict):
        return {k: to_plain(v) for k, v in x.items()}
    return x


def _axis(v: Any) -> int | tuple[int, ...] | None:
    if v is None:
        return None
    if isinstance(v, (list, tuple)):
        if not v or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
            raise TypeError(f"axis must be None, an int or a tuple of ints, got {v!r}")
        return tuple(v) if len(v) > 1 else v[0]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"axis must be None, an int or a tuple of ints, got {v!r}")
    return v


def _int_key(k: Any) -> int | str:
    if isinstance(k, str) and k not in _BLOCK_SPECIAL:
        try:
            return int(k)
        except ValueError:
            raise ValueError(
                f"block_sizes key {k!r} is neither an axis nor one of {_BLOCK_SPECIAL}"
            ) from None
    return k


def _block_sizes(v: Any) -> dict | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise TypeError(f"block_sizes must be a dict {{axis: size}}, got {v!r}")
    out: dict = {}
    for k, size in v.items():
        k = _int_key(k)
        if k == "type":
            if size not in ("static", "dynamic"):
                raise ValueError(f"block_sizes['type'] must be 'static' or 'dynamic', got {size!r}")
        elif k == "scale_bits":
            _num_bits(size)
        elif k == "scale_block_sizes":
            _block_sizes(size)
        elif isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"block_sizes keys must be axes (ints), got {k!r}")
        elif isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"block size for axis {k} must be a positive int, got {size!r}")
        out[k] = tuple(size) if isinstance(size, list) else size
    if not any(isinstance(k, int) for k in out):
        raise ValueError(f"block_sizes {v!r} names no axis")
    return out


def _amax(v: Any) -> float | list | None:
    if v is None:
        return None
    if hasattr(v, "tolist"):  # numpy array or tensor
        v = v.tolist()
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        v = float(v)
        vals = [v]
    elif isinstance(v, (list, tuple)):
        v = [float(x) if not isinstance(x, list) else x for x in v]
        vals = list(_flatten(v))
    else:
        raise TypeError(f"amax must be a float or a list/array of floats, got {v!r}")
    for x in vals:
        if not math.isfinite(x) or x < 0:
            raise ValueError(f"amax must be finite and >= 0, got {x}")
    return v


def _flatten(v):
    for x in v:
        if isinstance(x, list):
            yield from _flatten(x)
        else:
            yield float(x)


class ScaledQuantDescriptor:
    """Describes how a tensor is quantized. See the module docstring and the seed API for each field.

    Args:
        num_bits: int 2..16 for integer quantization, or ``(4, 3)`` for FP8 E4M3.
        name: a label.
        fake_quant: quantize-dequantize (True) or return integer codes (False).
        axis: None (per-tensor), int or tuple: the axes that keep their own amax.
        block_sizes: ``{axis: size, "type": "static"|"dynamic", "scale_bits": ..., "scale_block_sizes":
            ...}``; axis must be None with it.
        amax: a fixed amax (float or nested list).
        learn_amax: make amax a learnable parameter.
        scale_amax: multiply the calibrated amax by this (both ends of an asymmetric quantizer's range).
        calib_method: ``"max"`` or ``"histogram"``.
        unsigned: unsigned integer grid.
        narrow_range: signed grid ``[-bound, bound]`` instead of ``[-bound-1, bound]``.
        dynamic: compute amax on the fly instead of calibrating it. With ``asymmetric``: ONNX
            ``DynamicQuantizeLinear`` (uint8, scale and zero point from each tensor's own min and max).
        asymmetric: (quantcli addition) affine quantization on an unsigned grid with a zero point, calibrated
            from the running min and max (``FakeAffineTensorQuantFunction``); per-tensor, integer formats
            only.
    """

    def __init__(self, num_bits=8, name=None, **kwargs):
        unknown = sorted(set(kwargs) - set(FIELDS))
        if unknown:
            raise TypeError(f"unknown QuantDescriptor field(s) {unknown}; known: {list(FIELDS)}")
        v = dict(_DEFAULTS)
        v.update(kwargs)
        self._num_bits = _num_bits(num_bits)
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str, got {name!r}")
        self._name = name
        self._fake_quant = _bool("fake_quant", v["fake_quant"])
        self._axis = _axis(v["axis"])
        self._block_sizes = _block_sizes(v["block_sizes"])
        if self._axis is not None and self._block_sizes is not None:
            raise ValueError(
                "axis must be None when block_sizes is given (blocks already define the granularity)"
            )
        self._amax = _amax(v["amax"])
        self._learn_amax = _bool("learn_amax", v["learn_amax"])
        sa = v["scale_amax"]
        if sa is not None and (isinstance(sa, bool) or not isinstance(sa, (int, float)) or sa <= 0):
            raise ValueError(f"scale_amax must be a positive number, got {sa!r}")
        self._scale_amax = float(sa) if sa is not None else None
        if v["calib_method"] not in CALIB_METHODS:
            raise ValueError(f"calib_method must be one of {CALIB_METHODS}, got {v['calib_method']!r}")
        self._calib_method = v["calib_method"]
        self._unsigned = _bool("unsigned", v["unsigned"])
        self._narrow_range = _bool("narrow_range", v["narrow_range"])
        self._dynamic = _bool("dynamic", v["dynamic"])
        if self.is_fp8 and self._unsigned:
            raise ValueError("FP8 E4M3 is signed; unsigned=True does not apply")
        self._asymmetric = _bool("asymmetric", v["asymmetric"])
        if self._asymmetric and (self.is_fp8 or self._axis is not None or self._block_sizes is not None):
            raise ValueError(
                "asymmetric quantization is per-tensor and integer-only (no axis, block_sizes or FP8)"
            )
        if self._asymmetric and self._dynamic and self._num_bits != 8:
            raise ValueError(
                "dynamic asymmetric quantization is ONNX DynamicQuantizeLinear, which is uint8 "
                "only: "
                f"num_bits must be 8, got {self._num_bits}"
            )

    num_bits = property(lambda self: self._num_bits, doc="int bits, or (E, M) for FP8.")
    name = property(lambda self: self._name)
    fake_quant = property(lambda self: self._fake_quant)
    axis = property(lambda self: self._axis)
    block_sizes = property(lambda self: self._block_sizes)
    amax = property(lambda self: self._amax)
    learn_amax = property(lambda self: self._learn_amax)
    scale_amax = property(lambda self: self._scale_amax)
    calib_method = property(lambda self: self._calib_method)
    unsigned = property(lambda self: self._unsigned)
    narrow_range = property(lambda self: self._narrow_range)
    asymmetric = property(lambda self: self._asymmetric)

    @property
    def dynamic(self) -> bool:
        """True if amax is computed on the fly (``dynamic=True`` or block type ``"dynamic"``)."""
        return self._dynamic or bool(self._block_sizes and self._block_sizes.get("type") == "dynamic")

    @property
    def is_fp8(self) -> bool:
        return self._num_bits == (4, 3)

    @property
    def format_name(self) -> str:
        """``int8``, ``uint4``, ``fp8-e4m3``, ``uint8 asymmetric``...: see :func:`format_name`."""
        return format_name(self._num_bits, self._unsigned, asymmetric=self._asymmetric)

    @staticmethod
    def get_block_quant_axes_and_sizes(block_sizes: dict | None) -> dict[int, int]:
        """The ``{axis: size}`` part of ``block_sizes`` (special string keys dropped)."""
        if not block_sizes:
            return {}
        return {k: v for k, v in block_sizes.items() if isinstance(k, int) and not isinstance(k, bool)}

    def dict(self) -> dict[str, Any]:
        """Fields that differ from their defaults (``QuantDescriptor(**d.dict()) == d``)."""
        out = {}
        for k in FIELDS:
            val = getattr(self, "_" + k)
            if val != _DEFAULTS[k]:
                out[k] = val
        return out

    def replace(self, **changes) -> ScaledQuantDescriptor:
        """A copy with some fields changed (validated again)."""
        d = self.dict()
        d.update(changes)
        return type(self)(**d)

    def to_yaml(self) -> str:
        """Human-readable YAML of :meth:`dict` (tuples as lists)."""
        import yaml

        return yaml.safe_dump(to_plain(self.dict()), sort_keys=False, default_flow_style=None)

    @classmethod
    def from_yaml(cls, yaml_str: str) -> ScaledQuantDescriptor:
        """Create a descriptor from YAML written by :meth:`to_yaml` (or by hand)."""
        import yaml

        data = yaml.safe_load(yaml_str) or {}
        if not isinstance(data, dict):
            raise TypeError(f"descriptor YAML must be a mapping, got {type(data).__name__}")
        return cls(**data)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ScaledQuantDescriptor) and self.dict() == other.dict()

    def __hash__(self) -> int:
        return hash(repr(self))

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self.dict().items())
        return f"QuantDescriptor({body})"


QuantDescriptor = ScaledQuantDescriptor
