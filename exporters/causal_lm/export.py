"""``export --onnx`` of a causal LM: the decode graph (:mod:`exporters.causal_lm.decoder`) through the export
driver.

The graph is traced on a small step (2 rows, 3 cached positions, 2 new tokens, its token ids from the
checkpoint's example batch) with every size dynamic: batch, new tokens (``sequence``), cached positions
(``past_sequence``) and their sum (``total_sequence``). The forward's parameters are Python names
(``past_key_values_0_key``); the graph's inputs get the names onnxruntime-genai and Optimum use
(``past_key_values.0.key``). Everything else -- Q/DQ folding, MatMulNBits form, metadata, checks, atomic
write -- is :func:`exporters.onnx_export.export_onnx`'s, on the same quantizers under the same names.

With ``contrib_ops`` (the default) the graph takes the forms onnxruntime's CPU provider runs fastest, each
of which :data:`FUSIONS` names and ``fusions`` can leave out:

* ``group_query_attention``: attention as ``GroupQueryAttention`` where its CPU kernel runs the model
  (``head_size`` a multiple of 16);
* ``skip_norm``: each residual ``Add`` and the RMSNorm after it as ``SkipSimplifiedLayerNormalization``
  (Llama-style models whose norms compute ``LlamaRMSNorm``'s arithmetic);
* ``pack_projections``: weight-only projections that read the same tensor as one ``MatMulNBits`` (q/k/v
  straight into ``GroupQueryAttention``, gate/up before a ``Split``; :mod:`exporters.causal_lm.packing`).

``contrib_ops=False`` writes standard ONNX ops only. :attr:`DecodeExport.contrib_ops` lists the contrib ops
the graph holds, :attr:`DecodeExport.fusions` what was fused, :attr:`DecodeExport.note` why a fused form was
not used.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from exporters.causal_lm.attention import total_length_from_shape
from exporters.causal_lm.decode_info import LAYOUT_KEY, NO_DECODE_KEY, DecodeExport
from exporters.causal_lm.decoder import DecoderWithCache, python_name, with_named_forward
from exporters.causal_lm.embeddings import EmbeddingQuant, embedding_quant, replace_gather
from exporters.causal_lm.kv_cache import KVCacheQuant
from exporters.causal_lm.layout import DecoderLayout, NotDecodable, decoder_layout
from exporters.causal_lm.norm import drop_unused_outputs
from exporters.causal_lm.packing import PACKED_KEY, pack_projections
from exporters.fold import drop_unused_initializers
from quantcli.errors import ExportError

GQA_HEAD_MULTIPLE = 16  # onnxruntime's CPU GroupQueryAttention: "head_size shall be a multiple of 16"
TRACE_BATCH, TRACE_PAST, TRACE_SEQ = 2, 3, 2
FUSIONS = ("group_query_attention", "skip_norm", "pack_projections")  # contrib_ops=True: all of them


def decodable(model: nn.Module) -> tuple[DecoderLayout | None, str]:
    """(the model's layout, "") or (None, why no decode graph is written for it)."""
    try:
        return decoder_layout(model), ""
    except NotDecodable as e:
        return None, str(e)


def fused_note(layout: DecoderLayout) -> str:
    """Why onnxruntime's CPU GroupQueryAttention cannot run this model ("" where it can)."""
    if layout.head_size % GQA_HEAD_MULTIPLE:
        return (
            f"head_size {layout.head_size} is not a multiple of {GQA_HEAD_MULTIPLE} (onnxruntime's CPU "
            "GroupQueryAttention needs one): plain attention ops"
        )
    return ""


def trace_inputs(decoder: DecoderWithCache, example: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The step the graph is traced on, keyed by forward's parameter names; token ids from the example
    batch."""
    lo = decoder.layout
    ids = example.get("input_ids")
    if ids is None or ids.dim() != 2:
        ids = torch.zeros(TRACE_BATCH, TRACE_SEQ, dtype=torch.int64)
    ids = ids[:TRACE_BATCH, :TRACE_SEQ].to(torch.int64).clamp(0, lo.vocab_size - 1)
    if ids.shape != (TRACE_BATCH, TRACE_SEQ):
        ids = torch.zeros(TRACE_BATCH, TRACE_SEQ, dtype=torch.int64)
    out = {
        "input_ids": ids,
        "attention_mask": torch.ones(TRACE_BATCH, TRACE_PAST + TRACE_SEQ, dtype=torch.int64),
    }
    if decoder.takes_positions:
        out["position_ids"] = (
            (torch.arange(TRACE_SEQ) + TRACE_PAST)[None].expand(TRACE_BATCH, -1).contiguous()
        )
    gen = torch.Generator().manual_seed(0)
    for name in lo.past_names:  # distinct tensors: torch.export would alias one tensor passed twice
        past = torch.randn(TRACE_BATCH, lo.num_kv_heads, TRACE_PAST, lo.head_size, generator=gen)
        if decoder.cache_dtype == torch.int8:
            past = (past * 40).round().clamp(-128, 127)
        out[python_name(name)] = past.to(decoder.cache_dtype)
    return out


def dynamic_axes(decoder: DecoderWithCache) -> dict[str, dict[int, str]]:
    """Dynamic dimensions of every input (by forward parameter name) and output (by graph name)."""
    lo = decoder.layout
    axes = {
        "input_ids": {0: "batch", 1: "sequence"},
        "attention_mask": {0: "batch", 1: "total_sequence"},
        "logits": {0: "batch", 1: "sequence"},
    }
    if decoder.takes_positions:
        axes["position_ids"] = {0: "batch", 1: "sequence"}
    for name in lo.past_names:
        axes[python_name(name)] = {0: "batch", 2: "past_sequence"}
    for name in lo.present_names:
        axes[name] = {0: "batch", 2: "total_sequence"}
    return axes


def _fusions(contrib_ops: bool, fusions) -> set[str]:
    if fusions is None:
        return set(FUSIONS) if contrib_ops else set()
    unknown = set(fusions) - set(FUSIONS)
    if unknown:
        raise ExportError(
            f"unknown decode-graph fusion {sorted(unknown)[0]!r}; choose from {', '.join(FUSIONS)}"
        )
    return set(fusions)


def decoder_for_export(
    model: nn.Module,
    layout: DecoderLayout,
    contrib_ops: bool,
    fusions=None,
    kv_cache: KVCacheQuant | None = None,
    embeddings: EmbeddingQuant | None = None,
) -> tuple[DecoderWithCache, DecodeExport]:
    """The decode module to trace and what it will be, with the fused forms asked for (``fusions``, default
    :data:`FUSIONS` with ``contrib_ops``, none without) where the model allows them; ``kv_cache``: an int8
    cache's scales (None: float32)."""
    wanted = _fusions(contrib_ops, fusions)
    note = fused_note(layout) if "group_query_attention" in wanted else ""
    fused = "group_query_attention" in wanted and not note
    if kv_cache is not None and tuple(kv_cache.key_scale.shape) != (
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_size,
    ):
        raise ExportError(
            f"the KV cache scales are {list(kv_cache.key_scale.shape)}, the model's cache is "
            f"[{layout.num_layers}, {layout.num_kv_heads}, {layout.head_size}]; recalibrate with --kv-cache"
        )
    decoder = DecoderWithCache(
        model,
        fused=fused,
        layout=layout,
        skip_norm="skip_norm" in wanted,
        kv_cache=kv_cache,
        embeddings=embeddings,
    )
    decoder = with_named_forward(decoder)
    info = DecodeExport(
        layout=layout.to_plain(),
        inputs=decoder.input_names,
        outputs=decoder.output_names,
        contrib_ops=["GroupQueryAttention"] if fused else [],
        note="; ".join(n for n in (note, decoder.skip_norm_note) if n),
        fusions=["attention as GroupQueryAttention"] if fused else [],
        kv_cache=kv_cache.summary() if kv_cache is not None else None,
        embeddings=embeddings.summary() if embeddings is not None else None,
    )
    if embeddings is not None:
        info.contrib_ops.append("GatherBlockQuantized")
    if decoder.skip_norm:
        info.contrib_ops.append("SkipSimplifiedLayerNormalization")
        info.fusions.append("residual Add + RMSNorm as SkipSimplifiedLayerNormalization")
    if fused and layout.family == "gpt2":
        info.fusions.append("c_attn's packed q/k/v into GroupQueryAttention")
    return decoder, info


def export_decoder(
    model: nn.Module,
    example: dict[str, torch.Tensor],
    path: str | Path,
    opset: int | None = None,
    exporter: str = "torchscript",
    *,
    contrib_ops: bool = True,
    fusions=None,
    kv_cache: KVCacheQuant | None = None,
    embedding_bits: int | None = None,
    layout: DecoderLayout | None = None,
    weights_qdq: bool = False,
    metadata: dict[str, str] | None = None,
    provider: str | None = None,
):
    """Export a (quantized, calibrated) causal LM as a decode graph; returns the driver's
    :class:`~exporters.onnx_export.ExportResult` with ``decode`` filled (:class:`DecodeExport` as a dict).
    ``fusions``: which of :data:`FUSIONS` to apply (default: all with ``contrib_ops``, none without);
    ``kv_cache``: an int8 cache (:mod:`exporters.causal_lm.kv_cache`), None for float32;
    ``embedding_bits``: 4 or 8 for a ``GatherBlockQuantized`` embedding table
    (:mod:`exporters.causal_lm.embeddings`), None for float32."""
    from exporters.onnx_export import export_onnx

    layout = layout or decoder_layout(model)
    embeddings, emb_note = None, ""
    if embedding_bits is not None:
        if weights_qdq:
            raise ExportError("--embeddings stores a quantized table; leave out --weights-qdq")
        try:
            embeddings, emb_note = embedding_quant(model, embedding_bits)
        except ValueError as e:
            raise ExportError(f"--embeddings int{embedding_bits}: {e}") from None
    decoder, info = decoder_for_export(model.eval(), layout, contrib_ops, fusions, kv_cache, embeddings)
    info.note = "; ".join(n for n in (info.note, emb_note) if n)
    pack = "pack_projections" in _fusions(contrib_ops, fusions)
    inputs = trace_inputs(decoder, example)
    meta = {**(metadata or {}), LAYOUT_KEY: json.dumps(info.to_dict())}

    def edit(g) -> None:
        declare_shapes(g, decoder)
        drop_unused_outputs(g)
        total_length_from_shape(g)

    def finish(g, mapping: dict[str, str], res) -> None:
        """Pack sibling projections in the final (MatMulNBits) form, store the embedding table quantized;
        the metadata says what was done."""
        if embeddings is not None:
            note = replace_gather(g, embeddings, mapping)
            info.embeddings = embeddings.summary()
            info.note = "; ".join(n for n in (info.note, note) if n)
            info.fusions.append(
                f"embedding lookup as GatherBlockQuantized (int{embeddings.bits}"
                + (", lm_head's codes)" if embeddings.shared else ", its own table)")
            )
            drop_unused_initializers(g)
        if pack and not weights_qdq:
            groups = pack_projections(g, mapping)
            if groups:
                drop_unused_initializers(g)
                gone = {o for grp in groups for o in grp.replaced}
                res.kn_weights = [o for o in res.kn_weights if o not in gone] + [grp.output for grp in groups]
                # counted before packing: each group's members are now one stored weight, one layer
                res.matmul_nbits_layers = len(res.kn_weights)
                res.weights_stored_quantized -= len(gone) - len(groups)
                meta[PACKED_KEY] = json.dumps([grp.to_dict() for grp in groups])
                info.fusions += packed_fusions(groups)
        meta[LAYOUT_KEY] = json.dumps(info.to_dict())

    res = export_onnx(
        decoder,
        inputs,
        path,
        opset,
        exporter,
        dynamic_axes=dynamic_axes(decoder),
        weights_qdq=weights_qdq,
        metadata=meta,
        provider=provider,
        graph_input_names={python_name(n): n for n in decoder.input_names},
        edit_graph=edit,
        finish_graph=finish,
    )
    res.decode = info.to_dict()
    return res


def packed_fusions(groups) -> list[str]:
    """The packed groups in words: ``q/k/v packed into GroupQueryAttention (2 layers)``."""
    counts: dict[str, int] = {}
    for grp in groups:
        short = "/".join(layer.rsplit(".", 1)[-1].removesuffix("_proj") for layer in grp.layers)
        what = f"{short} packed" + (" into GroupQueryAttention" if grp.into_attention else "")
        counts[what] = counts.get(what, 0) + 1
    return [f"{what} ({n} layer{'s' if n > 1 else ''})" for what, n in counts.items()]


def io_shapes(decoder: DecoderWithCache) -> dict[str, list[int | str]]:
    """Every graph input's and output's shape, sizes known from the layout and named dynamic dimensions."""
    lo = decoder.layout
    shapes: dict[str, list[int | str]] = {
        "input_ids": ["batch", "sequence"],
        "attention_mask": ["batch", "total_sequence"],
        "position_ids": ["batch", "sequence"],
        "logits": ["batch", "sequence", lo.vocab_size],
    }
    for name in lo.past_names:
        shapes[name] = ["batch", lo.num_kv_heads, "past_sequence", lo.head_size]
    for name in lo.present_names:
        shapes[name] = ["batch", lo.num_kv_heads, "total_sequence", lo.head_size]
    return shapes


def declare_shapes(onnx_model, decoder: DecoderWithCache) -> None:
    """Write :func:`io_shapes` on the graph's inputs and outputs, in place: shape inference cannot see through
    ``GroupQueryAttention`` (its outputs come out of the exporter with unknown sizes), and the dynamo exporter
    names dynamic dimensions ``s0``, ``s1 + s2``."""
    from onnx import TensorShapeProto

    shapes = io_shapes(decoder)
    for value in [*onnx_model.graph.input, *onnx_model.graph.output]:
        if value.name not in shapes:
            continue
        dims = []
        for d in shapes[value.name]:
            dim = TensorShapeProto.Dimension()
            if isinstance(d, int):
                dim.dim_value = d
            else:
                dim.dim_param = d
            dims.append(dim)
        shape = value.type.tensor_type.shape
        del shape.dim[:]
        shape.dim.extend(dims)


def export_model(
    model: nn.Module,
    example: dict[str, torch.Tensor],
    path: str | Path,
    opset: int | None = None,
    exporter: str = "torchscript",
    *,
    kv_cache: bool = True,
    contrib_ops: bool = True,
    fusions=None,
    cache_quant: KVCacheQuant | None = None,
    embedding_bits: int | None = None,
    dynamic_axes: bool = True,
    **kwargs,
):
    """``export --onnx``: a decode graph for a causal LM of a supported family (``kv_cache``), else the graph
    of the model's own forward (:func:`exporters.onnx_export.export_onnx`). For a model with an ``lm_head``
    that gets no decode graph, ``ExportResult.decode_note`` says why. ``cache_quant``: the decode graph's
    int8 KV cache scales (None: a float32 cache; a prefill graph has no cache)."""
    from exporters.onnx_export import export_onnx

    layout, why = decodable(model) if kv_cache else (None, "")
    if layout is not None:
        if not dynamic_axes:
            raise ExportError(
                "--static-shapes does not apply to a decode graph (its sequence and cache lengths change "
                "at every step); leave it out, or add --no-kv-cache for a prefill graph of fixed shape"
            )
        if kwargs.pop("dynamic_dims", None):
            raise ExportError(
                "--dynamic-dim does not apply to a decode graph (its batch, sequence and cache lengths are "
                "dynamic already); leave it out, or add --no-kv-cache for a prefill graph"
            )
        return export_decoder(
            model,
            example,
            path,
            opset,
            exporter,
            contrib_ops=contrib_ops,
            fusions=fusions,
            kv_cache=cache_quant,
            embedding_bits=embedding_bits,
            layout=layout,
            **kwargs,
        )
    if embedding_bits is not None:
        raise ExportError(f"--embeddings applies to decode graphs: {why or '--no-kv-cache'}")
    note = f"prefill graph, no KV cache: {why}" if why and hasattr(model, "lm_head") else ""
    if note:  # read back by generate, which says why the graph has no cache
        kwargs["metadata"] = {**(kwargs.get("metadata") or {}), NO_DECODE_KEY: note}
    res = export_onnx(model, example, path, opset, exporter, dynamic_axes=dynamic_axes, **kwargs)
    res.decode_note = note
    return res


GENAI_CONFIG = "genai_config.json"


def genai_config(decode: dict, filename: str) -> dict:
    """onnxruntime-genai's ``genai_config.json`` for a decode graph (:class:`DecodeExport` as a dict): the
    input and output names, heads and sizes its ``Model``/``Generator`` read, greedy search by default."""
    lo = decode["layout"]
    inputs = {
        "input_ids": "input_ids",
        "attention_mask": "attention_mask",
        "past_key_names": "past_key_values.%d.key",
        "past_value_names": "past_key_values.%d.value",
    }
    if "position_ids" in decode["inputs"]:
        inputs["position_ids"] = "position_ids"
    first_eos = lo.get("eos_token_id")
    eos = list(lo.get("eos_token_ids") or ()) or ([first_eos] if first_eos is not None else [0])
    first = eos[0]
    bos, pad = lo.get("bos_token_id"), lo.get("pad_token_id")
    return {
        "model": {
            "bos_token_id": bos if bos is not None else first,
            "context_length": lo["max_positions"],
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": filename,
                "head_size": lo["head_size"],
                "hidden_size": lo["hidden_size"],
                "inputs": inputs,
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": lo["num_heads"],
                "num_hidden_layers": lo["num_layers"],
                "num_key_value_heads": lo["num_kv_heads"],
            },
            "eos_token_id": eos if len(eos) > 1 else first,  # a list where the model has several
            "pad_token_id": pad if pad is not None else first,
            # onnxruntime-genai's "gpt2" is its older GPT model (one combined past per layer); this graph has
            # the inputs of its decoder-only models (past_key_values.%d.key/value), which run as "llama"
            "type": lo["model_type"] if lo.get("family") != "gpt2" else "llama",
            "vocab_size": lo["vocab_size"],
        },
        "search": {
            "do_sample": False,
            "max_length": lo["max_positions"],
            "min_length": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": False,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }


def write_genai_config(onnx_path: str | Path, decode: dict) -> Path:
    """``genai_config.json`` beside ``onnx_path`` (written atomically): ``onnxruntime_genai.Model(folder)``
    loads the graph with it (add the model's ``tokenizer.json`` to the folder for ``og.Tokenizer``)."""
    from quantcli.files import atomic_write

    onnx_path = Path(onnx_path)
    target = onnx_path.parent / GENAI_CONFIG
    text = json.dumps(genai_config(decode, onnx_path.name), indent=4) + "\n"
    atomic_write(target, lambda tmp: Path(tmp).write_text(text))
    return target
