"""The residual ``Add`` and the RMSNorm after it as one onnxruntime ``SkipSimplifiedLayerNormalization``.

A Llama-style layer adds each sublayer's output to the residual stream and normalises the sum for the next
sublayer: ``h = h + a; x = rms_norm(h) * weight``. onnxruntime's CPU optimizer (1.31) fuses the RMSNorm's ops
into ``SimplifiedLayerNormalization`` but leaves the ``Add`` beside it (its ``SkipLayerNormFusion`` matches
``LayerNormalization`` only), so each layer runs two more nodes than onnxruntime-genai's graphs, which write
``com.microsoft.SkipSimplifiedLayerNormalization`` (outputs: the normalised sum and the sum itself). In a
decode step of one token the per-node cost is most of the step, so the decode graph writes the fused node
(measured: ``python -m benchmarks.bench_generate``, docs/llm.md).

:func:`skip_rms_norm` calls the custom op ``quantcli::skip_simplified_layer_norm``: its eager kernel is the
arithmetic of transformers' ``LlamaRMSNorm`` (and the sample's ``RMSNorm``) on ``x + skip``, its ONNX form one
``SkipSimplifiedLayerNormalization`` node whose unused optional outputs are left unnamed
(:func:`drop_unused_outputs`). :func:`fusable_norm` says whether a model's norm module computes exactly that.
"""

from __future__ import annotations

import torch
from torch import nn

MS_DOMAIN = "com.microsoft"
OP = "SkipSimplifiedLayerNormalization"
OUTPUTS = 4  # output, mean, inv_std_var, input_skip_bias_sum
_PROBE_TOLERANCE = 1e-5  # relative: a norm module and the fused arithmetic agree to float rounding


@torch.library.custom_op("quantcli::skip_simplified_layer_norm", mutates_args=())
def skip_simplified_layer_norm(
    x: torch.Tensor, skip: torch.Tensor, weight: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + skip) * weight, x + skip)`` over the last dimension, in float32 as ``LlamaRMSNorm``
    computes it: ``s * rsqrt(mean(s^2) + epsilon)`` then times ``weight``. ``x``, ``skip`` ``[..., hidden]``,
    ``weight`` ``[hidden]``."""
    s = x + skip
    h = s.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + epsilon)
    return weight * h.to(s.dtype), s


@skip_simplified_layer_norm.register_fake
def _fake(x, skip, weight, epsilon):
    return torch.empty_like(x), torch.empty_like(x)


def rms_norm_epsilon(norm: nn.Module) -> float | None:
    """The epsilon of an RMSNorm module (transformers' ``variance_epsilon``, or ``eps``), None if it has
    none."""
    for name in ("variance_epsilon", "eps"):
        v = getattr(norm, name, None)
        if isinstance(v, (int, float)):
            return float(v)
    return None


def fusable_norm(norm: nn.Module, hidden: int) -> str:
    """Why ``norm`` cannot be replaced by :func:`skip_rms_norm`'s arithmetic ("" where it can): it must
    have a ``weight`` ``[hidden]``, an epsilon, no submodules (no quantizer, no smoothing ``Mul``) and give
    :func:`skip_simplified_layer_norm`'s output on a probe input to float rounding."""
    weight = getattr(norm, "weight", None)
    eps = rms_norm_epsilon(norm)
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (hidden,) or eps is None:
        return f"{type(norm).__name__} has no weight [{hidden}] and epsilon"
    if any(True for _ in norm.children()):
        return f"{type(norm).__name__} has submodules"
    probe = torch.randn(2, 3, hidden, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = norm(probe).float()
        got = skip_simplified_layer_norm(probe, torch.zeros_like(probe), weight.detach(), eps)[0].float()
    scale = want.abs().max().clamp_min(1e-30)
    if not bool(((want - got).abs().max() / scale) <= _PROBE_TOLERANCE):
        return f"{type(norm).__name__} does not compute x * rsqrt(mean(x^2) + eps) * weight"
    return ""


def skip_rms_norm(x: torch.Tensor, skip: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + skip), x + skip)`` through the fused op; ``norm`` passed :func:`fusable_norm`."""
    return torch.ops.quantcli.skip_simplified_layer_norm(x, skip, norm.weight, rms_norm_epsilon(norm))


def _symbolic(g, x, skip, weight, epsilon):
    from torch.onnx import symbolic_helper as sh

    out = g.op(
        f"{MS_DOMAIN}::{OP}",
        x,
        skip,
        weight,
        epsilon_f=sh._get_const(epsilon, "f", "epsilon"),
        outputs=OUTPUTS,
    )
    return out[0], out[3]


_registered = False


def register_torchscript() -> None:
    """The TorchScript exporter's translation of ``quantcli::skip_simplified_layer_norm`` (once per
    process)."""
    global _registered
    if not _registered:
        register_schema()
        torch.onnx.register_custom_op_symbolic("quantcli::skip_simplified_layer_norm", _symbolic, 1)
        _registered = True


def register_schema() -> None:
    """``com.microsoft.SkipSimplifiedLayerNormalization`` in onnx's schema registry (the ONNX checker and
    the dynamo exporter's onnxscript read schemas; onnx ships none for onnxruntime's contrib ops), as
    onnxruntime's ``contrib_defs`` declare it; once per process."""
    from onnx import defs

    if defs.has(OP, MS_DOMAIN):
        return
    P = defs.OpSchema.FormalParameter
    opt = defs.OpSchema.FormalParameterOption.Optional
    schema = defs.OpSchema(
        OP,
        MS_DOMAIN,
        1,
        inputs=[
            P("input", "T"),
            P("skip", "T"),
            P("gamma", "T"),
            P("bias", "T", param_option=opt),
        ],
        outputs=[
            P("output", "T"),
            P("mean", "U", param_option=opt),
            P("inv_std_var", "U", param_option=opt),
            P("input_skip_bias_sum", "T", param_option=opt),
        ],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)"], ""),
            ("U", ["tensor(float)"], ""),
        ],
        attributes=[defs.OpSchema.Attribute("epsilon", defs.OpSchema.AttrType.FLOAT, required=False)],
    )
    defs.register_schema(schema)


def dynamo_translations() -> dict:
    """The dynamo exporter's translation of ``quantcli::skip_simplified_layer_norm``."""
    from onnxscript.values import Opset

    register_schema()
    ms = Opset(MS_DOMAIN, 1)

    def skip_norm_onnx(x, skip, weight, epsilon: float):
        out = ms.SkipSimplifiedLayerNormalization(x, skip, weight, epsilon=epsilon, _num_outputs=OUTPUTS)
        return out[0], out[3]

    return {torch.ops.quantcli.skip_simplified_layer_norm.default: skip_norm_onnx}


def drop_unused_outputs(onnx_model) -> int:
    """Leave unnamed every optional output of a ``SkipSimplifiedLayerNormalization`` that no node reads and
    that is no graph output (the exporters name all four; onnxruntime computes a named output); in place.
    Returns how many nodes there are."""
    read = {i for n in onnx_model.graph.node for i in n.input} | {o.name for o in onnx_model.graph.output}
    count = 0
    for n in onnx_model.graph.node:
        if n.op_type == OP and n.domain == MS_DOMAIN:
            count += 1
            n.output[:] = [o if (i == 0 or o in read) else "" for i, o in enumerate(n.output)]
            while n.output and not n.output[-1]:
                n.output.pop()
    return count
