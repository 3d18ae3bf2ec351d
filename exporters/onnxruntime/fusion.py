"""What onnxruntime made of each quantized layer: an integer kernel, or float between Q/DQ, and why.

:func:`inspect_fusion` loads the graph the way a user does (``InferenceSession(path)``: default options,
``ORT_ENABLE_ALL``), saves the graph onnxruntime runs (``SessionOptions.optimized_model_filepath``) and looks
up every quantized layer of the exported graph in it. A layer is a Conv/ConvTranspose/Gemm/MatMul whose weight
(second input) is a DequantizeLinear output, named after the module its quantizers belong to (the quantizer
map in ``metadata_props``). *Fused* is what onnxruntime did (the op type it runs the layer as); *reasons* is a
diagnosis of an unfused layer from the conditions of onnxruntime's QDQ selectors (``qdq_selectors.cc``), the
passes that run before them (``qdq_s8_to_u8.cc``, ``weight_bias_quantization.cc``,
``ensure_unique_dq_for_node_unit.cc``) and the guards of :mod:`exporters.onnxruntime.compat`. A reason is
reported only where one of those conditions explains it.
"""

from __future__ import annotations

import collections
import platform
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import helper

from exporters.graph import (
    consumer_map,
    initializer_map,
    name_scopes,
    producer_map,
    quantizer_map,
    read_onnx,
    scope_module_path,
)
from exporters.onnxruntime import compat
from exporters.onnxruntime.recurrent import recurrent_layers
from quantcli.errors import VerifyError, first_line
from quantcli.nn.recurrent import DYNAMIC_LSTM
from quantcli.nn.tensor_quantizer import owner, role

# the kernels onnxruntime runs a quantized layer as when its QDQ fusions apply
INTEGER_KERNELS = frozenset(
    {
        "QLinearConv",
        "QLinearConvTranspose",
        "QGemm",
        "QLinearMatMul",
        "MatMulIntegerToFloat",
        "MatMulNBits",
        "DynamicQuantizeMatMul",
        "MatMulInteger",
        "ConvInteger",
        "QAttention",
        "NhwcQLinearConv",
        DYNAMIC_LSTM,
    }
)
LAYER_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
DYNAMIC_OPS = ("MatMulInteger",)  # a DynamicQuantizeLinear -> MatMulInteger layer (exporters.dynamic_linear)
_MOVES = ("Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")  # weight layout changes
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
_INT8, _UINT8 = onnx.TensorProto.INT8, onnx.TensorProto.UINT8
_TYPE_MIN = {_INT8: -128, _UINT8: 0}


@dataclass
class LayerFusion:
    """One quantized layer: how the exported graph has it and what onnxruntime runs it as."""

    layer: str  # the module name its quantizers belong to (or the node name)
    node: str  # its node in the exported graph
    op_type: str  # Conv, ConvTranspose, Gemm, MatMul
    quantizers: list[str]
    kernel: str | None  # the op type onnxruntime runs it as; None: not found in the optimized graph
    fused: bool | None  # an integer kernel; None when it could not be traced
    reasons: list[str] = field(default_factory=list)  # why not fused, where the diagnosis can tell
    # the name of the node onnxruntime runs it as (its profiler's name for it)
    optimized_node: str | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class FusionReport:
    path: str
    provider: str
    load_error: str | None = None  # the session failed to load with default options
    layers: list[LayerFusion] = field(default_factory=list)
    needs: compat.SessionNeeds = field(default_factory=compat.SessionNeeds)  # for exact results (compat)
    # float layers (no weight quantizer) onnxruntime quantizes itself: :func:`runtime_quantized_layers`
    runtime_quantized: list[LayerFusion] = field(default_factory=list)
    _graph: onnx.ModelProto | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def unfused(self) -> list[LayerFusion]:
        return [r for r in self.layers if not r.fused]

    def graph(self) -> onnx.ModelProto:
        """The graph inspected, read once (its external data left on disk): what placement's rules that
        look at a layer's neighbours read."""
        if self._graph is None:
            self._graph = onnx.load(self.path, load_external_data=False)
        return self._graph

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "runtime": "onnxruntime",
            "provider": self.provider,
            "load_error": self.load_error,
            "session_needs": list(self.needs.reasons),
            "disabled_optimizers": list(self.needs.disabled_optimizers),
            "quantized_layers": len(self.layers),
            "unfused_layers": len(self.unfused),
            "layers": [r.to_dict() for r in self.layers],
            "runtime_quantized": [r.to_dict() for r in self.runtime_quantized],
        }


