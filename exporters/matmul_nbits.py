"""Weight-only blocked layers in the form onnxruntime runs as its N-bit kernel ``MatMulNBits``.

Both torch exporters write a Linear with a blocked weight quantizer as ``DequantizeLinear(axis=1,
block_size)`` on the ``[out, in]`` codes (per output channel, ``axis=0``, where the input dimension is one
block), then ``Gemm(transB=1)`` (2-D input) or ``Transpose -> MatMul -> Add`` (3-D input). onnxruntime's rule
``DQMatMulToMatMulNBits`` (``qdq_selectors.cc``, ``DQMatMulNodeGroupSelector`` and
``ValidateDQForMatMulNBits``) takes neither: it wants the DequantizeLinear to feed MatMul's input B directly,
with one consumer, no QuantizeLinear after the MatMul, the weight stored ``[K, N]`` (``[in, out]``) with
``axis=0``, a power-of-two ``block_size >= 16``, 2-, 4- or 8-bit integer codes, a float scale, and weight,
scale and zero point constant rank-2 initializers with the scale shaped ``[ceil(K / block), N]``.

:func:`to_matmul_nbits` rewrites each weight-only blocked layer into that form: the stored codes, scale and
zero point are transposed (the same numbers: every code keeps its own scale; a per-channel scale becomes one
block of the power of two >= K) and the ``Transpose`` goes. A ``Gemm`` becomes ``MatMul`` and a ``Sum`` with
its bias: onnxruntime's level-1 ``MatMulAddFusion`` turns ``MatMul -> Add`` on a 2-D input into a ``Gemm``,
and a Relu after that into a ``FusedGemm``, before the level-2 MatMulNBits rule runs, so the layer would stay
in float; it matches ``Add`` only. A 3-D layer keeps the exporter's ``Add`` (the fusion leaves dynamic 3-D
shapes alone), which onnxruntime then folds into MatMulNBits' bias input. The DequantizeLinear keeps its
output name, so the quantizer map still names its quantizer; the rewritten pairs are listed in the model's
metadata (:data:`KN_WEIGHTS_KEY`) so readers know the codes are stored transposed.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from exporters.fold import make_initializer
from exporters.graph import KN_WEIGHTS_KEY, consumer_map, initializer_map, kn_weights, producer_map, to_numpy

__all__ = ["KN_WEIGHTS_KEY", "kn_weights", "to_matmul_nbits"]
_NBITS_TYPES = {onnx.TensorProto.INT4, onnx.TensorProto.UINT4, onnx.TensorProto.INT8, onnx.TensorProto.UINT8}
MIN_BLOCK = 16


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _fusable_dq(dq: onnx.NodeProto, inits: dict) -> bool:
    """A blocked weight DequantizeLinear along the input dimension of stored ``[out, in]`` codes, in a type
    and block size MatMulNBits takes."""
    if dq.op_type != "DequantizeLinear" or dq.input[0] not in inits or dq.input[1] not in inits:
        return False
    w, s = inits[dq.input[0]], inits[dq.input[1]]
    zp = inits.get(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
    if len(dq.input) > 2 and dq.input[2] and zp is None:
        return False
    a = _attrs(dq)
    block = a.get("block_size", 0)
    if (
        w.data_type not in _NBITS_TYPES
        or len(w.dims) != 2
        or s.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    ):
        return False
    if not block:  # per output channel: one block spanning the input dimension
        return a.get("axis", 1) in (0, -2) and list(s.dims) == [w.dims[0]]
    return len(s.dims) == 2 and a.get("axis", 1) in (1, -1) and block >= MIN_BLOCK and not block & (block - 1)


def _matmul_of(dq: onnx.NodeProto, consumers: dict, producers: dict, outputs: set[str]):
    """(the MatMul or Gemm the weight feeds as input B, the Transpose between them or None), or None when the
    layer is not a weight-only ``x @ W^T``."""
    readers = consumers.get(dq.output[0], [])
    if len(readers) != 1 or dq.output[0] in outputs:
        return None
    node, transpose = readers[0], None
    if node.op_type == "Transpose":
        if _attrs(node).get("perm") != [1, 0] or node.output[0] in outputs:
            return None
        transpose, readers = node, consumers.get(node.output[0], [])
        if len(readers) != 1 or readers[0].op_type != "MatMul":
            return None
        node = readers[0]
    elif node.op_type == "Gemm":
        a = _attrs(node)
        if (
            a.get("transB", 0) != 1
            or a.get("transA", 0)
            or a.get("alpha", 1.0) != 1.0
            or a.get("beta", 1.0) != 1.0
        ):
            return None
    else:
        return None
    b_in = transpose.output[0] if transpose is not None else dq.output[0]
    if len(node.input) < 2 or node.input[1] != b_in or node.input[0] == b_in:
        return None
    a_src = producers.get(node.input[0])
    if a_src is not None and a_src.op_type == "DequantizeLinear":  # quantized activations: not weight-only
        return None
    if any(c.op_type == "QuantizeLinear" for c in consumers.get(node.output[0], [])):
        return None  # a Q after the MatMul blocks the rule
    return node, transpose


def _transpose_initializer(t: onnx.TensorProto, inits: dict, graph: onnx.GraphProto) -> str:
    """A ``[a, b]`` initializer as a new ``[b, a]`` one of the same type (a 1-D ``[a]`` one as ``[1, a]``);
    returns its name."""
    name = f"{t.name}_kn"
    if name not in inits:
        vals = to_numpy(t) if t.data_type in _NBITS_TYPES else onnx.numpy_helper.to_array(t)
        vals = np.ascontiguousarray(vals.T if vals.ndim == 2 else vals.reshape(1, -1))
        new = (
            make_initializer(name, vals.astype(np.float32), t.data_type)
            if t.data_type in _NBITS_TYPES
            else onnx.numpy_helper.from_array(vals, name)
        )
        graph.initializer.append(new)
        inits[name] = new
    return name


def _rewrite(g: onnx.GraphProto, dq: onnx.NodeProto, node: onnx.NodeProto, transpose, inits: dict) -> list:
    """Rewrite one layer in place; returns the nodes that replace ``node`` (and drop ``transpose``)."""
    k = inits[dq.input[0]].dims[1]
    if len(dq.input) > 2 and dq.input[2] and not np.any(to_numpy(inits[dq.input[2]])):
        # a symmetric grid: no zero point (0 is ONNX's default), so MatMulNBits gets none and runs its
        # symmetric kernels; the codes keep their type
        del dq.input[2]
    for i in range(min(len(dq.input), 3)):
        if dq.input[i]:
            dq.input[i] = _transpose_initializer(inits[dq.input[i]], inits, g)
    attrs = _attrs(dq)
    # per output channel: one block of the power of two >= K (ONNX allows a block longer than the axis)
    block = attrs.get("block_size") or max(MIN_BLOCK, 1 << (k - 1).bit_length())
    del dq.attribute[:]
    dq.attribute.extend([helper.make_attribute("axis", 0), helper.make_attribute("block_size", block)])
    if node.op_type == "MatMul":
        node.input[1] = dq.output[0]
        return [node]
    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    out = node.output[0]
    mm = helper.make_node(
        "MatMul", [node.input[0], dq.output[0]], [f"{out}_matmul" if bias else out], name=node.name
    )
    if bias is None:
        return [mm]
    return [mm, helper.make_node("Sum", [mm.output[0], bias], [out], name=f"{node.name}/bias")]


def _keep_activation_apart(
    node: onnx.NodeProto, n: int, consumers: dict, g: onnx.GraphProto, inits: dict
) -> list:
    """A ``Sum`` with a zero bias between a bias-free layer and a Relu/Clip that reads it (``x + 0`` is
    ``x``).

    onnxruntime's node-group selection takes a Relu or Clip right after the MatMul for one a QuantizeLinear
    would make redundant, and without that QuantizeLinear drops the group (``GetQDQSelection``): the layer
    would stay in float unless the Relu produces a graph output. Returns the node to add after ``node`` (none
    where nothing needs it); ``n`` is the layer's output width.
    """
    out = node.output[0]
    readers = consumers.get(out, [])
    if node.op_type != "MatMul" or len(readers) != 1 or readers[0].op_type not in ("Relu", "Clip"):
        return []
    zero = f"{node.name}_zero_bias"
    if zero not in inits:
        inits[zero] = onnx.numpy_helper.from_array(np.zeros(n, np.float32), zero)
        g.initializer.append(inits[zero])
    node.output[0] = f"{out}_matmul"
    return [helper.make_node("Sum", [node.output[0], zero], [out], name=f"{node.name}/apart")]


def to_matmul_nbits(model: onnx.ModelProto) -> list[str]:
    """Put every weight-only blocked Linear of ``model`` into onnxruntime's ``MatMulNBits`` form, in place.

    Returns the DequantizeLinear outputs rewritten (their codes are now stored ``[in, out]``).
    """
    g = model.graph
    inits = initializer_map(g)
    consumers, producers = consumer_map(model), producer_map(g)
    outputs = {o.name for o in g.output}
    replace: dict[int, list] = {}
    drop: set[int] = set()
    done: list[str] = []
    for dq in list(g.node):
        if not _fusable_dq(dq, inits):
            continue
        found = _matmul_of(dq, consumers, producers, outputs)
        if found is None:
            continue
        node, transpose = found
        replace[id(node)] = _rewrite(g, dq, node, transpose, inits)
        n = inits[dq.input[0]].dims[1]
        replace[id(node)] += _keep_activation_apart(replace[id(node)][-1], n, consumers, g, inits)
        if transpose is not None:
            drop.add(id(transpose))
        done.append(dq.output[0])
    if not done:
        return []
    nodes = [m for n in g.node if id(n) not in drop for m in replace.get(id(n), [n])]
    del g.node[:]
    g.node.extend(nodes)
    stale = set(done) | {n.output[0] for n in nodes if n.op_type == "MatMul"}
    keep = [v for v in g.value_info if v.name not in stale]  # re-inferred by the export's shape inference
    del g.value_info[:]
    g.value_info.extend(keep)
    return done
