"""The torch.export-based exporter: quantize ops as ``torch.library`` custom ops with ONNX translations.

Before tracing, every enabled quantizer gets its :class:`~quantcli.quant.qdq.QdqSpec`, computed from its real
amax and the shape of the tensor it sees (torch.export traces with fake tensors, so values are read first).
While exporting, each quantizer's export hook (:mod:`quantcli.nn.export_hooks`, set for the trace and removed
after it) calls ``quantcli::qdq`` with the spec's tensors; the op's eager kernel is ONNX's Q/DQ arithmetic
(:mod:`quantcli.quant.arithmetic`), and its onnxscript translation emits the same ``[Max, Min] ->
QuantizeLinear -> DequantizeLinear`` nodes as the TorchScript path. Int32 biases and Linear layers with
dynamic inputs get hooks that call ``quantcli::int32_bias`` and ``quantcli::dynamic_linear``.

:class:`AttentionLayout` works around torch's decomposition of ``scaled_dot_product_attention``
(pytorch#136543, #141107): torch.export records the attention output as contiguous, the ONNX exporter's
``run_decompositions`` re-traces it on CPU through ``_scaled_dot_product_flash_attention_for_cpu``, whose
output has the (B, L, H, E) layout, so a model's ``out.transpose(1, 2).contiguous().view(B, L, H * E)``
(transformers' T5, Swin) loses its ``contiguous`` as a no-op there, and the next fake-tensor pass, which
computes the output contiguous again, fails with "Cannot view a tensor with shape ...". A copy to contiguous
memory right after the attention (an ONNX ``Identity``) gives its output one layout in every pass.

:func:`simplify` runs the part of onnxscript's optimizer that the float ops need and the Q/DQ pairs survive:
constant folding (never of a Q/DQ node) and its rewrite rules, not its common-subexpression elimination (which
merges identical Q/DQ pairs: q/k/v input quantizers share their input and scale, and each quantizer must keep
its own pair) nor its renaming passes (the quantizer map names tensors). Without it, the ``CastLike`` chains
the exporter writes for every ``Clip``/``hardtanh`` bound keep onnxruntime from fusing the Conv + Clip and the
Q/DQ around them: the zoo's MobileNetV2 int8 graph ran 8x slower (22.5 ms vs 2.7 ms at 32 samples, 1 thread).

:class:`_Root` works around a name clash in torch.export: its ``GraphModule`` has attributes of its own
(``meta``, ``graph``, ``code``, ...), and the exported program's module copies the model's top-level children
onto one, so a child named ``meta`` (a model's metadata branch) is shadowed by ``GraphModule.meta`` and the
decomposition step fails ("Node meta_weight target meta.weight references nonexistent attribute weight of
meta"). Such a model is exported inside a wrapper that moves every child one level down; the wrapper's scope
is then removed from every node's recorded module path, so the quantizer map reads as without it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import re
import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from exporters.causal_lm import ops as decode_ops
from exporters.forward_inputs import forward_by_name
from quantcli.errors import ExportError, whole_line
from quantcli.nn.config import computes_plain_linear
from quantcli.nn.dynamic import linear_weight, weight_spec
from quantcli.nn.export_hooks import export_hooks
from quantcli.nn.fresh_inputs import fresh
from quantcli.nn.modules import QuantMixin
from quantcli.nn.quantizer_inputs import observe_inputs
from quantcli.nn.tensor_quantizer import quantizers
from quantcli.quant import arithmetic, formats
from quantcli.quant.granularity import broadcast_onnx_param
from quantcli.quant.qdq import QdqSpec, affine_spec, check_opset, e4m3_spec, symmetric_spec


@torch.library.custom_op("quantcli::qdq", mutates_args=())
def qdq(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    axis: int,
    block_size: int,
    elem_type: int,
    clip: bool,
) -> torch.Tensor:
    """ONNX ``[Max, Min] -> QuantizeLinear -> DequantizeLinear`` on ``x`` (float32 arithmetic)."""
    xin = x.to(torch.float32)
    if clip:
        xin = torch.minimum(torch.maximum(xin, lo), hi)
    s = broadcast_onnx_param(scale, tuple(xin.shape), axis, block_size)
    if elem_type == formats.FP8_E4M3.elem_type:
        return arithmetic.dequantize_linear(arithmetic.quantize_e4m3(xin, s), s).to(x.dtype)
    qtype = formats.BY_ELEM_TYPE[elem_type]
    z = broadcast_onnx_param(zero_point, tuple(xin.shape), axis, block_size)
    codes = arithmetic.quantize_linear(xin, s, z, qtype.qmin, qtype.qmax)
    return arithmetic.dequantize_linear(codes, s, z).to(x.dtype)


@qdq.register_fake
def _qdq_fake(x, scale, zero_point, lo, hi, axis, block_size, elem_type, clip):
    return torch.empty_like(x)


def call(x: torch.Tensor, spec: QdqSpec) -> torch.Tensor:
    clip = spec.lo is not None
    lo = spec.lo if clip else spec.scale
    hi = spec.hi if clip else spec.scale
    return torch.ops.quantcli.qdq(
        x, spec.scale, spec.zero_point, lo, hi, spec.axis, spec.block_size, spec.qtype.elem_type, clip
    )


@torch.library.custom_op("quantcli::int32_bias", mutates_args=())
def int32_bias(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """ONNX ``DequantizeLinear`` of int32 bias codes (held as float32) with a per-channel scale (zero point
    0)."""
    return arithmetic.dequantize_linear(codes, scale)


@int32_bias.register_fake
def _int32_bias_fake(codes, scale, zero_point):
    return torch.empty_like(codes)


def call_int32_bias(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """``codes``, ``scale``, ``zero_point``: real tensors computed before tracing, so torch.export lifts them
    as constants (the graph holds the codes, not the arithmetic that made them)."""
    return torch.ops.quantcli.int32_bias(codes, scale, zero_point)


def _bias_translation(opset: int):
    import onnxscript

    op = getattr(onnxscript, f"opset{opset}")

    def int32_bias_onnx(codes, scale, zero_point):
        return op.DequantizeLinear(
            op.Cast(codes, to=formats.INT32.elem_type),
            scale,
            op.Cast(zero_point, to=formats.INT32.elem_type),
            axis=0,
        )

    return int32_bias_onnx


@torch.library.custom_op("quantcli::dynamic_linear", mutates_args=())
def dynamic_linear_op(
    x: torch.Tensor,
    w_codes: torch.Tensor,
    w_scale: torch.Tensor,
    w_zero_point: torch.Tensor,
    bias: torch.Tensor,
    has_bias: bool,
) -> torch.Tensor:
    """``DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul -> Add`` on ``x``
    (:mod:`exporters.dynamic_linear`).

    ``w_codes`` int8 ``(K, N)``; ``w_scale`` float32 ``(N,)`` or scalar. The fake-quant value, in float32."""
    w = arithmetic.dequantize_linear(w_codes.to(torch.float32), w_scale, w_zero_point.to(torch.float32))
    y = torch.matmul(arithmetic.fake_quant_dynamic(x.to(torch.float32)), w)
    return (y + bias if has_bias else y).to(x.dtype)


@dynamic_linear_op.register_fake
def _dynamic_linear_fake(x, w_codes, w_scale, w_zero_point, bias, has_bias):
    return x.new_empty((*x.shape[:-1], w_codes.shape[1]))


def _dynamic_linear_constants(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 weight codes (K, N), float32 scale, int8 zero point) of a dynamic Linear, computed before tracing
    (torch.export traces with fake tensors, so values are read first)."""
    wq = layer.weight_quantizer
    w, amax = linear_weight(layer)
    w = w.detach().cpu()
    spec = weight_spec(amax, tuple(w.shape), wq.desc.num_bits, wq.desc.narrow_range)
    w_t = w.t().to(torch.float32)
    if spec.lo is not None:
        w_t = torch.minimum(torch.maximum(w_t, spec.lo), spec.hi)
    s = broadcast_onnx_param(
        spec.scale, tuple(w_t.shape), spec.axis if spec.scale.numel() > 1 else None, None
    )
    codes = arithmetic.quantize_linear(w_t, s, 0, spec.qtype.qmin, spec.qtype.qmax).to(torch.int8)
    return codes, spec.scale, spec.zero_point.to(torch.int8)


