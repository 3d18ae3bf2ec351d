"""Where quantizers go for a deployment target: what the model's structure says, read with ``torch.fx``.

Every quantized layer quantizes its input and its weight whatever the target. The onnxruntime target adds what
onnxruntime's QDQ fusions need
(``onnxruntime/core/optimizer/qdq_transformer/selectors_actions/qdq_selectors.cc``):

* **unsigned inputs after a ReLU.** A ``Relu`` before a ``QuantizeLinear`` disappears into the fused kernel
  only when the Q's zero point is its type's lowest code (``relu_quantizelinear.cc``); a signed grid centred
  on 0 keeps the Relu, and the Conv stays in float. A layer input that is non-negative by construction (a
  ReLU/ReLU6 output, possibly through pooling, flattening, reshaping) is quantized on the unsigned grid ``[0,
  255]`` (uint8, zero point 0): the same tensor, twice the resolution.
* **an output quantizer on a Conv** whose output does not reach quantized layers only (through ReLU and ops
  that commute with quantization: max pooling, flattening, reshaping), e.g. a Conv feeding a residual Add, a
  mean or a graph output: ``QLinearConv`` needs a Q on its output. Likewise on a Gemm (a Linear on 2-D
  input) whose ReLU feeds one reader that is not a quantized layer (``h + relu(fc(h))``): without a Q there,
  onnxruntime runs the Gemm and ReLU as one float ``FusedGemm`` (:func:`_relu_not_into_a_q`).
* **the skip input of a residual Add quantized** when the Add can then run as ``QLinearAdd``: its other
  operand is a quantized Conv's output (which has an output quantizer), the skip is not a Conv's output, and
  what the Add's output reaches through ReLU is quantized layers' inputs (:func:`onnxruntime_residual_skips`).
  The quantizer is a ``residual_quantizer`` as for tensorrt (below), on the uint8 grid when the skip is >= 0.
  onnxruntime's own ``quantize_static`` quantizes such Adds too; on the zoo's ResNet (basic blocks after a
  max-pooled stem) it took the int8 graph from 0.95x to 0.87x its float graph's time (onnxruntime's u8 graph:
  0.85x), MobileViT from 1.31x to 1.26x.
* **a Conv's input quantized before the zero padding in front of it** (``nn.ZeroPad2d``, ``nn.ConstantPad2d``
  with value 0, ... called once, or ``F.pad`` with zeros on a module's input, read by that Conv alone; see
  :func:`_zero_pad_before`): the graph is then ``Q -> DQ -> Pad -> Conv``, which
  onnxruntime folds into one ``QLinearConv`` (``pad_fusion.cc`` runs before the QDQ fusions), where ``Pad ->
  Q -> DQ -> Conv`` keeps the Pad as a node of its own (in EfficientNet's stride-2 blocks: 169 us of its
  3.1 ms). Exact: a zero pads to the zero point's code either way (``Q(0)`` is the zero point, ``DQ`` of it is
  0).
* **the input of an average pooling quantized** when that lets a residual Add run as ``QLinearAdd``: the Add's
  output reaches (through ReLU) an average pooling module whose output reaches quantized layers only, e.g.
  the last block of a ResNet before its global pooling and classifier. The pooling module gets an
  ``input_quantizer`` (uint8 after a ReLU), a global pooling the ``forward`` computes (``x.mean((2, 3))``,
  ``F.adaptive_avg_pool2d(x, 1)``) an ``activation_quantizer`` on its operand; onnxruntime then runs
  ``QLinearAdd`` (the ReLU absorbed) and ``QLinearGlobalAveragePool`` where the Add, ReLU and pooling ran in
  float between a DQ and a Q.
* **sigmoids, SiLU/Swish multiplications and global average poolings on codes** (:func:`qlinear_activations`):
  where such an operation reads quantized Convs' outputs or other such operations' and what it produces
  reaches only quantized layers or other such operations, each operand that is not a quantized Conv's output
  gets a quantizer (an ``activation_quantizer`` of the module whose ``forward`` runs the operation, put on
  the operand as that ``forward`` runs, :func:`quantcli.nn.computed.quantize_ops`; an adaptive average pooling
  module to one position gets an ``input_quantizer``; a sigmoid's output is on the uint8 grid), and
  ``F.silu`` runs as ``x * q(sigmoid(x))``. The quantizers of one tensor are calibrated on the same values,
  so the export shares one Q among them and the next layer's. onnxruntime then runs ``QLinearSigmoid``,
  ``QLinearMul`` and ``QLinearGlobalAveragePool`` where the operations ran in float between a DQ and a Q,
  as in its own ``quantize_static`` graphs: an EfficientNet's Swish (``x * sigmoid(x)``) and
  squeeze-excitation gate. ``nn.SiLU``, ``nn.Sigmoid`` and the user's own modules that only compute a
  function (a ``Swish``) are recorded op by op for this (:func:`function_module`).
* **int32 biases** on Conv and 2-D Linear layers (``QLinearConv``/``QGemm``), see :mod:`quantcli.nn.modules`.

The tensorrt target follows NVIDIA's Q/DQ placement recommendations (TensorRT developer guide, "Q/DQ
Layer-Placement Recommendations"): the inputs of weighted layers quantized, no output quantizers, ops that
commute with quantization (MaxPool) left to TensorRT, which moves Q/DQ across them itself, and **the skip
input of a residual Add quantized** (a ``residual_quantizer`` in the module whose ``forward`` adds): TensorRT
fuses the Add into the Conv that produces the other operand only when that operand is quantized. The Add is
functional (``x + y`` in a ``forward``), so the module's ``forward`` is replaced by its ``torch.fx`` trace
with the quantizer inserted (the same code otherwise; parameters, buffers and ``state_dict`` keys stay, plus
the quantizer's ``amax``).

The structure is read where the exporter reads it: from one forward on the example batch, recorded op by op
(:mod:`quantcli.nn.recorded_graph`), so Python control flow, shapes unpacked in Python and modules called
twice are seen as the export records them. Without an example batch (``quantize_model(model, config)`` from
Python, or a checkpoint written before the recording existed) the model is read with ``torch.fx`` symbolic
tracing instead; a model it cannot trace keeps the per-layer placement (quantized inputs and weights, int32
biases for onnxruntime) without the structural additions, and :class:`Placement` says why. TensorRT's residual
quantizers rewrite a block's ``forward`` through its ``torch.fx`` trace (a recording cannot be turned back
into code); a block that does not trace (Python control flow on an argument, as EfficientNet's
``drop_connect_rate``) gets its skip quantizer at run time instead: its own additions are counted as its
``forward`` runs, and the ones the recorded graph marked quantize their skip operand
(:func:`quantcli.nn.computed.quantize_adds`).

Layers the model computes functionally (:mod:`quantcli.nn.computed`) are recorded where their operation runs,
so a padding in their ``forward`` is a node before them, as the exporter's ``Pad`` is.
"""

