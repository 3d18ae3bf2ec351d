"""Post-export graph passes, shared by both exporters.

1. Constant nodes become initializers (one place to look up values).
2. ``Cast`` of an initializer is folded (the dynamo translations cast their zero points).
3. :func:`fold_pad_amounts`: a ``Pad``'s amounts computed from constants (TorchScript's translation of
   ``F.pad`` reverses them with a ``Slice`` of step -1, which its own constant folding skips) become an
   initializer, so onnxruntime can fold the Pad into the Conv it feeds (``pad_fusion.cc`` wants constant
   amounts), and :func:`explicit_pads`: a Conv/pooling node with ``auto_pad=VALID`` (``padding="valid"`` in
   torch) or no ``pads`` gets ``pads`` of zeros (the same op), the form that fusion also wants; one with
   ``auto_pad=SAME_*`` at stride 1 (``padding="same"``) gets the pads that stands for (onnxruntime refuses
   SAME with dilation).
   :func:`global_average_pools`: a ``ReduceMean`` over every spatial axis of a 4-D/5-D tensor (what the
   dynamo exporter makes of ``AdaptiveAvgPool2d(1)``, and TorchScript of ``x.mean((2, 3))``) becomes
   ``GlobalAveragePool`` (then ``Flatten`` without ``keepdims``): onnxruntime runs that one on codes
   (``QLinearGlobalAveragePool``) between a DQ and a Q, not ``ReduceMean``.
   :func:`unit_global_pools`: a global pooling of a 1x1 map (a small image through an ImageNet architecture)
   is the identity, and is removed.
4. Weights are stored quantized (the deployment form): a ``QuantizeLinear`` whose input is an initializer
   (possibly through the ``Max``/``Min`` clip) is replaced by its codes, computed with quantcli's arithmetic,
   the same arithmetic the fake-quant model uses; the float weight disappears from the file.
5. :func:`narrow_types`: 2..4-bit pairs, emitted as clipped int8, are stored as int4/uint4.
6. Unused initializers are dropped (those a subgraph reads are used).
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from exporters.graph import initializer_map, producer_map, to_numpy
from quantcli.quant import arithmetic, formats
from quantcli.quant.granularity import broadcast_onnx_param


def make_initializer(name: str, values: np.ndarray, elem_type: int) -> onnx.TensorProto:
    """An initializer of ``elem_type`` holding ``values`` (already representable in that type)."""
    dims = list(values.shape)
    if elem_type == onnx.TensorProto.FLOAT8E4M3FN:
        raw = torch.from_numpy(np.array(values, dtype=np.float32, order="C")).to(torch.float8_e4m3fn)
        return helper.make_tensor(name, elem_type, dims, raw.view(torch.uint8).numpy().tobytes(), raw=True)
    if elem_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        # two codes per byte, the first in the low nibble (ONNX's packing): half the bytes of int32_data
        # varints
        nibbles = (np.asarray(values).astype(np.int64).reshape(-1) & 0xF).astype(np.uint8)
        if nibbles.size % 2:
            nibbles = np.append(nibbles, np.uint8(0))
        packed = nibbles[0::2] | (nibbles[1::2] << 4)
        return helper.make_tensor(name, elem_type, dims, packed.tobytes(), raw=True)
    np_type = helper.tensor_dtype_to_np_dtype(elem_type)
    return numpy_helper.from_array(np.array(values, dtype=np_type, order="C"), name)  # keeps 0-d shapes


def constants_to_initializers(model: onnx.ModelProto) -> None:
    g = model.graph
    keep = []
    for n in g.node:
        if n.op_type == "Constant" and len(n.attribute) == 1 and n.attribute[0].name == "value":
            t = onnx.TensorProto()
            t.CopyFrom(n.attribute[0].t)
            t.name = n.output[0]
            g.initializer.append(t)
        else:
            keep.append(n)
    del g.node[:]
    g.node.extend(keep)


def _representable(vals: np.ndarray, elem_type: int) -> bool:
    t = formats.BY_ELEM_TYPE.get(elem_type)
    if t is None:
        return False
    if t is formats.FP8_E4M3:
        return bool(np.all(np.abs(vals) <= t.qmax))
    return bool(
        np.all(vals == np.round(vals)) and vals.min(initial=0) >= t.qmin and vals.max(initial=0) <= t.qmax
    )


def fold_casts(model: onnx.ModelProto) -> None:
    g = model.graph
    inits = initializer_map(g)
    keep = []
    for n in g.node:
        if n.op_type == "Cast" and n.input[0] in inits:
            to = next(a.i for a in n.attribute if a.name == "to")
            vals = to_numpy(inits[n.input[0]]).astype(np.float64)
            if _representable(vals, to):
                new = make_initializer(n.output[0], vals.astype(np.float32), to)
                g.initializer.append(new)
                inits[new.name] = new
                continue
        keep.append(n)
    del g.node[:]
    g.node.extend(keep)


#: the inputs of an op that say how (not what) it computes: folded when they depend on constants only
_CONSTANT_INPUTS = {"Pad": (1, 2)}


def fold_pad_amounts(model: onnx.ModelProto) -> int:
    """Evaluate the ``pads``/``constant_value`` inputs of ``Pad`` nodes that are computed from initializers
    alone, or from initializers and the static dimensions of a tensor's ``Shape`` (ONNX's reference
    evaluator), and store them as initializers; returns how many inputs were folded. The nodes that computed
    them go where nothing else reads them.

    A "same" padding computed in ``forward`` from the input's height and width (EfficientNet's
    ``Conv2dDynamicSamePadding``) reaches the TorchScript graph as ``Shape -> Gather -> Sub -> Div ...``; with
    the batch dimension dynamic, onnxruntime folds none of it, its ``Pad`` does not fold into the
    ``Conv``, and the Conv stays float. The amounts are evaluated with every symbolic dimension set to each
    of :data:`SYMBOLIC_FILLS`, and folded only when all give the same (they read only static dimensions)."""
    g = model.graph
    inits = initializer_map(g)
    producers = producer_map(g)
    shapes = _Shapes(model)
    folded = 0
    computed: set[str] = set()  # first outputs of the nodes that computed folded amounts
    for n in g.node:
        for i in _CONSTANT_INPUTS.get(n.op_type, ()):
            if i >= len(n.input) or not n.input[i] or n.input[i] in inits:
                continue
            found = _constant_subgraph(n.input[i], producers, inits, shapes)
            if found is None:
                continue
            nodes, shaped = found
            value = _evaluate(model, nodes, n.input[i], inits, shaped)
            if value is None:
                continue
            name = f"{n.input[i]}_folded"
            if name not in inits:
                t = numpy_helper.from_array(np.asarray(value), name)
                g.initializer.append(t)
                inits[name] = t
            computed.update(_ancestors(n.input[i], producers))  # through Shape: the whole computation
            n.input[i] = name
            folded += 1
            if shaped:  # the tensors after this Pad may have static shapes now: infer them again when asked
                shapes.refresh()
    for n in g.node:
        # an empty trailing input (TorchScript writes Pad(x, pads, "")) is absent: onnxruntime's Pad fusion
        # reads it as a non-constant value and keeps the Pad out of the Conv
        while n.op_type == "Pad" and len(n.input) > 2 and not n.input[-1]:
            n.input.pop()
    if folded:
        _drop_unread(g, computed)
    return folded


def _ancestors(name: str, producers: dict[str, onnx.NodeProto], limit: int = 1024) -> set[str]:
    """The first outputs of the nodes ``name`` is computed from (at most ``limit``)."""
    seen: set[str] = set()
    stack = [name]
    while stack and len(seen) < limit:
        node = producers.get(stack.pop())
        if node is not None and node.output[0] not in seen:
            seen.add(node.output[0])
            stack.extend(node.input)
    return seen


#: the sizes a symbolic dimension is given when a computed amount is evaluated: a value folds only when it is
#: the same for all. Every residue modulo 2 to 7: a parity test (Swin's ``F.pad(x, (0, 0, 0, W % 2, 0, H %
#: 2))``) gave 1 for both 1 and 3, the two sizes tried before, and was frozen to a pad of 1, so that no
#: even-sized input could run; a stride-2 "same" padding likewise
SYMBOLIC_FILLS = (1, 2, 3, 4, 5, 6, 7)


def _evaluate(
    model: onnx.ModelProto,
    nodes: list[onnx.NodeProto],
    output: str,
    inits: dict,
    shaped: dict[str, list[int | None]],
) -> np.ndarray | None:
    """``output`` of ``nodes`` (ONNX's reference evaluator), the tensors in ``shaped`` (read only through
    ``Shape``) fed as zeros of their shape; with symbolic dimensions, the value when it is the same for each
    filled in as every one of :data:`SYMBOLIC_FILLS`, else None."""
    from onnx.reference import ReferenceEvaluator  # only for computed amounts: a costly import

    sub = helper.make_graph(
        nodes,
        "constant",
        [helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, None) for x in shaped],
        [helper.make_tensor_value_info(output, onnx.TensorProto.UNDEFINED, None)],
        [inits[x] for x in {x for m in nodes for x in m.input} if x in inits],
    )
    values = []
    for fill in SYMBOLIC_FILLS if any(None in dims for dims in shaped.values()) else (1,):
        feeds = {
            x: np.zeros([fill if d is None else d for d in dims], np.float32) for x, dims in shaped.items()
        }
        try:
            (value,) = ReferenceEvaluator(helper.make_model(sub, opset_imports=model.opset_import)).run(
                None, feeds
            )
        except Exception:  # an op the reference evaluator lacks: leave the graph as it is
            return None
        values.append(np.asarray(value))
    if any(v.shape != values[0].shape or not np.array_equal(v, values[0]) for v in values[1:]):
        return None
    return values[0]


_PADDED_OPS = ("Conv", "MaxPool", "AveragePool")


def _same_pads(auto: bytes, kernel: list[int], dilations: list[int]) -> list[int]:
    """The explicit ``pads`` (begins, then ends) of ``auto_pad`` SAME_UPPER/SAME_LOWER at stride 1, where
    they do not depend on the input's size: ``dilation * (kernel - 1)`` in all, the odd one at the end for
    SAME_UPPER (torch's ``padding="same"``), at the beginning for SAME_LOWER."""
    totals = [d * (k - 1) for k, d in zip(kernel, dilations)]
    small = [t // 2 for t in totals]
    large = [t - h for t, h in zip(totals, small)]
    return small + large if auto == b"SAME_UPPER" else large + small


def explicit_pads(model: onnx.ModelProto) -> int:
    """Give Conv/MaxPool/AveragePool nodes explicit ``pads``; returns how many nodes changed.

    Without padding (``auto_pad`` VALID, or no ``pads``): zeros. With ``auto_pad`` SAME_UPPER/SAME_LOWER at
    stride 1 (torch's ``padding="same"``, which it allows only at stride 1): the pads it stands for
    (:func:`_same_pads`). onnxruntime refuses to run a dilated convolution with SAME padding ("Dilation not
    supported for AutoPadType::SAME_UPPER"), so ``Conv1d(..., padding="same", dilation=2)`` exported by
    torch could not run; and its Pad fusion wants explicit pads. SAME at a larger stride depends on the
    input's size and stays. Needs the kernel's shape: from ``kernel_shape``, or the weight initializer of a
    Conv."""
    inits = initializer_map(model.graph)
    changed = 0
    for n in model.graph.node:
        if n.op_type not in _PADDED_OPS:
            continue
        attrs = _attrs(n)
        auto = attrs.get("auto_pad", b"NOTSET")
        if auto == b"NOTSET" and "pads" in attrs:
            continue
        kernel = list(attrs["kernel_shape"]) if "kernel_shape" in attrs else None
        if kernel is None and n.op_type == "Conv" and n.input[1] in inits:
            kernel = list(inits[n.input[1]].dims[2:])
        if not kernel:
            continue
        if auto in (b"VALID", b"NOTSET"):
            pads = [0] * (2 * len(kernel))
        elif auto in (b"SAME_UPPER", b"SAME_LOWER") and all(s == 1 for s in attrs.get("strides", [1])):
            pads = _same_pads(auto, kernel, list(attrs.get("dilations", [1] * len(kernel))))
        else:
            continue
        keep = [a for a in n.attribute if a.name not in ("auto_pad", "pads")]
        del n.attribute[:]
        n.attribute.extend([*keep, helper.make_attribute("pads", pads)])
        changed += 1
    return changed


def _shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """Tensor name -> its dimensions (None for a symbolic or unknown one), where the graph records a shape
    (inputs, outputs, value_info)."""
    g = model.graph
    return {
        v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
        for v in [*g.input, *g.output, *g.value_info]
        if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")
    }


class _Shapes:
    """The shapes a graph records, completed by ONNX shape inference (on a copy, once, at the first tensor
    the graph records none for: TorchScript leaves some intermediate tensors without one)."""

    def __init__(self, model: onnx.ModelProto):
        self.model, self.known, self.inferred = model, None, False

    def refresh(self) -> None:
        """Forget what was read and inferred (the graph changed)."""
        self.known, self.inferred = None, False

    def get(self, name: str) -> list[int | None] | None:
        if self.known is None:
            self.known = _shapes(self.model)
        if name not in self.known and not self.inferred:
            self.inferred = True
            try:
                self.known.update(_shapes(onnx.shape_inference.infer_shapes(self.model)))
            except Exception:  # a graph it cannot infer (or too large to): the shape stays unknown
                pass
        return self.known.get(name)


def global_average_pools(model: onnx.ModelProto, shapes: _Shapes | None = None) -> int:
    """Rewrite ``ReduceMean`` over all spatial axes (2..rank-1) of a tensor of rank 4 or 5 as
    ``GlobalAveragePool`` (followed by ``Flatten(axis=1)`` where ``keepdims=0``); returns how many. A rank the
    graph does not record, or axes given by a computed tensor, leave the node as it is. ``shapes``: a table to
    share with the passes after this one (the rewrite keeps every tensor's name and shape)."""
    g = model.graph
    inits = initializer_map(g)
    shapes = shapes or _Shapes(model)
    out, changed = [], 0
    for n in g.node:
        if n.op_type != "ReduceMean":
            out.append(n)
            continue
        attrs = _attrs(n)
        if len(n.input) > 1 and n.input[1]:
            axes = to_numpy(inits[n.input[1]]).tolist() if n.input[1] in inits else None
        else:
            axes = attrs.get("axes")
        shape = shapes.get(n.input[0]) if axes is not None and len(axes) in (2, 3) else None
        rank = None if shape is None else len(shape)
        if rank not in (4, 5) or sorted(a % rank for a in axes) != list(range(2, rank)):
            out.append(n)
            continue
        keep = attrs.get("keepdims", 1)
        pooled = n.output[0] if keep else f"{n.output[0]}_pooled"
        name = n.name or n.output[0]
        out.append(
            helper.make_node("GlobalAveragePool", [n.input[0]], [pooled], name=f"{name}/GlobalAveragePool")
        )
        if not keep:
            out.append(helper.make_node("Flatten", [pooled], [n.output[0]], name=f"{name}/Flatten", axis=1))
        changed += 1
    if changed:
        del g.node[:]
        g.node.extend(out)
    return changed


_GLOBAL_POOLS = ("GlobalAveragePool", "GlobalMaxPool")


def unit_global_pools(model: onnx.ModelProto, shapes: _Shapes | None = None) -> int:
    """Remove each ``GlobalAveragePool``/``GlobalMaxPool`` whose input's spatial dimensions are all 1 (the
    graph records them, or shape inference finds them): the mean or max of one element is that element, so its
    readers read the input instead (an ``Identity`` keeps the name of a graph output). Returns how many.

    Why: a CNN run at a small resolution (32x32 images into an ImageNet architecture) pools a 1x1 map, and
    onnxruntime's ``QLinearGlobalAveragePool`` does that slowly where the input has many channels: 398 us of
    the 2.2 ms of the zoo's mobilenet_v2 ([32, 1280, 1, 1], 1 thread), where the float graph's pool took 22
    us. Without the node, DQ -> Flatten -> Q of one scale drops out too and the Q feeds the classifier's QGemm
    (``python -m benchmarks.profile_zoo --model mobilenet_v2``)."""
    g = model.graph
    shapes = shapes or _Shapes(model)
    kept_names = {o.name for o in g.output} | _read_in_subgraphs(g)
    bypass: dict[str, str] = {}
    out, changed = [], 0
    for n in g.node:
        shape = shapes.get(n.input[0]) if n.op_type in _GLOBAL_POOLS else None
        if shape is None or len(shape) < 3 or any(d != 1 for d in shape[2:]):
            out.append(n)
            continue
        changed += 1
        if n.output[0] in kept_names:
            out.append(helper.make_node("Identity", [n.input[0]], [n.output[0]], name=n.name or n.output[0]))
        else:
            bypass[n.output[0]] = n.input[0]
    for n in out:
        for i, x in enumerate(n.input):
            while x in bypass:  # a pool of a pool
                x = bypass[x]
            n.input[i] = x
    if changed:
        del g.node[:]
        g.node.extend(out)
    return changed


def _read_in_subgraphs(g: onnx.GraphProto) -> set[str]:
    """Every tensor name a node inside a subgraph (If/Loop/Scan bodies, nested) reads."""
    names: set[str] = set()
    for n in g.node:
        for a in n.attribute:
            for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                names |= {x for m in sub.node for x in m.input} | _read_in_subgraphs(sub)
    return names


def _constant_subgraph(
    name: str, producers: dict[str, onnx.NodeProto], inits: dict, shapes=None, limit: int = 64
) -> tuple[list[onnx.NodeProto], dict[str, list[int | None]]] | None:
    """The nodes that compute ``name`` from initializers alone, in graph order, and (with ``shapes``, a
    :class:`_Shapes`) the tensors they read only through a ``Shape`` node, with their dimensions (None:
    symbolic); None where a graph input or a tensor of unknown rank is read otherwise (or more than ``limit``
    nodes are involved)."""
    seen: dict[str, onnx.NodeProto] = {}  # by first output (protobuf wrappers have no stable identity)
    shaped: dict[str, list[int | None]] = {}
    stack = [name]
    while stack:
        x = stack.pop()
        if not x or x in inits:
            continue
        node = producers.get(x)
        if node is None or len(seen) >= limit:
            return None
        if node.output[0] in seen:
            continue
        seen[node.output[0]] = node
        if node.op_type == "Shape" and shapes is not None:
            dims = shapes.get(node.input[0])
            if dims is None:
                return None
            shaped[node.input[0]] = dims
            continue
        stack.extend(node.input)
    order = {o: k for k, o in enumerate(producers)}
    return sorted(seen.values(), key=lambda m: order[m.output[0]]), shaped


def constant_value(model: onnx.ModelProto, name: str, limit: int = 32) -> tuple[np.ndarray, set[str]] | None:
    """The value of tensor ``name``: an initializer's, or computed with ONNX's reference evaluator where at
    most ``limit`` nodes compute it from initializers alone (the dynamo exporter leaves an LSTM's
    gate-reordered weights as Slice/Concat of the parameter above onnxscript's folding size limit). Returns
    ``(value, first outputs of the nodes that computed it)``, or None (a graph input is involved, or the
    evaluator cannot run an op)."""
    g = model.graph
    inits = initializer_map(g)
    if name in inits:
        return to_numpy(inits[name]), set()
    found = _constant_subgraph(name, producer_map(g), inits, limit=limit)
    if found is None:
        return None
    nodes, _ = found
    from onnx.reference import ReferenceEvaluator

    sub = helper.make_graph(
        nodes,
        "constant",
        [],
        [helper.make_tensor_value_info(name, onnx.TensorProto.UNDEFINED, None)],
        [inits[x] for x in {x for m in nodes for x in m.input} if x in inits],
    )
    try:
        (value,) = ReferenceEvaluator(helper.make_model(sub, opset_imports=model.opset_import)).run(None, {})
    except Exception:  # an op the reference evaluator lacks
        return None
    return np.asarray(value), {m.output[0] for m in nodes}


def drop_unread(g: onnx.GraphProto, candidates: set[str]) -> None:
    """Remove the nodes whose first output is in ``candidates`` and that nothing reads any more (repeatedly):
    what computed a value a pass replaced."""
    _drop_unread(g, candidates)


def _drop_unread(g: onnx.GraphProto, candidates: set[str]) -> None:
    """Remove the nodes whose first output is in ``candidates`` and none of whose outputs is read any more,
    repeatedly."""
    while True:
        read = {x for n in g.node for x in n.input} | {o.name for o in g.output} | _read_in_subgraphs(g)
        keep = [n for n in g.node if n.output[0] not in candidates or any(o in read for o in n.output)]
        if len(keep) == len(g.node):
            return
        del g.node[:]
        g.node.extend(keep)


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def quantize_codes(
    x: np.ndarray, scale: np.ndarray, zp: np.ndarray, elem_type: int, axis: int | None, block: int | None
) -> np.ndarray:
    """ONNX QuantizeLinear on numpy, with quantcli's arithmetic."""
    s = broadcast_onnx_param(torch.from_numpy(scale.astype(np.float32)), x.shape, axis, block)
    xt = torch.from_numpy(x.astype(np.float32))
    t = formats.BY_ELEM_TYPE[elem_type]
    if t is formats.FP8_E4M3:
        return arithmetic.quantize_e4m3(xt, s).to(torch.float32).numpy()
    z = broadcast_onnx_param(torch.from_numpy(zp.astype(np.float32)), x.shape, axis, block)
    return arithmetic.quantize_linear(xt, s, z, t.qmin, t.qmax).numpy()


def fold_weight_quantization(model: onnx.ModelProto) -> int:
    """Replace QuantizeLinear of constant weights by stored codes. Returns how many were folded."""
    g = model.graph
    inits = initializer_map(g)
    producers = producer_map(g)
    drop_q: set[str] = set()  # nodes by first output (protobuf wrappers have no stable identity)
    drop_clip: set[str] = set()
    folded = 0
    for n in g.node:
        if n.op_type != "QuantizeLinear" or n.input[1] not in inits:
            continue
        chain, src = [], n.input[0]
        while (
            src not in inits
            and src in producers
            and producers[src].op_type in ("Max", "Min")
            and producers[src].input[1] in inits
        ):
            chain.append(producers[src])
            src = producers[src].input[0]
        if src not in inits:
            continue
        x = to_numpy(inits[src]).astype(np.float32)
        for c in reversed(chain):
            bound = to_numpy(inits[c.input[1]]).astype(np.float32)
            x = np.maximum(x, bound) if c.op_type == "Max" else np.minimum(x, bound)
        a = _attrs(n)
        zp_name = n.input[2] if len(n.input) > 2 else ""
        zp_t = inits.get(zp_name)
        elem = zp_t.data_type if zp_t is not None else onnx.TensorProto.UINT8
        zp = to_numpy(zp_t) if zp_t is not None else np.zeros(())
        scale = to_numpy(inits[n.input[1]])
        axis = a.get("axis", 1) if scale.size > 1 else None
        codes = quantize_codes(x, scale, zp, elem, axis, a.get("block_size") or None)
        new = make_initializer(n.output[0], codes, elem)
        g.initializer.append(new)
        inits[new.name] = new
        drop_q.add(n.output[0])
        drop_clip.update(c.output[0] for c in chain)
        folded += 1
    keep = [n for n in g.node if n.output[0] not in drop_q]
    del g.node[:]
    g.node.extend(keep)
    _drop_unread(g, drop_clip)  # a clip node may feed other nodes too: dropped only when nothing reads it
    return folded


def narrow_types(model: onnx.ModelProto, targets: dict[str, int]) -> int:
    """Store the Q/DQ pairs whose DequantizeLinear output is in ``targets`` in the target type (int4/uint4).

    Their codes already lie in the target range (the exporter clipped them), so retyping the zero point and
    any stored codes changes no value. Returns the number of pairs narrowed.
    """
    g = model.graph
    inits = initializer_map(g)
    retype: dict[str, int] = {}
    for n in g.node:
        if n.op_type == "DequantizeLinear" and n.output[0] in targets:
            t = targets[n.output[0]]
            if len(n.input) > 2 and n.input[2] in inits:
                retype[n.input[2]] = t
            if n.input[0] in inits:
                retype[n.input[0]] = t
    stale = (
        set(retype)
        | {
            n.input[0]
            for n in g.node
            if n.op_type == "QuantizeLinear" and len(n.input) > 2 and n.input[2] in retype
        }
        | {
            n.output[0]
            for n in g.node
            if n.op_type == "QuantizeLinear" and len(n.input) > 2 and n.input[2] in retype
        }
    )
    # typed int8 by the exporter: re-inferred later
    keep_vi = [v for v in g.value_info if v.name not in stale]
    del g.value_info[:]
    g.value_info.extend(keep_vi)
    for name, t in retype.items():
        old = inits[name]
        vals = to_numpy(old).astype(np.float64)
        if not _representable(vals, t):
            raise ValueError(f"{name}: values outside the range of ONNX type {t}")
        new = make_initializer(name, vals.astype(np.float32), t)
        old.CopyFrom(new)
    return sum(1 for n in g.node if n.op_type == "DequantizeLinear" and n.output[0] in targets)


def drop_unused_initializers(model: onnx.ModelProto) -> None:
    """Remove the initializers nothing reads: no node, no graph output, and no node inside a subgraph (a
    ``Loop`` body, as TorchScript exports ``EmbeddingBag``, reads outer-scope constants by name)."""
    g = model.graph
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output} | _read_in_subgraphs(g)
    keep = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)


