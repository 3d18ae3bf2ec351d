"""Which causal LMs get a decode graph, and their shapes: :func:`decoder_layout` reads a model's structure.

Two families, recognised by module names and config (the model's own classes are never imported):

* ``llama``: ``model.{embed_tokens, layers[i].{input_layernorm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm,
  mlp}, norm, rotary_emb}`` and ``lm_head``, with ``model_type`` ``llama``, ``qwen2`` or ``mistral`` (RMSNorm,
  rotary embedding, SwiGLU, grouped-query attention; Qwen2's q/k/v biases): transformers'
  ``LlamaForCausalLM``,
  ``Qwen2ForCausalLM``, ``MistralForCausalLM`` and the ``tiny_llama`` sample;
* ``gpt2``: ``transformer.{wte, wpe, h[i].{ln_1, attn.{c_attn, c_proj}, ln_2, mlp}, ln_f}`` and ``lm_head``
  (learned positions, LayerNorm, multi-head attention): transformers' ``GPT2LMHeadModel``.

What would compute something else in a decode graph than in the model is refused with the reason (a sliding
window, rotary scaling that depends on the sequence length, per-head q/k norms): :class:`NotDecodable`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

LLAMA_TYPES = ("llama", "qwen2", "mistral")
STATIC_ROPE = (
    "default",
    "linear",
    "llama3",
    "yarn",
)  # rope types whose inv_freq does not depend on the length


class NotDecodable(Exception):
    """The model is not a causal LM quantcli writes a decode graph for (the message says why)."""


@dataclass(frozen=True)
class DecoderLayout:
    """What a decode graph of the model holds (sizes in elements)."""

    family: str  # "llama" | "gpt2"
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    hidden_size: int
    vocab_size: int
    max_positions: int
    rotary: bool  # positions enter as a rotary embedding (else a learned position embedding)
    eos_token_id: int | None = None
    # every end-of-sequence id (Llama 3 and instruct models list several; generation stops at any)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None

    @property
    def past_names(self) -> list[str]:
        """``past_key_values.{i}.key`` / ``.value``, layer by layer (onnxruntime-genai's and Optimum's
        names)."""
        return [f"past_key_values.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")]

    @property
    def present_names(self) -> list[str]:
        return [f"present.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")]

    def to_plain(self) -> dict:
        return dict(self.__dict__)


def _get(config, *names, default=None):
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return default


def _first_int(v) -> int | None:
    if isinstance(v, (list, tuple)):
        return int(v[0]) if v else None
    return None if v is None else int(v)


def _all_ints(v) -> tuple[int, ...]:
    if isinstance(v, (list, tuple)):
        return tuple(int(i) for i in v)
    return () if v is None else (int(v),)


def _special_ids(config, generation_eos: tuple[int, ...] = ()) -> dict:
    """The layout's special token ids from the config: the first and every end-of-sequence id (config.json's,
    then ``generation_eos``, generation_config.json's), BOS and PAD; ids beyond the vocabulary (GPT2Config's
    default 50256 in a small model) are no tokens and are left out."""
    vocab = int(config.vocab_size)

    def valid(ids: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(i for i in ids if 0 <= i < vocab)

    eos = valid(tuple(dict.fromkeys(_all_ints(_get(config, "eos_token_id")) + tuple(generation_eos))))
    return {
        "eos_token_id": eos[0] if eos else None,
        "eos_token_ids": eos,
        "bos_token_id": _first_int(valid(_all_ints(_get(config, "bos_token_id")))),
        "pad_token_id": _first_int(valid(_all_ints(_get(config, "pad_token_id")))),
    }


def _rope_type(config) -> str:
    params = _get(config, "rope_parameters", "rope_scaling") or {}
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        raise NotDecodable("per-layer-type rotary parameters are not supported")
    return str((params or {}).get("rope_type", (params or {}).get("type", "default")))


def _sliding_window(config, mt: str) -> int | None:
    """The window of a model whose attention slides over one, else None: a window as long as the context
    never takes effect, and a config whose ``layer_types`` are all full attention has none (Qwen2 with
    ``use_sliding_window`` and ``max_window_layers`` beyond its layers)."""
    window = _get(config, "sliding_window")
    if window is None or int(window) >= int(config.max_position_embeddings):
        return None
    types = _get(config, "layer_types")
    if types is not None:
        return int(window) if any(t != "full_attention" for t in types) else None
    return int(window) if mt == "mistral" or _get(config, "use_sliding_window", default=False) else None


def _llama(model: nn.Module, config) -> DecoderLayout:
    body = model.model
    mt = config.model_type
    if mt not in LLAMA_TYPES:
        raise NotDecodable(
            f"model_type {mt!r} has a Llama-like structure, but decode graphs are written for Llama-like "
            f"({', '.join(LLAMA_TYPES)}) and GPT-2 models"
        )
    window = _sliding_window(config, mt)
    if window is not None:
        raise NotDecodable(f"{mt} with a sliding window ({window}) is not supported")
    rope = _rope_type(config)
    if rope not in STATIC_ROPE:
        raise NotDecodable(
            f"rope_type {rope!r} changes with the sequence length; supported: {', '.join(STATIC_ROPE)}"
        )
    if not hasattr(getattr(body, "rotary_emb", None), "inv_freq"):
        raise NotDecodable("the model has no rotary_emb.inv_freq to take the rotary embedding from")
    for i, layer in enumerate(body.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            raise NotDecodable(f"layer {i} has no self_attn.{{q,k,v,o}}_proj")
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            raise NotDecodable(f"layer {i} normalises queries/keys per head (q_norm/k_norm)")
        if not all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm", "mlp")):
            raise NotDecodable(f"layer {i} is not pre-norm attention + MLP")
    heads = int(config.num_attention_heads)
    hidden = int(config.hidden_size)
    return DecoderLayout(
        family="llama",
        model_type=mt,
        num_layers=len(body.layers),
        num_heads=heads,
        num_kv_heads=int(_get(config, "num_key_value_heads", default=heads)),
        head_size=int(_get(config, "head_dim", default=hidden // heads)),
        hidden_size=hidden,
        vocab_size=int(config.vocab_size),
        max_positions=int(config.max_position_embeddings),
        rotary=True,
        **_special_ids(config, getattr(model, "quantcli_generation_eos", ())),
    )


def _gpt2(model: nn.Module, config) -> DecoderLayout:
    heads, hidden = int(config.n_head), int(config.n_embd)
    for i, block in enumerate(model.transformer.h):
        if not all(hasattr(block.attn, p) for p in ("c_attn", "c_proj")) or getattr(
            block.attn, "is_cross_attention", False
        ):
            raise NotDecodable(f"block {i} is not GPT-2 self-attention")
    return DecoderLayout(
        family="gpt2",
        model_type="gpt2",
        num_layers=len(model.transformer.h),
        num_heads=heads,
        num_kv_heads=heads,
        head_size=hidden // heads,
        hidden_size=hidden,
        vocab_size=int(config.vocab_size),
        max_positions=int(config.n_positions),
        rotary=False,
        **_special_ids(config, getattr(model, "quantcli_generation_eos", ())),
    )


def decoder_layout(model: nn.Module) -> DecoderLayout:
    """The model's :class:`DecoderLayout`; :class:`NotDecodable` where it is no causal LM of a supported
    family."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "lm_head"):
        raise NotDecodable("not a causal LM with a config and an lm_head")
    mt = getattr(config, "model_type", None)
    if hasattr(model, "model") and hasattr(model.model, "layers"):
        return _llama(model, config)
    if mt == "gpt2" and hasattr(model, "transformer"):
        return _gpt2(model, config)
    raise NotDecodable(
        f"model_type {mt!r}: decode graphs are written for Llama-like (llama, qwen2, mistral) and GPT-2"
    )
