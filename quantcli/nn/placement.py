"""Where quantizers go for a deployment target: what the model's structure says, read with ``torch.fx``.

Every quantized layer quantizes its input and its weight whatever the target. The onnxruntime target adds what
onnxruntime's QDQ fusions need (``onnxruntime/core/optimizer/qdq_transformer/selectors_actions/qdq_selectors.cc``):

* **unsigned inputs after a ReLU.** A ``Relu`` before a ``QuantizeLinear`` disappears into the fused kernel only
  when the Q's zero point is its type's lowest code (``relu_quantizelinear.cc``); a signed grid centred on 0 keeps
  the Relu, and the Conv stays in float. A layer input that is non-negative by construction (a ReLU/ReLU6 output,
  possibly through pooling, flattening, reshaping) is quantized on the unsigned grid ``[0, 255]`` (uint8, zero
  point 0): the same tensor, twice the resolution.
* **an output quantizer on a Conv** whose output does not reach quantized layers only (through ReLU and ops that
  commute with quantization: max pooling, flattening, reshaping), e.g. a Conv feeding a residual Add, a mean or
  a graph output: ``QLinearConv`` needs a Q on its output.
* **int32 biases** on Conv and 2-D Linear layers (``QLinearConv``/``QGemm``), see :mod:`quantcli.nn.modules`.

The tensorrt target keeps the inputs-of-weighted-layers placement NVIDIA recommends, with no output quantizers.
A model ``torch.fx`` cannot trace (data-dependent control flow, shapes unpacked in Python) keeps that placement
too for the onnxruntime target, minus the two structural additions; :class:`Placement` says why.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx, nn

# ops whose output is >= 0 whatever their input
_RELU_MODULES = (nn.ReLU, nn.ReLU6)
_RELU_FUNCTIONS = {F.relu, torch.relu, F.relu6, torch.relu_}
# ops that keep a non-negative tensor non-negative, and commute with quantization where marked
_COMMUTING_MODULES = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
                      nn.AdaptiveMaxPool3d, nn.Flatten, nn.Identity, nn.Dropout, nn.Unflatten)
_COMMUTING_FUNCTIONS = {torch.flatten, F.max_pool1d, F.max_pool2d, F.max_pool3d, F.dropout, torch.reshape,
                        torch.squeeze, torch.unsqueeze, torch.transpose, torch.permute}
_COMMUTING_METHODS = {"view", "reshape", "flatten", "permute", "transpose", "contiguous", "squeeze", "unsqueeze"}
_SIGN_KEEPING_MODULES = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
                         nn.AdaptiveAvgPool3d)
_SIGN_KEEPING_FUNCTIONS = {F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d,
                           torch.mean}
_SIGN_KEEPING_METHODS = {"mean"}


@dataclass
class Placement:
    """The structural part of a target's placement, by layer (module) name."""

    target: str
    analysed: bool = True
    note: str | None = None  # why the structure could not be analysed
    unsigned_inputs: list[str] = field(default_factory=list)  # inputs >= 0 by construction: uint8 grid
    output_quantized: list[str] = field(default_factory=list)  # Conv layers that get an output quantizer

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class _Tracer(fx.Tracer):
    def __init__(self, leaves: set[int]):
        super().__init__()
        self._leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return id(m) in self._leaves or super().is_leaf_module(m, qualname)


def trace(model: nn.Module, layers: dict[str, nn.Module]) -> fx.Graph:
    """The fx graph of ``model`` with the quantized ``layers`` as leaves (raises what fx raises)."""
    from quantcli.nn.tensor_quantizer import TensorQuantizer

    leaves = {id(m) for m in layers.values()} | {id(m) for m in model.modules() if isinstance(m, TensorQuantizer)}
    return _Tracer(leaves).trace(model)


def _kind(node: fx.Node, modules: dict[str, nn.Module]) -> str:
    """relu, commuting (max pooling, reshaping), sign-keeping (average pooling, mean), or other."""
    if node.op == "call_module":
        m = modules.get(node.target)
        if isinstance(m, _RELU_MODULES):
            return "relu"
        if isinstance(m, _COMMUTING_MODULES):
            return "commuting"
        if isinstance(m, _SIGN_KEEPING_MODULES):
            return "sign-keeping"
    elif node.op == "call_function":
        if node.target in _RELU_FUNCTIONS:
            return "relu"
        if node.target in _COMMUTING_FUNCTIONS:
            return "commuting"
        if node.target in _SIGN_KEEPING_FUNCTIONS:
            return "sign-keeping"
        if node.target is operator.getitem:
            return "commuting"
    elif node.op == "call_method":
        if node.target == "relu":
            return "relu"
        if node.target in _COMMUTING_METHODS:
            return "commuting"
        if node.target in _SIGN_KEEPING_METHODS:
            return "sign-keeping"
    return "other"


def _nonnegative(node, modules: dict[str, nn.Module]) -> bool:
    """True if ``node``'s value is >= 0 by construction (a ReLU, possibly through sign-keeping ops)."""
    while isinstance(node, fx.Node):
        kind = _kind(node, modules)
        if kind == "relu":
            return True
        if kind not in ("commuting", "sign-keeping") or not node.args:
            return False
        node = node.args[0]
    return False


def _reaches_quantized_layers_only(node: fx.Node, modules, quantized_inputs: set[str]) -> bool:
    """True if every path from ``node`` through ReLUs and commuting ops ends at a quantized layer's input."""
    if not node.users:
        return False
    for user in node.users:
        if user.op == "call_module" and user.target in quantized_inputs and user.args and user.args[0] is node \
                and node not in user.args[1:]:
            continue
        if _kind(user, modules) in ("relu", "commuting") and user.args and user.args[0] is node:
            if _reaches_quantized_layers_only(user, modules, quantized_inputs):
                continue
        return False
    return True


def analyse(model: nn.Module, layers: dict[str, nn.Module], target: str,
            input_enabled: dict[str, bool], weight_integer: dict[str, bool]) -> Placement:
    """The structural placement for ``target`` of the quantized ``layers`` (name -> module) of ``model``.

    ``input_enabled``: layers whose input quantizer is on; ``weight_integer``: layers with an integer weight
    quantizer of at most 8 bits (the ones onnxruntime can run as integer kernels).
    """
    placement = Placement(target)
    if target != "onnxruntime":
        return placement
    try:
        graph = trace(model, layers)
    except Exception as e:  # fx cannot trace every model: say so and keep the per-layer placement
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        placement.analysed = False
        placement.note = f"torch.fx could not trace the model ({type(e).__name__}: {first})"
        return placement
    modules = dict(model.named_modules())
    quantized_inputs = {n for n, on in input_enabled.items() if on}
    for node in graph.nodes:
        if node.op != "call_module" or node.target not in layers:
            continue
        name = node.target
        if name in quantized_inputs and node.args and _nonnegative(node.args[0], modules):
            placement.unsigned_inputs.append(name)
        conv = isinstance(layers[name], (nn.Conv1d, nn.Conv2d, nn.Conv3d))
        if conv and name in quantized_inputs and weight_integer.get(name) \
                and not _reaches_quantized_layers_only(node, modules, quantized_inputs):
            placement.output_quantized.append(name)
    return placement