# ------------------------------------------------------------------------------------------- the graph


class _Graph:
    def __init__(self, model: onnx.ModelProto):
        g = model.graph
        self.inits = initializer_map(g)
        self.producers = producer_map(g)
        self.consumers = consumer_map(model)
        self.outputs = {o.name for o in g.output}
        self.qmap = quantizer_map(model)

    def attrs(self, n: onnx.NodeProto) -> dict:
        return {a.name: helper.get_attribute_value(a) for a in n.attribute}

    def dq_of(self, tensor: str, through: tuple[str, ...] = ()) -> tuple[onnx.NodeProto | None, bool]:
        """(the DequantizeLinear producing ``tensor``, through fp8 guards and ``through`` ops; guarded?)."""
        guarded = False
        n = self.producers.get(tensor)
        while n is not None and (compat.is_guard(n) or n.op_type in through):
            guarded = guarded or compat.is_guard(n)
            n = self.producers.get(n.input[0])
        return (n if n is not None and n.op_type == "DequantizeLinear" else None), guarded

    def quant_type(self, dq_or_q: onnx.NodeProto) -> int | None:
        """The quantized element type of a DQ (its zero point or stored codes) or of a Q (its zero point)."""
        names = [dq_or_q.input[2]] if len(dq_or_q.input) > 2 and dq_or_q.input[2] else []
        if dq_or_q.op_type == "DequantizeLinear":
            names.append(dq_or_q.input[0])
        for name in names:
            if name in self.inits:
                return self.inits[name].data_type
        if dq_or_q.op_type == "DequantizeLinear" and dq_or_q.input[0] in self.producers:
            q = self.producers[dq_or_q.input[0]]
            if q.op_type == "QuantizeLinear":
                return self.quant_type(q)
        return _UINT8 if dq_or_q.op_type == "QuantizeLinear" else None

    def scalar(self, name: str) -> bool:
        t = self.inits.get(name)
        return t is not None and (len(t.dims) == 0 or list(t.dims) == [1])

    def zero_point(self, q: onnx.NodeProto) -> int | None:
        if len(q.input) < 3 or not q.input[2]:
            return 0
        t = self.inits.get(q.input[2])
        if t is None or not self.scalar(q.input[2]):
            return None
        return int(onnx.numpy_helper.to_array(t).reshape(-1)[0])


def _type_name(t: int | None) -> str:
    return onnx.TensorProto.DataType.Name(t).lower() if t is not None else "unknown"


def _layer_name(quantizers: list[str], node: onnx.NodeProto) -> str:
    for kind in ("weight_quantizer", "input_quantizer"):
        for q in quantizers:
            if role(q) == kind:
                return owner(q)  # "" where the model's own (root) module computes it
    return node.name or node.output[0]


