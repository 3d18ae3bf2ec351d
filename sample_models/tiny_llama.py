"""``tiny_llama``: a small trained decoder with the structure of real ones, over bytes of CPython's own
source.

Llama architecture, module for module and name for name as transformers' ``LlamaForCausalLM`` (so its state
dict and config load there and in onnxruntime-genai's model builder, :func:`write_hf_folder`): rotary position
embeddings (RoPE, ``rope_theta`` 10000, no learned positions), RMSNorm, a SwiGLU feed-forward
(``down(silu(gate(x)) * up(x))``), grouped-query attention (4 query heads, 2 key/value heads of 32), and the
token embedding tied to ``lm_head``. 2 layers, hidden 128, intermediate 384, vocabulary 256 (one token per
byte: token id == byte value; byte 0, absent from the text, is the end-of-sequence token); 0.43 M parameters,
stored as float16 (under 1 MB) and run in float32.

One named input, ``input_ids`` (int64 ``[batch, seq]``); one output, the next-byte logits ``[batch, seq,
256]`` for every position. ``quantcli export`` writes it (like any causal LM) as a decode graph with a KV
cache (:mod:`exporters.causal_lm`).

Bundled data (``tiny_llama_data.npz``): 64 training windows of 256 bytes for calibration and 64 held-out
windows of 256 bytes from files never trained on, so perplexity is measurable offline (:func:`perplexity`).
Retrain with ``python -m sample_models.train tiny_llama``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

DATA = Path(__file__).parent / "data"
WEIGHTS = DATA / "tiny_llama.safetensors"
SPLITS = DATA / "tiny_llama_data.npz"
CONTEXT = 256  # bytes per training / held-out window
BATCH = 16
TIED = ("lm_head.weight", "model.embed_tokens.weight")  # (stored under the second name only)


@dataclass(frozen=True)
class TinyLlamaConfig:
    """The model's hyper-parameters under transformers' ``LlamaConfig`` names (and with its meaning)."""

    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 512
    hidden_act: str = "silu"
    tie_word_embeddings: bool = True
    bos_token_id: int = 0
    eos_token_id: int = 0
    pad_token_id: int = 0
    model_type: str = "llama"

    def to_hf(self) -> dict:
        """``config.json`` of the transformers ``LlamaForCausalLM`` with these weights."""
        return {
            "architectures": ["LlamaForCausalLM"],
            **asdict(self),
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "pretraining_tp": 1,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": "float32",
        }


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension (transformers' ``LlamaRMSNorm``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one cast in, one out, as transformers writes it: onnxruntime 1.31's optimizer breaks the graph of
        # two chained float->float casts here ("Node input ... is not ... output of a previous node")
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """``cos``/``sin`` ``[batch, seq, head_dim]`` of the positions (transformers' default rope)."""

    def __init__(self, config: TinyLlamaConfig):
        super().__init__()
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = 1.0

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].to(torch.float32) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Attention(nn.Module):
    """Causal grouped-query self-attention: each key/value head serves ``heads / kv_heads`` query heads."""

    def __init__(self, config: TinyLlamaConfig):
        super().__init__()
        d, h, kv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.heads, self.kv_heads = d, h, kv
        self.q_proj = nn.Linear(config.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + mask
        ctx = torch.softmax(scores, dim=-1) @ v
        return self.o_proj(ctx.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: TinyLlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: TinyLlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, config: TinyLlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class TinyLlama(nn.Module):
    """``LlamaForCausalLM`` in plain PyTorch: ``model.{embed_tokens, layers.i.{input_layernorm, self_attn.
    {q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}, norm}`` and ``lm_head``, tied."""

    def __init__(self, config: TinyLlamaConfig | None = None):
        super().__init__()
        self.config = config or TinyLlamaConfig()
        self.model = Body(self.config)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[1]
        pos = torch.arange(n, device=input_ids.device)
        # additive causal mask: a large finite negative keeps softmax finite in every runtime
        mask = (pos[None, :] > pos[:, None]).to(torch.float32) * -1e4
        cos, sin = self.model.rotary_emb(pos[None])
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        return self.lm_head(self.model.norm(x))


def stored_state(model: TinyLlama) -> dict[str, torch.Tensor]:
    """The state dict as stored: the tied ``lm_head.weight`` is the embedding, kept once (as transformers
    saves it)."""
    return {k: v for k, v in model.state_dict().items() if k != TIED[0]}


def load_state(model: TinyLlama, state: dict[str, torch.Tensor]) -> TinyLlama:
    state = {k: v.to(torch.float32) for k, v in state.items()}
    state.setdefault(TIED[0], state[TIED[1]])
    model.load_state_dict(state)
    return model


def build(pretrained: bool = True) -> TinyLlama:
    model = TinyLlama()
    if pretrained:
        from safetensors.torch import load_file

        load_state(model, load_file(str(WEIGHTS)))
    return model.eval()


def _windows(key: str) -> torch.Tensor:
    with np.load(SPLITS) as z:
        return torch.from_numpy(z[key].astype(np.int64))


def _batches(key: str) -> list[dict[str, torch.Tensor]]:
    ids = _windows(key)
    return [{"input_ids": ids[i : i + BATCH]} for i in range(0, len(ids), BATCH)]


def calibration_batches() -> list[dict[str, torch.Tensor]]:
    """64 windows of 256 bytes from the training text, in batches of 16."""
    return _batches("calib")


def evaluation_batches() -> list[dict[str, torch.Tensor]]:
    """64 windows of 256 bytes from held-out files (never trained or calibrated on), in batches of 16."""
    return _batches("eval")


def evaluation_labels() -> torch.Tensor:
    """The next byte after every position but the last of each held-out window ``[n, CONTEXT - 1]``."""
    return _windows("eval")[:, 1:]


def calibration_texts() -> list[bytes]:
    """The calibration windows as bytes (the text they tokenize from: token id == byte value)."""
    return [bytes(w.tolist()) for w in _windows("calib").to(torch.uint8)]


def evaluation_texts() -> list[bytes]:
    """The held-out windows as bytes."""
    return [bytes(w.tolist()) for w in _windows("eval").to(torch.uint8)]


def nll_sum(logits: np.ndarray, input_ids: np.ndarray) -> tuple[float, int]:
    """(sum of the next-token negative log-likelihoods in nats, number of predictions) of one batch: position
    t's logits ``[batch, seq, vocab]`` predict token t + 1 of ``input_ids``. float64, numerically stable."""
    z = np.asarray(logits, np.float64)[:, :-1]
    target = np.asarray(input_ids)[:, 1:]
    top = z.max(-1, keepdims=True)
    log_norm = np.log(np.exp(z - top).sum(-1)) + top[..., 0]
    picked = np.take_along_axis(z, target[..., None], -1)[..., 0]
    return float((log_norm - picked).sum()), int(target.size)


def perplexity(logits_of, batches: list[dict[str, torch.Tensor]]) -> float:
    """exp(mean next-byte NLL) over ``batches``; ``logits_of(input_ids: np.ndarray) -> np.ndarray`` runs a
    model (PyTorch or an onnxruntime session)."""
    total, count = 0.0, 0
    for b in batches:
        ids = b["input_ids"].numpy()
        s, n = nll_sum(logits_of(ids), ids)
        total += s
        count += n
    return math.exp(total / count)


# ------------------------------------------------------------------ as a Hugging Face model folder


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what a byte-level BPE tokenizer writes)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = dict(zip(printable, printable)), 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {b: chr(c) for b, c in chars.items()}


def tokenizer_json() -> dict:
    """A Hugging Face ``tokenizers`` byte-level tokenizer with no merges: token id == byte value."""
    chars = _bytes_to_unicode()
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": False,
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {chars[b]: b for b in range(256)},
            "merges": [],
        },
    }


def write_hf_folder(folder: str | Path, model: TinyLlama | None = None) -> Path:
    """Write ``model`` (default: the trained sample) as a Hugging Face ``LlamaForCausalLM`` folder:
    ``config.json``, ``model.safetensors`` (float32, the tied ``lm_head`` stored once), ``tokenizer.json`` and
    ``tokenizer_config.json``. transformers, ``quantcli calibrate FOLDER`` and onnxruntime-genai's model
    builder read it; nothing here needs transformers."""
    from safetensors.torch import save_file

    model = model if model is not None else build()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
    save_file(
        {k: v.detach().to(torch.float32).contiguous() for k, v in stored_state(model).items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json(), ensure_ascii=False))
    eos = _bytes_to_unicode()[model.config.eos_token_id]
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": eos,
                "bos_token": eos,
                "pad_token": eos,
                "model_max_length": model.config.max_position_embeddings,
            },
            ensure_ascii=False,
        )
    )
    return folder