from __future__ import annotations

import operator
import types
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx, nn

from quantcli.errors import first_line
from quantcli.nn.computed import is_computed, is_conv_layer, quantize_adds
from quantcli.nn.modules import QUANT_POOL_CLASSES
from quantcli.nn.recorded_graph import (
    ADD_FUNCTIONS,
    ADD_METHODS,
    MEAN_OPS,
    RecordedGraph,
    RecordedNode,
    activation_kind,
    record,
    to_one_position,
)

#: onnxruntime target: quantize the skip input of residual Adds that can then run as QLinearAdd (issue 25)
RESIDUAL_QLINEAR_ADD = True
#: onnxruntime target: quantize around sigmoids, SiLU/Swish multiplications and global average poolings
#: between quantized layers, so that they run as QLinearSigmoid/QLinearMul/QLinearGlobalAveragePool (issue 35)
QLINEAR_ACTIVATIONS = True

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
# ops whose output is >= 0 whatever their input
_RELU_MODULES = (nn.ReLU, nn.ReLU6)
_RELU_FUNCTIONS = {F.relu, torch.relu, F.relu6, torch.relu_}
# ops that keep a non-negative tensor non-negative, and commute with quantization where marked
_COMMUTING_MODULES = (
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
    nn.Flatten,
    nn.Identity,
    nn.Dropout,
    nn.Unflatten,
)
_COMMUTING_FUNCTIONS = {
    torch.flatten,
    F.max_pool1d,
    F.max_pool2d,
    F.max_pool3d,
    F.dropout,
    torch.reshape,
    torch.squeeze,
    torch.unsqueeze,
    torch.transpose,
    torch.permute,
}
_COMMUTING_METHODS = {
    "view",
    "reshape",
    "flatten",
    "permute",
    "transpose",
    "contiguous",
    "squeeze",
    "unsqueeze",
}
_SIGN_KEEPING_MODULES = tuple(QUANT_POOL_CLASSES)  # the average poolings
_SIGN_KEEPING_FUNCTIONS = {
    F.avg_pool1d,
    F.avg_pool2d,
    F.avg_pool3d,
    F.adaptive_avg_pool1d,
    F.adaptive_avg_pool2d,
    torch.mean,
}
_SIGN_KEEPING_METHODS = {"mean"}
_CONCAT_FUNCTIONS = {torch.cat, torch.concat, torch.concatenate}


@dataclass
class Placement:
    """The structural part of a target's placement, by layer (module) name."""

    target: str
    analysed: bool = True
    note: str | None = None  # why the structure could not be analysed
    unsigned_inputs: list[str] = field(default_factory=list)  # inputs >= 0 by construction: uint8 grid
    # Conv layers that get an output quantizer, and 2-D Linears whose ReLU output feeds a signed Concat
    output_quantized: list[str] = field(default_factory=list)
    # a Conv's output quantizer applied after the ReLU/pooling after it: layer -> (module applying it,
    # unsigned)
    output_after: dict[str, tuple[str, bool]] = field(default_factory=dict)
    # quantizers on residual skip inputs (tensorrt: every residual Add; onnxruntime: those that then run as
    # QLinearAdd)
    residual_quantized: list[str] = field(default_factory=list)
    # what the structure was read from: "recorded" (one forward) or "fx" (no example batch)
    graph: str = "recorded"
    # tensorrt: blocks with a residual Add whose forward torch.fx cannot rewrite (skip input left
    # unquantized): why
    residual_untraced: dict[str, str] = field(default_factory=dict)
    # a Conv's input quantizer applied to the input of the zero padding module before it: layer -> that
    # module
    input_before: dict[str, str] = field(default_factory=dict)
    # average pooling modules whose input gets a quantizer (a residual Add before them then runs as
    # QLinearAdd): module -> unsigned
    pool_inputs: dict[str, bool] = field(default_factory=dict)
    # onnxruntime: activation quantizers put on uint8 with a zero point (the config's asymmetric_activations)
    asymmetric: list[str] = field(default_factory=list)
    # onnxruntime: the residual Adds whose skip gets a quantizer (those that run as QLinearAdd once it is, and
    # those whose skip is such an Add's output), as {Add node: skip node} of the graph read (for the rewrite
    # that inserts those quantizers; not part of the report)
    qlinear_adds: dict = field(default_factory=dict, repr=False)
    # onnxruntime: the sigmoids, multiplications and global poolings run on codes (QLinearSigmoid, QLinearMul,
    # QLinearGlobalAveragePool) once their operands are quantized, as {node: ActivationOp} of the graph read
    # (for the rewrite that inserts those quantizers; not part of the report)
    qlinear_activations: dict = field(default_factory=dict, repr=False)
    # onnxruntime: the quantizers that rewrite added (by name)
    activation_quantized: list[str] = field(default_factory=list)
    # onnxruntime: a global average pooling a forward computes (F.adaptive_avg_pool2d(x, 1), x.mean((2, 3)))
    # was read as one a residual Add's output may reach, and a spatial mean as a global pooling (a checkpoint
    # without this key was calibrated before: its placement is rebuilt without)
    functional_pools: bool = False
    # onnxruntime: per chain of such operations between quantized layers, its quantizers (those above and
    # pooling modules' input quantizers) and the layers around it: a layer kept float breaks the chain, and
    # its quantizers then go too (quantcli.calibration.latency_placement.apply)
    activation_groups: list[dict] = field(default_factory=list)
    # the chains as graph nodes: [(nodes, layers)] (for the rewrite; not part of the report)
    activation_chains: list = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        hidden = ("qlinear_adds", "qlinear_activations", "activation_chains")
        return {k: v for k, v in self.__dict__.items() if k not in hidden}


