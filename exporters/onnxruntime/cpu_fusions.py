"""Keep onnxruntime from forming two CPU fusions whose kernels are slower than the ops they replace.

onnxruntime's level-2 optimizer (1.31, CPU provider) absorbs

- a residual ``Add`` into the ``LayerNormalization`` it feeds: ``SkipLayerNormalization``
  (``onnxruntime/core/optimizer/skip_layer_norm_fusion.cc``; the pattern's first node must be an ``Add``);
- a bias ``Add`` into the GELU it feeds: ``BiasGelu`` (``bias_gelu_fusion.cc``, an ``Add`` again).

Both are slower on CPU than what they replace. ``SkipLayerNormalization``'s kernel
(``onnxruntime/contrib_ops/cpu/skip_layer_norm.cc``) walks each row in plain scalar loops with a division per
element; ``BiasGelu``'s (``contrib_ops/cpu/bert/bias_gelu.cc``) works row by row through a temporary buffer
the size of its output. Measured with onnxruntime's profiler on ``sample_models.structured.deep_encoder`` (6
layers, hidden 384, batch 50 x 35 tokens, 1 thread, AMD EPYC): 6 ``SkipLayerNormalization`` took 20 ms where
the ``Add`` + ``LayerNormalization`` they replace take about 3.5 ms, and 6 ``BiasGelu`` 16-17 ms against about
11 ms for ``Gelu`` plus the bias addition, of a 150-170 ms run (``python -m benchmarks.bench_accuracy`` prints
what the whole graph gains; the README has the figures).

The fix writes those ``Add`` nodes as ``Sum`` with the same two inputs. ``Sum`` of two tensors is the same
IEEE addition with the same (multidirectional) broadcasting, so every value the graph computes as written is
bit-identical (onnxruntime with optimizations off, as ``verify`` runs it for exactness; the deployed session
computes what the unfused ops compute, where before the fused kernels summed in their own order); both fusions
match only an ``Add``, so onnxruntime keeps its ``LayerNormalization``
and ``Gelu`` kernels and runs the addition as an elementwise ``Sum`` (as fast as ``Add`` here).
Applied for the onnxruntime target's CPU provider only (``export --provider cpu``, the default): onnxruntime's
CUDA provider has fast fused kernels for both, and TensorRT fuses residual Adds into its own kernels.
"""

from __future__ import annotations

import onnx

from exporters.graph import consumer_map, producer_map

#: ops that scale a GELU's input before its Erf: torch's exporters write x * 0.5 * (1 + erf(x / sqrt(2)))
# (Div); : other writers multiply by 1 / sqrt(2) (Mul)
_ERF_SCALES = ("Div", "Mul")


def _feeds_layer_norm(name: str, consumers: dict[str, list[onnx.NodeProto]]) -> bool:
    return any(
        c.op_type == "LayerNormalization" and c.domain in ("", "ai.onnx") and c.input[0] == name
        for c in consumers.get(name, [])
    )


def _feeds_gelu(name: str, consumers: dict[str, list[onnx.NodeProto]]) -> bool:
    """``name`` is the input of an Erf-form GELU: it is scaled (Div/Mul) into an ``Erf``."""
    return any(
        c.op_type in _ERF_SCALES and any(e.op_type == "Erf" for e in consumers.get(c.output[0], []))
        for c in consumers.get(name, [])
    )


def _dynamic_bias(n: onnx.NodeProto, producers: dict[str, onnx.NodeProto]) -> bool:
    """``n`` adds the bias of a dynamic int8 layer: one input is ``MatMulInteger -> Cast -> Mul``."""
    for i in n.input:
        mul = producers.get(i)
        if mul is None or mul.op_type != "Mul":
            continue
        for x in mul.input:
            cast = producers.get(x)
            if cast is not None and cast.op_type == "Cast":
                source = producers.get(cast.input[0])
                if source is not None and source.op_type == "MatMulInteger":
                    return True
    return False


def keep_cpu_kernels(model: onnx.ModelProto) -> dict[str, int]:
    """Write as ``Sum`` each two-input ``Add`` that feeds a ``LayerNormalization`` (its input 0), and each
    that adds a bias to a ``MatMul``'s output and feeds an Erf-form GELU; returns how many of each. Values are
    unchanged (see the module docstring).

    A dynamic int8 layer's bias ``Add`` (``MatMulInteger -> Cast -> Mul -> Add``,
    :mod:`exporters.dynamic_linear`) stays an ``Add``: onnxruntime folds it into ``MatMulIntegerToFloat``
    (which needs an ``Add``), after which neither fusion can take it."""
    consumers = consumer_map(model)
    producers = producer_map(model.graph)
    counts = {"skip_layer_norm_avoided": 0, "bias_gelu_avoided": 0}
    for n in model.graph.node:
        if (
            n.op_type != "Add"
            or n.domain not in ("", "ai.onnx")
            or len(n.input) != 2
            or _dynamic_bias(n, producers)
        ):
            continue
        if _feeds_layer_norm(n.output[0], consumers):
            counts["skip_layer_norm_avoided"] += 1
        elif any(
            producers.get(i) is not None and producers[i].op_type == "MatMul" for i in n.input
        ) and _feeds_gelu(n.output[0], consumers):
            counts["bias_gelu_avoided"] += 1
        else:
            continue
        n.op_type = "Sum"
    return counts
