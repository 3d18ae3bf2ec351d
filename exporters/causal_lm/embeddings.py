"""The token embedding as onnxruntime's ``GatherBlockQuantized``: a 4- or 8-bit table, or lm_head's own codes.

A float embedding table is ``vocab x hidden x 4`` bytes: for a 49k-token vocabulary at hidden 576, 113 MB,
more than the rest of an int4 model. ``com.microsoft.GatherBlockQuantized`` (onnxruntime's CPU provider)
looks rows up in a block-quantized table and dequantizes them. :func:`embedding_quant` decides the table:

* tied embeddings (``lm_head.weight`` is the embedding's weight) whose lm_head is weight-only quantized to
  int4 with a block along the hidden dimension (``bits`` 4; the kernel takes no int8 table, so an int8
  lm_head's codes cannot be shared): the graph's lookup reads lm_head's own stored codes and
  scales (``[hidden, vocab]``, each through a ``Transpose`` onnxruntime folds when it loads the graph), so
  the file holds the table once -- as onnxruntime-genai's builder shares its tied int4 table -- and every
  row is the fake-quant weight lm_head computes with;
* otherwise its own table, quantized round-to-nearest, symmetric, ``block_size`` 32 along hidden: scale
  ``max|w| / (2^(bits-1) - 1)`` per block, codes ``round_half_even(w / scale)``; int4 stored as int4, int8 as
  uint8 with onnxruntime's default zero point 128 (its kernel takes no int8 table).

:func:`replace_gather` rewrites the decode graph's ``Gather`` of ``input_ids`` in place (an export pass);
:attr:`EmbeddingQuant.table` is the dequantized table that lookup returns, which the PyTorch reference uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper
from torch import nn

from exporters.fold import make_initializer
from exporters.graph import initializer_map, to_numpy

MS_DOMAIN = "com.microsoft"
OP = "GatherBlockQuantized"
BLOCK = 32  # the own table's block along hidden (onnxruntime-genai's default for int4)
BITS = (4, 8)
_INT_TYPES = {onnx.TensorProto.INT4: 4, onnx.TensorProto.UINT4: 4, onnx.TensorProto.INT8: 8}


@dataclass
class EmbeddingQuant:
    """How the graph stores the embedding table; ``table``: what a lookup returns, ``[vocab, hidden]``."""

    bits: int
    block_size: int
    table: torch.Tensor
    shared: bool  # lm_head's stored codes (tied embeddings)
    codes: np.ndarray | None = None  # own table: int codes [vocab, hidden]
    scales: np.ndarray | None = None  # own table: [vocab, hidden / block_size] float32

    def summary(self) -> dict:
        return {
            "bits": self.bits,
            "block_size": self.block_size,
            "shared_with_lm_head": self.shared,
            "table_bytes": 0 if self.shared else int(self.table.numel() * self.bits // 8),
            "float32_table_bytes": int(self.table.numel() * 4),
        }


def _embedding(model: nn.Module) -> nn.Module:
    if hasattr(model, "transformer"):
        return model.transformer.wte
    return model.model.embed_tokens


def _lm_head_format(model: nn.Module) -> tuple[int, int] | None:
    """(bits, block) of a weight-only blocked int lm_head (the MatMulNBits form), else None."""
    head = model.lm_head
    wq, iq = getattr(head, "weight_quantizer", None), getattr(head, "input_quantizer", None)
    if wq is None or not wq.enabled or (iq is not None and iq.enabled):
        return None
    d = wq.desc
    sizes = d.block_sizes or {}
    block = sizes.get(-1) or sizes.get(1)  # along the input (hidden) dimension of the [vocab, hidden] weight
    if d.is_fp8 or d.num_bits not in BITS or not isinstance(block, int) or d.dynamic:
        return None
    return int(d.num_bits), int(block)


def rtn_table(weight: torch.Tensor, bits: int, block: int) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """``(codes [vocab, hidden], scales [vocab, hidden / block], dequantized table)``: round-to-nearest,
    symmetric, one scale per block of ``block`` along hidden (a block of zeros: scale 0, codes 0)."""
    w = weight.detach().float()
    v, h = w.shape
    blocks = w.reshape(v, h // block, block)
    bound = 2 ** (bits - 1) - 1
    scale = blocks.abs().amax(dim=-1) / bound
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.clamp(torch.round(blocks / safe[..., None]), -bound - 1, bound)
    table = (codes * scale[..., None]).reshape(v, h)
    return codes.reshape(v, h).to(torch.int64).numpy(), scale.numpy().astype(np.float32), table


def embedding_quant(model: nn.Module, bits: int) -> tuple[EmbeddingQuant, str]:
    """The embedding table of ``model`` at ``bits`` (4 or 8): lm_head's codes where the embeddings are tied to
    an lm_head quantized weight-only at those bits, else its own round-to-nearest table; and a note saying
    why lm_head's codes were not shared ("" where they are, or where the embeddings are not tied)."""
    if bits not in BITS:
        raise ValueError(f"embeddings are stored in {' or '.join(map(str, BITS))} bits, not {bits}")
    emb = _embedding(model)
    tied = model.lm_head.weight is emb.weight
    head = _lm_head_format(model) if tied else None
    if head is not None and head[0] == bits == 4:  # its int8 codes: GatherBlockQuantized takes no int8 table
        with torch.no_grad():
            fq = model.lm_head.weight_quantizer(model.lm_head.weight).detach().float().clone()
        return EmbeddingQuant(bits, head[1], fq, shared=True), ""
    hidden = emb.weight.shape[1]
    if hidden % BLOCK:
        raise ValueError(f"hidden size {hidden} is not a multiple of the embedding block {BLOCK}")
    codes, scales, table = rtn_table(emb.weight, bits, BLOCK)
    note = ""
    if tied and bits == 8:
        note = (
            "onnxruntime's GatherBlockQuantized reads no int8 table: the embedding has its own (uint8) table"
        )
    elif tied:
        note = f"tied embeddings, but lm_head is not weight-only int{bits} blocked: the embedding has a table"
    return EmbeddingQuant(bits, BLOCK, table, shared=False, codes=codes, scales=scales), note


