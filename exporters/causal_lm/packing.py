"""Sibling weight-only projections packed into one: q/k/v into ``GroupQueryAttention``, gate/up into a Split.

In a decode step of one token each ``MatMulNBits`` costs mostly its fixed part (quantizing the input row at
``accuracy_level`` 4, dispatch), so projections that read the same input run faster as one node with their
output columns side by side: onnxruntime-genai's graphs run q, k and v as one ``MatMulNBits``. The packing is
exact: a weight-only blocked weight ``[K, N]`` (``MatMulNBits`` form, :mod:`exporters.matmul_nbits`) has its
blocks along ``K``, one scale per block and column, so the columns of several such weights side by side
(codes, scales and zero points concatenated along ``N``) are the same numbers in a ``[K, N1 + N2 + ...]``
weight.

:func:`pack_projections` packs every group of weight-only ``DequantizeLinear -> MatMul`` layers (each with
an optional constant bias ``Add``) that read the same tensor with the same format: one packed weight, one
``MatMul`` (and ``Add``), then a ``Split`` back into the members' output names; where the members are the
query, key and value inputs of one ``GroupQueryAttention`` (in that order), the attention takes the packed
tensor itself (its packed-QKV form) and no ``Split`` is written. The quantizer map loses the members' pairs;
``quantcli.packed_weights`` in the graph's metadata names, for each packed pair, its members' quantizers and
columns.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import onnx
from onnx import helper

from exporters.fold import make_initializer
from exporters.graph import consumer_map, initializer_map, producer_map, to_numpy

PACKED_KEY = "quantcli.packed_weights"  # metadata: packed DQ output -> its members
_INT_TYPES = {onnx.TensorProto.INT4, onnx.TensorProto.UINT4, onnx.TensorProto.INT8, onnx.TensorProto.UINT8}


@dataclass
class _Member:
    dq: onnx.NodeProto
    matmul: onnx.NodeProto
    add: onnx.NodeProto | None  # the constant bias Add after the MatMul
    bias: str | None  # its initializer
    columns: int

    @property
    def out(self) -> str:
        return (self.add or self.matmul).output[0]


@dataclass
class PackedGroup:
    """One packed weight: its DequantizeLinear output and its members' quantizers and columns, in order."""

    output: str
    replaced: list[str]  # the members' DequantizeLinear outputs, gone from the graph
    quantizers: list[str | None]
    columns: list[int]
    into_attention: bool  # GroupQueryAttention reads the packed tensor (no Split)
    layers: list[str] = field(default_factory=list)  # the members' layer names (their quantizers' modules)

    def to_dict(self) -> dict:
        return asdict(self)


def _attrs(n: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in n.attribute}


def _member(mm, producers, consumers, inits, outputs) -> _Member | None:
    """``mm`` as a weight-only layer in MatMulNBits form, or None."""
    if mm.op_type != "MatMul" or len(mm.input) != 2:
        return None
    dq = producers.get(mm.input[1])
    if dq is None or dq.op_type != "DequantizeLinear" or len(consumers.get(dq.output[0], [])) != 1:
        return None
    if dq.output[0] in outputs or any(i and i not in inits for i in dq.input):
        return None
    codes = inits[dq.input[0]]
    a = _attrs(dq)
    if codes.data_type not in _INT_TYPES or len(codes.dims) != 2 or a.get("axis", 1) != 0:
        return None
    if not a.get("block_size"):
        return None
    src = producers.get(mm.input[0])
    if src is not None and src.op_type == "DequantizeLinear":  # quantized activations: not weight-only
        return None
    readers = consumers.get(mm.output[0], [])
    add = bias = None
    if len(readers) == 1 and readers[0].op_type in ("Add", "Sum") and len(readers[0].input) == 2:
        other = [i for i in readers[0].input if i != mm.output[0]]
        t = inits.get(other[0]) if len(other) == 1 else None
        if t is not None and list(t.dims) == [codes.dims[1]] and t.data_type == onnx.TensorProto.FLOAT:
            add, bias = readers[0], other[0]
    if mm.output[0] in outputs:
        return None
    return _Member(dq, mm, add, bias, int(codes.dims[1]))


def _signature(m: _Member, inits) -> tuple:
    """What must be equal for layers to share one packed weight."""
    dq = m.dq
    zp = inits[dq.input[2]].data_type if len(dq.input) > 2 and dq.input[2] else None
    return (
        m.matmul.input[0],
        inits[dq.input[0]].data_type,
        inits[dq.input[0]].dims[0],
        inits[dq.input[1]].data_type,
        zp,
        _attrs(dq).get("block_size"),
        m.bias is not None,
    )


