"""Edits of exported ONNX graphs for the verify tests: each changes one thing and leaves the rest as
exported."""

import numpy as np
import onnx

from exporters.graph import qdq_pairs


def _pair(m, quantizer):
    return next(p for p in qdq_pairs(m) if p.quantizer == quantizer)


def _own_initializer(m, node_names, index, values):
    """Give the named nodes a private copy of input ``index`` with ``values`` (shared constants stay
    untouched)."""
    name = f"mutated_{len(m.graph.initializer)}"
    ref = next(n for n in m.graph.node if n.name in node_names)
    dtype = onnx.numpy_helper.to_array(
        next(t for t in m.graph.initializer if t.name == ref.input[index])
    ).dtype
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(values).astype(dtype), name))
    for n in m.graph.node:
        if n.name in node_names:
            n.input[index] = name


def initializer_values(m, name):
    """The values of initializer ``name``."""
    return onnx.numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == name))


def scale_times_two(m, quantizer):
    p = _pair(m, quantizer)
    dq = next(n for n in m.graph.node if n.name == p.dq_node)
    _own_initializer(m, {p.dq_node, p.q_node}, 1, initializer_values(m, dq.input[1]) * 2)


def zero_point_plus_one(m, quantizer):
    p = _pair(m, quantizer)
    dq = next(n for n in m.graph.node if n.name == p.dq_node)
    zp = initializer_values(m, dq.input[2])
    _own_initializer(
        m, {p.dq_node, p.q_node}, 2, np.where(zp < np.iinfo(zp.dtype).max, zp.astype(np.int64) + 1, zp - 1)
    )


def variant(m, edit, *args):
    c = onnx.ModelProto()
    c.CopyFrom(m)
    edit(c, *args)
    return c


def replace_op(m, op_type, index=0, by="Identity"):
    node = [n for n in m.graph.node if n.op_type == op_type][index]
    node.op_type = by
    del node.attribute[:]
    del node.input[1:]
    return node


def add_to_initializer(m, name, index, delta):
    v = initializer_values(m, name).copy()
    v.flat[index] += delta
    t = next(t for t in m.graph.initializer if t.name == name)
    t.CopyFrom(onnx.numpy_helper.from_array(v, name))


def add_to_input_of(m, node_prefix, name, index, delta):
    """Add ``delta`` to element ``index`` of initializer ``name`` as read by the nodes whose name starts with
    ``node_prefix`` only (the exporter shares equal initializers between layers)."""
    users = [n for n in m.graph.node if name in n.input and n.name.startswith(node_prefix)]
    assert users, (node_prefix, name)
    v = initializer_values(m, name).copy()
    v.flat[index] += delta
    _own_initializer(m, {n.name for n in users}, list(users[0].input).index(name), v)