def quantized_layers(model: onnx.ModelProto) -> list[tuple[str, onnx.NodeProto, list[str]]]:
    """(layer name, node, quantizer names) for every Conv/ConvTranspose/Gemm/MatMul whose second input (the
    weight, or a MatMul's right operand) is a DequantizeLinear output, every dynamic MatMulInteger layer and
    every DynamicQuantizeLSTM (named after its LSTM layer, ``lstm.l0``).

    Named after the module of its quantizers in the quantizer map, else after the node; the nodes of a module
    its forward calls several times (a shared encoder, a block run in a loop: one set of quantizers) by the
    module and the call, in graph order (``enc.c1 (call 2)``).
    """
    g = _Graph(model)
    recurrent = {r.node.name: r for r in recurrent_layers(model)}
    out = []
    for n in model.graph.node:
        if n.op_type == DYNAMIC_LSTM:  # an integer kernel itself (exporters.onnxruntime.recurrent)
            r = recurrent.get(n.name)
            out.append((r.layer if r else n.name, n, r.quantizers if r else []))
            continue
        if (
            n.op_type in DYNAMIC_OPS
            and n.input[0] in g.producers
            and g.producers[n.input[0]].op_type == "DynamicQuantizeLinear"
        ):
            names = [g.qmap[i] for i in n.input[:2] if i in g.qmap]
            out.append((_layer_name(names, n), n, names))
            continue
        if n.op_type not in LAYER_OPS:
            continue
        found = [g.dq_of(i, _MOVES)[0] for i in n.input[:2]]
        if len(found) < 2 or found[1] is None:
            # no DQ on the weight (second) input: a float layer reading a quantized tensor (the output Q of a
            # quantized layer before it, e.g. a layer latency placement kept float), not a quantized one
            continue
        dqs = [dq for dq in found if dq is not None]
        names = [g.qmap[dq.output[0]] for dq in dqs if dq.output[0] in g.qmap]
        out.append((_layer_name(names, n), n, names))
    claimed = collections.Counter(name for name, _, _ in out)
    calls: collections.Counter = collections.Counter()
    named = []
    for name, n, names in out:
        if claimed[name] > 1:
            calls[name] += 1
            name = f"{name} (call {calls[name]})"
        named.append((name, n, names))
    return named


# ------------------------------------------------------------------------------------------- diagnosis


def _int8_allowed() -> bool:
    """onnxruntime fuses signed int8 activations only on ARM (``QDQIsInt8Allowed``)."""
    return platform.machine().lower() in ("arm64", "aarch64", "armv8l")


def _activation_type(g: _Graph, dq: onnx.NodeProto, reasons: list[str], int8_allowed: bool) -> int | None:
    """The activation type after onnxruntime's int8 -> uint8 conversion (None: stays int8 and blocks)."""
    t = g.quant_type(dq)
    if t != _INT8 or int8_allowed:
        return t
    q = g.producers.get(dq.input[0])
    if q is None or q.op_type != "QuantizeLinear":
        reasons.append(
            "int8 activation without its QuantizeLinear: onnxruntime fuses only uint8 activations on x86"
        )
        return None
    edges = sum(len(g.consumers.get(d.output[0], [])) for d in g.consumers.get(q.output[0], []))
    if len(g.consumers.get(q.output[0], [])) != 1 or edges != 1 or g.zero_point(q) is None:
        reasons.append(
            f"int8 activation quantized once for {max(edges, 1)} consumers: on x86 onnxruntime "
            f"fuses only "
            "uint8 activations and converts an int8 QuantizeLinear only when it has one consumer "
            "(QDQS8ToU8Transformer); quantize activations as uint8"
        )
        return None
    return _UINT8


def _output_q(g: _Graph, n: onnx.NodeProto, reasons: list[str]) -> tuple[onnx.NodeProto | None, bool]:
    """(the Q that takes the layer's output, through an absorbed Relu/Clip; whether the output path allows a
    fusion)."""
    out = n.output[0]
    readers = g.consumers.get(out, [])
    is_output = out in g.outputs
    if (
        len(readers) == 1
        and readers[0].op_type in ("Relu", "Clip")
        and readers[0].output[0] not in g.outputs
        and len(g.consumers.get(readers[0].output[0], [])) == 1
    ):
        act = readers[0]
        nxt = g.consumers[act.output[0]][0]
        if nxt.op_type != "QuantizeLinear":
            reasons.append(
                f"the {act.op_type} after it feeds {nxt.op_type}, not a QuantizeLinear: onnxruntime fuses a "
                f"{act.op_type} into the layer only when a Q takes its output"
            )
            return None, False
        zp, t = g.zero_point(nxt), g.quant_type(nxt)
        if act.op_type == "Relu" and t in _TYPE_MIN and zp is not None:
            low = zp + 128 if t == _INT8 else zp  # int8 grids reach the fusion as uint8 (zero point + 128)
            if low != 0:
                reasons.append(
                    f"the Relu before its output Q is not absorbed: the Q's zero point ({zp}, "
                    f"{_type_name(t)}) is not the grid's lowest code; quantize post-ReLU "
                    f"activations "
                    "unsigned (uint8, zero point 0)"
                )
                return nxt, False
        if is_output:
            reasons.append(_graph_output_and_q(out, f" through the {act.op_type}"))
            return None, False
        return nxt, True
    qs = [c for c in readers if c.op_type == "QuantizeLinear"]
    if is_output:
        if qs:
            reasons.append(_graph_output_and_q(out, ""))
            return None, False
        return None, True
    if qs and len(qs) != len(readers):
        reasons.append(f"its output is read by {len(readers)} ops, not only by a QuantizeLinear")
        return None, False
    if len(qs) == 1:
        return qs[0], True
    if readers and readers[0].op_type == "BatchNormalization":
        reasons.append(
            "BatchNormalization between the layer and the next QuantizeLinear (fold it into the layer)"
        )
    return None, True


