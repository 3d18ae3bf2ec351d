"""wav2vec2 (transformers ``Wav2Vec2ForCTC``: a convolutional feature encoder with GroupNorm, a weight-normed
positional convolution, a post-LayerNorm transformer), small and randomly initialised; CTC logits."""

import numpy as np
import torch
from torch import nn

SAMPLES = 1600


class Logits(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_values):
        return self.model(input_values=input_values).logits


def samples(n: int, seed: int) -> dict[str, np.ndarray]:
    """Waveforms: a few sines and noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(SAMPLES, dtype=np.float64) / 16000.0
    f = rng.uniform(100, 2000, (n, 3, 1))
    wave = np.sin(2 * np.pi * f * t).sum(1) + 0.3 * rng.standard_normal((n, SAMPLES))
    return {"input_values": (wave / wave.std(axis=1, keepdims=True)).astype(np.float32)}


def make() -> nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    torch.manual_seed(0)
    cfg = Wav2Vec2Config(
        vocab_size=32,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        conv_dim=(32, 32, 32),
        conv_stride=(5, 4, 2),
        conv_kernel=(10, 8, 4),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        do_stable_layer_norm=False,
        feat_extract_norm="group",
        apply_spec_augment=False,
    )
    return Logits(Wav2Vec2ForCTC(cfg)).eval()
