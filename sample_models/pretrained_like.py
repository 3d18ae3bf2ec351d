"""``pretrained_like``: a MiniLM-sized BERT sentence encoder whose weights have the statistics of pretrained
ones.

A ``transformers`` ``BertModel`` (6 layers, hidden 384, 12 heads, intermediate 1536: all-MiniLM-L6-v2's shape)
behind mean pooling over the attention mask and L2 normalisation, fed word-level sentences of CPython's own
docstrings padded to the longest of each batch. Nothing is downloaded and nothing is trained: random init
gets the properties that decide how a pretrained encoder quantizes and runs, which random init lacks:

- **outlier residual dimensions**: pretrained BERTs have 2-6 hidden dimensions (bert-base's 308 and 381) whose
  LayerNorm gain and bias are 10-100x the others', so the LayerNorm outputs that q/k/v and the FFN
  up-projections read have per-tensor ranges set by those few channels (the reason SmoothQuant and
  ``--min-cosine`` matter). Here: :data:`OUTLIER_DIMS`, gains 15-60 and biases up to 20 in magnitude against
  gains ~1 and biases ~0.05 elsewhere, in every LayerNorm but the last; the weights reading those channels are
  a fifth of the others' (as trained models learn), so the float model stays well conditioned.
- **GELU outliers**: a few FFN channels with large pre-activations feed the down-projections outliers.
- **attention that is not uniform**: random init (std 0.02) gives q.k ~ 0 and softmax ~ uniform; here each
  head's key projection shares a component with its query projection and both are scaled so the logits spread
  over several units: per-head attention entropy well under log(T) (:func:`attention_entropy` measures it).
- **real padding**: batches of 32 sentences of 4-64 word tokens ([CLS] ... [SEP]) padded to the longest, so
  ``attention_mask`` has zeros and the graph computes on padded positions as deployed encoders do.

The token vocabulary is built here from the same docstrings (the 4000 most frequent words and punctuation,
[UNK] for the rest); the sentences are every sentence of the docstrings of :data:`MODULES`, in a fixed order.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections import Counter
from functools import lru_cache

import torch
from torch import nn

from sample_models.structured import MeanPooledEncoder, seeded_encoder

#: stdlib modules whose docstrings give the sentences (shipped with CPython: nothing is downloaded)
MODULES = (
    "argparse",
    "collections",
    "functools",
    "inspect",
    "json",
    "logging",
    "pathlib",
    "subprocess",
    "textwrap",
    "typing",
    "unittest.case",
    "email.message",
    "http.client",
    "decimal",
    "threading",
    "tarfile",
    "zipfile",
    "shutil",
    "tempfile",
    "datetime",
    "pickle",
    "csv",
    "configparser",
    "ast",
)
PAD, UNK, CLS, SEP = 0, 1, 2, 3
VOCAB = 4000
MAX_LEN = 66  # [CLS] + 64 words + [SEP]
BATCH = 32
#: residual-stream dimensions with pretrained-like outlier LayerNorm gains and biases
OUTLIER_DIMS = (31, 118, 260, 341)
OUTLIER_GAINS = (60.0, 25.0, 40.0, 15.0)
OUTLIER_BIASES = (-20.0, 8.0, -12.0, 4.0)
#: FFN intermediate channels whose pre-activation is scaled up (outlier GELU outputs)
OUTLIER_FFN_CHANNELS = (7, 400, 901, 1333)
#: the weights reading an outlier residual dimension are this fraction of the others (trained models learn
# small ones)
READER_SCALE = 0.2
FFN_SCALE = 20.0


@lru_cache(maxsize=1)
def sentences() -> tuple[str, ...]:
    """Every sentence (4-64 words) of the docstrings of :data:`MODULES`, in a fixed order."""
    out = []
    for name in MODULES:
        spec = importlib.util.find_spec(name)
        with open(spec.origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    for s in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
                        if 4 <= len(_words(s)) <= MAX_LEN - 2:
                            out.append(s)
    return tuple(out)


def _words(s: str) -> list[str]:
    return re.findall(r"\w+|[^\w\s]", s.lower())


@lru_cache(maxsize=1)
def vocabulary() -> dict[str, int]:
    counts = Counter(w for s in sentences() for w in _words(s))
    ranked = sorted(counts, key=lambda w: (-counts[w], w))[: VOCAB - 4]
    return {w: i + 4 for i, w in enumerate(ranked)}


def tokenize(batch: list[str]) -> dict[str, torch.Tensor]:
    """``{"input_ids", "attention_mask"}`` int64 ``(B, longest)``: [CLS] words [SEP], padded with 0."""
    vocab = vocabulary()
    rows = [[CLS] + [vocab.get(w, UNK) for w in _words(s)] + [SEP] for s in batch]
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), PAD, dtype=torch.int64)
    mask = torch.zeros((len(rows), n), dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def batches(split: str = "calib") -> list[dict[str, torch.Tensor]]:
    """Batches of :data:`BATCH` sentences: ``"calib"`` 8 batches, ``"holdout"`` 2 (the ``--min-cosine``
    search's), ``"test"`` 4; disjoint, taken from a fixed shuffle of :func:`sentences`."""
    s = list(sentences())
    order = torch.randperm(len(s), generator=torch.Generator().manual_seed(0)).tolist()
    s = [s[i] for i in order]
    start, count = {"calib": (0, 8), "holdout": (8, 2), "test": (10, 4)}[split]
    return [tokenize(s[(start + i) * BATCH : (start + i + 1) * BATCH]) for i in range(count)]


def build(seed: int = 0) -> MeanPooledEncoder:
    """The encoder (eval mode); deterministic for a ``seed``. Needs ``transformers``."""
    try:
        from transformers import BertConfig
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise ImportError("pretrained_like needs transformers: pip install 'quantcli[hf]'") from e
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    return seeded_encoder(config, seed, _pretrained_statistics, batches("calib"), add_pooling_layer=False)


@torch.no_grad()
def _pretrained_statistics(bert: nn.Module, gen: torch.Generator) -> None:
    dims = list(OUTLIER_DIMS)
    hidden = bert.config.hidden_size
    norms = [bert.embeddings.LayerNorm]
    for layer in bert.encoder.layer:
        norms += [layer.attention.output.LayerNorm, layer.output.LayerNorm]
    for i, norm in enumerate(norms):
        norm.weight.copy_(0.7 + 0.6 * torch.rand(hidden, generator=gen))
        norm.bias.copy_(0.05 * torch.randn(hidden, generator=gen))
        if i < len(norms) - 1:  # the last LayerNorm is the embedding itself: outliers there would dominate it
            jitter = 0.8 + 0.4 * torch.rand(len(dims), generator=gen)
            norm.weight[dims] = torch.tensor(OUTLIER_GAINS) * jitter
            norm.bias[dims] = torch.tensor(OUTLIER_BIASES) * jitter
    for layer in bert.encoder.layer:
        att = layer.attention.self
        # queries and keys share a per-head component, scaled so that the logits q.k / sqrt(d) spread over
        # several units: peaked, position- and content-dependent attention instead of random init's uniform
        # one
        shared = torch.randn(hidden, hidden, generator=gen) * 0.06
        att.query.weight.copy_(shared + 0.03 * torch.randn(hidden, hidden, generator=gen))
        att.key.weight.copy_(shared + 0.03 * torch.randn(hidden, hidden, generator=gen))
        att.query.bias.copy_(0.1 * torch.randn(hidden, generator=gen))
        att.key.bias.zero_()
        # readers of the outlier channels have small weights there, as trained models learn
        for lin in (att.query, att.key, att.value, layer.intermediate.dense):
            lin.weight[:, dims] *= READER_SCALE
        up, down = layer.intermediate.dense, layer.output.dense
        ch = list(OUTLIER_FFN_CHANNELS)
        up.weight[ch] *= FFN_SCALE
        up.bias[ch] = 3.0
        down.weight[:, ch] *= 0.1


@torch.no_grad()
def attention_entropy(model: MeanPooledEncoder, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(mean attention entropy over heads, layers and real query tokens, mean log(number of real keys)): the
    uniform attention of random init has the two equal."""
    out = model.bert(**batch, output_attentions=True)
    mask = batch["attention_mask"].bool()
    ent, uni = [], []
    for a in out.attentions:  # (B, H, T, T)
        h = -(a * a.clamp(min=1e-12).log()).sum(-1)  # (B, H, T)
        ent.append(h.mean(1)[mask].mean().item())
        uni.append(mask.sum(1).float().log().mean().item())
    return sum(ent) / len(ent), sum(uni) / len(uni)


def outlier_ratio(model: MeanPooledEncoder, batch: dict[str, torch.Tensor]) -> float:
    """Largest |activation| of the first encoder layer's input (a LayerNorm output) over its median channel
    max."""
    with torch.no_grad():
        x = model.bert.embeddings(input_ids=batch["input_ids"])
    m = x.abs().reshape(-1, x.shape[-1]).amax(0)
    return float(m.max() / m.median())
