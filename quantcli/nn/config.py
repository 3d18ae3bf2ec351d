"""Quant configs: presets plus ordered pattern rules.

A config is a preset name (``int8``, ``int8-per-tensor``, ``uint8-asymmetric``, ``fp8``, ``int4-weight-only``,
``int8-dynamic``: activations quantized at run time, Linear layers only),
a YAML/JSON file,
or the same content as a dict::

    preset: int8            # the starting point (default int8)
    block_size: 128         # int4-weight-only's block along the input dimension
    cpu: auto               # the CPU the graph is for: auto (this machine), x86-avx2, x86-vnni, arm64, any
    reduce_range: auto      # 8-bit weights on a 7-bit grid [-63, 63] (stored int8): auto = where ``cpu``'s
                            # uint8 x int8 kernels could saturate; true / false force it on / off
    fold_batchnorm: true    # fold each BatchNorm into the Conv/ConvTranspose/Linear before it
        (quantcli.nn.fold_bn)
    target: onnxruntime     # the runtime the Q/DQ placement is for: onnxruntime (default) or tensorrt
    asymmetric_activations: true  # signed activations on uint8 with a zero point (default: onnxruntime yes,
                                   # tensorrt no)
    rules:                  # applied in order, matched with fnmatch on quantizer names;
      - pattern: "classifier.*"            # later rules win field by field
        enable: false
      - pattern: "*.weight_quantizer"
        num_bits: 4

Quantizer names are module names plus ``.input_quantizer`` / ``.weight_quantizer``. A rule's other keys are
:class:`~quantcli.quant.descriptor.QuantDescriptor` fields. ``axis: output_channel`` means the layer's
output-channel axis (0, or 1 for transposed convolutions).

``cpu`` names the CPU the graph will run on (:mod:`quantcli.quant.cpu`); ``auto`` is this machine, and the
checkpoint stores the kind it resolved to, so a model rebuilt elsewhere gets the same grids.

``reduce_range`` is onnxruntime's remedy for x86 CPUs without VNNI (AVX2, AVX-512 without VNNI): their u8s8
kernel adds pairs of uint8 x int8 products in saturating 16-bit lanes (``VPMADDUBSW``), and 255 * 127 * 2 does
not fit (:mod:`quantcli.quant.u8s8`). With 7-bit weights (|w| <= 63) a pair stays below 2**15. It turns an
enabled 8-bit symmetric integer weight quantizer into ``num_bits: 7, narrow_range: true`` (rules that set
other widths are left alone); the exported graph stores the codes as int8 and computes exactly what the
fake-quant model computes. ``auto`` (the default, onnxruntime target) does so for the layers whose kernel
can saturate (every Linear and convolution but depthwise ones, whose kernel cannot) when ``cpu`` is
``x86-avx2`` or ``any``; ``true`` for every 8-bit weight whatever the CPU; ``false`` never (a graph that can
then saturate on the named CPU is reported by calibrate and failed by verify).

``asymmetric_activations`` (onnxruntime target; its default there): every 8-bit per-tensor activation
quantizer of a symmetric preset (``int8``, ``int8-per-tensor``) whose tensor can be negative and whose grid no
rule chose quantizes on uint8 with a zero point, calibrated as a ``[min, max]`` range
(:mod:`calibrators.two_sided`), as onnxruntime's own ``quantize_static`` does by default. onnxruntime runs the
same integer kernels either way (x86 runs activations as uint8); a skewed activation (a linear bottleneck's
output, a GELU's) gets up to twice the resolution. Tensors that are >= 0 by construction keep the unsigned
symmetric grid (the same grid). TensorRT runs symmetric int8 only: ``true`` with ``target: tensorrt`` is an
error. ``calibrate --method entropy`` (a symmetric search) leaves it off unless the config sets it.
"""

from __future__ import annotations

import copy
import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantcli.errors import ConfigError, first_line
from quantcli.quant import cpu as cpu_kinds
from quantcli.quant.descriptor import FIELDS, QuantDescriptor, to_plain
from quantcli.quant.u8s8 import is_depthwise

