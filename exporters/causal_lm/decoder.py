"""The decode-graph module: a causal LM run on new tokens and a KV cache, ``(logits, present)``.

:class:`DecoderWithCache` holds the LM's own modules under their own names
(``model.layers.0.self_attn.q_proj``:
the quantized layers, their quantizers and the quantizer names are the calibrated checkpoint's) and computes,
for ``seq`` new tokens after ``past`` cached positions::

    input_ids [batch, seq], attention_mask [batch, past + seq], (position_ids [batch, seq]),
    past_key_values.{i}.key / .value [batch, kv_heads, past, head_size]
        -> logits [batch, seq, vocab], present.{i}.key / .value [batch, kv_heads, past + seq, head_size]

One graph serves the prompt (``past`` = 0) and each generated token (``seq`` = 1). Attention is
:mod:`exporters.causal_lm.attention`'s, plain ops or onnxruntime's ``GroupQueryAttention`` (``fused``); with
``skip_norm`` each residual ``Add`` of a Llama-style model and the RMSNorm after it are onnxruntime's
``SkipSimplifiedLayerNormalization`` (:mod:`exporters.causal_lm.norm`); the embeddings, projections and MLPs
(and otherwise the norms) are the model's modules, called as its own forward calls them.
``position_ids`` is an input of the plain form and of learned-position models; ``GroupQueryAttention`` takes
the positions from ``attention_mask`` (as onnxruntime-genai's graphs do).
"""

from __future__ import annotations

import torch
from torch import nn

from exporters.causal_lm.attention import (
    causal_bias,
    default_scale,
    fused_attention,
    plain_attention,
    rotary_tables,
)
from exporters.causal_lm.embeddings import EmbeddingQuant
from exporters.causal_lm.kv_cache import KVCacheQuant
from exporters.causal_lm.layout import DecoderLayout, decoder_layout
from exporters.causal_lm.norm import fusable_norm, skip_rms_norm

FORWARD_INPUTS = ("input_ids", "attention_mask", "position_ids")


def python_name(graph_name: str) -> str:
    """``past_key_values.0.key`` -> ``past_key_values_0_key`` (the forward parameter a graph input is traced
    from)."""
    return graph_name.replace(".", "_")


class _Step:
    """What every layer of one decode step shares: the mask, the new positions' rotary tables, the form."""

    def __init__(
        self,
        attention_mask,
        bias,
        rope,
        caches,
        fused: bool,
        num_heads: int,
        skip_norm: bool = False,
        embedding_table: torch.Tensor | None = None,
    ):
        self.attention_mask, self.bias, self.rope, self.caches = attention_mask, bias, rope, caches
        self.fused, self.num_heads, self.skip_norm = fused, num_heads, skip_norm
        self.embedding_table = embedding_table

    def attend(self, q, k, v, past_key, past_value, scale: float, kv_scales=None):
        """Attention of the new tokens' ``q``/``k``/``v`` ``[b, s, heads * d]`` (``k``, ``v`` None: all three
        packed in ``q``, fused form only): (output, present key, value). ``kv_scales``: the layer's int8
        cache scales (:mod:`exporters.causal_lm.kv_cache`), None for a float cache."""
        if self.fused:
            return fused_attention(
                q,
                k,
                v,
                past_key,
                past_value,
                self.attention_mask,
                self.caches,
                self.num_heads,
                scale,
                kv_scales,
            )
        kv, d = past_key.shape[1], past_key.shape[-1]
        q = q.unflatten(-1, (self.num_heads, d)).transpose(1, 2)
        k = k.unflatten(-1, (kv, d)).transpose(1, 2)
        v = v.unflatten(-1, (kv, d)).transpose(1, 2)
        return plain_attention(q, k, v, past_key, past_value, self.bias, self.rope, scale, kv_scales)


def _embed(embedding: nn.Module, input_ids: torch.Tensor, step: _Step) -> torch.Tensor:
    """The token embedding: the model's module, or the quantized table's rows
    (:mod:`exporters.causal_lm.embeddings`; the export turns that lookup into ``GatherBlockQuantized``)."""
    if step.embedding_table is None:
        return embedding(input_ids)
    return torch.nn.functional.embedding(input_ids, step.embedding_table)