class _Tracer(fx.Tracer):
    def __init__(self, leaves: set[int]):
        super().__init__()
        self._leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return id(m) in self._leaves or super().is_leaf_module(m, qualname)


def _leaf_ids(model: nn.Module, layers: dict[str, nn.Module]) -> set[int]:
    from quantcli.nn.tensor_quantizer import TensorQuantizer

    return {id(m) for m in layers.values()} | {
        id(m) for m in model.modules() if isinstance(m, TensorQuantizer)
    }


def trace(model: nn.Module, layers: dict[str, nn.Module]) -> fx.Graph:
    """The fx graph of ``model`` with the quantized ``layers`` as leaves (raises what fx raises)."""
    return _Tracer(_leaf_ids(model, layers)).trace(model)


def read_graph(
    model: nn.Module,
    layers: dict[str, nn.Module],
    example: Mapping[str, torch.Tensor] | None,
    functions_inside: bool = False,
) -> fx.Graph | RecordedGraph:
    """The graph the analyses read: recorded on ``example`` (a keyword batch) when there is one, else the fx
    trace.

    In the recording, the quantized layers, quantizers, modules without submodules and the modules the
    analyses classify (ReLU, pooling, BatchNorm, ...) are single ``call_module`` nodes; other modules are
    recorded op by op, and so are the modules that only compute a function (:func:`function_module`) where
    ``functions_inside`` (the onnxruntime target, which quantizes around their sigmoids and
    multiplications).
    """
    if example is None:
        return trace(model, layers)
    leaves = _leaf_ids(model, layers)

    def is_leaf(name: str, m: nn.Module) -> bool:
        if is_computed(m):
            return False  # recorded op by op: its operation is its node (quantcli.nn.recorded_graph)
        return (
            id(m) in leaves
            or next(m.children(), None) is None
            or isinstance(m, (*_RELU_MODULES, *_COMMUTING_MODULES, *_SIGN_KEEPING_MODULES, *_PASS_THROUGH))
            or zero_pad(m)
        ) and not (functions_inside and QLINEAR_ACTIVATIONS and function_module(m))

    return record(model, example, is_leaf)


def function_module(m: nn.Module) -> bool:
    """A module that only computes a function of its input: ``nn.SiLU``, ``nn.Sigmoid``, or a class of the
    user's own (a ``Swish``) without submodules, parameters or buffers. The recording runs it op by op, so its
    sigmoid and multiplication are nodes the onnxruntime placement can quantize around, as the exporter
    writes them."""
    if next(m.children(), None) is not None or next(m.parameters(), None) is not None:
        return False
    if next(m.buffers(), None) is not None:
        return False
    if isinstance(m, (nn.SiLU, nn.Sigmoid)):
        return True
    module = type(m).__module__ or ""
    return not module.startswith(("torch.", "quantcli.", "exporters."))


def _is_node(x) -> bool:
    return isinstance(x, (fx.Node, RecordedNode))


def _kind(node: fx.Node, modules: dict[str, nn.Module]) -> str:
    """relu, commuting (max pooling, reshaping), sign-keeping (average pooling, mean), or other."""
    if node.op == "call_module":
        m = modules.get(node.target)
        if isinstance(m, _RELU_MODULES):
            return "relu"
        if isinstance(m, _COMMUTING_MODULES):
            return "commuting"
        if isinstance(m, _SIGN_KEEPING_MODULES) or zero_pad(m):
            return "sign-keeping"
    elif node.op == "call_function":
        if node.target is F.pad and node.meta.get("zero_pad"):
            return "sign-keeping"
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


def zero_pad(m: nn.Module | None) -> bool:
    """True for a padding module that pads with zeros and runs torch's own ``forward``."""
    return (
        isinstance(m, nn.modules.padding._ConstantPadNd)
        and type(m).forward is nn.modules.padding._ConstantPadNd.forward
        and m.value == 0
    )


def _zero_pad_before(node, calls: Counter, modules, graph) -> str | None:
    """The module whose (pre-)hook can quantize ``node``'s (a layer call's) input before the zero padding that
    produces it, or None. The padding's output must be ``node``'s input and nothing else's. Either

    * a zero padding module (:func:`zero_pad`) called once: its own input; or
    * ``torch.nn.functional.pad`` with zeros (TensorFlow-style "same" padding computed in a ``forward``, as in
      Hugging Face's MobileNet), padding the first positional argument of the module whose ``forward`` calls
      it, called once, which reads that argument nowhere else.
    """
    src = node.args[0] if node.args else None
    if not _is_node(src) or list(src.users) != [node] or node.args.count(src) != 1:
        return None
    if src.op == "call_module":
        return src.target if zero_pad(modules.get(src.target)) and calls[src.target] == 1 else None
    if src.op != "call_function" or src.target is not F.pad or not src.meta.get("zero_pad"):
        return None
    owner = _owner(src)
    calls_of_owner = getattr(graph, "module_inputs", {}).get(owner, [])
    x = src.args[0] if src.args else None
    if (
        x is None
        or not owner
        or len(calls_of_owner) != 1
        or not calls_of_owner[0]
        or calls_of_owner[0][0] is not x
    ):
        return None
    inside = [u for u in x.users if owner in (u.meta.get("nn_module_stack") or {})]
    return owner if inside == [src] else None


def _is_concat(node) -> bool:
    return _is_node(node) and node.op == "call_function" and node.target in _CONCAT_FUNCTIONS


def _concatenated(node) -> list:
    """The tensors a concatenation node joins (None for one no recorded node produced: a parameter)."""
    args = node.args
    if args and isinstance(args[0], (list, tuple)):  # torch.fx keeps the list
        args = args[0]
    return list(args)


def nonnegative(node, modules: dict[str, nn.Module]) -> bool:
    """True if ``node``'s value is >= 0 by construction (a ReLU, possibly through sign-keeping ops, or a
    concatenation of such tensors)."""
    while _is_node(node):
        if _is_concat(node):
            parts = _concatenated(node)
            return bool(parts) and all(nonnegative(p, modules) for p in parts)
        kind = _kind(node, modules)
        if kind == "relu":
            return True
        if kind not in ("commuting", "sign-keeping") or not node.args:
            return False
        node = node.args[0]
    return False


