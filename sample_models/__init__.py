"""Small models with bundled trained weights and calibration / evaluation data, so every command runs
out of the box: ``quantcli calibrate digits_cnn``."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class SampleModel:
    name: str
    module: str
    description: str

    def _mod(self):
        return importlib.import_module(self.module)

    def build(self):
        return self._mod().build()

    def calibration_batches(self):
        return self._mod().calibration_batches()

    def evaluation_batches(self):
        return self._mod().evaluation_batches()

    def evaluation_labels(self):
        return self._mod().evaluation_labels()


SAMPLES = {
    "digits_cnn": SampleModel("digits_cnn", "sample_models.digits_cnn", "CNN for scikit-learn's 8x8 digits"),
    "text_encoder": SampleModel(
        "text_encoder",
        "sample_models.text_encoder",
        "BERT-style encoder: Python code vs prose (CPython stdlib)",
    ),
    "tiny_lm": SampleModel(
        "tiny_lm",
        "sample_models.tiny_lm",
        "GPT-style byte-level causal LM (CPython stdlib source), logits per position",
    ),
    "tiny_llama": SampleModel(
        "tiny_llama",
        "sample_models.tiny_llama",
        "Llama-architecture byte-level decoder (RoPE, RMSNorm, SwiGLU, grouped-query attention, tied "
        "embeddings; CPython stdlib source); exports as a decode graph with a KV cache",
    ),
}


def get(name: str) -> SampleModel | None:
    return SAMPLES.get(name)