def _scale(attn: nn.Module, head_size: int) -> float:
    return float(getattr(attn, "scaling", None) or default_scale(head_size))


class _CacheScales(nn.Module):
    """A layer's int8 cache scales in onnxruntime's shapes (buffers: constants of the graph)."""

    def __init__(self, k_scale: torch.Tensor, v_scale: torch.Tensor):
        super().__init__()
        self.register_buffer("k_scale", k_scale, persistent=False)
        self.register_buffer("v_scale", v_scale, persistent=False)

    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_scale, self.v_scale


def _cache_scales(module: nn.Module):
    cs = getattr(module, "kv_cache_scales", None)
    return cs.pair() if cs is not None else None


class _LlamaAttention(nn.Module):
    """``self_attn``: the model's q/k/v/o projections around attention over the cache."""

    def __init__(self, src: nn.Module, head_size: int):
        super().__init__()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            self.add_module(name, getattr(src, name))
        self.scale = _scale(src, head_size)

    def forward(self, x, past_key, past_value, step: _Step):
        out, key, value = step.attend(
            self.q_proj(x),
            self.k_proj(x),
            self.v_proj(x),
            past_key,
            past_value,
            self.scale,
            _cache_scales(self),
        )
        return self.o_proj(out), key, value


class _LlamaLayer(nn.Module):
    def __init__(self, src: nn.Module, head_size: int):
        super().__init__()
        self.input_layernorm = src.input_layernorm
        self.self_attn = _LlamaAttention(src.self_attn, head_size)
        self.post_attention_layernorm = src.post_attention_layernorm
        self.mlp = src.mlp

    def forward(self, h, past_key, past_value, step: _Step, x=None, after: nn.Module | None = None):
        """``(h, key, value)``; with ``after`` (skip-norm form) the residual ``Add`` s are fused into the
        RMSNorms that read the sums: it takes the residual stream ``h`` and its normalised form ``x`` and
        returns ``(h, x, key, value)`` for the next layer (``after``: the next layer's input norm, or the
        final norm). The same arithmetic either way."""
        if after is None:
            a, key, value = self.self_attn(self.input_layernorm(h), past_key, past_value, step)
            h = h + a
            return h + self.mlp(self.post_attention_layernorm(h)), key, value
        a, key, value = self.self_attn(x, past_key, past_value, step)
        x, h = skip_rms_norm(h, a, self.post_attention_layernorm)
        x, h = skip_rms_norm(h, self.mlp(x), after)
        return h, x, key, value


class _LlamaBody(nn.Module):
    def __init__(self, src: nn.Module, head_size: int):
        super().__init__()
        self.embed_tokens = src.embed_tokens
        self.layers = nn.ModuleList(_LlamaLayer(layer, head_size) for layer in src.layers)
        self.norm = src.norm

    def forward(self, input_ids, past, step: _Step):
        h = _embed(self.embed_tokens, input_ids, step)
        if step.skip_norm:
            return self._skip_norm_forward(h, past, step)
        present = []
        for i, layer in enumerate(self.layers):
            h, key, value = layer(h, past[2 * i], past[2 * i + 1], step)
            present += [key, value]
        return self.norm(h), present

    def _skip_norm_forward(self, h, past, step: _Step):
        """The layers with each residual ``Add`` fused into the RMSNorm that reads the sum (the next
        sublayer's, or the final norm): the same arithmetic, one node per pair in the graph. Each layer is
        called as a module (the exporters name nodes, and so quantizers, by the module calls)."""
        present = []
        x = self.layers[0].input_layernorm(h)
        for i, layer in enumerate(self.layers):
            after = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            h, x, key, value = layer(h, past[2 * i], past[2 * i + 1], step, x, after)
            present += [key, value]
        return x, present

    def norms(self) -> list[nn.Module]:
        """Every RMSNorm, in order."""
        out = []
        for layer in self.layers:
            out += [layer.input_layernorm, layer.post_attention_layernorm]
        return out + [self.norm]


