"""What onnxruntime's default session does to quantcli's Q/DQ graphs beyond fusing them: the optimizer passes
that mis-handle float8 and the graph form that avoids them, and the session options a graph needs in
onnxruntime to compute what it computes with optimizations off (:func:`session_needs`).

onnxruntime's default session (``ORT_ENABLE_ALL``, checked against 1.31) runs three passes written for integer
Q/DQ that match float8 Q/DQ too (sources in microsoft/onnxruntime,
``onnxruntime/core/optimizer/qdq_transformer/``):

* ``QDQSelectorActionTransformer`` (``selectors_actions/qdq_selectors.cc``): the Gemm and MatMul selectors
  check for int8/int16/int4 but not float8, so ``DQ -> Gemm [-> Q]`` becomes ``QGemm`` and ``DQ -> MatMul``
  becomes ``MatMulIntegerToFloat`` (``QLinearMatMul``, ``QLinearConv`` with an output Q). Those kernels have
  no float8
  type: the session fails to load (onnxruntime #22269). A Gemm's float bias does not stop it when a Q follows:
  ``WeightBiasQuantization`` first turns the bias into an int32 DequantizeLinear (and changes its value).
* ``ReluQuantRewrite`` (``relu_quantizelinear.cc``) deletes a Relu whose only consumer is a QuantizeLinear
  unless the zero point is int8 other than -128 or uint8 other than 0. A float8 zero point passes that test,
  so the Relu disappears and negative values reach the signed E4M3 grid: the model loads and computes
  something else (digits_cnn: 5% top-1 agreement with the fake-quant model).
* ``WeightBiasQuantization``: above.

* ``QDQPropagationTransformer`` moves a Q backwards through Transpose/Reshape/... and the drop-Q/DQ rules of
  ``QDQSelectorActionTransformer`` then run that op on the codes: a Transpose has no float8 kernel either
  (text_encoder: fails to load even when every DQ is guarded).

The guarded form: an exact identity, ``Max(x, -inf)``, after every float8 activation DequantizeLinear and
before every float8 activation QuantizeLinear. No selector sees a DequantizeLinear feeding an op, no rewrite
or propagation sees an op feeding a Q, so the graph loads with default options and computes what it computes
with optimizations off, bit for bit (``Max`` with -inf passes NaN and infinities through). It costs one
elementwise pass per guard; float8 has no integer kernel in onnxruntime's CPU provider, so nothing fusable is
lost. TensorRT wants a DequantizeLinear directly before the op it runs in FP8, so the guards are for graphs
meant for onnxruntime.

Blocked (int4) weight-only graphs load and fuse into ``MatMulNBits``, whose default accuracy level
(``session.qdq_matmulnbits_accuracy_level`` = 4) quantizes the activations to int8 on the fly: text_encoder's
logits move by up to 0.016 (of 2.8) against the optimizations-off graph; accuracy level 1 (float32) leaves
1e-6. That is a speed/precision choice, not a bug: :func:`session_needs` asks for level 1 only with
``exact=True``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from exporters.graph import consumer_map, initializer_map, producer_map

FP8_TYPES = frozenset(
    {
        onnx.TensorProto.FLOAT8E4M3FN,
        onnx.TensorProto.FLOAT8E4M3FNUZ,
        onnx.TensorProto.FLOAT8E5M2,
        onnx.TensorProto.FLOAT8E5M2FNUZ,
    }
)
GUARD_OP = "Max"
GUARD_CONSTANT = "quantcli_fp8_guard_neg_inf"
GUARD_SUFFIX = "/fp8_guard"
# the passes an unguarded float8 graph must be loaded without (names as onnxruntime registers them)
FP8_UNSAFE_OPTIMIZERS = ("QDQSelectorActionTransformer", "ReluQuantRewrite", "WeightBiasQuantization")


def _is_fp8_dq(n: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> bool:
    """A DequantizeLinear of float8 codes (its zero point's type, or its stored codes' type)."""
    if n.op_type != "DequantizeLinear":
        return False
    for name in (n.input[2] if len(n.input) > 2 else "", n.input[0]):
        if name in inits:
            return inits[name].data_type in FP8_TYPES
    return False


def _is_fp8_q(n: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> bool:
    if n.op_type != "QuantizeLinear":
        return False
    if len(n.input) > 2 and n.input[2]:
        return n.input[2] in inits and inits[n.input[2]].data_type in FP8_TYPES
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    return attrs.get("output_dtype") in FP8_TYPES


def is_guard(n: onnx.NodeProto) -> bool:
    """A node this module inserted (``Max(x, -inf)``)."""
    return n.op_type == GUARD_OP and len(n.input) == 2 and n.input[1] == GUARD_CONSTANT


@dataclass
class Fp8Exposure:
    """Where an unguarded graph meets the passes above: node names, one list per pattern."""

    dq_feeding_ops: list[str] = field(default_factory=list)  # float8 activation DQ read directly by an op
    q_after_ops: list[str] = field(default_factory=list)  # float8 Q reading an op's output directly
    relu_into_q: list[str] = field(default_factory=list)  # the subset of q_after_ops whose op is a Relu

    def __bool__(self) -> bool:
        return bool(self.dq_feeding_ops or self.q_after_ops)


def fp8_exposure(model: onnx.ModelProto) -> Fp8Exposure:
    """The float8 patterns of ``model`` that onnxruntime's default optimizer breaks (empty: none, or
    guarded)."""
    g = model.graph
    inits = initializer_map(g)
    producers = producer_map(g)
    consumers = consumer_map(model)
    out = Fp8Exposure()
    for n in g.node:
        if _is_fp8_dq(n, inits) and n.input[0] not in inits:  # activation: codes computed at run time
            if any(not is_guard(c) for c in consumers.get(n.output[0], [])):
                out.dq_feeding_ops.append(n.name or n.output[0])
        if _is_fp8_q(n, inits):
            p = producers.get(n.input[0])
            if p is not None and not is_guard(p):
                out.q_after_ops.append(n.name or n.output[0])
                if p.op_type == "Relu":
                    out.relu_into_q.append(n.name or n.output[0])
    return out


def guard_fp8(model: onnx.ModelProto) -> int:
    """Insert the guards (see the module docstring) in place; returns how many were inserted.

    Idempotent: guarded places are not guarded twice. The DequantizeLinear outputs keep their names, so the
    quantizer map in ``metadata_props`` still names every pair.
    """
    g = model.graph
    inits = initializer_map(g)
    producers = producer_map(g)
    consumers = consumer_map(model)
    taken = {o for n in g.node for o in n.output} | set(inits) | {i.name for i in g.input}

    def fresh(base: str) -> str:
        name, k = base, 0
        while name in taken:
            k += 1
            name = f"{base}_{k}"
        taken.add(name)
        return name

    before: dict[int, list[onnx.NodeProto]] = {}  # id(node) -> guards to place just before it
    after: dict[int, list[onnx.NodeProto]] = {}  # id(node) -> guards to place just after it
    count = 0
    for n in list(g.node):
        if _is_fp8_dq(n, inits) and n.input[0] not in inits:
            readers = [c for c in consumers.get(n.output[0], []) if not is_guard(c)]
            if readers:
                out = fresh(n.output[0] + "_guarded")
                after.setdefault(id(n), []).append(
                    helper.make_node(
                        GUARD_OP, [n.output[0], GUARD_CONSTANT], [out], name=(n.name or out) + GUARD_SUFFIX
                    )
                )
                for c in readers:
                    for k, i in enumerate(c.input):
                        if i == n.output[0]:
                            c.input[k] = out
                count += 1
        if _is_fp8_q(n, inits):
            p = producers.get(n.input[0])
            if p is not None and not is_guard(p):
                out = fresh(n.input[0] + "_guarded")
                before.setdefault(id(n), []).append(
                    helper.make_node(
                        GUARD_OP, [n.input[0], GUARD_CONSTANT], [out], name=(n.name or out) + GUARD_SUFFIX
                    )
                )
                n.input[0] = out
                count += 1
    if not count:
        return 0
    nodes = []
    for n in g.node:
        nodes.extend(before.get(id(n), []))
        nodes.append(n)
        nodes.extend(after.get(id(n), []))
    del g.node[:]
    g.node.extend(nodes)
    if GUARD_CONSTANT not in inits:
        g.initializer.append(numpy_helper.from_array(np.array(-np.inf, dtype=np.float32), GUARD_CONSTANT))
    return count


def unguard_fp8(model: onnx.ModelProto) -> int:
    """Remove the guards in place (the form TensorRT fuses); returns how many were removed."""
    g = model.graph
    alias = {n.output[0]: n.input[0] for n in g.node if is_guard(n)}
    if not alias:
        return 0
    keep = [n for n in g.node if not is_guard(n)]
    for n in keep:
        for k, i in enumerate(n.input):
            n.input[k] = alias.get(i, i)
    del g.node[:]
    g.node.extend(keep)
    left = [t for t in g.initializer if t.name != GUARD_CONSTANT]
    del g.initializer[:]
    g.initializer.extend(left)
    return len(alias)


@dataclass(frozen=True)
class SessionNeeds:
    """What an onnxruntime session needs to load a graph and compute what it computes with optimizations off.

    ``disabled_optimizers`` goes to ``onnxruntime.InferenceSession(..., disabled_optimizers=...)``; empty when
    the default options are right. ``reasons``: one line per need.
    """

    disabled_optimizers: tuple[str, ...] = ()
    config_entries: tuple[tuple[str, str], ...] = ()  # SessionOptions.add_session_config_entry(key, value)
    reasons: tuple[str, ...] = ()

    def session_kwargs(self) -> dict:
        """Keyword arguments for ``onnxruntime.InferenceSession``."""
        return {"disabled_optimizers": list(self.disabled_optimizers)} if self.disabled_optimizers else {}

    def configure(self, so) -> None:
        """Add the config entries to an ``onnxruntime.SessionOptions``."""
        for key, value in self.config_entries:
            so.add_session_config_entry(key, value)

    def __bool__(self) -> bool:
        return bool(self.disabled_optimizers or self.config_entries)


MATMULNBITS_ACCURACY = ("session.qdq_matmulnbits_accuracy_level", "1")  # float32 activations in MatMulNBits
_BLOCKED_TYPES = frozenset({onnx.TensorProto.INT4, onnx.TensorProto.UINT4})


def _matmulnbits_candidates(model: onnx.ModelProto) -> int:
    """Weight DequantizeLinear (int4, or blocked) read by a MatMul/Gemm: what becomes MatMulNBits."""
    g = model.graph
    inits = initializer_map(g)
    consumers = consumer_map(model)
    count = 0
    for n in g.node:
        if n.op_type != "DequantizeLinear" or n.input[0] not in inits:
            continue
        blocked = any(a.name == "block_size" and a.i > 0 for a in n.attribute)
        if not blocked and inits[n.input[0]].data_type not in _BLOCKED_TYPES:
            continue
        reads, seen = list(consumers.get(n.output[0], [])), set()
        while reads:
            c = reads.pop()
            if id(c) in seen:
                continue
            seen.add(id(c))
            if c.op_type in ("MatMul", "Gemm"):
                count += 1
                break
            if c.op_type in ("Transpose", "Reshape"):
                reads.extend(consumers.get(c.output[0], []))
    return count


def session_needs(model: onnx.ModelProto, exact: bool = False) -> SessionNeeds:
    """The session options ``model`` needs in onnxruntime (see the module docstring for why).

    Without ``exact``: what it needs to load and compute the graph's own function (float8 graphs without
    guards). With ``exact``: also what makes the results equal the optimizations-off graph's up to float
    rounding (MatMulNBits at accuracy level 1, float32).
    """
    exp = fp8_exposure(model)
    entries, reasons = [], []
    if exact:
        n = _matmulnbits_candidates(model)
        if n:
            entries.append(MATMULNBITS_ACCURACY)
            reasons.append(
                f"{n} weight-only MatMul become MatMulNBits, which by default quantizes its "
                f"activations "
                "to int8 (accuracy level 4); level 1 keeps them float32"
            )
    if not exp:
        return SessionNeeds((), tuple(entries), tuple(reasons))
    if exp.dq_feeding_ops:
        reasons.append(
            f"{len(exp.dq_feeding_ops)} float8 DequantizeLinear feed ops directly: onnxruntime "
            f"would fuse "
            "them into integer kernels that have no float8 type and fail to load (onnxruntime "
            "#22269)"
        )
    if exp.relu_into_q:
        reasons.append(
            f"{len(exp.relu_into_q)} Relu feed a float8 QuantizeLinear: onnxruntime's "
            f"ReluQuantRewrite "
            "would delete them and change the results"
        )
    if len(exp.q_after_ops) > len(exp.relu_into_q):
        reasons.append(
            f"{len(exp.q_after_ops) - len(exp.relu_into_q)} float8 QuantizeLinear read an op's "
            f"output: "
            "onnxruntime may move them across data-movement ops that have no float8 kernel"
        )
    return SessionNeeds(FP8_UNSAFE_OPTIMIZERS, tuple(entries), tuple(reasons))