def _graph_output_and_q(out: str, through: str) -> str:
    """Why a layer whose output is a graph output and also quantized for the next layer stays float
    (``qdq_selectors.cc``, ``CheckQDQNodes``): with a Q among its readers onnxruntime takes that Q into the
    fusion, requires it to be the only reader of an output that is not a graph output, and does not fall
    back to the float-output kernel (a Relu/Clip before the Q is no way out: it is absorbed, or removed first
    when the Q makes it redundant)."""
    return (
        f"its output {out!r} is a graph output and is also quantized for the next layer{through}: "
        "onnxruntime fuses a layer with an output QuantizeLinear only when that Q is its only reader and the "
        "output is not a graph output, and with a Q there it does not fall back to the float-output kernel"
    )


def _bias_ok(g: _Graph, n: onnx.NodeProto, x_dq, w_dq, out_q, reasons: list[str]) -> bool:
    if len(n.input) < 3 or not n.input[2]:
        return True
    b_dq, _ = g.dq_of(n.input[2])
    if b_dq is not None:
        if g.quant_type(b_dq) != onnx.TensorProto.INT32:
            reasons.append("its bias DequantizeLinear is not int32")
            return False
        return True
    if n.input[2] not in g.inits:
        reasons.append("its bias is computed at run time, not a DequantizeLinear of int32 codes")
        return False
    # weight_bias_quantization.cc: a float bias becomes int32 when the input DQ is per tensor, a Q follows
    # (through Relu/Clip, no branch) and the weight DQ is per tensor or per output channel, not blocked
    w_attrs = g.attrs(w_dq) if w_dq is not None else {}
    axis_ok = True
    if w_dq is not None and not g.scalar(w_dq.input[1]):
        want = (0 if g.attrs(n).get("transB", 0) else 1) if n.op_type == "Gemm" else 0
        axis_ok = w_attrs.get("axis", 1) == want and not w_attrs.get("block_size")
    if x_dq is not None and g.scalar(x_dq.input[1]) and out_q is not None and axis_ok:
        return True
    why = []
    if x_dq is not None and not g.scalar(x_dq.input[1]):
        why.append("the input is quantized per channel")
    if out_q is None:
        why.append("no QuantizeLinear takes its output")
    if not axis_ok:
        why.append("the weight is not quantized per tensor or per output channel")
    reasons.append(
        "float bias: onnxruntime makes a bias int32 (which the fusion needs) only when the input is "
        "quantized per tensor and a Q takes the output" + (f"; here {' and '.join(why)}" if why else "")
    )
    return False