def _reaches_quantized_layers_only(
    node: fx.Node, modules, quantized_inputs: set[str], skips: dict | None = None, ends=()
) -> bool:
    """True if every path from ``node`` through ReLUs and commuting ops ends at a quantized layer's input (or
    at a residual Add in ``skips`` whose skip operand it is, or at a node of ``ends`` (poolings, paddings)
    whose input gets a quantizer)."""
    return bool(node.users) and all(
        _user_reaches_quantized_layers_only(node, user, modules, quantized_inputs, skips, ends)
        for user in node.users
    )


def _user_reaches_quantized_layers_only(
    node: fx.Node, user: fx.Node, modules, quantized_inputs: set[str], skips: dict | None, ends
) -> bool:
    """:func:`_reaches_quantized_layers_only` for the paths through one user of ``node``."""
    if user in ends and user.args and user.args[0] is node:
        return True
    if (
        user.op == "call_module"
        and user.target in quantized_inputs
        and user.args
        and user.args[0] is node
        and node not in user.args[1:]
    ):
        return True
    if skips and skips.get(user) is node:
        return True
    return (
        _kind(user, modules) in ("relu", "commuting")
        and bool(user.args)
        and user.args[0] is node
        and _reaches_quantized_layers_only(user, modules, quantized_inputs, skips, ends)
    )


def _avg_pools(graph, modules, quantized_inputs: set[str], calls: Counter, ends=(), functional=True) -> set:
    """Average pooling nodes (modules called once; ``functional``: also a global average pooling a
    ``forward`` computes, ``F.adaptive_avg_pool2d(x, 1)`` or ``x.mean((2, 3))``) whose output reaches
    quantized layers' inputs (or the inputs of ``ends``) only: with a quantizer on their input they run on
    codes (``QLinearAveragePool``/``QLinearGlobalAveragePool``)."""
    return {
        n
        for n in graph.nodes
        if (
            (
                n.op == "call_module"
                and isinstance(modules.get(n.target), _SIGN_KEEPING_MODULES)
                and calls[n.target] == 1
            )
            or (functional and _functional_global_pool(n))
        )
        and _reaches_quantized_layers_only(n, modules, quantized_inputs, None, ends)
    }


def _functional_global_pool(n) -> bool:
    """Whether ``n`` is a global average pooling of one tensor computed by a function or method."""
    return (
        n.op != "call_module"
        and activation_kind(n.op, n.target) == "global_pool"
        and bool(n.meta.get("global_pool"))
        and len(n.args) == 1
        and _is_node(n.args[0])
    )


def _pools_reached(node, modules, pools) -> set:
    """The nodes of ``pools`` that ``node``'s output reaches through ReLUs and commuting ops."""
    out = set()
    for user in node.users:
        if user in pools:
            out.add(user)
        elif _kind(user, modules) in ("relu", "commuting") and user.args and user.args[0] is node:
            out |= _pools_reached(user, modules, pools)
    return out


def onnxruntime_residual_skips(
    residuals: list, modules, layers: dict[str, nn.Module], quantized_inputs: set[str], ends=()
) -> dict:
    """Of the ``residuals`` (:func:`residual_skips`), the Adds whose skip operand gets a quantizer:
    ``{add node: skip node}``. A candidate's branch is a quantized Conv's output (it gets an output quantizer)
    and its skip is not a Conv's output (that one gets its own). onnxruntime runs a candidate as
    ``QLinearAdd`` where everything its output reaches through ReLUs and commuting ops is a quantized layer's
    input, a candidate's skip or the input of a node of ``ends`` (``QLinearAdd`` needs a Q on every output
    edge). The Adds that do are returned, and with them every candidate whose skip such an Add's output is:
    that skip operand must be quantized for the Add before to fuse, whether or not its own Add does. (Judged
    one Add at a time, the last block of an encoder stage, whose output also feeds a decoder's ``torch.cat``,
    lost its QLinearAdd, then so did the block before it, whose output is that block's skip, and so on up the
    stage.)"""
    layer_ids = {id(v) for v in layers.values()}
    candidates = {
        add: skip for add, skip, _ in residuals if _quantized_conv_behind(skip, modules, layer_ids) is None
    }
    # every residual Add that can fuse, a candidate or one of two quantized Convs' outputs (a downsampling
    # block's: both operands get output quantizers)
    fused = [
        add
        for add, _, _ in residuals
        if _reaches_quantized_layers_only(add, modules, quantized_inputs, candidates, ends)
    ]
    fed = {b for add in fused for b in _skips_reached(add, modules, candidates)}
    return {add: skip for add, skip in candidates.items() if add in fused or add in fed}


def _skips_reached(node, modules, candidates: dict) -> set:
    """The Adds of ``candidates`` whose skip operand is ``node``'s output, through ReLUs and commuting ops."""
    out = set()
    for user in node.users:
        if candidates.get(user) is node:
            out.add(user)
        elif _kind(user, modules) in ("relu", "commuting") and user.args and user.args[0] is node:
            out |= _skips_reached(user, modules, candidates)
    return out


