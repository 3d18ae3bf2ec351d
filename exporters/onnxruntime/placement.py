"""Graph passes for the onnxruntime target: the exported Q/DQ graph in the form onnxruntime's QDQ fusions
take.

None of them changes a value the graph computes (the fake-quant model stays bit-exact with the graph run with
optimizations off); they change only how the same codes are expressed:

1. :func:`uint8_activations`: a signed int8 activation grid with zero point 0 is emitted as uint8 with zero
   point 128. ``saturate(round(x / s) + 128)`` over ``[0, 255]`` is ``saturate(round(x / s))`` over ``[-128,
   127]`` plus 128 (same scale, same rounding, same saturation), and dequantization subtracts the 128 again.
   On x86 onnxruntime's Conv/MatMul/Gemm selectors take only uint8 activations (``QDQIsInt8Allowed`` is false
   off ARM); its own int8 -> uint8 rewrite (``qdq_s8_to_u8.cc``) skips a Q that feeds several nodes, so
   emitting uint8 directly avoids that trap.
2. :func:`share_quantize`: QuantizeLinear nodes with the same input and the same scale and zero point (q/k/v
   projections reading one tensor, a branch and its shortcut) become one Q; every quantizer keeps its own
   DequantizeLinear (``EnsureUniqueDQForNodeUnit`` wants one DQ per consumer anyway, and verify maps
   quantizers by DQ output).
3. :func:`propagate_quantize`: a Q after ops that commute with quantization (MaxPool, Flatten, Reshape,
   Transpose, Squeeze, Unsqueeze) gets an identical Q -> DQ in front of each of them, up to the producer, so a
   Conv -> Relu -> MaxPool -> Flatten -> Q chain becomes Conv -> Relu -> Q -> DQ -> MaxPool -> Q -> DQ -> ...:
   onnxruntime then fuses the Conv (with the Relu) into QLinearConv and runs MaxPool/Flatten on the codes.
   Exact: ``DQ(Q(.))`` is monotone and elementwise, so it commutes with max pooling and with moving elements,
   and ``Q(DQ(Q(x))) == Q(x)``.

   A Q after a ``Concat`` (per tensor, the Concat read only by Qs of that grid) gets the same Q -> DQ on each
   Concat input that no DequantizeLinear produces, as onnxruntime's ``quantize_static`` quantizes every
   Concat input, where one of them is a quantized layer's output (through a Relu) that then fuses: a layer
   -> Relu -> Concat -> Q chain (a Linear's output concatenated with other features before the next layer)
   then has a Q after the Relu, so onnxruntime fuses the layer and the Relu into its integer kernel (when the
   Q's zero point is the grid's lowest code), and ``DQ -> Concat -> Q`` becomes ``QLinearConcat``, a copy of
   codes of one scale. Exact for the same reason: the concatenation of ``DQ(Q(x_i))`` quantized again is
   ``Q(concat(x_i))`` element for element.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from exporters.fold import make_initializer
from exporters.graph import (
    PROPAGATED_MARK,
    consumer_map,
    initializer_map,
    is_propagated,
    producer_map,
    to_numpy,
)

COMMUTING_OPS = ("MaxPool", "Flatten", "Reshape", "Transpose", "Squeeze", "Unsqueeze")
UINT8_ZERO_POINT = "quantcli_uint8_zero_point_128"
_EIGHT_BIT = (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)


def _drop_value_info(model: onnx.ModelProto, names: set[str]) -> None:
    keep = [v for v in model.graph.value_info if v.name not in names]  # re-inferred by shape inference
    del model.graph.value_info[:]
    model.graph.value_info.extend(keep)


def uint8_activations(model: onnx.ModelProto) -> int:
    """Emit int8 activation Q/DQ pairs with a scalar zero point 0 as uint8 with zero point 128; returns how
    many Qs."""
    g = model.graph
    inits = initializer_map(model.graph)
    consumers = consumer_map(model)
    changed: set[str] = set()
    count = 0
    for n in g.node:
        if n.op_type != "QuantizeLinear" or len(n.input) < 3 or n.input[0] in inits:
            continue
        zp = inits.get(n.input[2])
        if (
            zp is None
            or zp.data_type != onnx.TensorProto.INT8
            or to_numpy(zp).size != 1
            or to_numpy(zp).item() != 0
        ):
            continue
        readers = consumers.get(n.output[0], [])
        if not all(r.op_type == "DequantizeLinear" and r.input[2] == n.input[2] for r in readers):
            continue
        if UINT8_ZERO_POINT not in inits:
            t = make_initializer(UINT8_ZERO_POINT, np.array(128.0, np.float32), onnx.TensorProto.UINT8)
            g.initializer.append(t)
            inits[UINT8_ZERO_POINT] = t
        n.input[2] = UINT8_ZERO_POINT
        for r in readers:
            r.input[2] = UINT8_ZERO_POINT
        changed.add(n.output[0])
        count += 1
    _drop_value_info(model, changed)
    return count


def _source(name: str, producers: dict[str, onnx.NodeProto]) -> str:
    """The tensor behind float Casts: a Q reads float, so a Cast to float of its input is the same values (the
    TorchScript exporter reads q/k/v's shared input through such Casts)."""
    n = producers.get(name)
    while (
        n is not None
        and n.op_type == "Cast"
        and any(a.name == "to" and a.i == onnx.TensorProto.FLOAT for a in n.attribute)
    ):
        name = n.input[0]
        n = producers.get(name)
    return name


def _key(n: onnx.NodeProto, inits: dict[str, onnx.TensorProto], producers=None):
    vals = []
    for name in n.input[1:]:
        t = inits.get(name)
        if t is None:
            return None
        vals.append((t.data_type, tuple(t.dims), to_numpy(t).tobytes()))
    attrs = tuple(sorted((a.name, str(helper.get_attribute_value(a))) for a in n.attribute))
    return (_source(n.input[0], producers) if producers is not None else n.input[0]), tuple(vals), attrs


def share_quantize(model: onnx.ModelProto) -> int:
    """One QuantizeLinear per (input, scale, zero point, attributes); returns how many Qs were removed."""
    g = model.graph
    inits = initializer_map(model.graph)
    outputs = {o.name for o in g.output}
    producers = producer_map(g)
    first: dict = {}
    rename: dict[str, str] = {}
    keep = []
    for n in g.node:
        if n.op_type == "QuantizeLinear" and n.input[0] not in inits and n.output[0] not in outputs:
            k = _key(n, inits, producers)
            if k is not None and k in first:
                rename[n.output[0]] = first[k].output[0]
                continue
            if k is not None:
                first[k] = n
        keep.append(n)
    if not rename:
        return 0
    for n in keep:
        for i, name in enumerate(n.input):
            if name in rename:
                n.input[i] = rename[name]
    del g.node[:]
    g.node.extend(keep)
    _drop_value_info(model, set(rename))
    return len(rename)


def propagate_quantize(model: onnx.ModelProto) -> int:
    """Copy each activation Q (with its DQ) backwards across ops that commute with quantization; returns
    copies."""
    g = model.graph
    inits = initializer_map(model.graph)
    outputs = {o.name for o in g.output}
    added = 0
    changed = True
    while changed:
        changed = False
        producers = producer_map(g)
        consumers = consumer_map(model)
        for q in list(g.node):
            if (
                q.op_type != "QuantizeLinear"
                or q.input[0] in inits
                or len(q.input) < 3
                or q.input[2] not in inits
                or inits[q.input[2]].data_type not in _EIGHT_BIT
                or q.input[1] not in inits
                or to_numpy(inits[q.input[1]]).size != 1
            ):
                # float8 has no MaxPool/Transpose kernels in onnxruntime: leave it; and a per-channel Q (a
                # weight a layer computes, weight standardisation's) names an axis a Reshape or Transpose
                # before it does not keep: its copy had a scale of 32 on an axis of size 1, a graph
                # onnxruntime refused to load
                continue
            op = producers.get(q.input[0])
            if op is not None and op.op_type == "Concat" and op.output[0] not in outputs:
                copied = _quantize_concat_inputs(g, op, q, inits, producers, consumers)
                if copied:
                    added += copied
                    changed = True
                    break
                continue
            if op is None or op.op_type not in COMMUTING_OPS or op.output[0] in outputs:
                continue
            if op.input[0] in inits or not _same_grid_readers(op, q, inits, consumers):
                continue  # a float reader of the op's output would see quantized values: not exact any more
            src = op.input[0]
            src_producer = producers.get(src)
            if src_producer is not None and src_producer.op_type == "DequantizeLinear":
                continue  # already fed by a DQ (an earlier copy)
            if _float_source(src, producers, inits):
                continue  # nothing before gains a kernel, and the op would run on codes where float is faster
            new, op.input[0] = _copy_quantize(
                q, src, f"{op.name or op.output[0]}/{PROPAGATED_MARK}", inits, consumers
            )
            _insert_before(g, op, new)
            added += 1
            changed = True
            break
    return added


def _copy_quantize(
    q: onnx.NodeProto, src: str, base: str, inits, consumers
) -> tuple[list[onnx.NodeProto], str]:
    """The nodes that put ``q``'s grid on ``src`` (a QuantizeLinear and its DequantizeLinear, named ``base``)
    and the DQ's output. Where a QuantizeLinear of that grid already reads ``src`` (the input quantizer of
    another reader: a stem's output read by a Conv and by a MaxPool), only the DQ is added, reading it: the
    tensor keeps one Q, as onnxruntime's fusion of its producer needs."""
    same = next((c for c in consumers.get(src, []) if _same_grid(c, q, inits)), None)
    if same is None:
        same = helper.make_node("QuantizeLinear", [src, *q.input[1:]], [base + "_q"], name=base + "/Q")
        same.attribute.extend(q.attribute)
    dq = helper.make_node(
        "DequantizeLinear", [*same.output, *same.input[1:]], [base + "_dq"], name=base + "/DQ"
    )
    dq.attribute.extend(a for a in q.attribute if a.name in ("axis", "block_size"))
    return [same, dq], dq.output[0]


def _insert_before(g: onnx.GraphProto, op: onnx.NodeProto, new: list[onnx.NodeProto]) -> None:
    """Put ``new`` in front of ``op`` in ``g``'s node order; a node of ``new`` already in ``g`` (a reused Q)
    stays where it is if it comes before ``op``, and moves in front of it otherwise (it reads what ``op``
    reads)."""
    nodes = list(g.node)
    before = {id(n) for n in nodes[: nodes.index(op)]}
    new = [n for n in new if id(n) not in before]
    nodes = [n for n in nodes if not any(n is m for m in new)]
    at = nodes.index(op)
    del g.node[:]
    g.node.extend(nodes[:at] + new + nodes[at:])


def _same_grid_readers(op: onnx.NodeProto, q: onnx.NodeProto, inits, consumers) -> bool:
    """True if every reader of ``op``'s output is a QuantizeLinear of ``q``'s scale, zero point and
    attributes (a float reader would see quantized values once ``op`` reads codes)."""
    return all(_same_grid(c, q, inits) for c in consumers.get(op.output[0], []))


def _same_grid(c: onnx.NodeProto, q: onnx.NodeProto, inits) -> bool:
    """True if ``c`` is a QuantizeLinear of ``q``'s scale, zero point and attributes."""
    if c.op_type != "QuantizeLinear":
        return False
    mine, theirs = _key(c, inits), _key(q, inits)
    return mine is not None and theirs is not None and mine[1:] == theirs[1:]


#: the layers onnxruntime fuses with a Q on their output (a Relu/Clip between them absorbed)
_LAYER_OPS = ("Conv", "Gemm", "MatMul")


def _layer_before(name: str, producers, consumers) -> bool:
    """True if ``name`` is the output of a Conv/Gemm/MatMul fed by a DequantizeLinear, through at most one
    Relu/Clip that alone reads it: the tensor a Q must take for onnxruntime to fuse that layer."""
    n = producers.get(name)
    if n is not None and n.op_type in ("Relu", "Clip") and len(consumers.get(n.input[0], [])) == 1:
        n = producers.get(n.input[0])
    if n is None or n.op_type not in _LAYER_OPS or not n.input:
        return False
    src = producers.get(n.input[0])
    return src is not None and src.op_type == "DequantizeLinear"


def _float_source(name: str, producers, inits) -> bool:
    """True where ``name``, back through the ops that commute with quantization, is a graph input or the
    output of a float layer (a Conv/Gemm/MatMul no DequantizeLinear feeds, through at most one Relu/Clip): a Q
    copied there gives no layer an integer kernel, and the op between runs on codes in onnxruntime's
    generic layout. A MaxPool after a stem kept float ran as a uint8 NCHW MaxPool: 383 us against 6 us in
    float, 5.4x the float graph at batch 32 on an AVX-512 VNNI CPU."""
    n = producers.get(name)
    while n is not None and n.op_type in COMMUTING_OPS and n.input and n.input[0] not in inits:
        n = producers.get(n.input[0])
    if n is None:
        return True  # a graph input
    if n.op_type in ("Relu", "Clip") and n.input:
        n = producers.get(n.input[0])
        if n is None:
            return True
    if n.op_type not in _LAYER_OPS or not n.input:
        return False
    src = producers.get(n.input[0])
    return src is None or src.op_type != "DequantizeLinear"


def _quantize_concat_inputs(g, op: onnx.NodeProto, q: onnx.NodeProto, inits, producers, consumers) -> int:
    """Put a copy of ``q`` (a per-tensor Q reading the Concat ``op``) with its DQ on each input of ``op`` that
    no DequantizeLinear produces, where one of those is a quantized layer's output (:func:`_layer_before`)
    that then fuses; returns how many were added. An input that a DQ produces (an earlier copy, or another
    quantizer's codes) is left: ``QLinearConcat`` takes inputs of different grids."""
    if any(name in inits or not name for name in op.input) or not _same_grid_readers(op, q, inits, consumers):
        return 0
    if any(to_numpy(inits[name]).size != 1 for name in q.input[1:]):
        return 0  # a per-channel grid would have to be cut along the concatenation axis
    todo = []
    for name in dict.fromkeys(op.input):
        src = producers.get(name)
        if src is None or src.op_type != "DequantizeLinear":
            todo.append(name)
    if not any(_layer_before(name, producers, consumers) for name in todo):
        return 0  # no layer gains its integer kernel: the graph stays as the quantizers wrote it
    new = []
    for k, name in enumerate(todo):
        added, dq_out = _copy_quantize(
            q, name, f"{op.name or op.output[0]}/{PROPAGATED_MARK}_{k}", inits, consumers
        )
        new += added
        for i, x in enumerate(op.input):
            if x == name:
                op.input[i] = dq_out
    _insert_before(g, op, new)
    return len(todo)


def strip_propagated(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` without the Q/DQ copies :func:`propagate_quantize` added: the same values, with
    every quantizer's own QuantizeLinear reading the float tensor it quantizes (for local error
    measurements)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    dqs = {n.output[0]: n for n in g.node if n.op_type == "DequantizeLinear" and is_propagated(n)}
    producers = producer_map(g)
    source, stripped = {}, set()
    for out, dq in dqs.items():
        q = producers.get(dq.input[0])
        if q is None or q.op_type != "QuantizeLinear" or list(q.input[1:]) != list(dq.input[1:]):
            # not a copy as propagate_quantize makes them (an edited graph): left as it is, to be judged
            continue
        source[out] = q.input[0]
        stripped |= {id(dq), id(q)}
    for n in g.node:
        for i, name in enumerate(n.input):
            if name in source:
                n.input[i] = source[name]
    read = {x for n in g.node if id(n) not in stripped for x in n.input}
    # a Q read elsewhere stays
    keep = [n for n in g.node if id(n) not in stripped or any(o in read for o in n.output)]
    del g.node[:]
    g.node.extend(keep)
    return m


def propagated_copy_problems(model: onnx.ModelProto) -> list[str]:
    """Each copy :func:`propagate_quantize` made must carry the grid of the quantizer it copies: the scale
    and zero point of every QuantizeLinear its DQ reaches across commuting ops (and Concats). A copy of
    another grid changes the values those ops pass on, and nothing else in a graph's check sees it (the
    exact session runs without the copies, :func:`strip_propagated`)."""
    g = model.graph
    inits = initializer_map(g)
    consumers = consumer_map(model)

    def grid(n: onnx.NodeProto):  # the scale and zero point, as values (a DQ's attributes are a Q's subset)
        key = _key(n, inits)
        return None if key is None else key[1]

    problems = []
    for dq in g.node:
        if dq.op_type != "DequantizeLinear" or not is_propagated(dq) or grid(dq) is None:
            continue
        mine, todo, seen = grid(dq), [dq.output[0]], set()
        while todo:
            name = todo.pop()
            for c in consumers.get(name, []):
                if id(c) in seen:
                    continue
                seen.add(id(c))
                if c.op_type in (*COMMUTING_OPS, "Concat"):
                    todo.extend(c.output)
                elif c.op_type == "QuantizeLinear" and grid(c) is not None:
                    if grid(c) != mine:
                        problems.append(
                            f"{dq.name}: the copy of {c.name}'s grid (moved across commuting ops) has "
                            "another scale or zero point"
                        )
    return problems


def place_for_onnxruntime(model: onnx.ModelProto) -> dict[str, int]:
    """Passes 1-3 in order; returns what each did."""
    u8 = uint8_activations(model)
    shared = share_quantize(model)
    copies = propagate_quantize(model)
    return {"uint8_activation_quantizers": u8, "shared_quantizers": shared, "propagated_quantizers": copies}
