"""Causal self-attention over a KV cache, as plain ops or as onnxruntime's ``GroupQueryAttention``.

Both forms take the new tokens' query/key/value projections and the cache of earlier positions
``[batch, kv_heads, past, head_size]``, and return the attention output and the cache extended by the new keys
and values (``present``, ``[batch, kv_heads, past + seq, head_size]``): key/value heads only, each serving
``heads / kv_heads`` query heads (grouped-query attention is never expanded, in the cache or in the matmuls).
Keys are stored after the rotary embedding, as transformers and onnxruntime-genai store them.

* :func:`plain_attention` writes standard ONNX ops: rotary embedding from ``position_ids``, ``Concat`` onto
  the cache, a 5-D ``MatMul`` that reads each key/value head once for its group of query heads, an additive
  mask built from ``attention_mask`` (causal, and padded positions masked: any padding, left or right).
* :func:`fused_attention` calls the custom op ``quantcli::group_query_attention`` whose eager kernel is the
  same arithmetic and whose ONNX form is one ``com.microsoft.GroupQueryAttention`` node (rotary inside, from
  cos/sin caches). Its contract is onnxruntime's: positions are ``past + 0..seq-1`` for every row (no left
  padding), and a batch larger than one with a cache can only add one token at a time (onnxruntime:
  "batch_size must be 1 when sequence_length > 1 and past context is given").

:func:`register_torchscript` adds the op's TorchScript translation; :func:`dynamo_translations` gives the
dynamo exporter's.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from exporters.causal_lm import kv_cache

MASKED = (
    -1e9
)  # additive mask of a position that must not be attended (finite: a fully padded row stays finite)
MS_DOMAIN = "com.microsoft"
GQA = "GroupQueryAttention"
_registered = False


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, non-interleaved halves (transformers' ``apply_rotary_pos_emb``);
    ``x`` ``[b, h, s, d]``, ``cos``/``sin`` ``[b, s, d]``."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def rotary_tables(inv_freq: torch.Tensor, positions: torch.Tensor, scaling: float = 1.0):
    """``cos``, ``sin`` ``[..., head_size]`` of integer ``positions`` (both halves), times ``scaling``."""
    freqs = positions[..., None].to(torch.float32) * inv_freq.to(torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def _grouped_attention(q, k, v, bias, scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale + bias) v`` with ``q`` ``[b, h, s, d]`` and ``k``/``v`` ``[b, kv, t, d]``:
    query heads grouped ``[b, kv, h/kv, s, d]`` against their shared key/value head. ``bias``
    ``[b, 1, 1, s, t]``. Returns ``[b, s, h * d]``."""
    h, kv = q.shape[1], k.shape[1]
    # no batch or sequence sizes in the reshapes: a traced size could be recorded as a constant
    q5 = q.unflatten(1, (kv, h // kv))
    scores = torch.matmul(q5, k.unsqueeze(2).transpose(-1, -2)) * scale + bias
    ctx = torch.matmul(torch.softmax(scores, dim=-1), v.unsqueeze(2))  # [b, kv, g, s, d]
    return ctx.flatten(1, 2).transpose(1, 2).flatten(2)


def causal_bias(attention_mask: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Additive mask ``[b, 1, 1, seq, total]`` for the ``seq`` new tokens of ``input_ids`` ``[b, seq]`` at
    the end of the ``total`` positions of ``attention_mask`` ``[b, total]``: 0 where a query may attend a key
    (the key is not later than the query and not padding), else :data:`MASKED`."""
    total, seq = attention_mask.shape[1], input_ids.shape[1]
    keys = torch.arange(total, device=attention_mask.device)
    queries = torch.arange(seq, device=attention_mask.device) + (total - seq)
    allowed = (keys[None, :] <= queries[:, None])[None] & (attention_mask[:, None, :] > 0)
    zero = torch.zeros((), dtype=torch.float32)
    return torch.where(allowed, zero, torch.full((), MASKED))[:, None, None]


def plain_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    bias: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    scale: float,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[b, h, s, d]`` over ``past`` + the new ``k``/``v`` ``[b, kv, s, d]``; ``bias``:
    :func:`causal_bias`; ``rope``: the new positions' ``(cos, sin)`` ``[b, s, d]`` or None. Returns (output
    ``[b, s, h * d]``, present key, value). ``kv_scales``: ``(k_scale, v_scale)`` of an int8 cache
    (:mod:`exporters.causal_lm.kv_cache`): ``past`` and ``present`` hold int8 codes, the new keys (after the
    rotary embedding) and values are quantized, and attention reads every position dequantized."""
    if rope is not None:
        q, k = rotary(q, *rope), rotary(k, *rope)
    if kv_scales is not None:
        ks, vs = kv_scales
        key = torch.cat((past_key, kv_cache.quantize(k, ks)), dim=2)
        value = torch.cat((past_value, kv_cache.quantize(v, vs)), dim=2)
        out = _grouped_attention(q, kv_cache.dequantize(key, ks), kv_cache.dequantize(value, vs), bias, scale)
        return out, key, value
    key = torch.cat((past_key, k), dim=2)
    value = torch.cat((past_value, v), dim=2)
    out = _grouped_attention(q, key, value, bias, scale)
    return out, key, value


# ---------------------------------------------------------------- onnxruntime's GroupQueryAttention


@torch.library.custom_op("quantcli::group_query_attention", mutates_args=())
def group_query_attention(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    seqlens_k: torch.Tensor,
    total_sequence_length: torch.Tensor,
    cos_cache: torch.Tensor | None,
    sin_cache: torch.Tensor | None,
    num_heads: int,
    kv_num_heads: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """onnxruntime's ``com.microsoft.GroupQueryAttention`` (CPU provider, rotary non-interleaved), in float32.

    ``query`` ``[b, s, h*d]`` (or q, k and v packed ``[b, s, (h + 2 kv) * d]`` when ``key`` is None);
    ``seqlens_k`` int32 ``[b]``: valid positions - 1 per row, past and new; ``cos_cache``/``sin_cache``
    ``[max_positions, d / 2]`` or None (no rotary). The new tokens sit at positions ``past + 0..s-1``.
    ``k_scale``/``v_scale``: an int8 cache (``[1]`` per tensor, ``[1, kv, 1, d]`` per channel; int8
    ``past``/``present``)."""
    b, s, _ = query.shape
    kv = kv_num_heads
    d = past_key.shape[-1]
    if key is None:
        query, key, value = torch.split(query, [num_heads * d, kv * d, kv * d], dim=-1)
    q = query.unflatten(-1, (num_heads, d)).transpose(1, 2)
    k = key.unflatten(-1, (kv, d)).transpose(1, 2)
    v = value.unflatten(-1, (kv, d)).transpose(1, 2)
    past = past_key.shape[2]
    rope = None
    if cos_cache is not None:
        pos = (torch.arange(s) + past)[None].expand(b, s)
        rope = (torch.cat((cos_cache, cos_cache), -1)[pos], torch.cat((sin_cache, sin_cache), -1)[pos])
    # valid keys: the first seqlens_k + 1 positions of each row (onnxruntime's right padding)
    mask = (torch.arange(past + s)[None, :] <= seqlens_k.to(torch.int64)[:, None]).to(torch.int64)
    bias = causal_bias(mask, query[..., 0])
    kv_scales = (k_scale, v_scale) if k_scale is not None else None
    return plain_attention(q, k, v, past_key, past_value, bias, rope, scale, kv_scales)


@group_query_attention.register_fake
def _gqa_fake(
    query,
    key,
    value,
    past_key,
    past_value,
    seqlens_k,
    total,
    cos,
    sin,
    num_heads,
    kv_num_heads,
    scale,
    k_scale=None,
    v_scale=None,
):
    b, s, _ = query.shape
    d = past_key.shape[-1]
    present = past_key.new_empty((b, kv_num_heads, past_key.shape[2] + s, d))
    return query.new_empty((b, s, num_heads * d)), present, torch.empty_like(present)


def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    attention_mask: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor] | None,
    num_heads: int,
    scale: float,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`plain_attention`'s result through ``GroupQueryAttention``: ``q``/``k``/``v`` ``[b, s, heads *
    d]`` (``k``/``v`` None: packed in ``q``), ``caches``: ``(cos, sin)`` ``[max_positions, d / 2]`` or
    None; ``kv_scales``: an int8 cache's ``(k_scale, v_scale)`` in onnxruntime's shapes."""
    seqlens = (attention_mask.sum(dim=-1) - 1).to(torch.int32)
    # Shape -> Gather -> Cast in both exporters' graphs (the length of the mask, not a traced constant)
    total = torch.tensor(attention_mask.shape[1], dtype=torch.int32)
    cos, sin = caches if caches is not None else (None, None)
    ks, vs = kv_scales if kv_scales is not None else (None, None)
    return torch.ops.quantcli.group_query_attention(
        q, k, v, past_key, past_value, seqlens, total, cos, sin, num_heads, past_key.shape[1], scale, ks, vs
    )


def _quant_type(k_scale_numel: int) -> str:
    """onnxruntime's ``k_quant_type`` of a cache scale with this many elements."""
    return "PER_TENSOR" if k_scale_numel == 1 else "PER_CHANNEL"


KV_SCALE_INPUT = 12  # k_scale's input index (then v_scale); 9-11: position_ids, attention_bias, head_sink


def _gqa_symbolic(
    g,
    query,
    key,
    value,
    past_key,
    past_value,
    seqlens_k,
    total,
    cos,
    sin,
    num_heads,
    kv_heads,
    scale,
    k_scale=None,
    v_scale=None,
):
    from torch.onnx import symbolic_helper as sh

    def optional(x):
        return x if x is not None and not sh._is_none(x) else sh._optional_input_placeholder_tensor(g)

    attrs = {
        "num_heads_i": sh._get_const(num_heads, "i", "num_heads"),
        "kv_num_heads_i": sh._get_const(kv_heads, "i", "kv_num_heads"),
        "scale_f": sh._get_const(scale, "f", "scale"),
        "do_rotary_i": 0 if sh._is_none(cos) else 1,
    }
    inputs = [query, optional(key), optional(value), past_key, past_value, seqlens_k, total]
    quantized = k_scale is not None and not sh._is_none(k_scale)
    if not sh._is_none(cos) or quantized:
        inputs += [optional(cos), optional(sin)]
    if quantized:
        inputs += [optional(None)] * (KV_SCALE_INPUT - len(inputs)) + [k_scale, v_scale]
        numel = int(sh._maybe_get_const(k_scale, "t").numel())
        attrs.update(
            k_quant_type_s=_quant_type(numel), v_quant_type_s=_quant_type(numel), kv_cache_bit_width_i=8
        )
    return g.op(f"{MS_DOMAIN}::GroupQueryAttention", *inputs, outputs=3, **attrs)


def register_torchscript() -> None:
    """The TorchScript exporter's translation of ``quantcli::group_query_attention`` (once per process)."""
    global _registered
    if not _registered:
        _register_schema()  # so that onnx.checker checks the node it writes
        torch.onnx.register_custom_op_symbolic("quantcli::group_query_attention", _gqa_symbolic, 1)
        _registered = True


def _register_schema() -> None:
    """``com.microsoft.GroupQueryAttention`` in onnx's schema registry (the dynamo exporter's onnxscript
    builds nodes from schemas; onnx ships none for onnxruntime's contrib ops). Inputs, outputs and attributes
    as onnxruntime's ``contrib_defs`` declare the ones this module uses; once per process."""
    from onnx import defs

    if defs.has(GQA, MS_DOMAIN):
        return
    P = defs.OpSchema.FormalParameter
    opt = defs.OpSchema.FormalParameterOption.Optional
    attr = defs.OpSchema.Attribute
    types = defs.OpSchema.AttrType
    schema = defs.OpSchema(
        GQA,
        MS_DOMAIN,
        1,
        inputs=[
            P("query", "T"),
            P("key", "T", param_option=opt),
            P("value", "T", param_option=opt),
            P("past_key", "C", param_option=opt),
            P("past_value", "C", param_option=opt),
            P("seqlens_k", "M"),
            P("total_sequence_length", "M"),
            P("cos_cache", "T", param_option=opt),
            P("sin_cache", "T", param_option=opt),
            P("position_ids", "I", param_option=opt),
            P("attention_bias", "T", param_option=opt),
            P("head_sink", "T", param_option=opt),
            P("k_scale", "S", param_option=opt),
            P("v_scale", "S", param_option=opt),
        ],
        outputs=[P("output", "T"), P("present_key", "C"), P("present_value", "C")],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)"], ""),
            ("C", ["tensor(float)", "tensor(float16)", "tensor(int8)"], ""),
            ("M", ["tensor(int32)"], ""),
            ("I", ["tensor(int64)"], ""),
            ("S", ["tensor(float)"], ""),
        ],
        attributes=[
            attr("num_heads", types.INT, required=True),
            attr("kv_num_heads", types.INT, required=True),
            attr("scale", types.FLOAT, required=False),
            attr("do_rotary", types.INT, required=False),
            attr("k_quant_type", types.STRING, required=False),
            attr("v_quant_type", types.STRING, required=False),
            attr("kv_cache_bit_width", types.INT, required=False),
        ],
    )
    defs.register_schema(schema)


