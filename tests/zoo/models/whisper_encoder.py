"""A Whisper encoder (transformers ``WhisperModel``'s encoder: two Conv1d over log-mel features, GELU,
sinusoidal positions, pre-LayerNorm attention), small and randomly initialised; the last hidden state."""

import numpy as np
import torch
from torch import nn

MELS = 16
FRAMES = 32  # 2 x max_source_positions: the encoder's second convolution halves it


class Encoder(nn.Module):
    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_features):
        return self.encoder(input_features=input_features).last_hidden_state


def samples(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input_features": rng.standard_normal((n, MELS, FRAMES)).astype(np.float32)}


def make() -> nn.Module:
    from transformers import WhisperConfig, WhisperModel

    torch.manual_seed(0)
    cfg = WhisperConfig(
        vocab_size=256,
        num_mel_bins=MELS,
        d_model=64,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_layers=1,
        decoder_attention_heads=4,
        decoder_ffn_dim=128,
        max_source_positions=FRAMES // 2,
        max_target_positions=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    return Encoder(WhisperModel(cfg).get_encoder()).eval()
