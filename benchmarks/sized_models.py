"""Models of the sizes people calibrate on a GPU, with random weights (for timing only: what a layer computes
does not depend on its weights' values, how long it takes does not either): a ResNet-50-shaped CNN, a
BERT-base-shaped encoder and a decoder of about 1 B parameters. Each takes a ``scale`` in ``(0, 1]`` that
shrinks widths and depth for a CPU run (``bench_gpu_calibration --quick``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Bottleneck(nn.Module):
    """ResNet's 1x1 -> 3x3 -> 1x1 block with BatchNorms and a projection shortcut where the shape changes."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet50Like(nn.Module):
    """ResNet-50's layout: stem, [3, 4, 6, 3] bottlenecks of widths 64-512 (x scale), global pool,
    classifier."""

    def __init__(self, scale: float = 1.0, classes: int = 1000):
        super().__init__()
        w = [max(8, int(c * scale)) for c in (64, 128, 256, 512)]
        self.stem = nn.Sequential(
            nn.Conv2d(3, w[0], 7, 2, 3, bias=False), nn.BatchNorm2d(w[0]), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        blocks, cin = [], w[0]
        for i, (width, n) in enumerate(zip(w, (3, 4, 6, 3))):
            for j in range(n):
                blocks.append(Bottleneck(cin, width, 2 if j == 0 and i > 0 else 1))
                cin = 4 * width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


class EncoderLayer(nn.Module):
    """A post-LayerNorm transformer layer (BERT's): attention, then a GELU feed-forward."""

    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.up, self.down = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def _split(self, t):
        b, s, h = t.shape
        return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (self._split(p(x)) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v)
        x = self.ln1(x + self.o(a.transpose(1, 2).reshape(b, s, h)))
        return self.ln2(x + self.down(F.gelu(self.up(x))))


class BertBaseLike(nn.Module):
    """BERT-base's shape: 12 layers, hidden 768, 12 heads, feed-forward 3072 (x scale), token embeddings."""

    def __init__(self, scale: float = 1.0, vocab: int = 30522):
        super().__init__()
        hidden, ffn = max(64, int(768 * scale) // 64 * 64), max(128, int(3072 * scale))
        layers = max(2, round(12 * scale))
        self.embed, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(512, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.layers = nn.ModuleList(EncoderLayer(hidden, max(1, hidden // 64), ffn) for _ in range(layers))
        self.pooler = nn.Linear(hidden, hidden)

    def forward(self, input_ids):
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.norm(self.embed(input_ids) + self.pos(pos))
        for layer in self.layers:
            x = layer(x)
        return torch.tanh(self.pooler(x[:, 0]))


class DecoderLayer(nn.Module):
    """A pre-RMSNorm decoder layer (Llama's): causal attention, then a SwiGLU feed-forward."""

    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)
        self.n1, self.n2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)

    def _split(self, t):
        b, s, h = t.shape
        return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

    def forward(self, x):
        b, s, h = x.shape
        y = self.n1(x)
        q, k, v = (self._split(p(y)) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        y = self.n2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Decoder1BLike(nn.Module):
    """About 1 B parameters at scale 1: hidden 2048, 16 layers, 16 heads, SwiGLU 5632, vocabulary 32000,
    untied output layer; returns the logits."""

    def __init__(self, scale: float = 1.0, vocab: int = 32000):
        super().__init__()
        hidden = max(64, int(2048 * scale) // 64 * 64)
        ffn, layers = max(128, int(5632 * scale)), max(2, round(16 * scale))
        vocab = max(256, int(vocab * scale))
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(DecoderLayer(hidden, hidden // 64 or 1, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