def dynamo_translations() -> dict:
    """The dynamo exporter's translation of ``quantcli::group_query_attention``."""
    from onnxscript.values import Opset

    _register_schema()
    ms = Opset(MS_DOMAIN, 1)

    def gqa_onnx(
        query,
        key,
        value,
        past_key,
        past_value,
        seqlens_k,
        total,
        cos,
        sin,
        num_heads: int,
        kv_num_heads: int,
        scale: float,
        k_scale=None,
        v_scale=None,
    ):
        if k_scale is None:
            return ms.GroupQueryAttention(
                query,
                key,
                value,
                past_key,
                past_value,
                seqlens_k,
                total,
                cos,
                sin,
                num_heads=num_heads,
                kv_num_heads=kv_num_heads,
                scale=scale,
                do_rotary=0 if cos is None else 1,
            )
        numel = 1
        for d in k_scale.shape:
            numel *= int(d)
        return ms.GroupQueryAttention(
            query,
            key,
            value,
            past_key,
            past_value,
            seqlens_k,
            total,
            cos,
            sin,
            None,
            None,
            None,
            k_scale,
            v_scale,
            num_heads=num_heads,
            kv_num_heads=kv_num_heads,
            scale=scale,
            do_rotary=0 if cos is None else 1,
            k_quant_type=_quant_type(numel),
            v_quant_type=_quant_type(numel),
            kv_cache_bit_width=8,
        )

    return {torch.ops.quantcli.group_query_attention.default: gqa_onnx}