def _weight_only(g: _Graph, n: onnx.NodeProto, w_dq) -> list[str]:
    """Why a layer with float activations is not MatMulNBits (the only weight-only integer kernel)."""
    if n.op_type not in ("MatMul", "Gemm"):
        return [
            f"weight-only quantization: onnxruntime has no integer {n.op_type} kernel for float "
            f"activations "
            "(only MatMul -> MatMulNBits); it runs in float on dequantized weights"
        ]
    t = g.quant_type(w_dq)
    if t not in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4, _INT8, _UINT8):
        return [f"weight-only {_type_name(t)}: MatMulNBits takes 2-, 4- or 8-bit integer weights"]
    a = g.attrs(n)
    if n.op_type == "Gemm" and (a.get("transB", 0) or a.get("transA", 0) or a.get("alpha", 1.0) != 1.0):
        return [
            "a Gemm with transB=1: onnxruntime turns a weight-only DequantizeLinear -> Gemm into "
            "MatMulNBits only for transB=0 (weights stored as (in, out))"
        ]
    wa = g.attrs(w_dq)
    bs = wa.get("block_size", 0)
    if bs and (wa.get("axis", 1) != 0 or bs < 16 or bs & (bs - 1)):
        return [
            f"blocked weights (block {bs}, axis {wa.get('axis', 1)}): MatMulNBits needs blocks along "
            f"axis 0 of "
            "an (in, out) weight, a power of two >= 16"
        ]
    return []


#: why a quantized ConvTranspose runs in float on onnxruntime's CPU provider, whatever its Q/DQ
CONV_TRANSPOSE = (
    "onnxruntime's CPU provider has no integer ConvTranspose kernel (its QDQ fusions have no rule for it; "
    "QLinearConvTranspose exists only in the XNNPACK provider): it runs in float between Q/DQ"
)


def diagnose(model: onnx.ModelProto, node: onnx.NodeProto, int8_allowed: bool | None = None) -> list[str]:
    """Why onnxruntime's CPU QDQ fusions would not take ``node`` (empty: no condition found that blocks
    it)."""
    return _diagnose(_Graph(model), node, _int8_allowed() if int8_allowed is None else int8_allowed)


def _diagnose(g: _Graph, node: onnx.NodeProto, int8_allowed: bool) -> list[str]:
    reasons: list[str] = []
    # MatMulInteger is itself an integer kernel; these are what its fusions need
    if node.op_type in DYNAMIC_OPS:
        if node.input[1] not in g.inits:
            reasons.append(
                "its weight codes are computed at run time (exported with --weights-qdq?), not a "
                "constant: the MatMulIntegerToFloat fusion needs constant weights"
            )
        return reasons
    x_dq, x_guarded = g.dq_of(node.input[0])
    w_dq, w_guarded = g.dq_of(node.input[1], _MOVES)
    if x_guarded or w_guarded or (x_dq is not None and g.quant_type(x_dq) in compat.FP8_TYPES):
        return [
            "float8: onnxruntime has no float8 integer kernel, so it runs in float on dequantized values "
            "(guarded against onnxruntime's float8 fusion bugs so that the graph loads)"
        ]
    if w_dq is None:
        return ["its weight is not quantized (no DequantizeLinear on it)"]
    if x_dq is None:
        return _weight_only(g, node, w_dq)
    if node.op_type == "ConvTranspose":  # whatever the graph: the other conditions would suggest a remedy
        return [CONV_TRANSPOSE]
    x_t = _activation_type(g, x_dq, reasons, int8_allowed)
    w_t = g.quant_type(w_dq)
    for what, t in (("activation", g.quant_type(x_dq)), ("weight", w_t)):
        if t not in (_INT8, _UINT8):
            reasons.append(f"{_type_name(t)} {what}: onnxruntime's CPU QDQ fusions take 8-bit integers")
    if x_t == _INT8 and w_t != _INT8:
        reasons.append("int8 activations with a uint8 weight: a signed activation needs a signed weight")
    out_q, path_ok = _output_q(g, node, reasons)
    if node.op_type == "Conv" and out_q is None and path_ok:
        if not any("BatchNormalization" in r for r in reasons):
            reasons.append(f"no QuantizeLinear takes its output: QLinear{node.op_type} needs one")
    if out_q is not None and path_ok and x_t in (_INT8, _UINT8):
        q_t = g.quant_type(out_q)
        q_t = _UINT8 if q_t == _INT8 and not int8_allowed else q_t
        if q_t != x_t:
            reasons.append(
                f"its output Q ({_type_name(g.quant_type(out_q))}) and input ({_type_name(x_t)}) "
                "differ in type"
            )
    if node.op_type in ("Conv", "Gemm"):
        _bias_ok(g, node, x_dq, w_dq, out_q, reasons)
        if (
            node.op_type == "Gemm"
            and len(node.input) > 2
            and node.input[2]
            and g.attrs(node).get("beta", 1.0) != 1.0
        ):
            reasons.append("Gemm with beta != 1")
    return reasons


