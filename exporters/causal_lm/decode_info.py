"""What a decode graph is, as its metadata records it: read without torch (``generate`` starts in onnxruntime,
not after importing torch)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

LAYOUT_KEY = "quantcli.causal_lm"  # metadata: the decode graph's layout and inputs (generate, verify read it)
NO_DECODE_KEY = "quantcli.no_decode_graph"  # metadata: why a causal LM was written as a prefill graph


@dataclass
class DecodeExport:
    """What the decode graph is (stored in the graph's metadata under :data:`LAYOUT_KEY`)."""

    layout: dict
    inputs: list[str]
    outputs: list[str]
    contrib_ops: list[str] = field(default_factory=list)  # onnxruntime contrib ops the graph uses
    note: str = ""  # why a fused form was not used, if it was asked for
    fusions: list[str] = field(default_factory=list)  # what was fused, in words
    kv_cache: dict | None = None  # an int8 cache: KVCacheQuant.summary() (None: float32)
    embeddings: dict | None = None  # a quantized table: EmbeddingQuant.summary() (None: float32)

    def to_dict(self) -> dict:
        return asdict(self)


def read_decode_info(onnx_model) -> DecodeExport | None:
    """The :class:`DecodeExport` a decode graph's metadata holds, or None for any other graph."""
    for p in onnx_model.metadata_props:
        if p.key == LAYOUT_KEY:
            return DecodeExport(**json.loads(p.value))
    return None
