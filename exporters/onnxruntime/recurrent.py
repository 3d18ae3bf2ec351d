"""onnxruntime's integer LSTM: the exported ``LSTM`` node of each quantized layer rewritten as
``com.microsoft::DynamicQuantizeLSTM``, the node onnxruntime's own ``quantize_dynamic`` writes.

The exporter writes a quantized layer as a plain ``LSTM`` whose ``W``/``R`` hold the dequantized weights
(:func:`quantcli.nn.recurrent.exported_weights`): initializers, or, from the dynamo exporter above
onnxscript's folding size, computed from the parameter by ``Slice``/``Concat`` nodes (evaluated here,
:func:`exporters.fold.constant_value`, and removed). Each is found by those values (equal to the layer's, gate
order and layout as torch's exporters write them: the node names differ between the two exporters), and
replaced by a ``DynamicQuantizeLSTM`` with the same inputs, attributes and outputs, taking
the int8 codes transposed to ``(directions, in, 4*hidden)`` and their float32 scales (per direction, or per
direction and output row) with zero points 0. The kernel's own run-time quantization of the activations is
what :class:`quantcli.nn.recurrent.QuantLSTM` computes.

Which node is which layer, and its quantizers, go into the model's metadata (:data:`RECURRENT_KEY`), where
``verify`` and ``inspect`` read them (:func:`recurrent_layers`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from exporters.fold import constant_value, drop_unread, make_initializer
from exporters.graph import initializer_map
from quantcli.nn.recurrent import DYNAMIC_LSTM, OnnxLayer

RECURRENT_KEY = "quantcli.recurrent"  # metadata: node name -> {"layer": "lstm.l0", "quantizers": [...]}
MS_DOMAIN = "com.microsoft"
_LSTM_INPUTS = 8  # X, W, R, B, sequence_lens, initial_h, initial_c, P


@dataclass
class RecurrentLayer:
    """A ``DynamicQuantizeLSTM`` node of a graph, as the metadata names it."""

    node: onnx.NodeProto
    layer: str
    quantizers: list[str]


def to_dynamic_quantize_lstm(model: onnx.ModelProto, layers: list[OnnxLayer]) -> dict[str, dict]:
    """Rewrite, in place, the ``LSTM`` node of every layer in ``layers``; returns what goes into the metadata
    (node name -> layer and quantizers). A layer whose node is not found is an internal error."""
    if not layers:
        return {}
    g = model.graph
    todo = list(layers)
    done: dict[str, dict] = {}
    computed: set[str] = set()  # nodes that computed a replaced W or R
    for node in [n for n in g.node if n.op_type == "LSTM" and n.domain in ("", "ai.onnx")]:
        if len(node.input) < 3:
            continue
        w, r = constant_value(model, node.input[1]), constant_value(model, node.input[2])
        if w is None or r is None:
            continue
        layer = _matching(todo, w[0], r[0])
        if layer is None:
            continue
        todo.remove(layer)
        computed |= w[1] | r[1]
        name = node.name or f"{layer.name}/LSTM"
        index = list(g.node).index(node)
        new = _dynamic_node(g, initializer_map(g), node, layer, name)
        g.node.remove(node)
        g.node.insert(index, new)
        done[name] = {"layer": layer.name, "quantizers": layer.quantizers}
    drop_unread(g, computed)
    if todo:
        raise RuntimeError(
            f"the exported graph has no LSTM node with the dequantized weights of {todo[0].name} (the "
            "exporter wrote them otherwise)"
        )
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return done


def _matching(layers: list[OnnxLayer], w: np.ndarray, r: np.ndarray) -> OnnxLayer | None:
    for layer in layers:
        lw, lr = layer.w.numpy(), layer.r.numpy()
        if lw.shape == w.shape and lr.shape == r.shape and np.array_equal(lw, w) and np.array_equal(lr, r):
            return layer
    return None


def _dynamic_node(
    g: onnx.GraphProto, inits: dict, node: onnx.NodeProto, layer: OnnxLayer, name: str
) -> onnx.NodeProto:
    """The ``DynamicQuantizeLSTM`` for ``node``, its new initializers added to ``g``."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.pop("layout", 0) != 0:
        raise RuntimeError(f"{name}: an LSTM node with layout=1 (DynamicQuantizeLSTM has no layout)")
    added = []
    for key, values, elem in (
        ("W_quantized", layer.w_codes, onnx.TensorProto.INT8),
        ("R_quantized", layer.r_codes, onnx.TensorProto.INT8),
        ("W_scale", layer.w_scale, onnx.TensorProto.FLOAT),
        ("W_zero_point", np.zeros(tuple(layer.w_scale.shape)), onnx.TensorProto.INT8),
        ("R_scale", layer.r_scale, onnx.TensorProto.FLOAT),
        ("R_zero_point", np.zeros(tuple(layer.r_scale.shape)), onnx.TensorProto.INT8),
    ):
        tname = f"{name}/{key}"
        t = make_initializer(tname, np.asarray(values, dtype=np.float32), elem)
        g.initializer.append(t)
        inits[tname] = t
        added.append(tname)
    rest = [node.input[i] if i < len(node.input) else "" for i in range(3, _LSTM_INPUTS)]
    inputs = [node.input[0], added[0], added[1], *rest, *added[2:]]
    return helper.make_node(DYNAMIC_LSTM, inputs, list(node.output), name=name, domain=MS_DOMAIN, **attrs)


def recurrent_layers(model: onnx.ModelProto) -> list[RecurrentLayer]:
    """The ``DynamicQuantizeLSTM`` nodes of ``model`` with the layer and quantizers its metadata names (none
    for a node the metadata does not know)."""
    meta = next((p.value for p in model.metadata_props if p.key == RECURRENT_KEY), None)
    known = json.loads(meta) if meta else {}
    out = []
    for node in model.graph.node:
        if node.op_type == DYNAMIC_LSTM:
            entry = known.get(node.name, {})
            out.append(RecurrentLayer(node, entry.get("layer", node.name), list(entry.get("quantizers", []))))
    return out