# ------------------------------------------------------------------------------------------- the runtime


def _dynamic_output(g: _Graph, node: onnx.NodeProto) -> list[str]:
    """The tensors of a MatMulInteger layer's chain (MatMulInteger -> Cast -> Mul -> Add), first to last."""
    chain = [node.output[0]]
    for op in ("Cast", "Mul", "Add"):
        readers = g.consumers.get(chain[-1], [])
        if len(readers) != 1 or readers[0].op_type != op:
            break
        chain.append(readers[0].output[0])
    return chain


def _find_dynamic(
    by_output: dict[str, onnx.NodeProto], g: _Graph, node: onnx.NodeProto
) -> onnx.NodeProto | None:
    """The node that computes a dynamic layer in onnxruntime's graph (``by_output``: its producer map): the
    one writing the last tensor of its chain (``MatMulIntegerToFloatFusion`` and
    ``DynamicQuantizeMatMulFusion`` keep the Add's or Mul's output)."""
    chain = _dynamic_output(g, node)
    for t in reversed(chain):
        n = by_output.get(t)
        if n is not None and (n.op_type in INTEGER_KERNELS or t == chain[0]):
            return n
    return by_output.get(chain[0])


def _find(
    optimized: onnx.ModelProto, node: onnx.NodeProto, others: frozenset[str] = frozenset()
) -> onnx.NodeProto | None:
    """The node onnxruntime made of ``node``: same name, or a fusion named after it ("fused X", "X/...",
    "X_...").
    ``others``: the names of the original graph's other nodes, which are those nodes and never a fusion of
    this one (the dynamo exporter names two Gemms ``node_linear`` and ``node_linear_1``: the second's
    ``QGemm`` is not the first's)."""
    name, out = node.name, node.output[0]
    kernels = [
        n
        for n in optimized.graph.node
        if n.op_type in INTEGER_KERNELS
        or any(
            # not the Q/DQ/Mul/Cast nodes fusions name after it
            k in n.op_type
            for k in ("Conv", "Gemm", "MatMul", "LSTM")
        )
    ]

    def named_after(fused: str, original: str) -> bool:
        return (
            fused == original
            or fused.endswith(" " + original)
            or fused.startswith(original + "/")
            or fused.startswith(original + "_")
        )

    # another node whose name extends this one's (node_conv2d_6 beside node_conv2d): a fusion named after it
    # (node_conv2d_6_token_18) is its, not this node's
    longer = [o for o in others if name and o.startswith(name) and o != name]
    cands = [
        n
        for n in kernels
        if name
        and named_after(n.name, name)
        and (n.name == name or not any(named_after(n.name, o) for o in longer))
    ]
    if not cands:  # NCHWc and layout passes name nodes after the output tensor
        cands = [n for n in kernels if n.name in (out, out + "_nchwc") or out in n.output]
    if not cands:
        return None
    cands.sort(key=lambda n: (n.op_type not in INTEGER_KERNELS, n.op_type not in LAYER_OPS, n.name != name))
    return cands[0]


# float fusions
_ABSORBED = ("Relu", "Clip", "LeakyRelu", "Sigmoid", "HardSigmoid", "Add", "BatchNormalization")


def find_float(model: onnx.ModelProto, optimized: onnx.ModelProto, name: str) -> onnx.NodeProto | None:
    """The node onnxruntime runs the float layer node ``name`` of ``model`` as, in its ``optimized`` graph.

    Like :func:`_find`, and where onnxruntime fused the activation after the layer into it (``FusedConv``, an
    NCHWc ``Conv`` named after the activation's output tensor), the node that writes that activation's output.
    """
    node = next((n for n in model.graph.node if n.name == name), None)
    if node is None:
        return None
    others = frozenset(n.name for n in model.graph.node if n.name != name)
    got = _find(optimized, node, others)
    consumers = consumer_map(model)
    cur = node
    while got is None:
        readers = consumers.get(cur.output[0], [])
        if len(readers) != 1 or readers[0].op_type not in _ABSORBED:
            return None
        cur = readers[0]
        got = _find(
            optimized, onnx.helper.make_node(node.op_type, list(node.input), [cur.output[0]], name=""), others
        )
    return got


