"""The mutation campaign over zoo graphs: each arithmetic mutation changes what one part of the graph computes
(a scale, a zero point, weight codes, an int32 bias, a float op, a deleted node) and must make verify exit 1
naming the check and the tensor; each equivalent rewrite computes the same and may exit 0 or 1; none may exit
2.

A mutation is ``(name, edit)``: ``edit(model)`` changes an ``onnx.ModelProto`` in place and returns what it
changed (a quantizer, a node), or ``None`` where the graph has nothing it applies to.
"""

from __future__ import annotations

import numpy as np
import onnx

from exporters.graph import qdq_pairs
from tests.mutations import initializer_values, replace_op, scale_times_two, zero_point_plus_one

#: float ops whose replacement by an Identity changes values (a Relu or Clip before an unsigned QuantizeLinear
#: would not: the QuantizeLinear clamps at 0 itself)
FLOAT_OPS = (
    "Softmax",
    "LayerNormalization",
    "Erf",
    "Sigmoid",
    "Tanh",
    "Sqrt",
    "Div",
    "Gelu",
    "HardSigmoid",
    "HardSwish",
)


def _middle(items):
    return items[len(items) // 2] if items else None


def _activation(m):
    return _middle(sorted({p.quantizer for p in qdq_pairs(m) if p.quantizer and p.stored == "runtime"}))


def _weight_pairs(m):
    return [
        p
        for p in qdq_pairs(m)
        if p.quantizer and p.stored == "initializer" and p.quantizer.endswith("weight_quantizer")
    ]


def activation_scale(m):
    q = _activation(m)
    return q and (scale_times_two(m, q) or q)


def weight_scale(m):
    p = _middle(_weight_pairs(m))
    return p and (scale_times_two(m, p.quantizer) or p.quantizer)


def activation_zero_point(m):
    q = _activation(m)
    return q and (zero_point_plus_one(m, q) or q)


def weight_codes(m):
    """Negate the codes of one output channel (axis 0) of a weight stored quantized."""
    p = _middle(_weight_pairs(m))
    if p is None:
        return None
    t = next(t for t in m.graph.initializer if t.name == p.tensor)
    v = onnx.numpy_helper.to_array(t).copy()
    v[0] = np.clip(-v[0].astype(np.int32), np.iinfo(v.dtype).min, np.iinfo(v.dtype).max).astype(v.dtype)
    if not np.any(v[0]):
        return None
    t.CopyFrom(onnx.numpy_helper.from_array(v, t.name))
    return p.quantizer


def int32_bias(m):
    """Add three times the largest bias code to the first element of one int32 bias (a DequantizeLinear of
    int32
    codes: the onnxruntime target's Conv/Gemm biases)."""
    inits = {t.name: t for t in m.graph.initializer}
    dqs = [
        n
        for n in m.graph.node
        if n.op_type == "DequantizeLinear"
        and n.input[0] in inits
        and inits[n.input[0]].data_type == onnx.TensorProto.INT32
    ]
    n = _middle(dqs)
    if n is None:
        return None
    v = initializer_values(m, n.input[0]).copy()
    v.flat[0] += int(3 * np.abs(v).max()) + 1000
    inits[n.input[0]].CopyFrom(onnx.numpy_helper.from_array(v, n.input[0]))
    return n.name


def float_op(m):
    """Replace the middle node of the first float op type the graph has by an Identity (a graph with none of
    them: a Relu by a Neg)."""
    for op, by in [(op, "Identity") for op in FLOAT_OPS] + [("Relu", "Neg")]:
        nodes = [n for n in m.graph.node if n.op_type == op]
        if nodes:
            return replace_op(m, op, len(nodes) // 2, by).name
    return None


def delete_add(m):
    """Delete a residual Add (both operands computed): its consumers read its first operand instead."""
    consts = {t.name for t in m.graph.initializer} | {
        o for n in m.graph.node if n.op_type == "Constant" for o in n.output
    }
    adds = [
        n
        for n in m.graph.node
        if n.op_type in ("Add", "Sum") and len(n.input) == 2 and not any(i in consts for i in n.input)
    ]
    graph_outputs = {o.name for o in m.graph.output}
    adds = [n for n in adds if n.output[0] not in graph_outputs]
    node = _middle(adds)
    if node is None:
        return None
    for other in m.graph.node:
        for k, i in enumerate(other.input):
            if i == node.output[0]:
                other.input[k] = node.input[0]
    m.graph.node.remove(node)
    return node.name


def insert_identity(m):
    """Equivalent: an Identity between a DequantizeLinear and its consumers."""
    p = _middle([p for p in qdq_pairs(m) if p.stored == "runtime"])
    if p is None:
        return None
    new = p.output + "_identity"
    for n in m.graph.node:
        for k, i in enumerate(n.input):
            if i == p.output:
                n.input[k] = new
    dq_index = next(k for k, n in enumerate(m.graph.node) if n.name == p.dq_node)
    m.graph.node.insert(dq_index + 1, onnx.helper.make_node("Identity", [p.output], [new], name=new))
    return p.quantizer


def duplicate_weight(m):
    """Equivalent: one consumer of a shared or stored weight reads a copy of it under another name."""
    p = _middle(_weight_pairs(m))
    if p is None:
        return None
    t = next(t for t in m.graph.initializer if t.name == p.tensor)
    copy = onnx.TensorProto()
    copy.CopyFrom(t)
    copy.name = t.name + "_copy"
    m.graph.initializer.append(copy)
    dq = next(n for n in m.graph.node if n.name == p.dq_node)
    dq.input[0] = copy.name
    return p.quantizer


ARITHMETIC = [
    ("activation scale x2", activation_scale),
    ("weight scale x2", weight_scale),
    ("activation zero point +1", activation_zero_point),
    ("weight codes negated", weight_codes),
    ("int32 bias", int32_bias),
    ("float op replaced", float_op),
    ("residual Add deleted", delete_add),
]
EQUIVALENT = [("Identity inserted", insert_identity), ("weight copied", duplicate_weight)]