OUTPUT_CHANNEL = "output_channel"
INPUT_CHANNEL_BLOCKS = "input_channel_blocks"

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "int8": {
        "input": {"enable": True, "num_bits": 8},
        "weight": {"enable": True, "num_bits": 8, "axis": OUTPUT_CHANNEL},
    },
    "int8-per-tensor": {
        "input": {"enable": True, "num_bits": 8},
        "weight": {"enable": True, "num_bits": 8},
    },
    "uint8-asymmetric": {
        "input": {"enable": True, "num_bits": 8, "asymmetric": True},
        "weight": {"enable": True, "num_bits": 8, "axis": OUTPUT_CHANNEL},
    },
    "fp8": {
        "input": {"enable": True, "num_bits": (4, 3)},
        "weight": {"enable": True, "num_bits": (4, 3)},
    },
    "int4-weight-only": {
        "input": {"enable": False},
        "weight": {"enable": True, "num_bits": 4, "block_sizes": INPUT_CHANNEL_BLOCKS},
    },
    # activations quantized at run time as ONNX DynamicQuantizeLinear does (uint8, per tensor, no
    # calibration); exported as DynamicQuantizeLinear -> MatMulInteger, which onnxruntime runs as
    # DynamicQuantizeMatMul
    "int8-dynamic": {
        "input": {"enable": True, "num_bits": 8, "asymmetric": True, "dynamic": True},
        "weight": {"enable": True, "num_bits": 8, "axis": OUTPUT_CHANNEL},
    },
}
#: presets that quantize Linear layers only; convolutions stay float. int8-dynamic: onnxruntime has no fused
#: integer kernel for DynamicQuantizeLinear -> ConvInteger (its own quantize_dynamic output runs ConvInteger,
# Cast, : Mul and Add as separate ops on the CPU provider, and its DynamicQuantizeConvIntegerFusion turns the
# pattern back : into a float Conv on dequantized weights), so a dynamic Conv costs a min/max pass and gains
# no integer kernel
LINEAR_ONLY_PRESETS = ("int8-dynamic",)
DEFAULT_BLOCK_SIZE = 128
#: deployment targets: which runtime's fusions decide where quantizers go (:mod:`quantcli.nn.placement`)
TARGETS = ("onnxruntime", "tensorrt")
DEFAULT_TARGET = "onnxruntime"
REDUCED_WEIGHT_BITS = 7  # reduce_range: |code| <= 63, so a uint8 x int8 pair sum fits in 16 bits
REDUCE_RANGE_AUTO = "auto"
_RULE_KEYS = {"pattern", "enable", *FIELDS}


def _dynamic_rule(i: int, r: dict[str, Any]) -> None:
    """A rule's ``dynamic: true`` is ONNX DynamicQuantizeLinear's quantization, the only dynamic one that
    exports: uint8 with a zero point (asymmetric, 8 bits), set here where the rule leaves them out (as the
    int8-dynamic preset sets them); a rule that says otherwise is refused."""
    if r.get("asymmetric") is False or r.get("num_bits", 8) != 8:
        raise ConfigError(
            f"rule {i} ({r['pattern']!r}): dynamic quantization exports as ONNX DynamicQuantizeLinear, "
            "which is asymmetric uint8: drop asymmetric: false and num_bits from the rule (or set "
            "asymmetric: true, num_bits: 8)"
        )
    r.setdefault("asymmetric", True)
    r.setdefault("num_bits", 8)