class _GPT2Attention(nn.Module):
    def __init__(self, src: nn.Module, head_size: int, width: int):
        super().__init__()
        self.c_attn, self.c_proj = src.c_attn, src.c_proj
        self.scale, self.width = _scale(src, head_size), width

    def forward(self, x, past_key, past_value, step: _Step):
        qkv = self.c_attn(x)
        scales = _cache_scales(self)
        if step.fused:  # GroupQueryAttention reads q, k and v packed, as c_attn computes them
            out, key, value = step.attend(qkv, None, None, past_key, past_value, self.scale, scales)
        else:
            q, k, v = qkv.split(self.width, dim=-1)
            out, key, value = step.attend(q, k, v, past_key, past_value, self.scale, scales)
        return self.c_proj(out), key, value


class _GPT2Block(nn.Module):
    def __init__(self, src: nn.Module, head_size: int, width: int):
        super().__init__()
        self.ln_1 = src.ln_1
        self.attn = _GPT2Attention(src.attn, head_size, width)
        self.ln_2 = src.ln_2
        self.mlp = src.mlp

    def forward(self, h, past_key, past_value, step: _Step):
        a, key, value = self.attn(self.ln_1(h), past_key, past_value, step)
        h = h + a
        return h + self.mlp(self.ln_2(h)), key, value


class _GPT2Body(nn.Module):
    def __init__(self, src: nn.Module, head_size: int, width: int):
        super().__init__()
        self.wte, self.wpe = src.wte, src.wpe
        self.h = nn.ModuleList(_GPT2Block(b, head_size, width) for b in src.h)
        self.ln_f = src.ln_f

    def forward(self, input_ids, position_ids, past, step: _Step):
        h = _embed(self.wte, input_ids, step) + self.wpe(position_ids)
        present = []
        for i, block in enumerate(self.h):
            h, key, value = block(h, past[2 * i], past[2 * i + 1], step)
            present += [key, value]
        return self.ln_f(h), present


