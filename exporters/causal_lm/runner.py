"""Driving a decode graph with onnxruntime: a plain loop over its inputs and outputs, as a user's would be.

:class:`DecodeSession` reads the graph's layout from its metadata
(:data:`exporters.causal_lm.decode_info.LAYOUT_KEY`), feeds ``input_ids``, ``attention_mask``,
``position_ids`` (where the graph takes them) and the cache, and keeps the ``present`` outputs as the next
step's ``past``. It runs a prompt (:meth:`DecodeSession.prefill`), one token at a time
(:meth:`DecodeSession.step`), a whole sequence teacher-forced (:meth:`DecodeSession.logits`) and generation,
greedy or sampled (:func:`generate`). Rows without padding: the positions of a row are ``0..n-1``. Nothing
here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from exporters.causal_lm.decode_info import NO_DECODE_KEY, DecodeExport, read_decode_info
from quantcli.errors import QuantCliError


class NotADecodeGraph(QuantCliError):
    """The ONNX file is not a decode graph quantcli wrote."""


@dataclass
class Cache:
    """The cache after some positions: ``past`` arrays per layer (key, value), and how many positions."""

    past: list[np.ndarray]
    length: int


def read_info(path) -> DecodeExport:
    import onnx

    graph = onnx.load(str(path), load_external_data=False)
    info = read_decode_info(graph)
    if info is None:
        why = {p.key: p.value for p in graph.metadata_props}.get(NO_DECODE_KEY)
        if why:  # a causal LM export wrote as a prefill graph, saying why
            raise NotADecodeGraph(f"{path} is not a decode graph: export wrote a {why}")
        if any(i.name.startswith(("past_key_values", "past.")) for i in graph.graph.input):
            # onnxruntime-genai's model builder, Optimum: a cache, but no layout quantcli can read
            raise NotADecodeGraph(
                f"{path} is a decode graph quantcli did not write (it has past_key_values inputs but no "
                "quantcli.causal_lm metadata saying its layout and tokenizer): run it with the tool that "
                "wrote it (onnxruntime-genai for its model builder's), or export the model with quantcli"
            )
        raise NotADecodeGraph(
            f"{path} is not a decode graph (no KV cache inputs); export the causal LM with `quantcli export` "
            "(without --no-kv-cache)"
        )
    return info


class DecodeSession:
    """An onnxruntime session of a decode graph (CPU provider unless ``providers`` says otherwise).
    ``layout``: ``num_layers``, ``num_kv_heads``, ``head_size`` (``eos_token_id``) of a graph with the same
    inputs and outputs that quantcli did not write (onnxruntime-genai's model builder's); by default the
    graph's metadata."""

    def __init__(self, path, session_options=None, providers=("CPUExecutionProvider",), layout=None):
        import onnxruntime as ort

        lo = layout if layout is not None else read_info(path).layout
        self.num_layers, self.kv_heads, self.head_size = lo["num_layers"], lo["num_kv_heads"], lo["head_size"]
        self.past_names = [
            f"past_key_values.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")
        ]
        self.present_names = [f"present.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")]
        try:
            self.session = ort.InferenceSession(str(path), session_options, providers=list(providers))
        except Exception as e:  # onnxruntime's own refusal (a graph it cannot load as saved): bad input
            from quantcli.errors import VerifyError, first_line

            raise VerifyError(f"onnxruntime cannot load {path}: {first_line(e, 240)}") from None
        self.input_names = {i.name for i in self.session.get_inputs()}
        types = {i.name: i.type for i in self.session.get_inputs()}
        # an int8 KV cache (exporters.causal_lm.kv_cache) takes int8 codes
        self.cache_dtype = np.int8 if types.get(self.past_names[0]) == "tensor(int8)" else np.float32
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.eos_token_id = lo.get("eos_token_id")
        # every end-of-sequence id (graphs exported before the layout listed them have the first only)
        self.eos_token_ids = frozenset(lo.get("eos_token_ids") or ()) | (
            {self.eos_token_id} if self.eos_token_id is not None else set()
        )

    def empty(self, batch: int = 1) -> Cache:
        shape = (batch, self.kv_heads, 0, self.head_size)
        return Cache([np.zeros(shape, self.cache_dtype) for _ in self.past_names], 0)

    def run(self, ids: np.ndarray, cache: Cache) -> tuple[np.ndarray, Cache]:
        """Logits ``[b, n, vocab]`` of ``ids`` ``[b, n]`` after ``cache``, and the cache with them."""
        b, n = ids.shape
        total = cache.length + n
        feeds = {"input_ids": ids.astype(np.int64), "attention_mask": np.ones((b, total), np.int64)}
        if "position_ids" in self.input_names:
            feeds["position_ids"] = np.broadcast_to(
                np.arange(cache.length, total, dtype=np.int64), (b, n)
            ).copy()
        feeds.update(zip(self.past_names, cache.past))
        out = dict(zip(self.output_names, self.session.run(None, feeds)))
        return out["logits"], Cache([out[n] for n in self.present_names], total)

    def prefill(self, ids: np.ndarray) -> tuple[np.ndarray, Cache]:
        return self.run(ids, self.empty(len(ids)))

    def step(self, token: np.ndarray, cache: Cache) -> tuple[np.ndarray, Cache]:
        """One new token per row, ``token`` ``[b]``: its logits ``[b, vocab]`` and the cache."""
        logits, cache = self.run(np.asarray(token, np.int64)[:, None], cache)
        return logits[:, -1], cache

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """Teacher-forced logits of the whole sequence in one prefill (past length 0)."""
        return self.prefill(ids)[0]

    def stepwise_logits(self, ids: np.ndarray, prompt: int) -> np.ndarray:
        """Logits of ``ids`` from a prefill of ``prompt`` tokens and one decode step per later token: what
        :meth:`logits` gives when the cache is right."""
        logits, cache = self.prefill(ids[:, :prompt])
        out = [logits]
        for t in range(prompt, ids.shape[1]):
            last, cache = self.step(ids[:, t], cache)
            out.append(last[:, None])
        return np.concatenate(out, axis=1)