#: initializers at least this large are stored once where several are equal (weights, not scalars: a scale or
#: zero point of one quantizer stays its own, so editing it edits one pair)
SHARED_MIN_BYTES = 1024


def share_identical_initializers(model: onnx.ModelProto) -> int:
    """Store equal initializers (the same type, shape and bytes) of at least :data:`SHARED_MIN_BYTES` once:
    a module called several times in forward (a block applied in a loop, ALBERT's shared layers) is traced
    once per call, each call writing its own copy of the same weight codes. Readers are pointed at the first
    copy; returns the bytes saved. Initializers kept in external data are left as they are."""
    g = model.graph
    first: dict[bytes, str] = {}
    renamed: dict[str, str] = {}
    saved = 0
    for t in g.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            continue
        size = t.ByteSize()
        if size < SHARED_MIN_BYTES:
            continue
        key = onnx.TensorProto()
        key.CopyFrom(t)
        key.name = ""
        k = key.SerializeToString()
        if k in first:
            renamed[t.name] = first[k]
            saved += size
        else:
            first[k] = t.name
    if not renamed:
        return 0
    outputs = {o.name for o in g.output}
    for n in g.node:
        for i, name in enumerate(n.input):
            if name in renamed and name not in outputs:
                n.input[i] = renamed[name]
    return saved


