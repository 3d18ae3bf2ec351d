"""The structure check: the graph holds every quantizer the checkpoint has, with exactly the numbers its amax
implies.

Per enabled quantizer: its Q/DQ pair is in the graph (found through the exporter's quantizer map), its float32
scale and its zero point are the ones its amax implies, and stored weight codes decode to the checkpoint's
fake-quant weights; stored int32 bias codes and scales equal the checkpoint's, exactly. A quantizer without a
pair is *pruned* (information, not a failure) when its output reaches none of the model's outputs -- the
exporter removed it as dead code, like a ``BertModel``'s pooler under mean pooling -- and *missing* (a
failure) otherwise. Which one is decided from the checkpoint's model, traced by autograd
(:func:`quantcli.nn.usage.unused_quantizers`), not from what the file claims.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import torch

from exporters.dynamic_linear import dynamic_layers
from exporters.graph import (
    QUANTIZERS_KEY,
    QdqPair,
    consumer_map,
    initializer_map,
    is_int32_bias,
    producer_map,
    pruned_quantizers,
    qdq_pairs,
    quantizer_map,
    to_numpy,
    traced_branches,
    unread_inputs,
)
from exporters.onnxruntime.placement import propagated_copy_problems
from exporters.onnxruntime.recurrent import recurrent_layers
from quantcli.errors import VerifyError, few, first_line
from quantcli.inputs.batch_axes import head
from quantcli.inputs.checkpoint import Calibrated
from quantcli.nn.recurrent import onnx_layers
from quantcli.nn.tensor_quantizer import owner, quantizers, role, uncalibrated
from quantcli.nn.usage import unused_quantizers
from quantcli.quant import arithmetic
from quantcli.quant.granularity import broadcast_onnx_param
from quantcli.verify.stats import PairStats

UINT8_OFFSET = 128  # int8 codes q in [-128, 127] are uint8 codes q + 128 with zero point 128


def _signed_symmetric(q) -> bool:
    d = q.desc
    return not (d.is_fp8 or d.asymmetric or d.unsigned) and isinstance(d.num_bits, int) and d.num_bits <= 8


def expected_scale(q) -> tuple[np.ndarray, np.ndarray]:
    """(scale, zero point) a calibrated quantizer implies, flattened, float32."""
    d = q.desc
    a = q.amax.detach().cpu().to(torch.float32)
    if d.asymmetric:
        from quantcli.quant.arithmetic import affine_qparams

        s, zp = affine_qparams(q.amin if q.amin is not None else torch.zeros(()), a, d.num_bits)
        return s.reshape(-1).numpy(), zp.reshape(-1).to(torch.float32).numpy()
    bound = arithmetic.FP8_E4M3_MAX if d.is_fp8 else arithmetic.symmetric_bound(d.num_bits, d.unsigned)
    s = arithmetic.symmetric_scale(a, bound).reshape(-1).numpy()
    return s, np.zeros(1, np.float32)


def expected_scales(ckpt: Calibrated) -> dict[str, np.ndarray]:
    """Scale each enabled, calibrated quantizer implies (for tests and tools)."""
    return {
        name: expected_scale(q)[0]
        for name, q in quantizers(ckpt.model).items()
        if q.enabled and q.amax is not None and not q.dynamic_uint8
    }


def dequantize(codes, scale, zp, axis, block) -> np.ndarray:
    """ONNX DequantizeLinear of codes with the parameters in ONNX layout."""
    shape = tuple(np.shape(codes))
    s = broadcast_onnx_param(torch.from_numpy(np.asarray(scale, np.float32)), shape, axis, block)
    z = broadcast_onnx_param(torch.from_numpy(np.asarray(zp, np.float32)), shape, axis, block)
    return arithmetic.dequantize_linear(torch.from_numpy(np.asarray(codes, np.float32)), s, z).numpy()


def graph_weight(p: QdqPair, inits: dict[str, onnx.TensorProto]) -> np.ndarray | None:
    """The dequantized weight as the graph computes it (stored codes, or a float initializer through its Q),
    in the layout of the quantizer's tensor (``[out, in]`` also where the codes are stored ``[in, out]`` for
    MatMulNBits)."""
    if p.tensor not in inits:
        return None
    values = to_numpy(inits[p.tensor]).astype(np.float32)
    if p.stored == "runtime":
        from exporters.fold import quantize_codes
        from quantcli.quant.formats import BY_NAME

        values = quantize_codes(
            values, p.scale, p.zero_point, BY_NAME[p.format].elem_type, p.axis, p.block_size
        )
    deq = dequantize(
        values, p.scale.astype(np.float32), p.zero_point.astype(np.float32), p.axis, p.block_size
    )
    return p.quantizer_layout(deq)


def _weight_operands(ckpt: Calibrated) -> dict[str, torch.Tensor]:
    """``<layer>.weight`` -> the tensor a layer's weight quantizer quantizes, where that is not the layer's
    ``weight`` parameter: a computed layer's operand (:mod:`quantcli.nn.computed`), which is its parameter
    under another name (``nn.MultiheadAttention``'s ``in_proj_weight``) or a tensor its forward computes from
    its parameters (weight standardisation: read on one forward of the example batch)."""
    from quantcli.nn.computed import ComputedLayer, weight_operands

    out: dict[str, torch.Tensor] = {}
    for name, m in ckpt.model.named_modules():
        if isinstance(m, ComputedLayer) and not m.weight_derived and m.weight_name != "weight":
            out[f"{name}.weight" if name else "weight"] = m.weight_source()
    derived = weight_operands(ckpt.model, ckpt.example)
    out.update({f"{owner(q)}.weight" if owner(q) else "weight": t for q, t in derived.items()})
    return out


def _weight_row(name: str, q, p: QdqPair, inits, params) -> tuple[dict[str, Any] | None, str | None]:
    """Per-layer row of a weight quantizer and a problem, if its stored codes differ from the checkpoint's."""
    module = owner(name)
    w = params.get(f"{module}.weight" if module else "weight")
    got = graph_weight(p, inits)
    if w is None or got is None:
        return None, None
    with torch.no_grad():  # the parameter itself: within verify's constant_weights, its one quantization
        want = q(w).cpu().numpy()
    if got.shape != want.shape:
        return None, f"stored weight has shape {list(got.shape)}, the checkpoint's {list(want.shape)}"
    local = PairStats()
    local.add(want, w.detach().cpu().numpy())
    bad = int(np.count_nonzero(got != want))
    row = {
        "quantizer": name,
        "module": module,
        "kind": "weight",
        "snr_db": local.snr_db,
        "max_abs_error": local.max_abs,
        "identical_codes": 1.0 - bad / max(got.size, 1),
    }
    row["identical_codes_end_to_end"] = row["identical_codes"]
    return row, (f"{bad} stored weight code(s) differ from the checkpoint's weights" if bad else None)


def _check_dynamic_layers(
    model: onnx.ModelProto,
    ckpt: Calibrated,
    qs: dict,
    problems: dict[str, list[str]],
    rows: list[dict[str, Any]],
) -> set[str]:
    """Structure of the ``DynamicQuantizeLinear -> MatMulInteger`` layers (:mod:`exporters.dynamic_linear`).

    The input quantizer has no scale to compare (it is computed at run time; ``fidelity.codes`` checks it on
    the sample); the weight's float32 scale must be ``amax / bound`` exactly, its zero point 0 and its stored
    codes the checkpoint's. Returns the quantizer names found in such layers; appends the weights' per-layer
    rows."""
    found: set[str] = set()
    inits = initializer_map(model.graph)
    weights = dict(ckpt.model.named_parameters())
    for layer in dynamic_layers(model):
        found |= {n for n in (layer.input_quantizer, layer.weight_quantizer) if n is not None}
        wname = layer.weight_quantizer
        if wname not in qs:
            continue
        q = qs[wname]
        want, _ = expected_scale(q)
        got = layer.weight_scale
        if got is None or got.reshape(-1).shape != want.shape or not np.array_equal(got.reshape(-1), want):
            problems.setdefault(wname, []).append(
                "weight scale (in the Mul after MatMulInteger) differs from amax/bound"
            )
            continue
        if layer.weight_zero_point is not None and np.any(layer.weight_zero_point != 0):
            problems.setdefault(wname, []).append("weight zero point is not 0")
        module = owner(wname)
        w = weights.get(f"{module}.weight" if module else "weight")
        if layer.weight in inits and w is not None:
            with torch.no_grad():
                want_w = q(w.detach()).cpu().numpy()
            codes = to_numpy(inits[layer.weight]).astype(np.float32)  # (K, N)
            scale = want.reshape(1, -1) if want.size > 1 else want.reshape(())
            deq = (codes * scale).astype(np.float32)
            if getattr(ckpt.model.get_submodule(module), "weight_axis", 0) == 0:
                deq = deq.T  # a Linear's weight is (N, K); an x @ W + b layer's (transformers' Conv1D) (K, N)
            bad = int(np.count_nonzero(deq != want_w)) if deq.shape == want_w.shape else want_w.size
            if bad:
                problems.setdefault(wname, []).append(
                    f"{bad} stored weight code(s) differ from the checkpoint's weights"
                )
            local = PairStats()
            local.add(want_w, w.detach().cpu().numpy())
            same = 1.0 - bad / max(want_w.size, 1)
            rows.append(
                {
                    "quantizer": wname,
                    "module": module,
                    "kind": "weight",
                    "snr_db": local.snr_db,
                    "max_abs_error": local.max_abs,
                    "identical_codes": same,
                    "identical_codes_end_to_end": same,
                }
            )
    return found


def _check_recurrent_layers(
    model: onnx.ModelProto,
    ckpt: Calibrated,
    qs: dict,
    problems: dict[str, list[str]],
    rows: list[dict[str, Any]],
) -> set[str]:
    """The ``DynamicQuantizeLSTM`` layers (:mod:`exporters.onnxruntime.recurrent`): their stored int8 codes
    and float32 scales must be the checkpoint's LSTM weights quantized as :class:`QuantLSTM` quantizes them,
    their zero points 0. Returns the quantizer names found in such layers; appends a row per layer."""
    found: set[str] = set()
    inits = initializer_map(model.graph)
    want = {layer.name: layer for layer in onnx_layers(ckpt.model)}
    for got in recurrent_layers(model):
        found |= set(got.quantizers)
        expected = want.get(got.layer)
        where = next((q for q in got.quantizers if q in qs), got.layer)
        if expected is None:
            problems.setdefault(where, []).append(
                f"{got.node.name}: the checkpoint has no quantized LSTM layer {got.layer}"
            )
            continue
        stored = [to_numpy(inits[i]) if i in inits else None for i in got.node.input]
        checks = [
            ("input weight codes", 1, expected.w_codes),
            ("recurrent weight codes", 2, expected.r_codes),
            ("input weight scale", 8, expected.w_scale),
            ("input weight zero point", 9, torch.zeros(tuple(expected.w_scale.shape))),
            ("recurrent weight scale", 10, expected.r_scale),
            ("recurrent weight zero point", 11, torch.zeros(tuple(expected.r_scale.shape))),
        ]
        bad = 0
        for what, index, values in checks:
            value = stored[index] if index < len(stored) else None
            ref = values.numpy()
            if value is None or value.shape != ref.shape:
                problems.setdefault(where, []).append(f"{got.node.name}: {what} missing or of another shape")
                bad += ref.size
            elif not np.array_equal(value.astype(np.float64), ref.astype(np.float64)):
                n = int(np.count_nonzero(value.astype(np.float64) != ref.astype(np.float64)))
                problems.setdefault(where, []).append(f"{got.node.name}: {n} {what} value(s) differ")
                bad += n
        total = expected.w_codes.numel() + expected.r_codes.numel()
        rows.append(
            {
                "quantizer": where,
                "module": got.layer,
                "kind": "weight (DynamicQuantizeLSTM)",
                "identical_codes": 1.0 - min(bad, total) / max(total, 1),
                "identical_codes_end_to_end": 1.0 - min(bad, total) / max(total, 1),
            }
        )
    return found


def _bias_layer(node: onnx.NodeProto, producers, dq_quantizer: dict[str, str]) -> str | None:
    """The module whose int32 bias ``node`` (the bias's consumer: Conv, Gemm, or the Add after a MatMul) adds:
    the one whose weight quantizer's DequantizeLinear feeds the same op (or the MatMul before the Add)."""
    for candidate in (node, *(producers.get(i) for i in node.input)):
        if candidate is None:
            continue
        for i in candidate.input:
            name = dq_quantizer.get(i, "")
            if role(name) == "weight_quantizer":
                return owner(name)
    return None


def _check_biases(
    model: onnx.ModelProto, ckpt: Calibrated, pairs: list[QdqPair], problems: dict[str, list[str]]
) -> int:
    """Stored int32 bias codes and scales against the checkpoint's (:meth:`QuantMixin.int32_bias_constants`),
    exactly, as weight codes are. Returns how many biases were compared."""
    inits, producers, consumers = initializer_map(model.graph), producer_map(model.graph), consumer_map(model)
    dq_quantizer = {p.output: p.quantizer for p in pairs if p.quantizer}
    compared = 0
    for n in model.graph.node:
        if not is_int32_bias(n, inits) or n.input[1] not in inits:
            continue
        layer = next(
            (m for c in consumers.get(n.output[0], []) if (m := _bias_layer(c, producers, dq_quantizer))),
            None,
        )
        module = _submodule(ckpt.model, layer)
        constants = module.int32_bias_constants() if hasattr(module, "int32_bias_constants") else None
        if constants is None:
            continue
        want_codes, want_scale = (t.detach().cpu().numpy().astype(np.float64) for t in constants)
        codes = to_numpy(inits[n.input[0]]).astype(np.float64).reshape(-1)
        scale = to_numpy(inits[n.input[1]]).astype(np.float32).reshape(-1)
        compared += 1
        where = f"{layer}.bias"
        if codes.shape != want_codes.shape:
            problems.setdefault(where, []).append(
                f"int32 bias has {codes.size} codes, the checkpoint's {want_codes.size}"
            )
            continue
        bad = np.flatnonzero(codes != want_codes)
        if bad.size:
            i = int(bad[0])
            problems.setdefault(where, []).append(
                f"{bad.size} stored int32 bias code(s) differ from the checkpoint's (e.g. channel {i}: "
                f"{int(codes[i])} vs {int(want_codes[i])})"
            )
        if not np.array_equal(np.broadcast_to(scale, want_scale.shape), want_scale.astype(np.float32)):
            problems.setdefault(where, []).append("int32 bias scale differs from input scale x weight scale")
    return compared


def _submodule(model: torch.nn.Module, path: str | None) -> torch.nn.Module | None:
    if path is None:
        return None
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _no_metadata(pairs: int, quantizers: int) -> str:
    """What a graph without ``quantcli.quantizers`` lacks, and what that costs."""
    return (
        f"the graph has no {QUANTIZERS_KEY} metadata (which Q/DQ pair belongs to which quantizer; "
        f"quantcli "
        "export writes it, an editor that drops metadata_props loses it), so its "
        f"{pairs} Q/DQ pair(s) cannot be matched to the checkpoint's {quantizers} quantizer(s): their "
        f"scales, "
        "zero points, weight and bias codes are not checked and no quantizer is replayed (only the outputs "
        "are compared); re-export it with quantcli export, or copy the metadata back"
    )


def check_structure(
    model: onnx.ModelProto, ckpt: Calibrated, decode: bool = False
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the structure section of the report, per-layer rows of the weight quantizers). ``decode``: a causal
    LM's decode graph, whose inputs are the checkpoint's and its attention mask and KV cache besides."""
    graph_inputs = [
        i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}
    ]
    read = [n for n in ckpt.input_names if n not in unread_inputs(model)]  # export left the others out
    # by name: the checkpoint keeps the data's order (an .npz saved y, x), the graph forward's (x, y)
    if (not set(read) <= set(graph_inputs)) if decode else sorted(graph_inputs) != sorted(read):
        raise VerifyError(
            f"the ONNX inputs {graph_inputs} do not match the checkpoint's inputs "
            f"{ckpt.input_names}; "
            "export this checkpoint with `quantcli export` or pass the matching --reference"
        )
    all_pairs = qdq_pairs(model)
    pairs: dict[str, QdqPair] = {}
    for p in all_pairs:
        if p.quantizer:
            pairs.setdefault(p.quantizer, p)
    qs = {n: q for n, q in quantizers(ckpt.model).items() if q.enabled}
    missing = uncalibrated(ckpt.model)
    if missing:
        raise VerifyError(
            f"the reference checkpoint's quantizer(s) {few(missing, 3)} have no amax (a damaged "
            "or edited checkpoint); calibrate the model again"
        )
    inits = initializer_map(model.graph)
    params = {**dict(ckpt.model.named_parameters()), **_weight_operands(ckpt)}
    problems: dict[str, list[str]] = {}
    rows: list[dict[str, Any]] = []
    dynamic = _check_dynamic_layers(model, ckpt, qs, problems, rows)
    dynamic |= _check_recurrent_layers(model, ckpt, qs, problems, rows)
    absent = sorted(set(qs) - set(pairs) - dynamic)
    one = head(ckpt.example, 1)  # connectivity does not depend on the batch size
    unused = (unused_quantizers(ckpt.model, one) or set()) if absent else set()
    pruned = [n for n in absent if n in unused]
    if absent and all_pairs and not quantizer_map(model):
        problems["graph metadata"] = [_no_metadata(len(all_pairs), len(qs))]
    else:
        for name in absent:
            if name not in unused:
                problems.setdefault(name, []).append("Q/DQ pair missing from the graph (its output is used)")
    for name, q in qs.items():
        p = pairs.get(name)
        if p is None:
            continue
        want, want_zp = expected_scale(q)
        got = p.quantizer_layout(p.scale).reshape(-1).astype(np.float32)
        if got.shape != want.shape or not np.array_equal(got, want):
            idx = int(np.argmax(got != want)) if got.shape == want.shape else 0
            shown = got.flat[idx] if got.size else "none"
            problems.setdefault(name, []).append(
                f"scale differs from amax/bound (e.g. index {idx}: {shown} vs {want.flat[idx]:.9g})"
            )
        zp = p.quantizer_layout(p.zero_point).reshape(-1).astype(np.float32)
        if p.format == "uint8" and _signed_symmetric(q):
            # the onnxruntime target stores a signed symmetric grid's codes as uint8 + 128
            # (exporters.onnxruntime.placement)
            want_zp = want_zp + np.float32(UINT8_OFFSET)
        if not (zp.shape == want_zp.shape or want_zp.size == 1) or not np.array_equal(
            zp, np.broadcast_to(want_zp, zp.shape)
        ):
            problems.setdefault(name, []).append(
                f"zero point differs from the calibrated range ({zp.flat[0] if zp.size else 'none'} vs "
                f"{want_zp.flat[0]:g})"
            )
        if name.endswith("weight_quantizer"):
            try:
                row, problem = _weight_row(name, q, p, inits, params)
            # codes and scale that do not fit (inputs swapped, reshaped)
            except (RuntimeError, ValueError) as e:
                row, problem = (
                    None,
                    f"stored weight cannot be dequantized with its scale: {first_line(e, 160)}",
                )
            if row is not None:
                rows.append(row)
            if problem:
                problems.setdefault(name, []).append(problem)
    biases = _check_biases(model, ckpt, all_pairs, problems)
    copies = propagated_copy_problems(model)  # (the exact session runs without them: checked only here)
    if copies:
        problems["Q/DQ copies across commuting ops"] = copies
    flat = [f"{name}: {x}" for name, probs in problems.items() for x in probs]
    recorded = pruned_quantizers(model)
    return {
        "passed": not flat,
        "problems": flat,
        "layers_with_problems": sorted(problems),
        "quantizers_expected": len(qs),
        "quantizers_found": len((set(pairs) | dynamic) & set(qs)),
        "pruned": pruned,
        "notes": [f"{n}: pruned by the exporter, its output reaches no model output" for n in pruned],
        "pruned_recorded_at_export": recorded,
        "traced_branches_at_export": traced_branches(model),
        "unmapped_pairs": sum(1 for p in all_pairs if not p.quantizer),
        "unexpected_quantizers": sorted((set(pairs) | dynamic) - set(qs)),
        "int32_biases_compared": biases,
    }, rows