@dataclass
class Generation:
    """Token ids generated after a prompt, and what ended generation."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    stopped: str = "max_new_tokens"  # or "eos"
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def text_tokens(self) -> list[int]:
        """The generated ids the text is made of: the end-of-sequence token that stopped it left out."""
        return self.tokens[:-1] if self.stopped == "eos" else self.tokens

    @property
    def tokens_per_second(self) -> float:
        return (
            len(self.tokens[1:]) / self.decode_seconds
            if self.decode_seconds > 0 and len(self.tokens) > 1
            else 0.0
        )


def sample_token(logits: np.ndarray, rng: np.random.Generator | None, temperature: float, top_k: int) -> int:
    """Greedy (``rng`` None or ``temperature`` 0: the first maximum) or a sample from the softmax of the top
    ``top_k`` logits divided by ``temperature`` (``top_k`` 0: all)."""
    z = np.asarray(logits, np.float64)
    if rng is None or temperature <= 0:
        return int(np.argmax(z))
    if 0 < top_k < z.size:
        cut = np.partition(z, -top_k)[-top_k]
        z = np.where(z >= cut, z, -np.inf)
    z = (z - z.max()) / temperature
    p = np.exp(z)
    return int(rng.choice(z.size, p=p / p.sum()))


def generate(
    session: DecodeSession,
    prompt: list[int],
    max_new_tokens: int,
    *,
    seed: int | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    stop_at_eos: bool = True,
    on_token: Callable[[Generation], None] | None = None,
) -> Generation:
    """Generate up to ``max_new_tokens`` after ``prompt`` (token ids): greedy when ``seed`` is None, else
    sampled with a ``numpy`` generator seeded by it. Stops after the end-of-sequence token when
    ``stop_at_eos``. ``on_token(generation)`` is called after each token is appended (and ``stopped`` set
    where it ends generation): a caller streams the text so."""
    import time

    if not prompt:
        raise ValueError("the prompt has no tokens")
    rng = None if seed is None else np.random.default_rng(seed)
    out = Generation(list(prompt))
    t0 = time.perf_counter()
    logits, cache = session.prefill(np.asarray([prompt], np.int64))
    last = logits[0, -1]
    out.prefill_seconds = time.perf_counter() - t0
    t0, streaming = time.perf_counter(), 0.0
    for i in range(max_new_tokens):
        token = sample_token(last, rng, temperature, top_k)
        out.tokens.append(token)
        if stop_at_eos and token in session.eos_token_ids:
            out.stopped = "eos"
        if on_token is not None:
            t1 = time.perf_counter()
            on_token(out)
            streaming += time.perf_counter() - t1  # the caller's time is not the graph's
        if out.stopped == "eos":
            break
        if i + 1 < max_new_tokens:
            step, cache = session.step(np.asarray([token]), cache)
            last = step[0]
    out.decode_seconds = time.perf_counter() - t0 - streaming
    return out
