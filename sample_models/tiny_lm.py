"""``tiny_lm``: a small GPT-style causal language model over bytes, trained on CPython's own standard library.

One named input, ``input_ids`` (int64 ``[batch, seq]``, byte values 0..255, ``seq <= MAX_LEN``); one output,
the next-byte logits ``[batch, seq, 256]`` for every position (a prefill graph; there is no KV cache). Token
and position embeddings, two pre-norm decoder blocks (causal self-attention with separate q/k/v ``nn.Linear``
projections, GELU feed-forward), a final LayerNorm and an ``lm_head``; about 0.43 M parameters, stored as
float16 (under 1 MB) and run in float32.

Every Linear reads 128 input features (one int4 block of 128) or a multiple of it -- except the second block's
feed-forward output projection, which reads 330: its last block of 128 is partial (74), for the padding path.

Bundled data (``tiny_lm_data.npz``): 256 training windows of 64 bytes for calibration and 256 held-out windows
from files never trained on, so perplexity is measurable offline (:func:`perplexity`). Retrain with
``python -m sample_models.train tiny_lm``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

DATA = Path(__file__).parent / "data"
WEIGHTS = DATA / "tiny_lm.safetensors"
SPLITS = DATA / "tiny_lm_data.npz"

VOCAB = 256
MAX_LEN = 64
DIM = 128
HEADS = 4
HIDDEN = (384, 330)  # per block; 330 = 2 x 128 + 74
BATCH = 32


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.output = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.heads

        def split(t):
            return t.view(b, n, h, d // h).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // h) + mask
        ctx = torch.softmax(scores, dim=-1) @ v
        return self.output(ctx.transpose(1, 2).reshape(b, n, d))


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attention = CausalSelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x), mask)
        return x + self.down(self.act(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = HEADS, hidden: tuple[int, ...] = HIDDEN):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, dim)
        self.positions = nn.Embedding(MAX_LEN, dim)
        self.blocks = nn.ModuleList(DecoderBlock(dim, heads, h) for h in hidden)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[1]
        pos = torch.arange(n, device=input_ids.device)
        # additive causal mask: a large finite negative keeps softmax finite in every runtime
        mask = (pos[None, :] > pos[:, None]).to(torch.float32) * -1e4
        x = self.tokens(input_ids) + self.positions(pos)[None]
        for block in self.blocks:
            x = block(x, mask)
        return self.lm_head(self.norm(x))


def build(pretrained: bool = True) -> TinyLM:
    model = TinyLM()
    if pretrained:
        from safetensors.torch import load_file

        model.load_state_dict({k: v.to(torch.float32) for k, v in load_file(str(WEIGHTS)).items()})
    return model.eval()


def _batches(key: str, limit: int | None = None) -> list[dict[str, torch.Tensor]]:
    with np.load(SPLITS) as z:
        ids = torch.from_numpy(z[key].astype(np.int64))
    ids = ids[:limit] if limit is not None else ids
    return [{"input_ids": ids[i : i + BATCH]} for i in range(0, len(ids), BATCH)]


def calibration_batches() -> list[dict[str, torch.Tensor]]:
    """256 windows of 64 bytes from the training text, in batches of 32."""
    return _batches("calib")


def evaluation_batches() -> list[dict[str, torch.Tensor]]:
    """256 windows of 64 bytes from held-out files (never trained or calibrated on), in batches of 32."""
    return _batches("eval")


def evaluation_labels() -> torch.Tensor:
    """The next byte after every position but the last of each held-out window ``[n, MAX_LEN - 1]``."""
    return torch.cat([b["input_ids"][:, 1:] for b in evaluation_batches()])


def nll_sum(logits: np.ndarray, input_ids: np.ndarray) -> tuple[float, int]:
    """(sum of the next-byte negative log-likelihoods in nats, number of predictions) of one batch: position
    t's logits ``[batch, seq, 256]`` predict byte t + 1 of ``input_ids``. float64, numerically stable."""
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
