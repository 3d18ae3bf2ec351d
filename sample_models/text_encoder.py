"""``text_encoder``: a small BERT-style encoder that tells Python code from English prose.

Byte-level tokens (``input_ids``, int64, 1 = [CLS], 0 = padding, byte + 2 otherwise) and ``attention_mask``
(int64, 1 = token, 0 = padding) are the two named inputs. Token + position embeddings, two encoder layers
with separate q/k/v ``nn.Linear`` projections, GELU feed-forward, layer norm; the [CLS] vector is classified
into 2 classes (0 = prose, 1 = code). Trained on lines of CPython's own standard library: docstring text
versus source lines. Retrain with ``python -m sample_models.train text_encoder``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

DATA = Path(__file__).parent / "data"
WEIGHTS = DATA / "text_encoder.safetensors"
SPLITS = DATA / "text_encoder_data.npz"

VOCAB = 258
MAX_LEN = 80
CLS = 1


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.output = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.heads

        def split(t):
            return t.view(b, n, h, d // h).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // h) + bias
        ctx = torch.softmax(scores, dim=-1) @ v
        return self.output(ctx.transpose(1, 2).reshape(b, n, d))


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.attention = SelfAttention(dim, heads)
        self.norm1 = nn.LayerNorm(dim)
        self.intermediate = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.out = nn.Linear(hidden, dim)
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.attention(x, bias))
        return self.norm2(x + self.out(self.act(self.intermediate(x))))


class TextEncoder(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4, hidden: int = 128, layers: int = 2, classes: int = 2):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, dim)
        self.positions = nn.Embedding(MAX_LEN, dim)
        self.norm = nn.LayerNorm(dim)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads, hidden) for _ in range(layers))
        self.classifier = nn.Linear(dim, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[1]
        pos = torch.arange(n, device=input_ids.device).unsqueeze(0)
        x = self.norm(self.tokens(input_ids) + self.positions(pos))
        # additive mask: a large finite negative keeps softmax finite in every runtime
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -1e4
        for layer in self.layers:
            x = layer(x, bias)
        return self.classifier(x[:, 0])


def build(pretrained: bool = True) -> TextEncoder:
    model = TextEncoder()
    if pretrained:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(WEIGHTS)))
    return model.eval()


def tokenize(lines: list[str], max_len: int = MAX_LEN) -> dict[str, torch.Tensor]:
    """Pad to the longest line in the batch: ``{"input_ids", "attention_mask"}`` int64."""
    encoded = [[CLS] + [b + 2 for b in s.encode("utf-8")][: max_len - 1] for s in lines]
    n = max(len(e) for e in encoded)
    ids = torch.zeros(len(encoded), n, dtype=torch.long)
    mask = torch.zeros(len(encoded), n, dtype=torch.long)
    for i, e in enumerate(encoded):
        ids[i, : len(e)] = torch.tensor(e)
        mask[i, : len(e)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _batches(prefix: str) -> list[dict[str, torch.Tensor]]:
    out = []
    with np.load(SPLITS) as z:
        i = 0
        while f"{prefix}_{i}_input_ids" in z:
            out.append(
                {
                    k: torch.from_numpy(z[f"{prefix}_{i}_{k}"].astype(np.int64))
                    for k in ("input_ids", "attention_mask")
                }
            )
            i += 1
    return out


def calibration_batches() -> list[dict[str, torch.Tensor]]:
    """Tokenised training lines in batches whose sequence lengths differ."""
    return _batches("calib")


def evaluation_batches() -> list[dict[str, torch.Tensor]]:
    """Held-out lines (never trained or calibrated on), batches of varying sequence length."""
    return _batches("eval")


def evaluation_labels() -> torch.Tensor:
    with np.load(SPLITS) as z:
        return torch.from_numpy(z["eval_labels"].astype(np.int64))