def as_exported(model: nn.Module, summary: dict) -> EmbeddingQuant:
    """The table a decode graph's metadata describes (:meth:`EmbeddingQuant.summary`), from the model it was
    exported from: what :func:`embedding_quant` and :func:`replace_gather` made of it."""
    quant, _ = embedding_quant(model, int(summary["bits"]))
    if quant.shared and not summary["shared_with_lm_head"]:  # replace_gather fell back to its own table
        codes, scales, table = rtn_table(quant.table, quant.bits, BLOCK)
        quant = EmbeddingQuant(quant.bits, BLOCK, table, False, codes, scales)
    return quant


def _lookup(g: onnx.GraphProto, inits: dict) -> onnx.NodeProto | None:
    """The ``Gather`` of ``input_ids`` from a float ``[vocab, hidden]`` table."""
    for n in g.node:
        if (
            n.op_type == "Gather"
            and len(n.input) == 2
            and n.input[1] == "input_ids"
            and n.input[0] in inits
            and len(inits[n.input[0]].dims) == 2
        ):
            return n
    return None


def _lm_head_pair(g: onnx.GraphProto, quantizer_map: dict[str, str], inits: dict):
    """lm_head's weight DequantizeLinear in the MatMulNBits form (``[hidden, vocab]`` codes, ``axis`` 0),
    or None."""
    for n in g.node:
        if n.op_type != "DequantizeLinear" or quantizer_map.get(n.output[0]) != "lm_head.weight_quantizer":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        codes = inits.get(n.input[0])
        if codes is None or codes.data_type not in _INT_TYPES or attrs.get("axis", 1) != 0:
            return None
        return n, attrs.get("block_size", 0)
    return None