def total_length_from_shape(onnx_model) -> int:
    """Give each ``GroupQueryAttention`` its ``total_sequence_length`` as ``Cast(Shape(attention_mask,
    start=1, end=2))``, in place: the exporters write the length as ``Shape -> Gather`` (TorchScript) or
    ``Shape -> Squeeze`` (dynamo) before the ``Cast``, a node more per step (onnxruntime's kernel reads the
    one-element tensor as it reads a scalar). Opset 15 or later (Shape's ``start``/``end``). Returns how many
    chains were shortened; the nodes left unread are removed."""
    from onnx import helper, numpy_helper

    g = onnx_model.graph
    if next((o.version for o in onnx_model.opset_import if o.domain in ("", "ai.onnx")), 0) < 15:
        return 0  # Shape's start and end came in opset 15
    producers = {o: n for n in g.node for o in n.output}
    consts = {t.name: numpy_helper.to_array(t) for t in g.initializer if not t.dims or list(t.dims) == [1]}
    for n in g.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    done = 0
    for gqa in [n for n in g.node if n.op_type == GQA and n.domain == MS_DOMAIN and len(n.input) > 6]:
        cast = producers.get(gqa.input[6])
        pick = producers.get(cast.input[0]) if cast is not None and cast.op_type == "Cast" else None
        shape = producers.get(pick.input[0]) if pick is not None else None
        if shape is None or shape.op_type != "Shape":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in shape.attribute}
        if pick.op_type == "Gather" and not attrs and pick.input[1] in consts:
            if int(np.asarray(consts[pick.input[1]]).reshape(-1)[0]) != 1 or consts[pick.input[1]].ndim:
                continue
        elif not (pick.op_type == "Squeeze" and attrs.get("start") == 1 and attrs.get("end") == 2):
            continue
        length = f"{shape.input[0]}_length"
        if length not in producers:
            node = helper.make_node(
                "Shape", [shape.input[0]], [length], name=f"{length}/Shape", start=1, end=2
            )
            g.node.insert(list(g.node).index(shape), node)
            producers[length] = node
        cast.input[0] = length
        done += 1
    _drop_unread(g)
    return done


def _drop_unread(g) -> None:
    """Remove nodes whose outputs nothing reads (and that write no graph output), until none is left."""
    outputs = {o.name for o in g.output}
    while True:
        read = {i for n in g.node for i in n.input} | outputs
        dead = [n for n in g.node if not any(o in read for o in n.output if o)]
        if not dead:
            return
        for n in dead:
            g.node.remove(n)


def default_scale(head_size: int) -> float:
    return 1.0 / math.sqrt(head_size)