@dataclass
class QuantConfig:
    preset: str = "int8"
    rules: list[dict[str, Any]] = field(default_factory=list)
    block_size: int = DEFAULT_BLOCK_SIZE
    source: str = "int8"
    reduce_range: bool | str = REDUCE_RANGE_AUTO  # True, False or "auto" (see the module docstring)
    fold_batchnorm: bool = True
    target: str = DEFAULT_TARGET
    asymmetric_activations: bool | None = None  # None: the target's default (see the module docstring)
    cpu: str = cpu_kinds.AUTO  # the deployment CPU: "auto" (this machine) or one of quantcli.quant.cpu.KINDS

    def __post_init__(self):
        if self.target not in TARGETS:
            raise ConfigError(f"unknown target {self.target!r}; choose one of {', '.join(TARGETS)}")
        if self.asymmetric_activations not in (None, True, False):
            raise ConfigError(
                f"asymmetric_activations must be true or false, got {self.asymmetric_activations!r}"
            )
        if self.asymmetric_activations and self.target == "tensorrt":
            raise ConfigError(
                "asymmetric_activations: true does not fit target tensorrt (TensorRT runs symmetric int8 "
                "only); "
                "drop it or use target onnxruntime"
            )
        if self.preset not in PRESETS:
            raise ConfigError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ConfigError(f"block_size must be a positive int, got {self.block_size!r}")
        if self.block_size == 1:  # one scale per weight: no QuantizeLinear or MatMulNBits layout takes it
            raise ConfigError(f"block_size 1 {BLOCK_OF_ONE}")
        if self.reduce_range is None:
            self.reduce_range = REDUCE_RANGE_AUTO
        if not isinstance(self.reduce_range, bool) and self.reduce_range != REDUCE_RANGE_AUTO:
            raise ConfigError(f"reduce_range must be true, false or auto, got {self.reduce_range!r}")
        if self.cpu is None:
            self.cpu = cpu_kinds.AUTO
        if self.cpu not in cpu_kinds.CHOICES:
            raise ConfigError(f"unknown cpu {self.cpu!r}; choose one of {', '.join(cpu_kinds.CHOICES)}")
        if not isinstance(self.fold_batchnorm, bool):
            raise ConfigError(f"fold_batchnorm must be true or false, got {self.fold_batchnorm!r}")
        for i, r in enumerate(self.rules):
            if not isinstance(r, dict) or "pattern" not in r or not isinstance(r["pattern"], str):
                raise ConfigError(f"rule {i} must be a mapping with a 'pattern' string, got {r!r}")
            unknown = sorted(set(r) - _RULE_KEYS)
            if unknown:
                raise ConfigError(
                    f"rule {i} ({r['pattern']!r}) has unknown field(s) {unknown}; "
                    f"known: enable, {', '.join(FIELDS)}"
                )
            if "enable" in r and not isinstance(r["enable"], bool):
                raise ConfigError(f"rule {i} ({r['pattern']!r}): enable must be true or false")
            if r.get("dynamic") is True:
                _dynamic_rule(i, r)
        if self.target == "tensorrt":
            self._refuse_asymmetric_for_tensorrt()

    def _refuse_asymmetric_for_tensorrt(self) -> None:
        """TensorRT runs symmetric int8 only: a preset or rule with asymmetric (uint8 with a zero point, or
        dynamic, which is asymmetric) activations does not fit it."""
        if PRESETS[self.preset]["input"].get("asymmetric"):
            raise ConfigError(
                f"preset {self.preset} quantizes activations on an asymmetric uint8 grid, which TensorRT "
                "does not run (symmetric int8 only); use preset int8 with target tensorrt, or target "
                "onnxruntime"
            )
        for i, r in enumerate(self.rules):
            if r.get("asymmetric") is True:
                raise ConfigError(
                    f"rule {i} ({r['pattern']!r}) makes quantizers asymmetric"
                    f"{' (dynamic)' if r.get('dynamic') else ''}, which TensorRT does not run (symmetric "
                    "int8 only); drop it or use target onnxruntime"
                )

    def to_plain(self) -> dict[str, Any]:
        """JSON/pickle-safe data (for checkpoints and ONNX metadata)."""
        return {
            "preset": self.preset,
            "block_size": self.block_size,
            "rules": to_plain(self.rules),
            "source": self.source,
            "reduce_range": self.reduce_range,
            "fold_batchnorm": self.fold_batchnorm,
            "target": self.target,
            "asymmetric_activations": self.activations_asymmetric,
            "cpu": self.deploy_cpu,
        }

    @property
    def deploy_cpu(self) -> str:
        """The deployment CPU's kind: ``cpu``, with ``auto`` read from this machine."""
        return cpu_kinds.resolve(self.cpu)

    def reduces_weights(self, layer) -> bool:
        """Whether ``layer``'s 8-bit symmetric weights go on the 7-bit grid (``reduce_range``, see the module
        docstring)."""
        if self.reduce_range != REDUCE_RANGE_AUTO:
            return bool(self.reduce_range)
        if self.target != "onnxruntime" or not cpu_kinds.can_saturate(self.deploy_cpu):
            return False
        return kernel_can_saturate(layer)

    @property
    def activations_asymmetric(self) -> bool:
        """Whether signed activations get the asymmetric grid: the config's ``asymmetric_activations``, or the
        target's default (onnxruntime: yes)."""
        if self.asymmetric_activations is not None:
            return self.asymmetric_activations
        return self.target == "onnxruntime"

    @classmethod
    def from_plain(cls, data: dict[str, Any], source: str = "<dict>") -> QuantConfig:
        if not isinstance(data, dict):
            raise ConfigError(
                f"a quant config must be a mapping or a list of rules, got {type(data).__name__}"
            )
        unknown = sorted(
            set(data)
            - {"preset", "rules", "block_size", "source", "reduce_range", "fold_batchnorm", "target"}
            - {"asymmetric_activations", "cpu"}
        )
        if unknown:
            raise ConfigError(
                f"unknown config field(s) {unknown} in {source}; "
                "known: preset, block_size, reduce_range, fold_batchnorm, target, asymmetric_activations, "
                "cpu, rules"
            )
        rules = data.get("rules") or []
        if not isinstance(rules, list):
            raise ConfigError(
                f"rules in {source} must be a list of rules (mappings with a pattern), got "
                f"{type(rules).__name__}"
            )
        return cls(
            preset=data.get("preset", "int8"),
            rules=list(rules),
            block_size=data.get("block_size", DEFAULT_BLOCK_SIZE),
            source=data.get("source", source),
            reduce_range=data.get("reduce_range", REDUCE_RANGE_AUTO),
            fold_batchnorm=data.get("fold_batchnorm", True),
            target=data.get("target", DEFAULT_TARGET),
            asymmetric_activations=data.get("asymmetric_activations"),
            cpu=data.get("cpu", cpu_kinds.AUTO),
        )

    def _input_enabled(self, weight_quantizer_name: str, layer) -> bool:
        """Whether the layer of ``weight_quantizer_name`` quantizes its input (an integer kernel multiplies
        activations by these weights); weight-only layers' weights are left as configured."""
        name = weight_quantizer_name.removesuffix("weight_quantizer") + "input_quantizer"
        return self.resolve(name, "input", layer)[0]

    def matching_rules(self, quantizer_name: str) -> list[int]:
        """Indices of the rules whose pattern matches ``quantizer_name``, in order."""
        return [i for i, r in enumerate(self.rules) if fnmatch.fnmatchcase(quantizer_name, r["pattern"])]

    def resolve(self, quantizer_name: str, kind: str, layer) -> tuple[bool, QuantDescriptor, list[int]]:
        """(enabled, descriptor, indices of the rules that matched) for one quantizer."""
        base = PRESETS[self.preset][kind]
        if self.preset in LINEAR_ONLY_PRESETS and not computes_plain_linear(layer):
            base = {"enable": False}  # a rule may still enable it (as a static quantizer)
        fields = copy.deepcopy(base)
        matched = self.matching_rules(quantizer_name)
        for i in matched:
            rule = {k: v for k, v in self.rules[i].items() if k != "pattern"}
            # a rule's granularity replaces the one it inherits: blocks (block_sizes) or one axis, not both
            if rule.get("block_sizes") is not None and "axis" not in rule:
                fields.pop("axis", None)
            if rule.get("axis") is not None and "block_sizes" not in rule:
                fields.pop("block_sizes", None)
            fields.update(rule)
        enabled = fields.pop("enable", True)
        if kind != "weight" and any(_sets_calib_method_of_activations(self.rules[i]) for i in matched):
            # activations are calibrated by calibrate's --method: a rule's calib_method there would do nothing
            raise ConfigError(
                f"{quantizer_name}: calib_method applies to weight quantizers; an activation quantizer is "
                "calibrated by calibrate's --method (max, entropy, mse, percentile): drop it from this rule"
            )
        if fields.get("axis") == OUTPUT_CHANNEL:
            fields["axis"] = layer.weight_axis
        if fields.get("block_sizes") == INPUT_CHANNEL_BLOCKS:
            in_axis = 1 - layer.weight_axis if layer.weight.dim() > 1 else 0
            if layer.weight.shape[in_axis] == 1:
                # one input channel (a first conv on grey images): nothing to block, quantize per output
                # channel
                fields.pop("block_sizes")
                fields["axis"] = layer.weight_axis
            else:
                fields["block_sizes"] = {
                    (-1 if layer.weight.dim() == 2 and in_axis == 1 else in_axis): self.block_size
                }
        if enabled:
            _check_granularity(quantizer_name, kind, layer, fields)
        if not enabled and kind == "input" and "num_bits" not in fields:
            fields["num_bits"] = 8
        if (
            kind == "weight"
            and fields.get("num_bits", 8) == 8
            and not (fields.get("unsigned") or fields.get("asymmetric"))
            and self._input_enabled(quantizer_name, layer)
            and self.reduces_weights(layer)
        ):
            fields.update(num_bits=REDUCED_WEIGHT_BITS, narrow_range=True)
        try:
            desc = QuantDescriptor(name=quantizer_name, **fields)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{quantizer_name}: {e}") from None
        return enabled, desc, matched