def dynamic_linear(
    layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, constants: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    """A QuantLinear with a dynamic input quantizer, while torch.export traces (its export hook); ``bias``:
    the one its ``F.linear`` adds; ``constants``: :func:`_dynamic_linear_constants`."""
    codes, scale, zp = constants
    added = bias if bias is not None else scale
    return torch.ops.quantcli.dynamic_linear(x, codes, scale, zp, added, bias is not None)


def _dynamic_linear_translation(opset: int):
    import onnxscript

    op = getattr(onnxscript, f"opset{opset}")

    def dynamic_linear_onnx(x, w_codes, w_scale, w_zero_point, bias, has_bias: bool):
        xq, xs, xzp = op.DynamicQuantizeLinear(x)
        acc = op.MatMulInteger(xq, w_codes, xzp, w_zero_point)
        y = op.Mul(op.Cast(acc, to=1), op.Mul(xs, w_scale))
        if has_bias:
            y = op.Add(y, bias)
        return y

    return dynamic_linear_onnx


def _translation(opset: int):
    import onnxscript

    op = getattr(onnxscript, f"opset{opset}")

    def qdq_onnx(x, scale, zero_point, lo, hi, axis: int, block_size: int, elem_type: int, clip: bool):
        if clip:
            x = op.Min(op.Max(x, lo), hi)
        zp = op.Cast(zero_point, to=elem_type)
        if block_size > 0:
            q = op.QuantizeLinear(x, scale, zp, axis=axis, block_size=block_size)
            return op.DequantizeLinear(q, scale, zp, axis=axis, block_size=block_size)
        q = op.QuantizeLinear(x, scale, zp, axis=axis)
        return op.DequantizeLinear(q, scale, zp, axis=axis)

    return qdq_onnx


def quantizer_spec(q, x_shape) -> QdqSpec:
    d = q.desc
    if d.asymmetric:
        amin = q.amin if q.amin is not None else torch.zeros(())
        return affine_spec(amin, q.amax, d.num_bits)
    if d.is_fp8:
        return e4m3_spec(q.amax, x_shape)
    return symmetric_spec(q.amax, x_shape, d.num_bits, d.unsigned, d.narrow_range)


def _input_shapes(model: nn.Module, example: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """The shape of the tensor each static quantizer sees, from one eager forward."""
    shapes: dict[str, tuple[int, ...]] = {}
    static = [n for n, q in quantizers(model).items() if q.mode == "quantize" and not q.dynamic_uint8]
    observe_inputs(model, example, static, lambda n, x: shapes.__setitem__(n, tuple(x.shape)))
    return shapes


def _bias_hook(layer: nn.Module) -> Callable[[], torch.Tensor]:
    """The int32 bias as a constant op (its codes read now), or the float bias where the layer adds that."""
    with torch.no_grad():
        constants = layer.int32_bias_constants()
    if constants is None:
        return lambda: layer.bias
    codes, scale = (t.detach() for t in constants)
    return functools.partial(call_int32_bias, codes, scale, torch.zeros_like(scale))


def export_hooks_for(
    model: nn.Module, example: dict[str, torch.Tensor], opset: int
) -> list[tuple[nn.Module, str, Callable]]:
    """Every module's export hook (:mod:`quantcli.nn.export_hooks`), with the constants it carries read from
    real values before tracing; raises :class:`ExportError` where a quantizer's format needs a newer opset."""
    shapes = _input_shapes(model, example)
    hooks: list[tuple[nn.Module, str, Callable]] = []
    for module in model.modules():
        q = getattr(module, "input_quantizer", None)
        if computes_plain_linear(module) and q is not None and q.mode == "quantize" and q.dynamic_uint8:
            hooks.append(
                (
                    module,
                    "export_hook",
                    functools.partial(dynamic_linear, module, constants=_dynamic_linear_constants(module)),
                )
            )
        if isinstance(module, QuantMixin) and module.int32_bias and module.bias is not None:
            hooks.append((module, "bias_export_hook", _bias_hook(module)))
    for n, q in quantizers(model).items():
        if n in shapes:
            spec = quantizer_spec(q, shapes[n])
            check_opset(opset, spec)
            hooks.append((q, "export_hook", functools.partial(call, spec=spec)))
    return hooks


class AttentionLayout(TorchFunctionMode):
    """While torch.export traces: every ``scaled_dot_product_attention`` output copied to contiguous memory (a
    ``clone``, always recorded, unlike ``contiguous``), so its layout no longer depends on which SDPA kernel a
    pass of the exporter dispatches to (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.nn.functional.scaled_dot_product_attention and isinstance(out, torch.Tensor):
            out = out.clone(memory_format=torch.contiguous_format)
        return out


#: the nodes :func:`simplify` never folds into constants: each quantizer keeps its pair (exporters.fold stores
#: weights quantized afterwards, knowing which quantizer each pair is)
_KEEP = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"}


def simplify(model) -> None:
    """Constant folding (Q/DQ nodes excepted) and onnxscript's rewrite rules, in place on the exported
    ``onnx_ir`` model, twice or until nothing changes; then unused nodes removed. Nothing is renamed or
    merged."""
    from onnxscript import ir, rewriter
    from onnxscript.ir.passes import common
    from onnxscript.optimizer import _constant_folding

    ir.passes.PassManager(
        [
            _constant_folding.FoldConstantsPass(
                shape_inference=True,
                input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
                should_fold=lambda node: False if node.op_type in _KEEP else None,
            ),
            rewriter.RewritePass(rewriter._DEFAULT_REWRITE_RULES),
            common.RemoveUnusedNodesPass(),
        ],
        steps=2,
        early_stop=True,
    )(model)


_ROOT = "quantcli_root"  # the wrapper's child: the model, when its own children's names clash (_Root)
_SCOPES = "pkg.torch.onnx.name_scopes"


@functools.cache
def _graph_module_names() -> frozenset[str]:
    """The attribute names a ``torch.fx.GraphModule`` has beyond ``nn.Module``'s (``meta``, ``graph``,
    ...)."""
    gm = torch.fx.GraphModule(nn.Module(), torch.fx.Graph())
    return frozenset((set(dir(gm)) | set(vars(gm))) - set(dir(nn.Module())) - set(vars(nn.Module())))


def clashing_children(model: nn.Module) -> list[str]:
    """The model's top-level children whose names a ``GraphModule`` attribute shadows."""
    return [n for n, _ in model.named_children() if n in _graph_module_names()]


class _Root(nn.Module):
    """The model one level down (see the module docstring)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        setattr(self, _ROOT, model)

    def forward(self, *args, **kwargs):
        return getattr(self, _ROOT)(*args, **kwargs)


def _wrapped(model: nn.Module) -> nn.Module:
    """``model`` inside a :class:`_Root` whose ``forward`` has the model's signature, so that torch.export
    binds the same keyword inputs and dynamic shapes."""
    import inspect

    own = inspect.signature(model.forward)
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)

    def forward(self, *args, **kwargs):
        return _Root.forward(self, *args, **kwargs)

    forward.__signature__ = own.replace(parameters=[self_param, *own.parameters.values()])
    cls = type("QuantcliRoot", (_Root,), {"forward": forward})
    return cls(model).train(model.training)


def _unwrap_scopes(model) -> None:
    """Remove the wrapper's scope from every node's recorded module path (``pkg.torch.onnx.name_scopes``)."""
    from onnxscript import ir

    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        value = node.metadata_props.get(_SCOPES)
        if value is None:
            continue
        scopes = [s.strip(" '\"") for s in value.strip("[]").split(",")]
        kept = [s[len(_ROOT) + 1 :] if s.startswith(_ROOT + ".") else s for s in scopes if s != _ROOT]
        node.metadata_props[_SCOPES] = repr(kept)


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it was raised from (at most 20)."""
    out = [e]
    for _ in range(20):
        nxt = out[-1].__cause__ or out[-1].__context__
        if nxt is None:
            break
        out.append(nxt)
    return out


def _cause(e: BaseException) -> str:
    """torch.export's message for a failure, one line: its own first line (a step's banner, "Failed to
    decompose the FX graph for ONNX compatibility. This is step 2/3 ...", says where, not why) and the
    innermost cause's."""
    inner = _chain(e)[-1]
    outer = whole_line(e, 1000).split(" This is step", 1)[0]
    if inner is e:
        return outer[:400]
    return f"{outer[:200]}: {type(inner).__name__}: {whole_line(inner, 300)}"


_STATIC = re.compile(r"inferred a static shape of (\d+) for dimension inputs\['(\w+)'\]\.shape\[(\d+)\]")


def tied_axes(message: str, example: dict[str, torch.Tensor], axes: dict) -> list[str]:
    """``NAME=AXIS`` for every input axis that is not exported dynamic but has the size of a dynamic axis that
    torch.export found static (its message: "tracing inferred a static shape of 16 for dimension
    inputs['x'].shape[0]"): the axes the model ties to it (a graph's ``(nodes, nodes)`` adjacency multiplied
    by its ``(nodes, features)`` features), which ``--dynamic-dim`` makes dynamic too."""
    sizes = {int(m.group(1)) for m in _STATIC.finditer(message) if m.group(2) in example}
    out = []
    for name, t in example.items():
        dynamic = set(axes.get(name, {}) or ())
        extra = [d for d, s in enumerate(t.shape) if s in sizes and d not in dynamic]
        if extra:
            out.append(f"{name}={','.join(map(str, extra))}")
    return out


_SYMBOL = re.compile(r"\bs\d+\b")


def name_dims(onnx_model, axes: dict[str, dict[int, str]] | None) -> None:
    """Give the dynamic axes torch.export names ``s43``, ``s53`` the names they were exported under
    (``batch``, ``sequence``, ``x_2``), in place: every graph input's and output's shape and every value's
    that uses the symbol, expressions (``2*s53``) included. A symbol asked two names keeps the first."""
    names: dict[str, str] = {}
    for v in onnx_model.graph.input:
        dims = v.type.tensor_type.shape.dim
        for axis, want in (axes or {}).get(v.name, {}).items():
            if axis < len(dims) and _SYMBOL.fullmatch(dims[axis].dim_param):
                names.setdefault(dims[axis].dim_param, want)
    if not names:
        return
    for v in [*onnx_model.graph.input, *onnx_model.graph.output, *onnx_model.graph.value_info]:
        for d in v.type.tensor_type.shape.dim:
            if d.dim_param:
                d.dim_param = _SYMBOL.sub(lambda m: names.get(m.group(0), m.group(0)), d.dim_param)


def export_dynamo(
    model: nn.Module, example: dict[str, torch.Tensor], path, opset: int, input_names, output_names, axes
) -> None:
    """``torch.onnx.export(..., dynamo=True)`` with the quantize ops translated to Q/DQ nodes."""
    hooks = export_hooks_for(model, example, opset)
    wrap = bool(clashing_children(model))
    dynamic_shapes = None
    if axes:
        dynamic_shapes = {k: {d: torch.export.Dim.DYNAMIC for d in axes.get(k, {})} or None for k in example}
    # torch's own log lines (torch.onnx's progress, torch.fx's "W1128 ... symbolic_shapes" warnings before an
    # error) go to handlers bound to the real stderr, past the redirection below: quantcli reports for it
    disabled = logging.root.manager.disable
    try:
        with (
            forward_by_name(model, list(example)),  # before wrapping: the wrapper takes its signature
            export_hooks(hooks),
            AttentionLayout(),
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            traced = _wrapped(model) if wrap else model
            warnings.simplefilter("ignore")
            logging.disable(logging.WARNING)  # restored below
            prog = torch.onnx.export(
                traced,
                (),
                kwargs=fresh(example),
                dynamo=True,
                opset_version=opset,
                custom_translation_table={
                    torch.ops.quantcli.qdq.default: _translation(opset),
                    torch.ops.quantcli.int32_bias.default: _bias_translation(opset),
                    torch.ops.quantcli.dynamic_linear.default: _dynamic_linear_translation(opset),
                    **decode_ops.dynamo_translations(),
                },
                input_names=input_names,
                output_names=output_names,
                dynamic_shapes=dynamic_shapes,
                # no onnxscript optimizer: it merges identical Q/DQ pairs (q/k/v input quantizers share their
                # input and scale), so a quantizer would lose its own pair; exporters.fold does the folding
                optimize=False,
                verbose=False,
                report=False,
            )
            simplify(prog.model)
            if wrap:
                _unwrap_scopes(prog.model)
            prog.save(str(path))
    except ExportError:
        raise
    except Exception as e:
        from exporters.aten_symbolics import unsupported_operator
        from quantcli.files import no_space

        if no_space(e):  # the disk, not the model: the usual one-line full-disk error, not "try torchscript"
            raise

        tied = tied_axes(" ".join(whole_line(c, 4000) for c in _chain(e)), example, axes or {})
        if tied:
            options = " ".join(f"--dynamic-dim {t}" for t in tied)
            raise ExportError(
                "torch.export found that the model ties the size of its dynamic axes to axes exported with a "
                f"fixed size: export with {options} to make them dynamic too (or with --exporter torchscript)"
            ) from None
        raise unsupported_operator(e, "dynamo", opset) or ExportError(
            f"torch.onnx.export(dynamo=True) failed: {_cause(e)} (try --exporter torchscript)"
        ) from None
    finally:
        logging.disable(disabled)