def align_zero_points(model: onnx.ModelProto) -> None:
    """Give every Q/DQ zero point its scale's shape (ONNX requires it; torch.export may lift a 0-d zero as
    [1])."""
    g = model.graph
    inits = initializer_map(g)
    for n in g.node:
        if n.op_type not in ("QuantizeLinear", "DequantizeLinear") or len(n.input) < 3:
            continue
        s, z = inits.get(n.input[1]), inits.get(n.input[2])
        if s is None or z is None or list(s.dims) == list(z.dims):
            continue
        vals = to_numpy(z)
        if vals.size != int(np.prod(s.dims, dtype=np.int64)):
            continue
        name = f"{n.input[2]}_as_{'x'.join(map(str, s.dims)) or 'scalar'}"
        if name not in inits:
            new = make_initializer(name, vals.reshape(tuple(s.dims)).astype(np.float32), z.data_type)
            g.initializer.append(new)
            inits[name] = new
        n.input[2] = name


def prepare(model: onnx.ModelProto, fold_weights: bool) -> int:
    """Passes 1-4; returns the number of weights stored quantized."""
    constants_to_initializers(model)
    fold_casts(model)
    fold_pad_amounts(model)
    explicit_pads(model)
    shapes = _Shapes(model)  # one ONNX shape inference at most, for both pooling passes
    global_average_pools(model, shapes)
    unit_global_pools(model, shapes)
    align_zero_points(model)
    return fold_weight_quantization(model) if fold_weights else 0