def optimized_graph(
    path: str | Path, provider: str = "cpu", disabled_optimizers: list[str] | None = None
) -> onnx.ModelProto:
    """The graph onnxruntime runs for ``path`` with default options (ORT_ENABLE_ALL); raises on a load
    failure."""
    import onnxruntime as ort

    work = Path(tempfile.mkdtemp(prefix="quantcli-ort-"))
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 4  # fatal only: a load failure is reported once, by quantcli
        so.intra_op_num_threads = 1
        so.optimized_model_filepath = str(work / "optimized.onnx")
        so.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", "optimized.onnx.data"
        )
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        ort.InferenceSession(
            str(path),
            so,
            providers=[PROVIDERS[provider]],
            **({"disabled_optimizers": disabled_optimizers} if disabled_optimizers else {}),
        )
        return onnx.load(str(work / "optimized.onnx"), load_external_data=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _cuda_usable() -> bool:
    import torch

    return torch.cuda.is_available()


#: a float layer onnxruntime quantizes itself (``weight_bias_quantization.cc``)
RUNTIME_QUANTIZED = (
    "its weight is float, but it reads a per-tensor DequantizeLinear and its output goes (through Relu/Clip) "
    "to a QuantizeLinear alone: onnxruntime's WeightBiasQuantization gives it per-tensor int8 weights of its "
    "own and runs it as an integer kernel"
)


def runtime_quantized_layers(
    model: onnx.ModelProto, optimized: onnx.ModelProto
) -> list[tuple[str, onnx.NodeProto, onnx.NodeProto | None]]:
    """``(module name, node, what onnxruntime runs it as)`` for every Conv/ConvTranspose/Gemm of ``model``
    with a float weight that onnxruntime quantized itself in ``optimized``, the graph it runs. Its
    WeightBiasQuantization pass (``weight_bias_quantization.cc``, basic level, on by default) gives such a
    layer symmetric per-tensor int8 weights, coarser than a quantizer's per-channel grid, where it reads a
    per-tensor DequantizeLinear and its output goes (through Relu/Clip) to a QuantizeLinear alone, also after
    onnxruntime moved a DQ forward: a layer kept float between quantized neighbours. The pass names the weight
    scale it adds after the node (``<node>_weight_scale``), which is how it is found. Named after the node's
    module scope (else the node)."""
    names = [t.name for t in optimized.graph.initializer]
    names += [o for n in optimized.graph.node if n.op_type == "Constant" for o in n.output]
    scales = sorted(name for name in names if "_weight_scale" in name)  # what the pass adds, no other
    readers: dict[str, onnx.NodeProto] = {}
    for n in optimized.graph.node:
        for i in n.input:
            readers.setdefault(i, n)
    g = _Graph(model)
    out = []
    for n in model.graph.node:
        if n.op_type not in ("Conv", "ConvTranspose", "Gemm") or len(n.input) < 2 or not n.name:
            continue
        w = g.inits.get(n.input[1])
        if w is None or w.data_type != onnx.TensorProto.FLOAT:
            continue
        mark = n.name + "_weight_scale"
        added = [name for name in scales if name.startswith(mark)]
        if added:
            out.append((_scope_module(n), n, readers.get(added[0])))
    return out


def _scope_module(node: onnx.NodeProto) -> str:
    """The module a node was exported from: the dynamo exporter's innermost name scope, else the TorchScript
    node name's scope (``/body/body.0/body.0.0/Conv`` is ``body.0.0``), else the node's name."""
    scopes = [s for s in name_scopes(node) if s]
    if scopes:
        return scopes[-1]
    parts = node.name.strip("/").split("/")
    return scope_module_path(parts[:-1]) if len(parts) > 1 else node.name


#: a layer whose input Q/DQ onnxruntime folded away (a constant input: DeBERTa's relative-position projections
#: of ``rel_embeddings``) and whose weight DQ it then ran as weight-only ``MatMulNBits``
CONSTANT_INPUT = (
    "its input is a constant: onnxruntime folds the input's Q/DQ away and runs the layer as weight-only "
    "MatMulNBits on float activations at every run, where in float the whole product folds to a constant"
)


def _activation_quantized(g: _Graph, node: onnx.NodeProto) -> bool:
    """Whether the layer's first input is read through a DequantizeLinear (its activation quantized)."""
    return g.dq_of(node.input[0], _MOVES)[0] is not None


def inspect_fusion(path: str | Path, provider: str = "cpu") -> FusionReport:
    """Per quantized layer of ``path``: what onnxruntime runs it as with default session options, and why.

    Args:
        provider: ``cpu`` or ``cuda`` (the execution provider the session is created for).

    A graph that fails to load is reported (``load_error``), every layer with ``fused=False``.
    """
    import onnxruntime as ort

    ort.set_default_logger_severity(4)  # fatal only: load failures are reported in the report, not logged
    if provider not in PROVIDERS:
        raise VerifyError(f"unknown provider {provider!r}; use cpu or cuda")
    if PROVIDERS[provider] not in ort.get_available_providers():
        raise VerifyError(f"onnxruntime here has no {PROVIDERS[provider]}; use --provider cpu")
    if provider == "cuda" and not _cuda_usable():  # onnxruntime-gpu lists CUDA on a machine without a GPU
        raise VerifyError("--provider cuda: no CUDA GPU is usable here; use --provider cpu")
    model = read_onnx(path)
    report = FusionReport(str(path), provider, needs=compat.session_needs(model))
    layers = quantized_layers(model)
    g, int8_allowed = _Graph(model), _int8_allowed()
    node_names = frozenset(n.name for n in model.graph.node)
    try:
        optimized = optimized_graph(path, provider)
        optimized_producers = producer_map(optimized.graph)
    except Exception as e:  # onnxruntime's own errors: the report says what a user would see
        report.load_error = first_line(e, 300)
        optimized = None
    for layer, node, names in layers:
        if optimized is None:
            report.layers.append(
                LayerFusion(
                    layer,
                    node.name,
                    node.op_type,
                    names,
                    None,
                    False,
                    ["the session did not load with default options"],
                    None,
                )
            )
            continue
        got = (
            _find_dynamic(optimized_producers, g, node)
            if node.op_type in DYNAMIC_OPS
            else _find(optimized, node, node_names - {node.name})
        )
        kernel = got.op_type if got is not None else None
        fused = None if got is None else kernel in INTEGER_KERNELS
        if fused and kernel == "MatMulNBits" and _activation_quantized(g, node):
            fused, reasons = False, [CONSTANT_INPUT]  # weight-only on float activations: not the int8 kernel
        elif fused or provider != "cpu":
            reasons = (
                []
                if fused
                else [
                    "onnxruntime's CUDA provider has no QDQ integer fusion except weight-only MatMul -> "
                    "MatMulNBits (int8 on GPUs goes through the TensorRT provider)"
                ]
            )
        else:
            reasons = _diagnose(g, node, int8_allowed)
        if fused is False and not reasons:
            reasons = ["not matched by onnxruntime's QDQ fusions (no known condition explains it)"]
        if fused is None:
            reasons = ["not found in onnxruntime's optimized graph (renamed or merged by a fusion)"] + reasons
        report.layers.append(
            LayerFusion(
                layer,
                node.name,
                node.op_type,
                names,
                kernel,
                fused,
                reasons,
                got.name if got is not None else None,
            )
        )
    for layer, node, got in runtime_quantized_layers(model, optimized) if optimized is not None else ():
        kernel = got.op_type if got is not None else None
        report.runtime_quantized.append(
            LayerFusion(
                layer,
                node.name,
                node.op_type,
                [],
                kernel,
                None if got is None else kernel in INTEGER_KERNELS,
                [RUNTIME_QUANTIZED],
                got.name if got is not None else None,
            )
        )
    return report