#: why a block size of 1 (the config's block_size, or a rule's block_sizes) is refused
BLOCK_OF_ONE = (
    "gives every weight its own scale, which no ONNX format holds: pass 2 or more (32, 64 or 128 are usual)"
)


def _check_granularity(name: str, kind: str, layer, fields: dict) -> None:
    """A quantizer's fields that calibrate would accept and export could not write, refused here: blocks of an
    activation (their amax would follow the calibration batch's shape), a weight's axis other than its output
    channels (the int32 bias and the integer kernels take per output channel scales), a dynamic input of a
    layer other than a Linear (DynamicQuantizeLinear -> MatMulInteger is the only dynamic export)."""
    sizes = fields.get("block_sizes") or {}
    if kind == "weight" and isinstance(sizes, dict) and any(v == 1 for k, v in sizes.items() if k != "type"):
        raise ConfigError(f"{name}: a block size of 1 {BLOCK_OF_ONE}")
    if kind != "weight" and fields.get("block_sizes"):
        raise ConfigError(
            f"{name}: block_sizes applies to weight quantizers; an activation's scale is per tensor: drop "
            "block_sizes from the rule that matches it"
        )
    weight = getattr(layer, "weight", None)
    axis = fields.get("axis")
    if kind == "weight" and isinstance(axis, int) and not fields.get("block_sizes") and weight is not None:
        out = getattr(layer, "weight_axis", 0)
        if weight.dim() > 1 and axis % weight.dim() != out:
            raise ConfigError(
                f"{name}: axis {axis} is not the weight's output channel axis ({out}); a weight's scales are "
                f"per output channel (axis: {out}), per tensor (axis: null) or per block (block_sizes)"
            )
    if kind == "input" and fields.get("dynamic") and not computes_plain_linear(layer):
        kind_of = type(layer).__name__.removeprefix("Quant")
        raise ConfigError(
            f"{name}: dynamic quantization applies to the inputs of Linear layers (exported as "
            f"DynamicQuantizeLinear -> MatMulInteger); this one is a {kind_of}'s: drop dynamic from the rule "
            "that matches it, or narrow its pattern"
        )


