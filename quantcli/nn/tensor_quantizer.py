"""``TensorQuantizer``: a module that holds a descriptor, an ``amax`` buffer and a calibrator.

Modes: ``"calibrate"`` (observe only: collect statistics, return the input unchanged), ``"quantize"``
(fake-quantize with amax) and ``"disabled"`` (identity).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from calibrators import HistogramCalibrator, MaxCalibrator, MinMaxCalibrator, shared
from calibrators.base import normalize_axis
from calibrators.max import max_abs
from calibrators.methods import HISTOGRAM_METHODS, defined_for
from calibrators.two_sided import METHODS as TWO_SIDED_METHODS
from calibrators.two_sided_calibrator import TwoSidedHistogramCalibrator
from quantcli import defaults
from quantcli.errors import CalibrationError, CheckpointError, ConfigError, ExportError
from quantcli.nn.amax_checks import check_now
from quantcli.quant import arithmetic
from quantcli.quant.descriptor import QuantDescriptor
from quantcli.quant.granularity import block_of
from quantcli.quant.tensor_quant import (
    FakeAffineTensorQuantFunction,
    FakeDynamicQuantFunction,
    FakeTensorQuantFunction,
    ScaledE4M3Function,
)

MODES = ("calibrate", "quantize", "disabled")


class TensorQuantizer(nn.Module):
    """Quantizes one tensor as its :class:`QuantDescriptor` says.

    ``amax`` is a buffer (``None`` until calibrated) and appears in ``state_dict`` once set; its shape keeps
    the rank of the tensor for per-axis (``(C, 1, 1, 1)``) and is ``shape // block`` along the blocked axis.
    """

    #: while an exporter traces, the op it computes this quantizer's output with
    # (:mod:`quantcli.nn.export_hooks`)
    export_hook: Callable[[torch.Tensor], torch.Tensor] | None = None
    #: while exporting, the value a weight quantizer's input computed from parameters took on the example
    #: batch, quantized in its place so that the graph stores it (:mod:`quantcli.nn.derived_weights`)
    constant_input: torch.Tensor | None = None

    def __init__(self, desc: QuantDescriptor | None = None, name: str | None = None, enabled: bool = True):
        super().__init__()
        self.desc = desc or QuantDescriptor()
        self.name = name
        self.enabled = enabled
        self.mode = "quantize" if enabled else "disabled"
        self.calibrator = None
        self.histogram = None  # the last histogram calibrator, after calibration with a histogram method
        amax = None if self.desc.amax is None else torch.tensor(self.desc.amax, dtype=torch.float32)
        self.register_buffer("amax", amax)
        self.register_buffer("amin", None)  # asymmetric quantizers: the calibrated minimum (<= 0)
        blocks = QuantDescriptor.get_block_quant_axes_and_sizes(self.desc.block_sizes)
        if len(blocks) > 1:
            raise ConfigError(
                f"{name}: block quantization along several axes {sorted(blocks)} is not "
                f"supported "
                "(ONNX QuantizeLinear blocks one axis)"
            )
        self._block = next(iter(blocks.items()), None)
        if self.desc.learn_amax and amax is not None:
            self.set_amax(amax)  # becomes a Parameter

    #: attributes that never hold a parameter, buffer or module: set without ``Module.__setattr__``'s checks
    #: (a calibration sets each a few times per quantizer: on a GPU's host a millisecond in a few hundred)
    _PLAIN = frozenset({"mode", "calibrator", "histogram"})

    def __setattr__(self, name: str, value) -> None:
        if name in TensorQuantizer._PLAIN and name in self.__dict__:
            self.__dict__[name] = value
        else:
            super().__setattr__(name, value)

    @property
    def dynamic_uint8(self) -> bool:
        """Quantized at run time as ONNX ``DynamicQuantizeLinear`` does (``dynamic`` + ``asymmetric``): no
        amax."""
        return self.desc.dynamic and self.desc.asymmetric

    # ------------------------------------------------------------------------------------------- modes
    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode if self.enabled else "disabled"

    def start_calibration(self, method: str = "max", num_bins: int = defaults.NUM_BINS) -> None:
        """Attach a fresh calibrator and switch to observing."""
        if not self.enabled or self.desc.dynamic:
            return
        use_hist = method in HISTOGRAM_METHODS
        axis = None if self._block is not None else self.desc.axis  # blocks: collect() sets the block axes
        nb = self.desc.num_bits
        bits = nb if isinstance(nb, int) else tuple(nb)
        if self.desc.asymmetric and method in TWO_SIDED_METHODS:
            self.calibrator = TwoSidedHistogramCalibrator(bits, num_bins=num_bins, name=self.name)
        elif self.desc.asymmetric:
            self.calibrator = MinMaxCalibrator(bits, name=self.name)
        elif use_hist:
            self.calibrator = HistogramCalibrator(
                bits, axis, self.desc.unsigned, num_bins=num_bins, name=self.name
            )
        else:
            self.calibrator = MaxCalibrator(bits, axis, self.desc.unsigned, name=self.name)
        self.set_mode("calibrate")

    def _blocked_view(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        axis, size = self._block
        d = axis % x.dim()
        n = x.shape[d]
        size = min(size, n)
        blocks = -(-n // size)
        if block_of(n, blocks) != size:
            raise ConfigError(
                f"{self.name}: blocks of {size} along dimension {d} of size {n} cannot be told from blocks "
                f"of {block_of(n, blocks)} by amax's shape; use a power-of-two block size or a "
                "divisor"
            )
        if n % size:  # the last block is partial: zeros fill it (they change no block's max |x|)
            if isinstance(self.calibrator, HistogramCalibrator):
                raise ConfigError(
                    f"{self.name}: dimension {d} of size {n} is not a multiple of the block size {size}; "
                    f"histogram calibration of a partial last block is not supported"
                )
            pad = [0, 0] * (x.dim() - 1 - d) + [0, blocks * size - n]
            x = torch.nn.functional.pad(x, pad)
        return x.unflatten(d, (blocks, size)), d

    def collect(self, x: torch.Tensor) -> None:
        if self.calibrator is None:
            raise CalibrationError(f"{self.name}: start_calibration() first")
        # only a layer's input shares what it observed with the quantizers of the same tensor (calibrators.
        # shared): another quantizer's tensor may be changed in place before anything reads it again
        apart = shared.active() and role(self.name or "") != "input_quantizer"
        outer = shared.suspend() if apart else None
        try:
            if self._block is not None:
                xb, d = self._blocked_view(x)
                self.calibrator.axis = tuple(i for i in range(xb.dim()) if i != d + 1)
                self.calibrator.collect(xb)
            else:
                self.calibrator.collect(x)
        finally:
            if apart:
                shared.resume(outer)

    def calibrate_max(self, x: torch.Tensor) -> torch.Tensor:
        """amax as ``start_calibration("max")``, ``collect(x)`` and ``load_calib_amax()`` set it from the one
        tensor ``x`` (a weight), for a symmetric quantizer, in one reduction (:func:`calibrators.max.max_abs`)
        and with no host read: a NaN or inf in ``x`` gives a non-finite amax, which :meth:`set_amax` refuses.
        Switches to quantizing."""
        if self.desc.asymmetric:
            raise CalibrationError(f"{self.name}: an asymmetric quantizer's range needs its calibrator")
        x = x.detach()
        if self.desc.unsigned and x.numel() and bool(x.min() < 0):  # (a host read for unsigned weights only)
            raise ConfigError(_negative_to_unsigned(self.name, float(x.min())))
        if self._block is not None:
            xb, d = self._blocked_view(x)
            return self._take_amax(max_abs(xb, tuple(i for i in range(xb.dim()) if i != d + 1)))
        return self._take_amax(max_abs(x, normalize_axis(self.desc.axis, x.dim())))

    def _take_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """A calibrated amax (the block axis kept, where blocked) as the quantizer's: the block axis squeezed,
        ``scale_amax`` applied; the calibrator let go and the mode switched to quantizing."""
        if self._block is not None:
            amax = amax.squeeze(self._blocked_axis_after(amax))
        if self.desc.scale_amax is not None:
            amax = amax * self.desc.scale_amax
        self.set_amax(amax)
        self.calibrator = None
        self.set_mode("quantize")
        return self.amax

    def load_calib_amax(self, method: str = "max", **kwargs) -> torch.Tensor:
        """Compute amax from the calibrator (``method`` for histograms), store it, and switch to
        quantizing."""
        if self.calibrator is None:
            raise CalibrationError(f"{self.name}: was never calibrated")
        if isinstance(self.calibrator, (MinMaxCalibrator, TwoSidedHistogramCalibrator)):
            cal = self.calibrator
            if isinstance(cal, MinMaxCalibrator):
                lo, amax = cal.compute_range()
            elif method in TWO_SIDED_METHODS:
                kw = {k: v for k, v in kwargs.items() if k == "percentile" == method}
                lo, amax = cal.compute_range(method, **kw)
                self.histogram = cal  # kept: another method can be computed without re-running the model
            else:  # entropy searches a symmetric threshold: the data's min and max
                lo, amax = cal.extremes.compute_range()
                self.histogram = cal
            if self.desc.scale_amax is not None:  # a two-sided range scales at both ends
                lo, amax = lo * self.desc.scale_amax, amax * self.desc.scale_amax
            self.amin = lo
            self.set_amax(amax)
            self.calibrator = None
            self.set_mode("quantize")
            return self.amax
        if isinstance(self.calibrator, HistogramCalibrator):
            if method == "max":
                method = "entropy"
            if not defined_for(method, self.desc.is_fp8):
                raise CalibrationError(
                    f"{self.name}: entropy calibration is for integer formats; use mse or percentile for FP8"
                )
            kw = {k: v for k, v in kwargs.items() if k != "num_bins"}
            if method != "percentile":
                kw.pop("percentile", None)
            amax = self.calibrator.compute_amax(method, **kw)
            # kept: another method can be computed without re-running the model
            self.histogram = self.calibrator
        else:
            amax = self.calibrator.compute_amax()
        return self._take_amax(amax)

    def recompute_amax(self, method: str, **kwargs) -> torch.Tensor:
        """amax by another histogram method from the kept histogram (no new data pass)."""
        if self.histogram is None:
            raise CalibrationError(
                f"{self.name}: no histogram kept; calibrate with entropy, mse or percentile first"
            )
        self.calibrator = self.histogram
        return self.load_calib_amax(method, **kwargs)

    def _blocked_axis_after(self, amax: torch.Tensor) -> int:
        d = self._block[0] % (amax.dim() - 1)
        return d + 1

    def set_amax(self, amax: torch.Tensor) -> None:
        if amax.requires_grad:  # (an operation per quantizer otherwise)
            amax = amax.detach()
        amax = amax.to(torch.float32)
        check_now(self.name, amax)
        if isinstance(self._parameters.get("amax"), nn.Parameter):
            self._parameters["amax"] = nn.Parameter(amax)
        elif self.desc.learn_amax:
            self.amax = None
            self._buffers.pop("amax", None)
            self._parameters["amax"] = nn.Parameter(amax)
        else:
            self.amax = amax

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        key = prefix + "amax"
        if key in state_dict and self.amax is None:
            self.set_amax(state_dict[key])
        if prefix + "amin" in state_dict and self.amin is None:
            self.amin = state_dict[prefix + "amin"].detach().to(torch.float32).clone()
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    # ------------------------------------------------------------------------------------------- forward
    def _dynamic_amax(self, x: torch.Tensor) -> torch.Tensor:
        """amax of this very tensor (``dynamic=True``): max |x| per kept axis or block."""
        if self._block is not None:
            xb, d = self._blocked_view(x)
            c = MaxCalibrator(axis=tuple(i for i in range(xb.dim()) if i != d + 1), name=self.name)
            c.collect(xb)
            return c.compute_amax().squeeze(d + 1)
        c = MaxCalibrator(axis=self.desc.axis, name=self.name)
        c.collect(x)
        return c.compute_amax()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.constant_input
        if c is not None and c.shape == x.shape and c.dtype == x.dtype:
            x = c
        if self.mode == "disabled":
            return x
        if self.mode == "calibrate":
            self.collect(x)
            return x
        if self.dynamic_uint8:
            if torch.onnx.is_in_onnx_export():
                raise ExportError(
                    f"{self.name}: a dynamic (DynamicQuantizeLinear) activation quantizer "
                    f"exports only as "
                    "the input of a Linear layer with 8-bit integer weights"
                )
            return FakeDynamicQuantFunction.apply(x)
        if self.export_hook is not None:
            return self.export_hook(x)
        amax = self._dynamic_amax(x) if self.desc.dynamic else self.amax
        if amax is None:
            raise CalibrationError(f"{self.name}: amax is not set; calibrate the model first")
        # one value fits any tensor: only a vector is checked (the check and the tracer test cost microseconds
        # per call, on the path every quantized forward takes)
        if amax.numel() > 1 and not (self.desc.dynamic or _tracing()):
            wrong = amax_shape_error(amax.numel(), tuple(x.shape), self.desc.axis, self._block)
            if wrong is not None:  # only an edited or damaged checkpoint: calibration sets it from x
                raise CheckpointError(
                    f"{self.name}: amax holds {amax.numel()} values, but {wrong}; the checkpoint was edited "
                    "or is damaged: re-create it with `quantcli calibrate`"
                )
        if torch.onnx.is_in_onnx_export():  # learned or calibrated, amax is a constant in the graph
            from quantcli.quant.qdq import export_amax  # (loads onnx: only when exporting)

            amax = export_amax(amax)
        else:
            amax = amax.to(x.device)
        if self.desc.asymmetric:
            amin = self.amin if self.amin is not None else torch.zeros_like(amax)
            if torch.onnx.is_in_onnx_export():
                from quantcli.quant.qdq import export_amax

                amin = export_amax(amin)
            else:
                amin = amin.to(x.device)
            return FakeAffineTensorQuantFunction.apply(x, amin, amax, self.desc.num_bits)
        if self.desc.is_fp8:
            return ScaledE4M3Function.apply(x, amax, 4, 3)
        try:
            return FakeTensorQuantFunction.apply(
                x, amax, self.desc.num_bits, self.desc.unsigned, self.desc.narrow_range
            )
        except TypeError:  # the op's own refusal (pytorch_quantization's), said with the quantizer's name
            if not (self.desc.unsigned and x.numel() and bool(x.min() < 0)):
                raise
            raise ConfigError(_negative_to_unsigned(self.name, float(x.min()))) from None

    def has_integer_scale(self) -> bool:
        """Whether :meth:`integer_scale` is a scale (no tensor operation: what the quantizer is, not its
        values)."""
        d = self.desc
        return not (
            self.mode != "quantize"
            or d.is_fp8
            or d.dynamic
            or self._block is not None
            or self.amax is None
            or d.num_bits > 8
        )

    def integer_scale(self) -> torch.Tensor | None:
        """The float32 ONNX scale of an enabled, calibrated integer quantizer of at most 8 bits that is per
        tensor or per axis (flattened to 1-D); None for other formats (fp8, blocked, dynamic, wider) or before
        calibration."""
        if not self.has_integer_scale():
            return None
        d = self.desc
        if d.asymmetric:
            amin = self.amin if self.amin is not None else torch.zeros_like(self.amax)
            scale = arithmetic.affine_qparams(amin, self.amax, d.num_bits)[0]
        else:
            scale = arithmetic.symmetric_scale(self.amax, arithmetic.symmetric_bound(d.num_bits, d.unsigned))
        return scale.detach().to(torch.float32).reshape(-1)

    def extra_repr(self) -> str:
        d = self.desc
        bits = d.format_name
        if self.dynamic_uint8:
            return f"{bits} dynamic per-tensor (DynamicQuantizeLinear) mode={self.mode}"
        gran = (
            f"axis={d.axis}"
            if d.axis is not None
            else (f"block={self._block[1]}" if self._block else "per-tensor")
        )
        if self.amax is None:
            a = "amax=None"
        elif self.amax.numel() == 1:
            a = f"amax={self.amax.item():.4g}"
        else:
            a = f"amax=[{self.amax.min().item():.4g}, {self.amax.max().item():.4g}]({self.amax.numel()})"
        return f"{bits} {gran}{' narrow' if d.narrow_range else ''} {a} mode={self.mode}"


def _tracing() -> bool:
    """Whether a tracer is recording this forward (sizes may be traced values there: not compared)."""
    return torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or torch.compiler.is_compiling()


def amax_shape_error(
    numel: int, shape: tuple[int, ...], axis: int | tuple[int, ...] | None, block: tuple[int, int] | None
) -> str | None:
    """Why an amax of ``numel`` values cannot quantize a tensor of ``shape`` (one value per tensor, per index
    of ``axis``, or per block of ``block = (axis, size)``, the last block possibly partial), or None when it
    can."""
    if block is not None:
        d, size = block[0] % len(shape), block[1]
        blocks = -(-shape[d] // min(size, shape[d]))
        want = math.prod(shape) // shape[d] * blocks if shape[d] else 0
        where = f"the {list(shape)} tensor it quantizes has {want} blocks ({blocks} of {size} along dim {d})"
    elif axis is None:
        want, where = 1, "it quantizes per tensor (one value)"
    else:
        axes = (axis,) if isinstance(axis, int) else tuple(axis)
        want = math.prod(shape[a] for a in axes)
        where = f"the {list(shape)} tensor it quantizes has {want} along axis {axis}"
    return None if numel in (1, want) else where


def _negative_to_unsigned(name: str, lowest: float) -> str:
    return (
        f"{name} is unsigned (a grid of non-negative values), but the tensor it quantizes has negative "
        f"values (min {lowest:.6g}): set `unsigned: false` for it in the config, or quantize a non-negative "
        "tensor"
    )


def owner(quantizer: str) -> str:
    """The module a quantizer belongs to, by name: ``layer1.0.conv1`` for ``layer1.0.conv1.weight_quantizer``,
    and ``""`` (the model itself) for a quantizer of the root module (``weight_quantizer``)."""
    return quantizer.rsplit(".", 1)[0] if "." in quantizer else ""


def role(quantizer: str) -> str:
    """A quantizer's attribute on its module: ``input_quantizer``, ``weight_quantizer``, ``output_quantizer``,
    ..., whether its module is a submodule or the model itself."""
    return quantizer.rsplit(".", 1)[-1]


def quantizer_name(module: str, role_name: str) -> str:
    """The model-wide name of ``module``'s quantizer ``role_name`` (the root module's has no prefix)."""
    return f"{module}.{role_name}" if module else role_name


def quantizers(model: nn.Module) -> dict[str, TensorQuantizer]:
    """Every TensorQuantizer in ``model``, by its module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, TensorQuantizer)}


def uncalibrated(model: nn.Module) -> list[str]:
    """The enabled static quantizers of ``model`` without an amax, by name (what export and verify refuse)."""
    return [n for n, q in quantizers(model).items() if q.enabled and not q.desc.dynamic and q.amax is None]