def _concat(tensors: list[onnx.TensorProto], name: str) -> onnx.TensorProto:
    """Initializers ``[rows, n_i]`` side by side along their last axis, in their type."""
    vals = np.concatenate([to_numpy(t) for t in tensors], axis=-1)
    if tensors[0].data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return make_initializer(name, vals, tensors[0].data_type)
    return onnx.numpy_helper.from_array(np.ascontiguousarray(vals), name)


def _attention_order(members: list[_Member], consumers) -> list[_Member] | None:
    """The members as query, key, value of one GroupQueryAttention that reads nothing else there, or None."""
    if len(members) != 3:
        return None
    readers = [consumers.get(m.out, []) for m in members]
    if not all(len(r) == 1 and r[0].op_type == "GroupQueryAttention" for r in readers):
        return None
    gqa = readers[0][0]
    if any(r[0] is not gqa for r in readers) or len(gqa.input) < 3:
        return None
    by_out = {m.out: m for m in members}
    if set(gqa.input[:3]) != set(by_out):
        return None
    return [by_out[i] for i in gqa.input[:3]]


def pack_projections(model: onnx.ModelProto, quantizer_map: dict[str, str]) -> list[PackedGroup]:
    """Pack every group of sibling weight-only projections (module docstring), in place; the members' entries
    leave ``quantizer_map`` (in place). Returns the groups packed."""
    g = model.graph
    inits = initializer_map(g)
    producers, consumers = producer_map(g), consumer_map(model)
    outputs = {o.name for o in g.output}
    groups: dict[tuple, list[_Member]] = {}
    for n in g.node:
        m = _member(n, producers, consumers, inits, outputs)
        if m is not None:
            groups.setdefault(_signature(m, inits), []).append(m)
    replace: dict[int, list[onnx.NodeProto]] = {}
    drop: set[int] = set()
    packed: list[PackedGroup] = []
    for members in groups.values():
        if len(members) < 2:
            continue
        ordered = _attention_order(members, consumers)
        into_attention = ordered is not None
        members = ordered or members
        first = members[0]
        base = first.matmul.name.strip("/").replace("/", "_") or first.matmul.output[0]
        name = f"{base}_packed{len(members)}"
        dq_in = [
            _concat([inits[m.dq.input[i]] for m in members], f"{name}_{part}")
            for i, part in enumerate(("codes", "scale", "zero_point")[: len(first.dq.input)])
            if first.dq.input[i]
        ]
        g.initializer.extend(dq_in)
        dq_out, mm_out = f"{name}_weight", f"{name}_out"
        nodes = [
            helper.make_node(
                "DequantizeLinear",
                [t.name for t in dq_in],
                [dq_out],
                name=f"{name}/DequantizeLinear",
                **_attrs(first.dq),
            ),
            helper.make_node("MatMul", [first.matmul.input[0], dq_out], [mm_out], name=f"{name}/MatMul"),
        ]
        if first.bias is not None:
            bias = onnx.numpy_helper.from_array(
                np.concatenate([onnx.numpy_helper.to_array(inits[m.bias]) for m in members]), f"{name}_bias"
            )
            g.initializer.append(bias)
            nodes.append(helper.make_node("Add", [mm_out, bias.name], [f"{name}_biased"], name=f"{name}/Add"))
            mm_out = nodes[-1].output[0]
        if into_attention:
            gqa = consumers[first.out][0]
            gqa.input[0], gqa.input[1], gqa.input[2] = mm_out, "", ""
        else:
            cols = onnx.numpy_helper.from_array(
                np.array([m.columns for m in members], np.int64), f"{name}_split"
            )
            g.initializer.append(cols)
            nodes.append(
                helper.make_node(
                    "Split", [mm_out, cols.name], [m.out for m in members], name=f"{name}/Split", axis=-1
                )
            )
        replace[id(first.matmul)] = nodes
        for m in members:
            drop.update(id(x) for x in (m.dq, m.matmul, m.add) if x is not None)
        drop.discard(id(first.matmul))
        names = [quantizer_map.pop(m.dq.output[0], None) for m in members]
        packed.append(
            PackedGroup(
                output=dq_out,
                replaced=[m.dq.output[0] for m in members],
                quantizers=names,
                columns=[m.columns for m in members],
                into_attention=into_attention,
                layers=[q.rsplit(".", 1)[0] if q else m.matmul.name for q, m in zip(names, members)],
            )
        )
    if not packed:
        return []
    before = {o for n in g.node for o in n.output}
    nodes = [m for n in g.node if id(n) not in drop or id(n) in replace for m in replace.get(id(n), [n])]
    del g.node[:]
    g.node.extend(nodes)
    gone = before - {o for n in nodes for o in n.output}
    keep = [v for v in g.value_info if v.name not in gone]
    del g.value_info[:]
    g.value_info.extend(keep)
    return packed