def replace_gather(onnx_model: onnx.ModelProto, quant: EmbeddingQuant, quantizer_map: dict[str, str]) -> str:
    """Rewrite the embedding lookup as ``GatherBlockQuantized``, in place (after the MatMulNBits pass:
    lm_head's codes are stored ``[hidden, vocab]``). Returns "" or why lm_head's codes could not be shared
    after all (then the lookup has its own table)."""
    register_schema()
    g = onnx_model.graph
    inits = initializer_map(g)
    gather = _lookup(g, inits)
    if gather is None:
        raise ValueError("the decode graph has no Gather of input_ids from an embedding table")
    name = gather.name.strip("/").replace("/", "_") or "embed_tokens"
    out = gather.output[0]
    note = ""
    if quant.shared:
        pair = _lm_head_pair(g, quantizer_map, inits)
        if pair is not None and _equals(pair[0], pair[1], inits, quant.table):
            dq, block = pair
            # lm_head's [hidden, vocab] codes, scales (and zero points), each through a Transpose that
            # onnxruntime folds at load: one copy in the file, and the DequantizeLinear keeps its initializer
            # to itself (the MatMulNBits rule does not take a weight another node reads)
            nodes, inputs = [], []
            for k, part in enumerate(dq.input[:3]):
                if part:
                    t = helper.make_node(
                        "Transpose", [part], [f"{name}_{k}_vocab_first"], name=f"{name}/T{k}", perm=[1, 0]
                    )
                    nodes.append(t)
                    inputs.append(t.output[0])
            inputs.insert(1, "input_ids")
            nodes.append(
                helper.make_node(
                    OP,
                    inputs,
                    [out],
                    name=f"{name}/{OP}",
                    domain=MS_DOMAIN,
                    gather_axis=0,
                    quantize_axis=1,
                    block_size=block,
                    bits=quant.bits,
                )
            )
            _replace(g, gather, nodes)
            return ""
        note = "lm_head's stored codes differ from its fake-quant weight: the embedding has its own table"
        quant.codes, quant.scales, quant.table = rtn_table(quant.table, quant.bits, BLOCK)
        quant.block_size, quant.shared = BLOCK, False
    codes = quant.codes
    if quant.bits == 4:
        data = make_initializer(f"{name}_codes", codes.astype(np.float32), onnx.TensorProto.INT4)
    else:  # onnxruntime's int8 table is uint8 with the default zero point 128
        data = numpy_helper.from_array((codes + 128).astype(np.uint8), f"{name}_codes")
    scales = numpy_helper.from_array(np.ascontiguousarray(quant.scales), f"{name}_scales")
    g.initializer.extend([data, scales])
    node = helper.make_node(
        OP,
        [data.name, "input_ids", scales.name],
        [out],
        name=f"{name}/{OP}",
        domain=MS_DOMAIN,
        gather_axis=0,
        quantize_axis=1,
        block_size=quant.block_size,
        bits=quant.bits,
    )
    _replace(g, gather, [node])
    return note


def _equals(dq: onnx.NodeProto, block: int, inits: dict, table: torch.Tensor) -> bool:
    """lm_head's stored ``[hidden, vocab]`` codes times their scales (minus zero points) are the table."""
    codes = to_numpy(inits[dq.input[0]]).astype(np.float32)
    scale = numpy_helper.to_array(inits[dq.input[1]]).astype(np.float32)
    zp = to_numpy(inits[dq.input[2]]).astype(np.float32) if len(dq.input) > 2 and dq.input[2] else 0.0
    if codes.shape != tuple(table.shape[::-1]) or not block:
        return False
    rep = np.repeat(scale, block, axis=0)[: codes.shape[0]]
    zrep = np.repeat(zp, block, axis=0)[: codes.shape[0]] if np.ndim(zp) else zp
    return bool(np.array_equal((codes - zrep) * rep, table.numpy().T))


def _replace(g: onnx.GraphProto, old: onnx.NodeProto, new: list[onnx.NodeProto]) -> None:
    i = list(g.node).index(old)
    g.node.remove(old)
    for k, n in enumerate(new):
        g.node.insert(i + k, n)


def register_schema() -> None:
    """``com.microsoft.GatherBlockQuantized`` in onnx's schema registry (the ONNX checker reads it), as
    onnxruntime's ``contrib_defs`` declare it; once per process."""
    from onnx import defs

    if defs.has(OP, MS_DOMAIN):
        return
    P = defs.OpSchema.FormalParameter
    opt = defs.OpSchema.FormalParameterOption.Optional
    attr = defs.OpSchema.Attribute
    types = defs.OpSchema.AttrType
    defs.register_schema(
        defs.OpSchema(
            OP,
            MS_DOMAIN,
            1,
            inputs=[
                P("data", "T1"),
                P("indices", "Tind"),
                P("scales", "T2"),
                P("zero_points", "T1", param_option=opt),
            ],
            outputs=[P("output", "T2")],
            type_constraints=[
                ("T1", ["tensor(int4)", "tensor(uint4)", "tensor(uint8)"], ""),
                ("T2", ["tensor(float)", "tensor(float16)"], ""),
                ("Tind", ["tensor(int32)", "tensor(int64)"], ""),
            ],
            attributes=[
                attr("gather_axis", types.INT, required=False),
                attr("quantize_axis", types.INT, required=False),
                attr("block_size", types.INT, required=False),
                attr("bits", types.INT, required=False),
            ],
        )
    )
