"""``verify`` of a decode graph: does the quantized graph generate what the model generates?

Four checks, on held-out token sequences (the sample model's held-out windows, or ``--data``), each row cut
to its unpadded length and to ``max_tokens``:

* ``lm.perplexity_increase`` <= ``max_ppl_increase``: teacher-forced perplexity of the deployed graph (default
  session options; one prefill of each sequence) relative to the float model's, ``ppl_graph / ppl_float - 1``.
  The fake-quant model's perplexity is reported beside them (the graph should equal it; a gap is the export's,
  the rest is quantization's); for a graph with an int8 KV cache, the fake-quant model's keys and values are
  quantized as the cache stores them (``calibrate --kv-cache``), and its embedding rows are the graph's
  quantized table (``export --embeddings``).
* ``lm.token_agreement`` >= ``min_token_agreement``: from the first half of each sequence the float model
  generates ``steps`` greedy tokens; along that continuation, the fraction of steps where the graph's most
  likely token is the float model's (teacher-forced, so one early difference does not decide the rest). The
  first divergence of the graph's own free-running greedy generation (through its KV cache) is reported per
  prompt.
* ``lm.decode_parity`` <= ``max_parity_diff``: logits of a prefill of the first half and one decode step per
  later token, against one prefill of the whole sequence: per decode position ``max |a - b| / max |b|``, and
  the check takes their median (the maximum and where it is are reported). The KV cache must not change the
  logits beyond float noise: a cache error moves every position, while float noise that moves one activation
  code across a rounding boundary of a static int8 graph moves one position (a 5e-3 difference on tiny_llama
  calibrated on 8 samples failed a correct graph when the check took the maximum). MatMulNBits runs at
  float32 compute here (``accuracy_level`` 1), where onnxruntime's default int8 compute can move an
  activation code on a 1e-7 difference.
* ``lm.rms_ratio`` <= ``max_rms_ratio``: the graph computes the fake-quant model: RMS(graph logits -
  fake-quant logits) over the quantization error's RMS (fake-quant against float), on the prefills
  ``lm.decode_parity`` runs (its session, its sequences); the unit and limit of ``fidelity.rms_ratio``. The
  other three passed a graph whose final norm was scaled by 0.7 (perplexity within its 50%, the argmax
  unchanged).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from quantcli.errors import first_line
from quantcli.verify.verdict import MAX_RMS_RATIO, Check, structure_check_of

MAX_PPL_INCREASE = 0.5
MIN_TOKEN_AGREEMENT = 0.5
MAX_PARITY_DIFF = 1e-4
DECODE_STEPS = 16
MAX_SEQUENCES = 16
MAX_TOKENS = 128
#: the shortest held-out row worth judging: a prompt, and tokens after it to predict
MIN_ROW_TOKENS = 4


@dataclass
class LMReport:
    passed: bool
    checks: list[Check]
    perplexity: dict
    generation: dict
    parity: dict
    num_sequences: int
    seconds: float = 0.0
    kind: str = "causal_lm"
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "passed": self.passed,
            "checks": [c.to_dict() for c in self.checks],
            "perplexity": self.perplexity,
            "generation": self.generation,
            "parity": self.parity,
            "num_sequences": self.num_sequences,
            "seconds": self.seconds,
            "notes": self.notes,
        }


def sequences(batches, max_sequences: int = MAX_SEQUENCES, max_tokens: int = MAX_TOKENS) -> list[np.ndarray]:
    """Token id rows of ``batches`` (``input_ids``, and ``attention_mask`` where given: a row keeps its
    unmasked tokens), each cut to ``max_tokens``; rows of fewer than 4 tokens are left out."""
    rows: list[np.ndarray] = []
    for b in batches:
        ids = np.asarray(b["input_ids"])
        mask = np.asarray(b["attention_mask"]) if "attention_mask" in b else np.ones_like(ids)
        for r, m in zip(ids, mask):
            row = r[m.astype(bool)][:max_tokens].astype(np.int64)
            if row.size >= MIN_ROW_TOKENS:
                rows.append(row)
            if len(rows) == max_sequences:
                return rows
    return rows


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    """``[b, n, vocab]`` logits of a PyTorch causal LM (a tensor, or a dict with ``logits``) on ``ids``."""
    t = torch.from_numpy(ids)
    with torch.no_grad():
        try:
            out = model(input_ids=t, attention_mask=torch.ones_like(t))
        except TypeError:  # a model whose forward takes input_ids only (the sample models)
            out = model(input_ids=t)
    out = out["logits"] if isinstance(out, dict) else out
    return out.float().numpy()


def nll(logits: np.ndarray, ids: np.ndarray) -> tuple[float, int]:
    """(sum of next-token negative log-likelihoods in nats, count) of one row: ``logits`` ``[n, vocab]``."""
    z = np.asarray(logits, np.float64)[:-1]
    top = z.max(-1, keepdims=True)
    log_norm = np.log(np.exp(z - top).sum(-1)) + top[:, 0]
    return float((log_norm - z[np.arange(len(z)), ids[1:]]).sum()), len(z)


def greedy_continuation(model, prompt: np.ndarray, steps: int) -> list[int]:
    """The float model's ``steps`` greedy tokens after ``prompt`` (the whole sequence recomputed each
    step)."""
    ids = prompt[None]
    out: list[int] = []
    for _ in range(steps):
        nxt = int(np.argmax(torch_logits(model, ids)[0, -1]))
        out.append(nxt)
        ids = np.concatenate([ids, [[nxt]]], axis=1)
    return out


class _DeployedLM(torch.nn.Module):
    """The fake-quant model as its decode graph computes it: one prefill through the decode module, with the
    graph's int8 KV cache (keys and values quantized as the cache stores them,
    :mod:`exporters.causal_lm.kv_cache`) and its quantized embedding table
    (:mod:`exporters.causal_lm.embeddings`)."""

    def __init__(self, model, kv_cache: dict | None, embeddings: dict | None):
        from exporters.causal_lm.decoder import DecoderWithCache
        from exporters.causal_lm.embeddings import as_exported
        from exporters.causal_lm.kv_cache import KVCacheQuant

        super().__init__()
        self.decoder = DecoderWithCache(
            model,
            kv_cache=KVCacheQuant.from_plain(kv_cache) if kv_cache else None,
            embeddings=as_exported(model, embeddings) if embeddings else None,
        )

    def forward(self, input_ids):
        lo = self.decoder.layout
        b, n = input_ids.shape
        empty = torch.zeros(b, lo.num_kv_heads, 0, lo.head_size, dtype=self.decoder.cache_dtype)
        mask = torch.ones_like(input_ids)
        positions = torch.arange(n)[None].expand(b, n)
        return self.decoder.step(input_ids, mask, positions, [empty] * (2 * lo.num_layers))["logits"]


def as_deployed(model, kv_cache: dict | None = None, embeddings: dict | None = None):
    """``model`` computing its logits as its decode graph does: with the checkpoint's int8 KV cache
    (``kv_cache``: its stored scales) and the graph's quantized embedding table (``embeddings``: the graph's
    metadata); the fake-quant reference of such a graph."""
    return _DeployedLM(model, kv_cache, embeddings).eval()


def with_quantized_cache(model, kv_cache: dict):
    """``model`` with its int8 KV cache (:func:`as_deployed`)."""
    return as_deployed(model, kv_cache)


def is_decode_graph(onnx_path) -> bool:
    import onnx

    from exporters.causal_lm.decode_info import read_decode_info

    try:
        return read_decode_info(onnx.load(str(onnx_path), load_external_data=False)) is not None
    except Exception:  # not an ONNX file: the usual verify path says what is wrong with it
        return False


def _check(name: str, value: float, threshold: float, kind: str, detail: str | None = None) -> Check:
    ok = bool(np.isfinite(value)) and (value <= threshold if kind == "max" else value >= threshold)
    return Check(name, threshold, float(value), ok, kind, None if ok else detail)


def verify_decode_graph(
    onnx_path,
    ckpt,
    batches,
    *,
    steps: int = DECODE_STEPS,
    max_sequences: int = MAX_SEQUENCES,
    max_tokens: int = MAX_TOKENS,
    max_ppl_increase: float = MAX_PPL_INCREASE,
    min_token_agreement: float = MIN_TOKEN_AGREEMENT,
    max_parity_diff: float = MAX_PARITY_DIFF,
    max_rms_ratio: float = MAX_RMS_RATIO,
) -> LMReport:
    """Run the checks (module docstring) of the decode graph ``onnx_path`` against the calibrated checkpoint
    ``ckpt`` on ``batches``."""
    import onnxruntime as ort

    from exporters.causal_lm.runner import DecodeSession, read_info
    from exporters.graph import read_onnx
    from quantcli.errors import DataError

    t0 = time.perf_counter()
    thresholds = (max_ppl_increase, min_token_agreement, max_parity_diff, max_rms_ratio)
    graph = read_onnx(onnx_path)  # its external data too: a missing or corrupt file is a one-line error
    info = read_info(onnx_path)
    context = info.layout.get("max_positions")
    if context:
        if steps >= int(context):
            raise DataError(
                f"--decode-steps {steps} cannot follow a prompt within the graph's context of {context} "
                f"positions; pass at most {int(context) - 1}"
            )
        # within the graph's context: a sequence, and a prompt (half of one) with the steps generated after it
        max_tokens = min(max_tokens, int(context))
        steps = max(1, min(steps, int(context) - max_tokens // 2))
    rows = sequences(batches, max_sequences, max_tokens)
    if not rows:
        raise DataError(
            f"no held-out sequence of {MIN_ROW_TOKENS} tokens or more to verify a language model on; pass "
            f"--data with longer texts (and, where --max-length is given, {MIN_ROW_TOKENS} or more)"
        )
    deployed = DecodeSession(onnx_path)
    vocab = deployed.session.get_outputs()[0].shape[-1]
    top = max(int(r.max()) for r in rows)
    if isinstance(vocab, int) and (top >= vocab or min(int(r.min()) for r in rows) < 0):
        raise DataError(
            f"token ids in the data range up to {top}, outside the graph's vocabulary of {vocab}; pass data "
            "tokenized for this model"
        )
    so = ort.SessionOptions()
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    exact = DecodeSession(onnx_path, so)
    structure = structure_check(graph, ckpt)
    if not structure.passed:  # another model's or another calibration's graph: nothing else is meaningful
        return LMReport(False, [structure], {}, {}, {}, len(rows), time.perf_counter() - t0)
    float_model, fake = ckpt.float_model().eval(), ckpt.model.eval()
    kv = ckpt.kv_cache if deployed.cache_dtype == np.int8 else None
    if kv is not None or info.embeddings:
        fake = as_deployed(fake, kv, info.embeddings)
    try:
        report = _measure(deployed, exact, float_model, fake, rows, steps, t0, thresholds)
        report.checks.insert(0, structure)
        return report
    except _graph_errors() as e:  # the graph loads but a step fails: a failed check, not bad input
        check = Check("lm.graph_runs", 1.0, 0.0, False, "min", f"{type(e).__name__}: {first_line(e, 300)}")
        return LMReport(False, [check], {}, {}, {}, len(rows), time.perf_counter() - t0)


def structure_check(graph, ckpt) -> Check:
    """The structure check of :mod:`quantcli.verify.structure` on a decode graph: every quantizer of the
    checkpoint has its Q/DQ pair with exactly the scale and zero point its amax implies, weight codes
    included. Weights packed into one (q/k/v, gate/up: :mod:`exporters.causal_lm.packing`) are checked as
    their members, the packed codes, scales and zero points cut back into each member's columns
    (:func:`unpacked`). A graph of another model or another calibration fails it."""
    from quantcli.verify.structure import check_structure

    found, _ = check_structure(unpacked(graph), ckpt, decode=True)
    problems = (found.get("problems") or []) + kv_scale_problems(graph, ckpt)
    return structure_check_of(found, problems, not problems)


def kv_scale_problems(graph, ckpt) -> list[str]:
    """Where an int8 KV cache's scales in the graph are not the checkpoint's (``calibrate --kv-cache``),
    exactly: each layer's ``GroupQueryAttention`` ``k_scale`` and ``v_scale``, or, in a standard-ops graph,
    the scale each layer's new keys and values are divided by before their codes join the cache and the
    scales the cache's codes are multiplied by when attention reads them (:func:`plain_cache_scales`). A
    graph that runs a float cache (``export --float-kv-cache``) has none to compare."""
    import re

    from exporters.causal_lm.attention import KV_SCALE_INPUT
    from exporters.causal_lm.kv_cache import KVCacheQuant
    from exporters.fold import constant_value

    if ckpt.kv_cache is None:
        return []
    want = KVCacheQuant.from_plain(ckpt.kv_cache)
    found: dict[tuple[int, int], list] = {}  # (layer, 0 key / 1 value) -> the scales the graph holds
    for n in graph.graph.node:
        if n.op_type != "GroupQueryAttention" or len(n.input) <= KV_SCALE_INPUT + 1:
            continue
        # its layer: the cache it writes (present.{i}.key), whatever the family names its blocks (GPT-2: h.0)
        layer = next(filter(None, (re.fullmatch(r"present\.(\d+)\.key", o) for o in n.output)), None)
        values = [
            constant_value(graph, x) if x else None for x in n.input[KV_SCALE_INPUT : KV_SCALE_INPUT + 2]
        ]
        if layer is not None and all(v is not None for v in values):
            for kind, (value, _) in enumerate(values):
                found[(int(layer.group(1)), kind)] = [value]
    if not found:
        found = plain_cache_scales(graph)
    problems = []
    for (i, kind), scales in sorted(found.items()):
        name = ("key", "value")[kind]
        if scales is None:
            problems.append(f"layer {i}: the int8 KV cache's {name} scales are not found in the graph")
            continue
        ref = want.layer_scales(i)[kind].detach().cpu().numpy().astype(np.float32)
        if any(not _broadcasts_equal(got, ref) for got in scales):
            problems.append(
                f"layer {i}: the int8 KV cache's {name} scales differ from the checkpoint's (calibrate "
                "--kv-cache); export the checkpoint again"
            )
    return problems


def _broadcasts_equal(got: np.ndarray, ref: np.ndarray) -> bool:
    """``got`` holds exactly ``ref``'s values, in ``ref``'s shape or one that broadcasts to the same tensor
    (a per-tensor scale ``[1]`` or a scalar)."""
    got = np.asarray(got, np.float32)
    try:
        return bool(np.array_equal(np.broadcast_to(got, ref.shape), ref)) and got.size in (1, ref.size)
    except ValueError:
        return False


def plain_cache_scales(graph) -> dict[tuple[int, int], list | None]:
    """The scales of a standard-ops graph's int8 KV cache, by ``(layer, 0 key / 1 value)``: for each int8
    ``present.{i}.key``/``value`` output, the constant its new entries are divided by (``Div`` -> ``Round``
    -> ``Clip`` -> ``Cast`` into the ``Concat`` that appends them) and the constants the cached codes are
    multiplied by where they are read (``Cast`` -> ``Mul``); ``None`` where that pattern is not found."""
    import re

    import onnx

    from exporters.fold import constant_value
    from exporters.graph import consumer_map, producer_map

    producer, consumers = producer_map(graph.graph), consumer_map(graph)

    def constant(name):
        value = constant_value(graph, name)
        return None if value is None else value[0]

    def up_to(name, op, through):
        n = producer.get(name)
        while n is not None and n.op_type in through:
            n = producer.get(n.input[0])
        return n if n is not None and n.op_type == op else None

    def read_scales(name, seen=0):
        """The constants the codes ``name`` are multiplied by, through Casts, wherever they are read."""
        out = []
        for c in consumers.get(name, []):
            if c.op_type == "Cast" and seen < 4:
                out += read_scales(c.output[0], seen + 1)
            elif c.op_type == "Mul":
                other = c.input[1] if c.input[0] == name else c.input[0]
                out.append(constant(other))
        return out

    found: dict[tuple[int, int], list | None] = {}
    for out in graph.graph.output:
        m = re.fullmatch(r"present\.(\d+)\.(key|value)", out.name)
        if m is None or out.type.tensor_type.elem_type != onnx.TensorProto.INT8:
            continue
        key = (int(m.group(1)), 0 if m.group(2) == "key" else 1)
        concat = up_to(out.name, "Concat", ("Cast", "Identity"))
        divs = [up_to(x, "Div", ("Cast", "Clip", "Round")) for x in (concat.input if concat else [])]
        divs = [d for d in divs if d is not None]
        if concat is None or len(divs) != 1:
            found[key] = None
            continue
        scales = [constant(divs[0].input[1]), *read_scales(concat.output[0])]
        found[key] = None if any(v is None for v in scales) or len(scales) < 2 else scales
    return found


def unpacked(graph):
    """A copy of the decode ``graph`` in which each packed weight's members have their own DequantizeLinear
    again (its codes, scales and zero points cut along the columns, in the order and widths the metadata
    names), mapped to their quantizers, beside the packed one that the graph computes with. The members'
    pairs are read, not run: the structure check compares them with the checkpoint, value for value."""
    import json

    import onnx
    from onnx import helper

    from exporters.causal_lm.packing import PACKED_KEY
    from exporters.fold import make_initializer
    from exporters.graph import QUANTIZERS_KEY, initializer_map, producer_map, to_numpy
    from exporters.matmul_nbits import KN_WEIGHTS_KEY

    meta = {p.key: p.value for p in graph.metadata_props}
    if PACKED_KEY not in meta:
        return graph
    out = onnx.ModelProto()
    out.CopyFrom(graph)
    g, inits = out.graph, initializer_map(out.graph)
    producers = producer_map(g)
    names, kn = json.loads(meta.get(QUANTIZERS_KEY, "{}")), json.loads(meta.get(KN_WEIGHTS_KEY, "[]"))
    for group in json.loads(meta[PACKED_KEY]):
        dq = producers[group["output"]]
        edges = np.cumsum([0, *group["columns"]])
        for k, (member, quantizer) in enumerate(zip(group["replaced"], group["quantizers"])):
            parts = []
            for j, src in enumerate(dq.input):
                if not src:
                    parts.append("")
                    continue
                t = inits[src]
                piece = to_numpy(t)[..., edges[k] : edges[k + 1]]
                name = f"{member}__member_{j}"
                g.initializer.append(make_initializer(name, np.ascontiguousarray(piece), t.data_type))
                parts.append(name)
            g.node.append(
                helper.make_node(
                    "DequantizeLinear", parts, [member], name=f"{member}__member", domain=dq.domain
                )
            )
            g.node[-1].attribute.extend(dq.attribute)
            if quantizer:
                names[member] = quantizer
                kn.append(member)
    for key, value in ((QUANTIZERS_KEY, names), (KN_WEIGHTS_KEY, kn)):
        entry = next((p for p in out.metadata_props if p.key == key), None) or out.metadata_props.add(key=key)
        entry.value = json.dumps(value)
    return out


def _graph_errors() -> tuple[type[BaseException], ...]:
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    return tuple(
        getattr(state, n)
        for n in ("Fail", "InvalidArgument", "RuntimeException", "EPFail")
        if hasattr(state, n)
    )


def _measure(deployed, exact, float_model, fake, rows, steps, t0, thresholds) -> LMReport:
    from exporters.causal_lm.runner import generate
    from quantcli.verify.stats import PairStats, ratio

    max_ppl_increase, min_token_agreement, max_parity_diff, max_rms_ratio = thresholds

    # teacher-forced perplexities, row by row (a row's logits are [tokens, vocab]: an LLM's are large); the
    # fake-quant and float logits of the rows decode parity reads are kept for lm.rms_ratio
    parity_rows = max(1, min(4, len(rows)))
    sums, kept = {k: [0.0, 0] for k in ("float", "fake_quant", "graph")}, []
    for i, row in enumerate(rows):
        z = {
            "float": torch_logits(float_model, row[None])[0],
            "fake_quant": torch_logits(fake, row[None])[0],
            "graph": deployed.logits(row[None])[0],
        }
        for k, v in z.items():
            s, n = nll(v, row)
            sums[k][0], sums[k][1] = sums[k][0] + s, sums[k][1] + n
        if i < parity_rows:
            kept.append((z["fake_quant"], z["float"]))
    ppl = {k: math.exp(s / n) for k, (s, n) in sums.items()}
    increase = ppl["graph"] / ppl["float"] - 1.0

    agree, total, divergence = 0, 0, []
    for row in rows:
        prompt = row[: max(1, len(row) // 2)]
        want = greedy_continuation(float_model, prompt, steps)
        seq = np.concatenate([prompt, want])[None]
        got = deployed.logits(seq)[0, len(prompt) - 1 : -1].argmax(-1)
        agree += int((got == np.asarray(want)).sum())
        total += steps
        free = generate(deployed, prompt.tolist(), steps, stop_at_eos=False).tokens
        diff = [i for i, (a, b) in enumerate(zip(free, want)) if a != b]
        divergence.append(diff[0] if diff else None)
    agreement = agree / total

    per_position, worst, where = [], 0.0, None
    # lm.rms_ratio: the graph computes the fake-quant model: its exact session's logits (the prefills parity
    # compares with) against the model's, in units of the quantization error (fake-quant against float), as
    # fidelity.rms_ratio measures a graph without a KV cache; perplexity and agreement alone passed a graph
    # whose logits were scaled by 0.7
    fid, qerr = PairStats(), PairStats()
    for k, (row, (fq, fl)) in enumerate(zip(rows, kept)):
        half = max(1, len(row) // 2)
        a = exact.stepwise_logits(row[None], half)
        b = exact.logits(row[None])
        fid.add(b[0], fq)
        qerr.add(fq, fl)
        r = np.abs(a - b).max(-1)[0] / max(float(np.abs(b).max()), 1e-30)  # per position
        r = np.where(np.isfinite(r), r, np.inf)
        per_position.extend(r[half:].tolist())
        if r.max() > worst:
            worst, where = float(r.max()), f"sequence {k}, position {int(np.argmax(r))}"
    # a KV-cache error moves every decode position; float noise that moves one activation code across a
    # rounding boundary moves one position (and a little of the cache after it): the median tells them apart
    parity = float(np.median(per_position)) if per_position else 0.0
    rms_ratio = ratio(fid.rms, qerr.error_scale)
    moved = sum(v > max_parity_diff for v in per_position)
    where = f"{moved} of {len(per_position)} decode positions differ; the most at {where}" if moved else None

    first = [d for d in divergence if d is not None]
    checks = [
        _check(
            "lm.perplexity_increase",
            increase,
            max_ppl_increase,
            "max",
            f"perplexity {ppl['graph']:.4g} vs float {ppl['float']:.4g} (fake-quant {ppl['fake_quant']:.4g})",
        ),
        _check(
            "lm.token_agreement",
            agreement,
            min_token_agreement,
            "min",
            f"first divergence of free-running greedy generation at step {min(first)}" if first else None,
        ),
        _check("lm.decode_parity", parity, max_parity_diff, "max", where),
        _check(
            "lm.rms_ratio",
            rms_ratio,
            max_rms_ratio,
            "max",
            f"the graph's logits are {rms_ratio:.3g}x the quantization error from the fake-quant model's "
            "(exact session): it does not compute what was calibrated",
        ),
    ]
    return LMReport(
        passed=all(c.passed for c in checks),
        checks=checks,
        perplexity={
            **ppl,
            "increase": increase,
            "tokens": int(sum(len(r) - 1 for r in rows)),
            "rms_ratio": rms_ratio,
        },
        generation={
            "steps": steps,
            "prompts": len(rows),
            "token_agreement": agreement,
            "first_divergence": divergence,
            "identical_generations": sum(d is None for d in divergence),
        },
        parity={
            "median_relative_diff": parity,
            "max_relative_diff": worst,
            "positions_beyond_threshold": int(moved),
            "positions": len(per_position),
            "where": where,
            "sequences": parity_rows,
        },
        num_sequences=len(rows),
        seconds=time.perf_counter() - t0,
    )