class DecoderWithCache(nn.Module):
    """A causal LM as one decode step over a KV cache (module docstring). ``fused``: attention as
    ``GroupQueryAttention``; ``skip_norm``: residual ``Add`` + RMSNorm as ``SkipSimplifiedLayerNormalization``
    where every norm of the model computes its arithmetic (:attr:`skip_norm_note` says why not otherwise).

    The module tree mirrors the LM's (``model.layers.0.self_attn.q_proj``) and holds the LM's own modules at
    its leaves, so module paths, quantizer names and the TorchScript exporter's node scopes are the LM's; only
    the containers' forwards differ (they pass the cache). The LM itself is not changed."""

    def __init__(
        self,
        lm: nn.Module,
        fused: bool = False,
        layout: DecoderLayout | None = None,
        skip_norm: bool = False,
        kv_cache: KVCacheQuant | None = None,
        embeddings: EmbeddingQuant | None = None,
    ):
        super().__init__()
        self.layout = lo = layout or decoder_layout(lm)
        self.fused = fused
        self.kv_cache = kv_cache
        self.embeddings = embeddings
        # a quantized table's dequantized rows (None: the model's embedding)
        table = embeddings.table.float().contiguous() if embeddings is not None else None
        self.register_buffer("embedding_table", table, persistent=False)
        self.skip_norm_note = ""
        if lo.family == "gpt2":
            self.transformer = _GPT2Body(lm.transformer, lo.head_size, lo.hidden_size)
            if skip_norm:
                self.skip_norm_note = "GPT-2's LayerNorm: no SkipSimplifiedLayerNormalization (RMSNorm only)"
        else:
            self.model = _LlamaBody(lm.model, lo.head_size)
            if skip_norm:
                why = [w for w in (fusable_norm(n, lo.hidden_size) for n in self.model.norms()) if w]
                self.skip_norm_note = f"residual Add and RMSNorm not fused: {why[0]}" if why else ""
        self.skip_norm = skip_norm and not self.skip_norm_note
        if kv_cache is not None:
            for i, attn in enumerate(self.attention_modules()):
                attn.kv_cache_scales = _CacheScales(*kv_cache.layer_scales(i))
        self.lm_head = lm.lm_head
        self.quantcli_config = getattr(lm, "quantcli_config", None)
        if lo.rotary:
            rot = lm.model.rotary_emb
            self.rope_scaling = float(getattr(rot, "attention_scaling", 1.0))
            self.register_buffer("inv_freq", rot.inv_freq.detach().clone().float(), persistent=False)
            if fused:  # GroupQueryAttention's tables: [max_positions, head_size / 2]
                cos, sin = rotary_tables(self.inv_freq, torch.arange(lo.max_positions), self.rope_scaling)
                half = lo.head_size // 2
                self.register_buffer("cos_cache", cos[:, :half].contiguous(), persistent=False)
                self.register_buffer("sin_cache", sin[:, :half].contiguous(), persistent=False)

    def attention_modules(self) -> list[nn.Module]:
        """Each layer's attention module (``self_attn`` / ``attn``), in order."""
        if self.layout.family == "gpt2":
            return [block.attn for block in self.transformer.h]
        return [layer.self_attn for layer in self.model.layers]

    @property
    def cache_dtype(self) -> torch.dtype:
        """The type of ``past_key_values.*`` and ``present.*``: int8 codes for a quantized cache."""
        return torch.int8 if self.kv_cache is not None else torch.float32

    @property
    def input_names(self) -> list[str]:
        """The graph's inputs, in forward's order."""
        names = ["input_ids", "attention_mask"]
        if self.takes_positions:
            names.append("position_ids")
        return names + self.layout.past_names

    @property
    def output_names(self) -> list[str]:
        return ["logits", *self.layout.present_names]

    @property
    def takes_positions(self) -> bool:
        return not (self.fused and self.layout.rotary)

    def forward(self, input_ids, attention_mask, position_ids=None, *past):  # see with_named_forward
        return self.step(input_ids, attention_mask, position_ids, list(past))

    def step(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None,
        past: list[torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """One decode step; ``past``: key, value per layer. Returns ``{"logits", "present.{i}.key", ...}``."""
        lo = self.layout
        rope = caches = bias = None
        if self.fused:
            caches = (self.cos_cache, self.sin_cache) if lo.rotary else None
        else:
            bias = causal_bias(attention_mask, input_ids)
            if lo.rotary:
                rope = rotary_tables(self.inv_freq, position_ids, self.rope_scaling)
        step = _Step(
            attention_mask,
            bias,
            rope,
            caches,
            self.fused,
            lo.num_heads,
            self.skip_norm,
            self.embedding_table,
        )
        if lo.family == "gpt2":
            hidden, present = self.transformer(input_ids, position_ids, past, step)
        else:
            hidden, present = self.model(input_ids, past, step)
        return {"logits": self.lm_head(hidden), **dict(zip(lo.present_names, present))}


def with_named_forward(decoder: DecoderWithCache) -> DecoderWithCache:
    """``decoder`` whose class has a ``forward`` with one named parameter per graph input
    (``past_key_values_0_key``,
    ...): the exporters name graph inputs after forward's parameters and take keyword inputs by them."""
    params = [python_name(n) for n in decoder.input_names]
    past = [p for p in params if p not in FORWARD_INPUTS]
    positions = "position_ids" if "position_ids" in params else "None"
    src = (
        f"def forward(self, {', '.join(params)}):\n"
        f"    return self.step(input_ids, attention_mask, {positions}, [{', '.join(past)}])\n"
    )
    scope: dict = {}
    exec(compile(src, "<decode graph forward>", "exec"), scope)  # noqa: S102 (source built from layer counts)
    cls = type(f"DecoderWithCache{len(past) // 2}", (DecoderWithCache,), {"forward": scope["forward"]})
    decoder.__class__ = cls
    return decoder