def _sets_calib_method_of_activations(rule: dict) -> bool:
    """Whether ``rule`` sets ``calib_method`` for activation quantizers alone (its pattern matches no weight
    quantizer's name): a rule for every quantizer (``*``) may mean the weights'."""
    return "calib_method" in rule and not any(
        fnmatch.fnmatchcase(name, rule["pattern"]) for name in ("weight_quantizer", "layer.weight_quantizer")
    )


def kernel_can_saturate(layer) -> bool:
    """Whether onnxruntime runs ``layer`` quantized with a uint8 x int8 kernel that can saturate on a CPU
    without VNNI: every Linear and convolution but a depthwise one
    (:func:`quantcli.quant.u8s8.is_depthwise`)."""
    groups = getattr(layer, "groups", 1)
    if groups > 1 and hasattr(layer, "in_channels"):
        return not is_depthwise(layer.in_channels, layer.out_channels, groups)
    return True


def computes_plain_linear(layer) -> bool:
    """A layer the int8-dynamic presets quantize: one computing ``F.linear(x, self.weight, self.bias)`` with
    its own ``(out, in)`` weight, whatever its class (an ``nn.Linear``, a module found to compute it, or one
    whose forward calls it on its parameters), or ``x @ W + b`` with an ``(in, out)`` weight (transformers'
    ``Conv1D``, GPT-2's every projection; ``torch.mm``, ``torch.matmul``, ``torch.addmm`` on the module's own
    ``weight``, as a pygcn graph convolution computes): what the DynamicQuantizeLinear -> MatMulInteger
    export writes."""
    from torch import nn

    from quantcli.nn.computed import is_computed
    from quantcli.nn.linear_like import QuantLinearLike

    if isinstance(layer, (nn.Linear, QuantLinearLike)):
        return True
    axis = {"linear": 0, "mm": 1, "matmul": 1, "addmm": 1}.get(getattr(layer, "op_kind", None))
    return (
        is_computed(layer)
        and axis is not None
        and not layer.weight_derived
        and layer.weight_axis == axis
        and layer.weight.dim() == 2
    )