def analyse(
    model: nn.Module,
    layers: dict[str, nn.Module],
    target: str,
    input_enabled: dict[str, bool],
    weight_integer: dict[str, bool],
    example: Mapping[str, torch.Tensor] | None = None,
    activations: bool = True,
    functional_pools: bool = True,
) -> tuple[Placement, fx.Graph | RecordedGraph | None]:
    """The structural placement for ``target`` of the quantized ``layers`` (name -> module) of ``model``, and
    the graph it was read from (None when fx could not trace a model without an example batch).

    ``input_enabled``: layers whose input quantizer is on; ``weight_integer``: layers with an integer weight
    quantizer of at most 8 bits (the ones onnxruntime can run as integer kernels); ``example``: one keyword
    batch, on which the model's graph is recorded (:func:`read_graph`); ``activations``: quantize around
    sigmoids, multiplications and global poolings (:func:`qlinear_activations`; off for a checkpoint
    calibrated before that existed, whose placement is rebuilt as it was); ``functional_pools``: a global
    average pooling computed by a function (``F.adaptive_avg_pool2d``, a mean over the spatial axes) is a
    pooling a residual Add's output may reach, and a spatial mean a global pooling (off for a checkpoint
    calibrated before, as ``activations``).
    """
    placement = Placement(target, graph="recorded" if example is not None else "fx")
    try:
        graph = read_graph(model, layers, example, functions_inside=activations and target == "onnxruntime")
    except Exception as e:  # fx cannot trace every model: say so and keep the per-layer placement
        if example is not None:
            raise  # the forward itself failed on the user's batch: a DataError that names it
        first = first_line(e, 160)
        placement.analysed = False
        placement.note = (
            f"torch.fx could not trace the model ({type(e).__name__}: {first}) and no example "
            f"batch "
            "was given to record it"
        )
        return placement, None
    modules = dict(model.named_modules())
    if target == "tensorrt":
        return placement, graph
    functional_pools = functional_pools and activations and isinstance(graph, RecordedGraph)
    placement.functional_pools = functional_pools
    if not functional_pools and isinstance(graph, RecordedGraph):
        for n in graph.nodes:
            if (n.op, n.target) in MEAN_OPS:
                n.meta["global_pool"] = False  # read as before: a mean was no pooling
    quantized_inputs = {n for n, on in input_enabled.items() if on}
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    # a layer called more than once (a module reused) gets one decision that holds for every call
    layer_calls: dict[str, list] = {}
    for node in graph.nodes:
        if node.op == "call_module" and node.target in layers:
            layer_calls.setdefault(node.target, []).append(node)
    # zero paddings before a Conv whose input quantizer then runs before them: their input is quantized
    pads = set()
    for name, nodes in layer_calls.items():
        if len(nodes) == 1 and name in quantized_inputs and is_conv_layer(layers[name]):
            hooked = _zero_pad_before(nodes[0], calls, modules, graph)
            if hooked is not None:
                placement.input_before[name] = hooked
                pads.add(nodes[0].args[0])
    pools = (
        _avg_pools(graph, modules, quantized_inputs, calls, pads, functional_pools)
        if RESIDUAL_QLINEAR_ADD
        else set()
    )
    ends = pads | pools  # nodes whose input gets a quantizer, besides the quantized layers
    residuals = residual_skips(graph, modules, layers) if RESIDUAL_QLINEAR_ADD else []
    skips = onnxruntime_residual_skips(residuals, modules, layers, quantized_inputs, ends)
    placement.qlinear_adds = skips
    # the Adds that run as QLinearAdd with a Q on their output: those whose skip gets a quantizer, and those
    # whose both operands are quantized Convs' outputs (each Conv gets an output quantizer)
    layer_ids = {id(v) for v in layers.values()}
    adds = list(skips) + [
        add
        for add, skip, _ in (residuals if pools else ())
        if _quantized_conv_behind(skip, modules, layer_ids) is not None
        and _reaches_quantized_layers_only(add, modules, quantized_inputs, skips, ends)
    ]
    used_pools = set().union(*(_pools_reached(add, modules, pools) for add in adds)) if adds else set()
    placement.pool_inputs = {
        p.target: nonnegative(p.args[0], modules)
        for p in graph.nodes
        if p in used_pools and p.op == "call_module"
    }
    # a pooling the forward computes: its operand quantized as the forward runs, as a chain's are
    placement.qlinear_activations = {
        p: ActivationOp("global_pool", (0,), (nonnegative(p.args[0], modules),))
        for p in graph.nodes
        if p in used_pools and p.op != "call_module"
    }
    if QLINEAR_ACTIVATIONS and activations:
        acts = qlinear_activations(
            graph, modules, layers, quantized_inputs, weight_integer, calls, pads | used_pools
        )
        placement.activation_chains = _chains(acts, modules, layers)
        for n, op in acts.items():
            if op.kind == "pool_module":
                if op.quantize:
                    placement.pool_inputs.setdefault(n.target, op.unsigned[0])
            elif op.quantize or op.kind == "silu":
                placement.qlinear_activations[n] = op
    for name, nodes in layer_calls.items():
        if name in quantized_inputs and all(n.args and nonnegative(n.args[0], modules) for n in nodes):
            placement.unsigned_inputs.append(name)
        conv = is_conv_layer(layers[name])
        reached = used_pools | pads
        if (
            conv
            and name in quantized_inputs
            and weight_integer.get(name)
            and not all(
                _reaches_quantized_layers_only(n, modules, quantized_inputs, skips, reached) for n in nodes
            )
        ):
            placement.output_quantized.append(name)
            after = _output_point(nodes[0], calls, modules, quantized_inputs) if len(nodes) == 1 else None
            if after is not None:
                placement.output_after[name] = after
        elif (
            not conv
            and name in quantized_inputs
            and weight_integer.get(name)
            and len(nodes) == 1
            and _relu_not_into_a_q(nodes[0], modules, quantized_inputs, skips, reached)
        ):
            placement.output_quantized.append(name)
            after = _output_point(nodes[0], calls, modules, quantized_inputs)
            if after is not None:
                placement.output_after[name] = after
    return placement, graph


def _gemm_relu_end(node, modules) -> fx.Node | None:
    """For a Linear on a 2-D input (a Gemm) followed by a ReLU (and ops that commute with quantization, one
    reader each): the last of them, when it has one reader; else None (a 3-D Linear is a MatMul (+ Add), which
    fuses without an output Q; a ReLU read twice stays a node of its own and the Gemm fuses alone: QGemm with
    a float output)."""
    if node.meta.get("ndim") != 2:
        return None
    end, relu = node, False
    while len(end.users) == 1:
        (user,) = end.users
        if _kind(user, modules) not in ("relu", "commuting") or not user.args or user.args[0] is not end:
            break
        relu = relu or _kind(user, modules) == "relu"
        end = user
    return end if relu and len(end.users) == 1 else None


