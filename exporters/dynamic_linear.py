"""ONNX for a Linear with dynamic int8 activations: the pattern onnxruntime fuses into
``DynamicQuantizeMatMul``.

::

    x -> DynamicQuantizeLinear -> (x codes uint8, x scale, x zero point)
    MatMulInteger(x codes, W codes int8 (K, N), x zero point, W zero point 0)
      -> Cast(float) -> Mul(., Mul(x scale, W scale)) -> Add(., bias)

This is what onnxruntime's ``quantize_dynamic`` writes for a MatMul, and exactly the chain its
``MatMulIntegerToFloatFusion`` (``matmul_integer_to_float.cc``: MatMulInteger -> Cast -> Mul whose other input
is a Mul of the two scales, then an Add of a constant 1-D bias) and ``DynamicQuantizeMatMulFusion``
(``dynamic_quantize_matmul_fusion.cc``: the ``DynamicQuantizeLinear`` feeding only that node, constant weight
codes and scale) match. Each layer gets its own ``DynamicQuantizeLinear``, so q/k/v projections of one tensor
each fuse into a ``DynamicQuantizeMatMul`` (which quantizes its input itself).

The layer builds the pattern itself (:mod:`quantcli.nn.dynamic`: ``DynamicLinearFunction.symbolic``); the
weight codes are emitted as ``QuantizeLinear(Transpose(W))``, and :mod:`exporters.fold` stores them as an int8
initializer.

:func:`dynamic_quantizer_map` adds the dynamic quantizers to the quantizer map in ``metadata_props``:
the ``DynamicQuantizeLinear`` codes output -> the input quantizer, the weight codes -> the weight quantizer.
:func:`dynamic_layers` reads the pattern back (verify, inspect).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from exporters.graph import initializer_map, name_scopes, producer_map, scope_module_path
from quantcli.nn.tensor_quantizer import quantizer_name

__all__ = ["DynamicLayer", "dynamic_layers", "dynamic_quantizer_map"]


# ------------------------------------------------------------------------------------------- reading graphs


@dataclass
class DynamicLayer:
    """One ``DynamicQuantizeLinear -> MatMulInteger`` layer of an exported graph."""

    node: str  # the MatMulInteger node
    input: str  # the float tensor DynamicQuantizeLinear reads
    codes: str  # its uint8 codes output
    scale: str  # its float scale output
    zero_point: str  # its uint8 zero point output
    weight: str  # the weight codes (an int8 initializer when stored quantized)
    weight_scale: np.ndarray | None  # float32, (N,) or scalar; None when not a constant
    weight_zero_point: np.ndarray | None
    output: str  # the layer's float output (after the scale Mul, and the bias Add if there is one)
    input_quantizer: str | None = None
    weight_quantizer: str | None = None


def dynamic_layers(model: onnx.ModelProto) -> list[DynamicLayer]:
    """Every MatMulInteger fed by a DynamicQuantizeLinear, with the tensors verify and inspect need."""
    from exporters.graph import consumer_map, quantizer_map, to_numpy

    g = model.graph
    inits = initializer_map(g)
    producers = producer_map(g)
    consumers = consumer_map(model)
    qmap = quantizer_map(model)
    layers = []
    for n in g.node:
        if n.op_type != "MatMulInteger":
            continue
        dql = producers.get(n.input[0])
        if dql is None or dql.op_type != "DynamicQuantizeLinear":
            continue
        w_scale = w_zp = None
        out = n.output[0]
        cast = _only(consumers, out, "Cast")
        if cast is not None:
            mul = _only(consumers, cast.output[0], "Mul")
            if mul is not None:
                out = mul.output[0]
                other = mul.input[1] if mul.input[0] == cast.output[0] else mul.input[0]
                sm = producers.get(other)
                if sm is not None and sm.op_type == "Mul":
                    s_name = sm.input[1] if sm.input[0] == dql.output[1] else sm.input[0]
                    if s_name in inits:
                        w_scale = to_numpy(inits[s_name]).astype(np.float32)
                add = _only(consumers, out, "Add")
                if add is not None:
                    out = add.output[0]
        if len(n.input) > 3 and n.input[3] in inits:
            w_zp = to_numpy(inits[n.input[3]])
        layers.append(
            DynamicLayer(
                n.name,
                dql.input[0],
                dql.output[0],
                dql.output[1],
                dql.output[2],
                n.input[1],
                w_scale,
                w_zp,
                out,
                qmap.get(dql.output[0]),
                qmap.get(n.input[1]),
            )
        )
    return layers


def _only(consumers, tensor: str, op_type: str) -> onnx.NodeProto | None:
    c = consumers.get(tensor, [])
    return c[0] if len(c) == 1 and c[0].op_type == op_type else None


def dynamic_quantizer_map(
    model: onnx.ModelProto, quantizer_names, weight_codes_shapes=None
) -> dict[str, str]:
    """Quantizer map entries for the dynamic layers: codes output -> input quantizer, weight codes -> weight
    quantizer. The layer's module is found from the MatMulInteger's node scope
    (``/layers.0/attention/query/...``) or, for the dynamo exporter, its name-scope metadata.

    ``weight_codes_shapes`` (module -> the ``(K, N)`` shape its weight codes are stored in) tells apart the
    layers one scope holds: ``nn.MultiheadAttention`` computes its ``out_proj`` inside its own forward, so the
    dynamo exporter scopes both of its products to the attention module; the product whose codes are not that
    module's shape is the one of its submodules whose shape they are."""
    known = set(quantizer_names)
    nodes = {n.name: n for n in model.graph.node}
    inits = initializer_map(model.graph)
    shapes = weight_codes_shapes or {}
    out = {}
    taken: set[str] = set()
    found = [(layer, _module_of(nodes[layer.node], known)) for layer in dynamic_layers(model)]
    unplaced = []
    for layer, module in found:
        codes = tuple(inits[layer.weight].dims) if layer.weight in inits else None
        if module is not None and (codes is None or shapes.get(module, codes) == codes):
            taken.add(module)
            out[layer.codes] = quantizer_name(module, "input_quantizer")
            out[layer.weight] = quantizer_name(module, "weight_quantizer")
        elif module is not None:
            unplaced.append((layer, module, codes))
    for layer, scope, codes in unplaced:
        inside = [
            m
            for m, shape in shapes.items()
            if m.startswith(f"{scope}.")
            and shape == codes
            and m not in taken
            and quantizer_name(m, "input_quantizer") in known
        ]
        if len(inside) == 1:
            taken.add(inside[0])
            out[layer.codes] = quantizer_name(inside[0], "input_quantizer")
            out[layer.weight] = quantizer_name(inside[0], "weight_quantizer")
    return out


def _module_of(node: onnx.NodeProto, known: set[str]) -> str | None:
    """The module whose ``input_quantizer`` (a name in ``known``) the layer node belongs to: the dynamo name
    scopes, else the TorchScript node scope with Sequential/ModuleList children resolved, else its enclosing
    modules outward."""

    def has_input_quantizer(module: str) -> bool:
        return quantizer_name(module, "input_quantizer") in known

    hits = [s for s in name_scopes(node) if has_input_quantizer(s)]
    if hits:
        return hits[-1]
    parts = node.name.strip("/").split("/")
    for cut in range(len(parts) - 1, -1, -1):
        for module in (".".join(parts[:cut]), scope_module_path(parts[:cut])):
            if has_input_quantizer(module):
                return module
    return None