def _parse_error(e: Exception) -> str:
    """A parser's error in one line, with where in the file: YAML's marks (its own first line, "while
    scanning a quoted scalar", says what it was doing, not where or what went wrong); JSON's first line
    already says both."""
    mark = getattr(e, "problem_mark", None)
    if mark is None:
        return first_line(e)
    text = f"line {mark.line + 1}, column {mark.column + 1}: {getattr(e, 'problem', None) or first_line(e)}"
    start, context = getattr(e, "context_mark", None), getattr(e, "context", None)
    if start is not None and context:  # what was open, and where it began
        text += f" ({context.removeprefix('while ')} from line {start.line + 1}, column {start.column + 1})"
    return text


def load_config(config: str | Path | dict | list | QuantConfig | None) -> QuantConfig:
    """A preset name, a ``.yaml``/``.yml``/``.json`` path, a dict, a list of rules, or a QuantConfig."""
    if config is None:
        return QuantConfig()
    if isinstance(config, QuantConfig):
        return config
    if isinstance(config, list):
        return QuantConfig(rules=config, source="<rules>")
    if isinstance(config, dict):
        return QuantConfig.from_plain(config)
    text = str(config)
    if text in PRESETS:
        return QuantConfig(preset=text, source=text)
    path = Path(text)
    if path.suffix.lower() not in (".yaml", ".yml", ".json"):
        raise ConfigError(
            f"unknown preset {text!r}; choose one of {', '.join(PRESETS)} or give a .yaml/.json file"
        )
    if not path.is_file():
        raise ConfigError(f"config file {text} does not exist")
    try:
        raw = path.read_text(encoding="utf-8")
        if path.suffix.lower() == ".json":
            data = json.loads(raw)
        else:
            import yaml

            data = yaml.safe_load(raw)
    except Exception as e:  # yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError
        raise ConfigError(f"cannot parse {text}: {_parse_error(e)}") from None
    if isinstance(data, list):
        return QuantConfig(rules=data, source=str(path))
    if data is None:
        data = {}
    return QuantConfig.from_plain(data, source=str(path))