def _relu_not_into_a_q(node, modules, quantized_inputs: set[str], skips, ends) -> bool:
    """True for a Gemm whose ReLU (:func:`_gemm_relu_end`) feeds one reader that is not a quantized layer's
    input: a residual Add (``h + relu(fc(h))``), a mean, a graph output, or a concatenation
    (:func:`_into_signed_concat`). Without a Q after the ReLU onnxruntime runs the Gemm and ReLU as one
    float ``FusedGemm`` between the layer's Q/DQ, which latency placement then keeps float; with an output
    quantizer the Gemm runs as ``QGemm``, as in onnxruntime's own ``quantize_static`` graphs (which quantize
    the Add too)."""
    end = _gemm_relu_end(node, modules)
    if end is None:
        return False
    if not _reaches_quantized_layers_only(end, modules, quantized_inputs, skips, ends):
        return True
    return _into_signed_concat(end, modules, quantized_inputs, skips, ends)


def _into_signed_concat(end, modules, quantized_inputs: set[str], skips, ends) -> bool:
    """True where the ReLU after a Gemm (``end``, :func:`_gemm_relu_end`) feeds a concatenation that can be
    negative and whose output reaches quantized layers only (DLRM's bottom MLP before the embedding bags).

    The export copies the next layer's input quantizer onto the Concat's inputs
    (:func:`exporters.onnxruntime.placement.propagate_quantize`), but that grid has a zero point above 0 when
    the Concat can be negative, and onnxruntime absorbs a Relu into the layer before a Q only when the Q's
    zero point is the grid's lowest code; without a Q after it, onnxruntime makes the Gemm and Relu one float
    ``FusedGemm``. An output quantizer of its own (after a ReLU module: unsigned) gives the Gemm its
    ``QGemm``, as onnxruntime's ``quantize_static`` quantizes a Gemm -> Relu output; the Concat then reads
    its DequantizeLinear. A Concat that is >= 0 needs none: the copied Q is unsigned then."""
    (cat,) = end.users
    return (
        _is_concat(cat)
        and not nonnegative(cat, modules)
        and _reaches_quantized_layers_only(cat, modules, quantized_inputs, skips, ends)
    )


@dataclass(frozen=True)
class ActivationOp:
    """A sigmoid, SiLU, multiplication or global average pooling that runs on codes once the operands
    ``quantize`` (positional indices) are quantized (the others are quantized Convs' outputs, which have
    their output quantizer); ``unsigned``: per index of ``quantize``, whether that operand is >= 0 (a
    sigmoid's or a ReLU's output: uint8 grid)."""

    kind: str
    quantize: tuple[int, ...]
    unsigned: tuple[bool, ...]


def _activation_kind(node, modules, calls: Counter) -> str | None:
    if node.op == "call_module":
        m = modules.get(node.target)
        one = to_one_position(getattr(m, "output_size", None))
        if type(m) in QUANT_POOL_CLASSES and calls[node.target] == 1 and one:
            return "pool_module"  # an adaptive average pooling module to one position: its input_quantizer
        return None
    kind = activation_kind(node.op, node.target)
    if kind == "global_pool" and not node.meta.get("global_pool"):
        return None
    return kind


def _past_identities(x, modules):
    """The node ``x`` is, past Identities (a folded BatchNorm) and Dropouts; None where one has no node
    input."""
    while x.op == "call_module" and isinstance(modules.get(x.target), (nn.Identity, nn.Dropout)):
        if not x.args or not _is_node(x.args[0]):
            return None
        x = x.args[0]
    return x


def qlinear_activations(
    graph, modules, layers: dict[str, nn.Module], quantized_inputs: set[str], weight_integer, calls, ends=()
) -> dict:
    """The sigmoids, SiLUs, two-tensor multiplications and global average poolings (recorded graph only)
    that onnxruntime's CPU provider runs on codes (``QLinearSigmoid``, ``QLinearMul``,
    ``QLinearGlobalAveragePool``: every input from a DQ, a Q on every output edge) once their operands are
    quantized: ``{node: ActivationOp}``. Each operand is a quantized Conv's output or another such
    operation's, and each consumer of the output (through ReLUs and commuting ops) a quantized layer's input,
    another such operation or a node of ``ends`` (paddings, poolings) whose input gets a quantizer; so the
    chain between quantized layers runs on codes and no float consumer pays for a DQ."""
    if not isinstance(graph, RecordedGraph):
        return {}

    def conv_out(x) -> bool:
        # through a folded BatchNorm's Identity (or a Dropout): the Conv's output quantizer is after it
        # (_output_point) or before it, the same values either way
        x = _past_identities(x, modules)
        return (
            x is not None
            and x.op == "call_module"
            and x.target in layers
            and is_conv_layer(layers[x.target])
            and x.target in quantized_inputs
            and bool(weight_integer.get(x.target))
        )

    cands: dict = {}
    for n in graph.nodes:
        kind = _activation_kind(n, modules, calls)
        if kind is None:
            continue
        arity = 2 if kind == "mul" else 1
        if len(n.args) != arity or not all(_is_node(a) for a in n.args):
            continue
        if arity == 2 and n.args[0] is n.args[1]:
            continue
        cands[n] = kind

    def coded_users(n) -> bool:
        # a chain operation may take n as any operand; every other user must lead to quantized inputs only,
        # the chain's operations counting as ends there
        ends_or_chain = set(ends) | set(cands)
        return bool(n.users) and all(
            (u in cands and n in u.args)
            or _user_reaches_quantized_layers_only(n, u, modules, quantized_inputs, None, ends_or_chain)
            for u in n.users
        )

    changed = True
    while changed:
        changed = False
        for n in list(cands):
            if not all(conv_out(a) or a in cands for a in n.args) or not coded_users(n):
                del cands[n]
                changed = True
    out = {}
    for n, kind in cands.items():
        idx = tuple(i for i, a in enumerate(n.args) if not conv_out(a))
        unsigned = tuple(cands.get(n.args[i]) == "sigmoid" or nonnegative(n.args[i], modules) for i in idx)
        out[n] = ActivationOp(kind, idx, unsigned)
    return out


def _chains(acts: Mapping, modules, layers: dict[str, nn.Module]) -> list[tuple[list, list[str]]]:
    """The activation operations ``acts`` grouped into chains (connected through their operands), each with
    the quantized layers whose outputs it reads or that read its outputs (through ReLUs, commuting ops and
    paddings)."""
    parent = {n: n for n in acts}

    def root(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in acts:
        for a in n.args:
            if a in acts:
                parent[root(a)] = root(n)

    def producer_layer(x) -> str | None:
        x = _past_identities(x, modules)
        return x.target if x is not None and x.op == "call_module" and x.target in layers else None

    def consumer_layers(x, seen: set) -> set[str]:
        out = set()
        for u in x.users:
            if u in seen or u in acts:
                continue
            seen.add(u)
            if u.op == "call_module" and u.target in layers:
                out.add(u.target)
            elif _kind(u, modules) != "other":
                out |= consumer_layers(u, seen)
        return out

    chains: dict = {}
    for n in acts:
        nodes, around = chains.setdefault(root(n), ([], set()))
        nodes.append(n)
        around |= {t for a in n.args if a not in acts and (t := producer_layer(a)) is not None}
        around |= consumer_layers(n, set())
    return [(nodes, sorted(around)) for nodes, around in chains.values()]


def _output_point(
    node: fx.Node, calls: Counter, modules, quantized_inputs: set[str]
) -> tuple[str, bool] | None:
    """Where a Conv's output quantizer goes when a ReLU or ops that commute with quantization follow it alone:
    after the last of them (a module called once), so that onnxruntime absorbs the ReLU (unsigned grid) and
    runs the pooling on codes. ``calls``: how many times the graph calls each module. ``(module name,
    unsigned)``, or None to quantize right after the Conv."""
    chain, end = [], node
    while len(end.users) == 1:
        (user,) = end.users
        if _kind(user, modules) not in ("relu", "commuting") or not user.args or user.args[0] is not end:
            break
        chain.append(user)
        end = user
    if any(u.op == "call_module" and u.target in quantized_inputs for u in end.users):
        return None  # a quantized layer reads it: its own input quantizer is there already
    for i in range(len(chain) - 1, -1, -1):
        n = chain[i]
        if n.op == "call_module" and calls[n.target] == 1:
            return n.target, any(_kind(c, modules) == "relu" for c in chain[: i + 1])
    return None


# ------------------------------------------------------------------------------------------- residual Adds

_ADD_FUNCTIONS = ADD_FUNCTIONS
# between a Conv and its Add in a block
_PASS_THROUGH = (nn.modules.batchnorm._BatchNorm, nn.Identity, nn.Dropout)


def _is_add(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _ADD_FUNCTIONS) or (
        node.op == "call_method" and node.target in ADD_METHODS
    )


def _quantized_conv_behind(node, modules: dict[str, nn.Module], layer_ids: set[int]) -> nn.Module | None:
    """The quantized Conv (``id`` in ``layer_ids``) whose output ``node`` is, through
    BatchNorm/Identity/Dropout (None if there is none)."""
    while _is_node(node) and node.op == "call_module":
        m = modules.get(node.target)
        if m is not None and id(m) in layer_ids:
            return m if is_conv_layer(m) and m.input_quantizer.enabled else None
        if not isinstance(m, _PASS_THROUGH) or not node.args:
            return None
        node = node.args[0]
    return None


def residual_skips(graph, modules: dict[str, nn.Module], layers: dict[str, nn.Module]):
    """``(add node, skip operand, branch Conv)`` for each Add of a quantized Conv's output and another tensor.

    The branch is the operand a quantized Conv produces (through BatchNorm/Identity/Dropout); when both are,
    the one computed last (the block's main path in torchvision's and NVIDIA's blocks; a projection shortcut
    is computed first). Which operand a ``forward`` writes first or computes first says nothing by itself:
    timm's ConvNeXt adds ``drop_path(x) + shortcut``, Hugging Face's ResNet computes its shortcut after the
    main path.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    layer_ids = {id(v) for v in layers.values()}
    out = []
    for n in graph.nodes:
        if not _is_add(n) or len(n.args) < 2 or not all(_is_node(a) for a in n.args[:2]):
            continue
        a, b = n.args[:2]
        convs = {x: _quantized_conv_behind(x, modules, layer_ids) for x in (a, b)}
        behind = [x for x in (a, b) if convs[x] is not None]
        if not behind:
            continue
        branch = max(behind, key=order.__getitem__)
        skip = b if branch is a else a
        out.append((n, skip, convs[branch]))
    return out


def _owner(node) -> str:
    stack = list((node.meta.get("nn_module_stack") or {}).keys())
    return stack[-1] if stack else ""


def residual_owners(
    graph, layers: dict[str, nn.Module], modules: dict[str, nn.Module]
) -> dict[str, list[int | None]]:
    """The modules whose own ``forward`` adds a quantized Conv's output to a skip input (``""``: the model),
    from the model's ``graph`` (recorded or traced): for each, one entry per Add its ``forward`` runs (on its
    first call), in
    order: which operand (0 or 1) is the skip input, or None for an Add that is not a residual."""
    skips = {n: (0 if skip is n.args[0] else 1) for n, skip, _ in residual_skips(graph, modules, layers)}
    owners: dict[str, list[int | None]] = {}
    first_call: dict[str, object] = {}
    for n in graph.nodes:
        if _is_add(n):
            owner = _owner(n)
            if first_call.setdefault(owner, n.meta.get("call")) == n.meta.get("call"):
                owners.setdefault(owner, []).append(skips.get(n))
    return {o: adds for o, adds in owners.items() if any(i is not None for i in adds)}


class _ChildrenTracer(fx.Tracer):
    """Traces one module's own ``forward``: every submodule stays one ``call_module`` node, so the code that
    replaces the ``forward`` calls the same modules (the export's scopes, which name the Q/DQ pairs, stay)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return True


def insert_residual_quantizers(
    model: nn.Module,
    layers: dict[str, nn.Module],
    graph,
    make: Callable[[str, nn.Module, object], nn.Module],
    only: Mapping | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Quantize the skip input of every residual Add (tensorrt placement) that ``graph`` (the model's,
    recorded or traced) shows; returns the new quantizers' names, and the owning blocks left alone with why.

    ``make(name, branch_conv)`` builds the quantizer. Each owning module gets ``residual_quantizer`` (then
    ``residual_quantizer_1``, ...) and its ``forward`` becomes the fx trace of its own code (submodules called
    as they were) with the quantizer on the skip operand. The Adds of that trace are matched to the graph's by
    order. A module whose ``forward`` fx cannot trace keeps its code, and its Adds get their quantizers as
    they run, matched to the graph's by the same order (:func:`quantcli.nn.computed.quantize_adds`).
    """
    modules = dict(model.named_modules())
    branch_convs = {n: conv for n, _, conv in residual_skips(graph, modules, layers)}
    names, untraced = [], {}
    for owner, adds in residual_owners(graph, layers, modules).items():
        if only is not None:
            recorded = [n for n in graph.nodes if _is_add(n) and _owner(n) == owner]
            adds = [i if rec in only else None for i, rec in zip(adds, recorded)]
            if all(i is None for i in adds):
                continue
        label = owner or "(the model)"
        mod = model.get_submodule(owner) if owner else model
        try:
            block = _ChildrenTracer().trace(mod)
        except Exception as e:  # fx cannot trace every block: its Adds are quantized as they run instead
            if isinstance(graph, RecordedGraph):
                names += _quantize_adds_as_they_run(model, owner, mod, adds, graph, branch_convs, make)
            else:
                untraced[label] = (
                    f"torch.fx could not trace its forward ({type(e).__name__}: {first_line(e, 120)}), and "
                    "no example batch was recorded to find its additions by"
                )
            continue
        fx_adds = [n for n in block.nodes if _is_add(n)]
        if len(fx_adds) != len(adds) or any(
            i is not None and not isinstance(n.args[i], fx.Node) for n, i in zip(fx_adds, adds)
        ):
            untraced[label] = (
                f"its fx trace has {len(fx_adds)} Adds where the recorded forward ran "
                f"{len(adds)}: "
                "which operand is the skip input is not certain"
            )
            continue
        if any(n.op == "get_attr" and not _resolves(mod, n.target) for n in block.nodes):
            untraced[label] = "its fx trace holds constants of its own"
            continue  # keep the module's code rather than guess
        recorded = [n for n in graph.nodes if _is_add(n) and _owner(n) == owner]
        k = 0
        for n, i, rec in zip(fx_adds, adds, recorded):
            if i is None:
                continue
            attr = "residual_quantizer" if k == 0 else f"residual_quantizer_{k}"
            qname = f"{owner}.{attr}" if owner else attr
            mod.add_module(attr, make(qname, branch_convs[rec], rec.args[i]))
            skip = n.args[i]
            with block.inserting_before(n):
                qnode = block.call_module(attr, (skip,))
            n.replace_input_with(skip, qnode)
            names.append(qname)
            k += 1
        block.lint()
        traced = fx.GraphModule(mod, block)
        # the generated forward reads only ``self.<path>`` attributes, which ``mod`` has (checked above)
        mod.forward = types.MethodType(type(traced).forward, mod)
    return names, untraced


def _quantize_adds_as_they_run(
    model: nn.Module, owner: str, mod: nn.Module, adds: list, graph: RecordedGraph, branch_convs, make
) -> list[str]:
    """The residual quantizers of a block fx cannot rewrite: each skip operand the recorded graph marks
    (``adds``: per addition of the block's first call, in order, the skip operand's index or None) is
    quantized when the block's ``forward`` runs that addition."""
    recorded = [n for n in graph.nodes if _is_add(n) and _owner(n) == owner]
    spec: dict[int, tuple[int, str]] = {}
    names = []
    for k, (i, rec) in enumerate(zip(adds, recorded)):
        if i is None:
            continue
        attr = "residual_quantizer" if not spec else f"residual_quantizer_{len(spec)}"
        qname = f"{owner}.{attr}" if owner else attr
        mod.add_module(attr, make(qname, branch_convs[rec], rec.args[i]))
        spec[k] = (i, attr)
        names.append(qname)
    if spec:
        quantize_adds(model, mod, spec)
    return names


def insert_activation_quantizers(
    model: nn.Module, graph: RecordedGraph, ops: Mapping, make: Callable[[str, bool], nn.Module]
) -> dict:
    """Quantize the operands of the activation operations ``ops`` (:func:`qlinear_activations`, less the
    pooling modules) as their owning modules' ``forward`` runs (:func:`quantcli.nn.computed.quantize_ops`);
    returns the new quantizers' names by operation node. ``make(name, unsigned)`` builds a quantizer; each
    owning module gets ``activation_quantizer``, ``activation_quantizer_1``, ... (a SiLU's sigmoid output is
    one of them)."""
    from quantcli.nn.computed import OpQuantizers, quantize_ops

    names: dict = {}
    per_owner: dict[str, dict[int, dict[int, OpQuantizers]]] = {}
    counts: Counter = Counter()  # activation operations per (owner, call) so far: the ordinal
    added: Counter = Counter()
    for n in graph.nodes:
        if n.op == "call_module" or activation_kind(n.op, n.target) is None:
            continue
        owner, call = _owner(n), n.meta.get("call")
        k = counts[owner, call]
        counts[owner, call] += 1
        op = ops.get(n)
        calls_of_owner = graph.module_calls.get(owner, [])
        if op is None or call not in calls_of_owner:
            continue
        mod = model.get_submodule(owner) if owner else model

        def new(unsigned: bool, owner=owner, mod=mod, node=n) -> str:
            j = added[owner]
            added[owner] += 1
            attr = "activation_quantizer" if j == 0 else f"activation_quantizer_{j}"
            qname = f"{owner}.{attr}" if owner else attr
            mod.add_module(attr, make(qname, unsigned))
            names.setdefault(node, []).append(qname)
            return attr

        operands = tuple((i, new(u)) for i, u in zip(op.quantize, op.unsigned))
        sigmoid = new(True) if op.kind == "silu" else None
        per_owner.setdefault(owner, {}).setdefault(calls_of_owner.index(call), {})[k] = OpQuantizers(
            operands, sigmoid
        )
    for owner, per_call in per_owner.items():
        quantize_ops(model, model.get_submodule(owner) if owner else model, per_call)
    return names


def _resolves(mod: nn.Module, target: str) -> bool:
    obj = mod
    for part in target.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True
