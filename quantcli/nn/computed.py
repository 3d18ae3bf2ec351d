"""Layers found by the operations a model computes, not by their class (issue 35).

The exported graph has a ``Conv`` for every convolution a forward computes, whatever Python class computed it.
Found by class, a ``nn.Conv2d`` subclass whose ``forward`` pads before ``F.conv2d`` (EfficientNet-PyTorch's
``Conv2dStaticSamePadding``) either lost its padding (converted as a plain Conv2d) or stayed float. Here a
layer is quantized where it computes, and its ``forward`` runs as written:

* :func:`census` runs one forward on the example batch and lists every *weighted operation* it computes
  (``F.conv1d/2d/3d``, ``F.conv_transpose1d/2d/3d``, ``F.linear``, ``torch.matmul``/``@``, ``torch.mm``,
  ``torch.addmm`` (and their ``Tensor`` methods), a ``torch.einsum`` that is one of these products
  (:func:`einsum_product`: ``"bnd,de->bne"`` runs as ``torch.matmul``, ``"bnd,ed->bne"`` as ``F.linear``, so
  the graph has a MatMul onnxruntime fuses rather than an Einsum it runs in float), and the ``F.linear`` calls
  inside ``F.multi_head_attention_forward``): which module's parameters its weight operand is (the parameter
  itself, or a tensor computed from that module's parameters alone, as weight standardisation does), in which
  module's ``forward`` it runs, its bias, and whether that module returns the operation's output as its own
  (BatchNorm folding needs that). Products it does not quantize (:data:`OTHER_PRODUCTS`: an einsum of any
  other form, ``torch.bmm``, ``torch.tensordot``, ...) are noted against the modules whose weight they take,
  so that a layer left float says which one did.
* :func:`convert` makes such a module a *computed layer*: its class becomes ``Quant<Name>``
  (:class:`ComputedLayer` in front of the user's class, whose ``forward`` stays), with the same
  ``input_quantizer`` and ``weight_quantizer`` (and the placement's ``output_quantizer`` and int32 bias) as a
  converted ``nn.Conv2d``, so quantizer names, ``amax`` buffers, ``state_dict`` keys and the exporters' hooks
  are the same.
* while the model runs, a :class:`Dispatch` (a ``TorchFunctionMode``) puts the layer's quantizers around each
  of its operations: ``F.conv2d(x, w, b, ...)`` becomes ``output_quantizer(F.conv2d(input_quantizer(x),
  weight_quantizer(w), b', ...))``, ``b'`` the int32 bias where the target has one. Forward hooks enter it for
  the computed layers, the modules whose ``forward`` calls their operations (a plain function passing a
  module's weight to ``F.linear``), and the torch modules with a fused fast path
  (:data:`FAST_PATH_MODULES`): with a mode active, ``nn.TransformerEncoderLayer`` and
  ``nn.MultiheadAttention`` take their Python path (``torch.overrides.has_torch_function``), which calls the
  layers they own, in calibration, export and verify alike.

The dispatch also quantizes the skip operand of residual Adds in a block whose ``forward`` ``torch.fx`` cannot
rewrite (:func:`quantize_adds`): the block's own additions are counted as they run, and the ones the recorded
graph marked get their quantizer. In the same way it quantizes the operands of the sigmoids,
multiplications and global average poolings the onnxruntime placement runs on codes (:func:`quantize_ops`):
each call of an owning module counts its own such operations, and the marked ones get their quantizers.

A weight operand is attributed to a layer when it is one of the layer's parameters, a view of one, or the
result of operations whose tensor arguments are all such tensors (the same rule in the census and at run
time); the operation's input must not be one (``B @ A`` of two LoRA factors is part of a weight, not a layer).
``F.multi_head_attention_forward`` calls ``F.linear`` from inside one torch function, where no mode sees it:
while it runs, ``torch.nn.functional.linear`` is the dispatch's (restored after, whatever happens).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from quantcli.nn.forward_call import call_forward
from quantcli.nn.fresh_inputs import fresh
from quantcli.nn.module_outputs import same_randomness
from quantcli.nn.modules import QuantMixin, dynamic_export
from quantcli.nn.recorded_graph import (
    FORWARD_ERRORS,
    activation_kind,
    classify,
    forward_failed,
    is_add,
    layer_call,
)

#: weighted operations: function -> (kind, output-channel axis of the weight operand; -1 for its last)
_FUNCTIONS: dict[Callable, tuple[str, int]] = {
    F.conv1d: ("conv", 0),
    F.conv2d: ("conv", 0),
    F.conv3d: ("conv", 0),
    F.conv_transpose1d: ("conv_transpose", 1),
    F.conv_transpose2d: ("conv_transpose", 1),
    F.conv_transpose3d: ("conv_transpose", 1),
    F.linear: ("linear", 0),
    torch.matmul: ("matmul", -1),
    torch.mm: ("mm", -1),
    torch.Tensor.mm: ("mm", -1),
    torch.addmm: ("addmm", -1),
    torch.Tensor.addmm: ("addmm", -1),
}
KINDS = ("conv", "conv_transpose", "linear", "matmul", "mm", "addmm")
#: products of an activation and a weight that are not quantized (the census names them in a layer's float
#: reason): what to write instead is F.linear or torch.matmul. ``torch.einsum`` is quantized where it is a
#: product of the input's last axis with a 2-D weight (:func:`einsum_product`), named here otherwise.
OTHER_PRODUCTS: dict[Callable, str] = {
    torch.einsum: "torch.einsum",
    torch.bmm: "torch.bmm",
    torch.baddbmm: "torch.baddbmm",
    torch.addmv: "torch.addmv",
    torch.mv: "torch.mv",
    torch.tensordot: "torch.tensordot",
    F.bilinear: "F.bilinear",
    torch.Tensor.bmm: "Tensor.bmm",
}
#: the name a matmul whose left operand is the weight (``W @ x``) is noted under, as the products above
LEFT_MATMUL = "a matmul with the weight on the left (W @ x)"
# the operands' (position, keyword) by kind: input, weight, bias (torch.addmm(bias, x, W): the bias first)
_OPERANDS: dict[str, tuple[tuple[int, str] | None, ...]] = {
    "conv": ((0, "input"), (1, "weight"), (2, "bias")),
    "conv_transpose": ((0, "input"), (1, "weight"), (2, "bias")),
    "linear": ((0, "input"), (1, "weight"), (2, "bias")),
    "matmul": ((0, "input"), (1, "other"), None),
    "mm": ((0, "input"), (1, "mat2"), None),
    "addmm": ((1, "mat1"), (2, "mat2"), (0, "input")),
}
#: torch modules with a fused fast path that skips the layers they own while no torch function mode is active
FAST_PATH_MODULES: tuple[type, ...] = (
    nn.TransformerEncoderLayer,
    nn.TransformerEncoder,
    nn.TransformerDecoderLayer,
    nn.MultiheadAttention,
)


def weighted_kind(func: Callable) -> tuple[str, int] | None:
    """``(kind, weight axis)`` of a weighted operation, None for any other function."""
    hit = _FUNCTIONS.get(func)
    if hit is not None:
        return hit
    op, target = classify(func)
    return ("matmul", -1) if op == "call_method" and target == "matmul" else None


def _operand(args: tuple, kwargs: dict, where: tuple[int, str] | None):
    if where is None:
        return None
    i, name = where
    return args[i] if len(args) > i else kwargs.get(name)


def operands(kind: str, args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
    """``(input, weight, bias)`` of a weighted operation's call (bias None for matmul and mm)."""
    return tuple(_operand(args, kwargs, where) for where in _OPERANDS[kind])


def _with_operands(kind: str, args: tuple, kwargs: dict, values: tuple) -> tuple[tuple, dict]:
    args, kwargs = list(args), dict(kwargs)
    for where, v in zip(_OPERANDS[kind], values):
        if where is None:
            continue
        i, name = where
        if len(args) > i:
            args[i] = v
        elif name in kwargs or v is not None:
            kwargs[name] = v
    return tuple(args), kwargs


def einsum_product(equation: str, weight_first: bool) -> tuple[str, int] | None:
    """The form of a two-operand ``torch.einsum`` of an activation and a 2-D weight that contracts the
    activation's last axis and puts the weight's other axis last in its place: ``("linear", 0)`` for a weight
    ``[out, in]`` (``"bnd,ed->bne"``, what ``F.linear`` computes), ``("matmul", 1)`` for ``[in, out]``
    (``"...d,de->...e"``, ``x @ W``); None for any other equation (:func:`einsum_mismatch` says why).
    ``weight_first``: the weight is the first operand (``"de,bnd->bne"``)."""
    form = _einsum_form(equation, weight_first)
    return form if isinstance(form, tuple) else None


def einsum_mismatch(equation: str, weight_first: bool) -> str | None:
    """Why ``equation`` is not a product form :func:`einsum_product` quantizes (``"a 3-D weight"``), None when
    it is one."""
    form = _einsum_form(equation, weight_first)
    return form if isinstance(form, str) else None


def _einsum_form(equation: str, weight_first: bool) -> tuple[str, int] | str:
    eq = equation.replace(" ", "")
    if eq.count("->") != 1:
        return "no explicit output"
    ins, out = eq.split("->")
    terms = ins.split(",")
    if len(terms) != 2:
        return f"{len(terms)} operands"
    w, x = terms if weight_first else terms[::-1]
    if len(w) != 2 or not w.isalpha():
        return "a scalar weight" if not w else f"a {len(w.replace('...', '*'))}-D weight"
    if w[0] == w[1]:
        return "the weight's diagonal"
    body = x[3:] if x.startswith("...") else x
    if not body or not body.isalpha() or len(set(body)) != len(body):
        return "a repeated or broadcast axis"
    k = body[-1]
    if k not in w:
        return "a contraction of an axis other than the activation's last"
    j = w[1] if w[0] == k else w[0]
    if j in x:
        return "a weight axis shared with the activation"
    if out != x[:-1] + j:
        return "a transposed output" if sorted(out) == sorted(x[:-1] + j) else "an output of other axes"
    return ("matmul", 1) if w[0] == k else ("linear", 0)


def einsum_operands(args: tuple, kwargs: dict) -> tuple[str, Any, Any] | None:
    """``(equation, a, b)`` of a call ``torch.einsum(equation, a, b)`` (or with ``[a, b]``), else None."""
    if kwargs or not args or not isinstance(args[0], str):
        return None
    ops = args[1:]
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = tuple(ops[0])
    if len(ops) != 2 or not all(isinstance(t, torch.Tensor) for t in ops):
        return None
    return args[0], ops[0], ops[1]


#: the functions an einsum's product form runs as (:func:`einsum_product`)
_EINSUM_AS = {"linear": F.linear, "matmul": torch.matmul}


def _einsum_as_product(args: tuple, kwargs: dict, is_weight: Callable[[Any], bool]):
    """``(function, kind, axis, (x, W))`` that computes ``torch.einsum(*args)`` as ``F.linear`` or
    ``torch.matmul`` where one operand is a weight (``is_weight``) and the other is not, and the equation is a
    product form (:func:`einsum_product`); None otherwise."""
    call = einsum_operands(args, kwargs)
    if call is None:
        return None
    equation, a, b = call
    for weight_first, x, w in ((False, a, b), (True, b, a)):
        if is_weight(w) and not is_weight(x):
            form = einsum_product(equation, weight_first)
            if form is not None and w.dim() == 2:
                return _EINSUM_AS[form[0]], form[0], form[1], (x, w)
    return None


@contextlib.contextmanager
def _traced_scope(module: nn.Module, inside: bool) -> Iterator[None]:
    """While the TorchScript exporter traces and ``module``'s own forward is not the one running (``inside``
    False: a weight other code passes to ``F.linear``, ``nn.MultiheadAttention``'s ``out_proj``), its scope,
    as ``nn.Module`` pushes it for a call: the exporter names the quantizers' nodes by scope
    (``/head/proj/input_quantizer/QuantizeLinear``), and export maps them back to quantizers by those
    names."""
    state = torch._C._get_tracing_state() if not inside else None
    names = getattr(torch.jit._trace, "_trace_module_map", None) if state is not None else None
    name = names.get(module) if names else None
    if name is None:
        yield
        return
    state.push_scope(name)
    try:
        yield
    finally:
        state.pop_scope()


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    # runs on every torch function a hooked module calls: tensors and flat lists of them (``cat``) are read
    # directly, and only a nested structure goes through ``tree_flatten`` (10x slower per call)
    out = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple, dict)):
            out += [t for t in tree_flatten(a)[0] if isinstance(t, torch.Tensor)]
    return out


@contextlib.contextmanager
def _linear_replaced(fn: Callable) -> Iterator[None]:
    """``torch.nn.functional.linear`` is ``fn`` while the block runs (``F.multi_head_attention_forward`` calls
    the module's ``linear``); the original is back after, whatever happens."""
    original = F.__dict__["linear"]
    F.linear = fn
    try:
        yield
    finally:
        F.linear = original


# ------------------------------------------------------------------------------------------------ census


@dataclass
class OpUse:
    """One weighted operation the forward computed with a module's parameters as its weight."""

    kind: str  # one of KINDS (an einsum is recorded as the linear or matmul it runs as)
    layer: str  # the module whose parameters the weight operand is, or is computed from
    params: tuple[str, ...]  # those parameters (one, and ``derived`` False: the parameter itself)
    derived: bool
    caller: str  # the module whose forward (or a function it called) ran the operation; "" for the model
    bias: str  # "none", "own" (the layer's parameter ``bias``) or "other"
    weight_shape: tuple[int, ...]
    weight_axis: int  # the output-channel axis of the weight operand
    returns_output: bool = False  # the layer's forward returned this operation's output as its own


@dataclass
class Census:
    """What :func:`census` saw: every weighted operation, and the weights it could not attribute to one
    module (``{module: other modules its parameters were combined with}``)."""

    uses: list[OpUse] = field(default_factory=list)
    combined: dict[str, set[str]] = field(default_factory=dict)
    # module -> its parameters that products quantcli does not quantize took as a weight -> those products
    # (``torch.bmm``, ``torch.einsum "bnd,dhk->bnhk" (a 3-D weight)``, ...)
    other_products: dict[str, dict[str, set[str]]] = field(default_factory=dict)
    # module -> the other modules its weight parameter is registered in too (``self.w = self.enc.weight``),
    # where this module's forward computed with it
    aliased: dict[str, set[str]] = field(default_factory=dict)
    # module -> its buffers (``register_buffer``) a weighted operation took as the weight of an activation
    buffer_weights: dict[str, set[str]] = field(default_factory=dict)

    def by_layer(self) -> dict[str, list[OpUse]]:
        out: dict[str, list[OpUse]] = {}
        for u in self.uses:
            out.setdefault(u.layer, []).append(u)
        return out


class _Provenance:
    """Which tensors are a module's parameters or computed from them alone: ``id -> {(module, param)}``."""

    def __init__(self) -> None:
        self.params: dict[int, frozenset[tuple[str, str]]] = {}
        self.derived: dict[int, frozenset[tuple[str, str]]] = {}
        self.alive: list[torch.Tensor] = []  # no id is reused while tracked

    def source(self, t) -> frozenset[tuple[str, str]] | None:
        if not isinstance(t, torch.Tensor):
            return None
        s = self.params.get(id(t)) or self.derived.get(id(t))
        if s is None and t._base is not None:  # a view (``split``, ``chunk`` of a packed weight)
            s = self.params.get(id(t._base)) or self.derived.get(id(t._base))
        return s

    def track(self, args: tuple, kwargs: dict, out) -> None:
        ins = _tensors(args, kwargs)
        if not ins:
            return
        srcs = [self.source(t) for t in ins]
        if any(s is None for s in srcs):
            return
        union = frozenset().union(*srcs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.alive.append(t)
                self.derived[id(t)] = union


class _CensusMode(TorchFunctionMode):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.prov = _Provenance()
        self.buffers: dict[int, tuple[str, str]] = {}  # floating-point buffers: id -> (module, name)
        for mname, m in model.named_modules():
            for pname, p in m.named_parameters(recurse=False):
                if p.is_floating_point():
                    self.prov.params[id(p)] = self.prov.params.get(id(p), frozenset()) | {(mname, pname)}
            for bname, buf in m.named_buffers(recurse=False):
                if buf.is_floating_point():
                    self.buffers.setdefault(id(buf), (mname, bname))
        self.stack: list[str] = [""]
        self.result = Census()
        self.outputs: dict[int, OpUse] = {}  # id(operation output) -> its use

    def weighted(self, func: Callable, kind: str, axis: int, args: tuple, kwargs: dict, run=None):
        """Record ``func(*args, **kwargs)`` as a use of its weight's module; ``run()``, if given, computes the
        output instead (an einsum recorded as the product it is)."""
        x, w, b = operands(kind, args, kwargs)
        out = func(*args, **kwargs) if run is None else run()
        src = self.prov.source(w)
        if src is None or self.prov.source(x) is not None or not isinstance(w, torch.Tensor):
            if kind in ("matmul", "mm", "addmm") and src is None and self.prov.source(x) is not None:
                self._other_product(LEFT_MATMUL, args, kwargs)  # W @ x: the weight is the left operand
            elif src is None and isinstance(w, torch.Tensor) and id(w) in self.buffers:
                module, buffer = self.buffers[id(w)]  # a fixed weight held as a buffer: named, not quantized
                self.result.buffer_weights.setdefault(module, set()).add(buffer)
            self.prov.track(args, kwargs, out)
            return out
        caller = self.stack[-1]
        owners = {m for m, _ in src}
        if len(owners) > 1:
            # a parameter registered in several modules: the one whose forward calls the operation owns it
            if len(src) == 1 or caller not in owners:
                for m in owners:
                    self.result.combined.setdefault(m, set()).update(owners - {m})
                return out
            self.result.aliased.setdefault(caller, set()).update(owners - {caller})
            owners = {caller}
        (layer,) = owners
        params = tuple(sorted(p for m, p in src if m == layer))
        own = isinstance(b, torch.Tensor) and (layer, "bias") in self.prov.params.get(id(b), frozenset())
        bias = "none" if b is None else ("own" if own else "other")
        use = OpUse(
            kind,
            layer,
            params,
            derived=id(w) not in self.prov.params,
            caller=caller,
            bias=bias,
            weight_shape=tuple(w.shape),
            weight_axis=axis % w.dim() if w.dim() else 0,
        )
        self.result.uses.append(use)
        if isinstance(out, torch.Tensor):
            self.prov.alive.append(out)
            self.outputs[id(out)] = use
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward:
            linear = F.__dict__["linear"]

            def mha_linear(*a, **k):
                return self.weighted(linear, "linear", 0, a, k)

            with _linear_replaced(mha_linear):
                return func(*args, **kwargs)
        hit = weighted_kind(func)
        if hit is not None:
            return self.weighted(func, *hit, args, kwargs)
        if func is torch.einsum:
            product = _einsum_as_product(args, kwargs, lambda t: self.prov.source(t) is not None)
            if product is not None:
                fn, kind, axis, ops = product
                return self.weighted(fn, kind, axis, ops, {}, run=lambda: func(*args, **kwargs))
        if func in OTHER_PRODUCTS:
            self._other_product(self._product_name(func, args, kwargs), args, kwargs)
        out = func(*args, **kwargs)
        self.prov.track(args, kwargs, out)
        return out

    def _other_product(self, name: str, args: tuple, kwargs: dict) -> None:
        """Record ``name`` against the modules whose parameters are operands of a product with an activation
        (a tensor not computed from parameters alone)."""
        srcs = [self.prov.source(t) for t in _tensors(args, kwargs)]
        if all(s is not None for s in srcs):
            return  # parameters only: part of computing a weight
        for s in srcs:
            for module, param in s or ():
                self.result.other_products.setdefault(module, {}).setdefault(param, set()).add(name)

    def _product_name(self, func: Callable, args: tuple, kwargs: dict) -> str:
        """``OTHER_PRODUCTS``' name of ``func``; for an einsum of an activation and a weight, with its
        equation and what keeps it from a product form (``torch.einsum "bnd,dhk->bnhk" (a 3-D weight)``)."""
        name = OTHER_PRODUCTS[func]
        call = einsum_operands(args, kwargs) if func is torch.einsum else None
        if call is None:
            return name
        equation, a, b = call
        weight_first = self.prov.source(a) is not None and self.prov.source(b) is None
        why = einsum_mismatch(equation, weight_first)
        return f'{name} "{equation}" ({why})' if why else name


def census(model: nn.Module, example: Mapping[str, torch.Tensor], observe: Callable | None = None) -> Census:
    """Every weighted operation of one forward of ``model`` on ``example`` (no gradients, eval mode, the
    model's own modes restored after). ``observe(name, module, output)``, if given, is called after every
    module's call (the float check reads the outputs there). Raises :class:`quantcli.errors.DataError` when
    the forward fails."""
    mode = _CensusMode(model)
    training = {m: m.training for m in model.modules()}
    handles = []
    for name, m in model.named_modules():

        def pre(module, args, name=name):
            mode.stack.append(name)

        def post(module, args, output, name=name):
            mode.stack.pop()
            use = mode.outputs.get(id(output)) if isinstance(output, torch.Tensor) else None
            if use is not None and use.layer == name:
                use.returns_output = True
            if observe is not None:
                observe(name, module, output)

        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post, always_call=True))
    try:
        model.eval()
        inputs = fresh(example)  # (not an operation the model computes)
        with torch.no_grad(), same_randomness(), mode:
            call_forward(model, inputs)
    except FORWARD_ERRORS as e:
        raise forward_failed(example, e, "finding the operations it computes") from None
    finally:
        for h in handles:
            h.remove()
        for m, t in training.items():
            m.training = t
    return mode.result


# ------------------------------------------------------------------------------------------ computed layers


#: callables ``(layer, func, args, kwargs, out) -> out`` run on each computed layer's operation as it ran (its
#: operands quantized), before its output quantizer: verify's emulation of a CPU's integer kernels
#: (:class:`quantcli.analysis.saturation.Emulation`) sees every operation here, those
#: ``F.multi_head_attention_forward`` runs inside one torch function, where no mode sees them, included
OP_OBSERVERS: list[Callable] = []


class ComputedLayer(QuantMixin):
    """Mixed in front of a module whose weighted operation is quantized where it runs (module docstring).

    ``op_kind``: one of :data:`KINDS`; ``weight_name``: the parameter its weight operand is
    (or is computed from); ``weight_derived``: the operand is computed from the parameters, not the parameter
    itself (weight standardisation); ``weight_axis``: the operand's output-channel axis. The weight quantizer
    quantizes the operand the operation takes, so it is calibrated on it as the forward runs
    (``weight_from_forward``), not on the parameter."""

    op_kind = "linear"
    weight_name = "weight"
    weight_derived = False
    weight_from_forward = True
    #: see :class:`quantcli.nn.modules.QuantLinear` (a Linear whose input quantizer is dynamic)
    export_hook: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None

    @property
    def takes_int32_bias(self) -> bool:
        """QLinearConv and QGemm add an int32 bias; a bias that is the layer's own ``bias`` parameter can be
        one (onnxruntime has no CPU QDQ rule for ConvTranspose)."""
        return self.op_kind in ("conv", "linear", "addmm") and isinstance(
            self._parameters.get("bias"), torch.Tensor
        )

    def weight_source(self) -> torch.Tensor:
        return self._parameters[self.weight_name]

    def run_op(self, func: Callable, kind: str, args: tuple, kwargs: dict, inside: bool = True):
        """The operation with this layer's quantizers around it (recorded as this layer's call while a
        recording is under way). ``inside``: the layer's own ``forward`` is the innermost one running."""
        with _traced_scope(self, inside):
            return self._run_op(func, kind, args, kwargs)

    def _run_op(self, func: Callable, kind: str, args: tuple, kwargs: dict):
        x, w, b = operands(kind, args, kwargs)

        def run():
            if self._plain_linear(kind, w, kwargs):  # a dynamic input exports as a Linear's does
                exported = dynamic_export(self, x, b)
                if exported is not None:
                    return exported
            bias = b
            own_bias = b is not None and b is self._parameters.get("bias")
            if own_bias and self.int32_bias and _gemm_bias(kind, x, kwargs):
                bias = self.quantized_bias()  # QLinearConv / QGemm: int32 codes
            values = (self.quantize_input(x), self.weight_quantizer(w), bias)
            a, k = _with_operands(kind, args, kwargs, values)
            out = func(*a, **k)
            for observe in OP_OBSERVERS:
                out = observe(self, func, a, k, out)
            return self.quantize_output(out)

        return layer_call(self, [x], run)

    def _plain_linear(self, kind: str, w, kwargs: dict) -> bool:
        """``F.linear(x, self.weight, b)``, or ``x @ self.weight`` (``torch.mm``, ``torch.matmul``,
        ``torch.addmm`` without ``beta``/``alpha``) of an ``(in, out)`` weight: what the int8-dynamic export
        pattern computes (with the ``b`` the call adds: the module's own bias, none, or another tensor)."""
        if w is not self._parameters.get(self.weight_name):  # (nn.MultiheadAttention's: in_proj_weight)
            return False
        if kind == "linear":
            return True
        in_out = kind in ("mm", "matmul", "addmm") and self.weight_axis == 1 and w.dim() == 2
        return in_out and _unscaled(kwargs)


def _gemm_bias(kind: str, x, kwargs: dict) -> bool:
    """Whether the operation exports as a Conv or Gemm whose bias onnxruntime's integer kernel adds as int32
    codes: a convolution, ``F.linear`` of a 2-D input, ``torch.addmm(b, x, W)`` without ``beta`` or ``alpha``
    (onnxruntime fuses ``Gemm`` into ``QGemm`` only with an int32 bias; with a float one it stays float)."""
    if kind == "addmm":
        return _unscaled(kwargs)
    return kind == "conv" or (kind == "linear" and x.dim() == 2)


def _unscaled(kwargs: dict) -> bool:
    """``torch.addmm``'s ``beta`` and ``alpha`` (keyword-only) left at 1: the product plus the bias."""
    return kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1


_CLASSES: dict[tuple, type] = {}


def computed_class(cls: type, kind: str, weight_name: str, derived: bool, axis: int) -> type:
    """``Quant<Name>``: :class:`ComputedLayer` in front of ``cls`` (its ``forward`` and attributes stay)."""
    key = (cls, kind, weight_name, derived, axis)
    if key not in _CLASSES:
        attrs = {
            "__module__": __name__,
            "op_kind": kind,
            "weight_name": weight_name,
            "weight_derived": derived,
            "weight_axis": axis,
        }
        if weight_name != "weight" and not hasattr(cls, "weight"):
            # nn.MultiheadAttention's in_proj_weight: read as ``weight`` where layers are read (configs)
            attrs["weight"] = property(lambda self: self._parameters[self.weight_name])
        _CLASSES[key] = type(f"Quant{cls.__name__}", (ComputedLayer, cls), attrs)
    return _CLASSES[key]


def is_computed(module) -> bool:
    return isinstance(module, ComputedLayer)


def is_conv_layer(module) -> bool:
    """A quantized layer that runs as a (non-transposed) convolution: ``QLinearConv`` for onnxruntime."""
    if isinstance(module, ComputedLayer):
        return module.op_kind == "conv"
    return isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d))


# -------------------------------------------------------------------------------------------------- dispatch


@dataclass
class _Frame:
    module: nn.Module
    adds: dict[int, tuple[int, str]] | None  # a residual owner's additions to quantize: ordinal -> operand
    count: int = 0
    # this call's activation operations to quantize (quantize_ops): ordinal -> OpQuantizers
    ops: dict[int, OpQuantizers] | None = None
    op_count: int = 0


@dataclass(frozen=True)
class OpQuantizers:
    """The quantizers (attribute names of the owning module) of one activation operation: ``operands``, per
    positional operand index; ``sigmoid``: for ``F.silu``, the quantizer of its sigmoid's output (the
    operation then runs as ``x * sigmoid(x)``, as it exports)."""

    operands: tuple[tuple[int, str], ...] = ()
    sigmoid: str | None = None


class Dispatch(TorchFunctionMode):
    """The model's computed layers' quantizers, put around their operations while a hooked module runs (module
    docstring). One per model; every hooked module holds it (``copy.deepcopy`` copies it with the model, its
    layers mapped to the copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers: list[ComputedLayer] = []
        self.frames: list[_Frame] = []
        self.weights: dict[int, ComputedLayer] = {}
        self.prov = _Provenance()
        self.calls: dict[int, int] = {}  # calls of each module with quantize_ops in this forward

    # entered and left by the hooked modules' forward hooks
    def enter(self, module: nn.Module) -> None:
        if not self.frames:
            self.prov = _Provenance()
            self.weights = {}
            for layer in self.layers:
                w = layer._parameters.get(layer.weight_name)
                if isinstance(w, torch.Tensor):
                    self.weights[id(w)] = layer
                    self.prov.params[id(w)] = frozenset({(str(id(layer)), layer.weight_name)})
                for pname, p in layer.named_parameters(recurse=False):
                    if pname != layer.weight_name and p.is_floating_point():
                        self.prov.params[id(p)] = frozenset({(str(id(layer)), pname)})
            self.__enter__()
        frame = _Frame(module, module.__dict__.get("_quantcli_adds"))
        per_call = module.__dict__.get("_quantcli_ops")
        if per_call is not None:
            k = self.calls.get(id(module), 0)
            self.calls[id(module)] = k + 1
            frame.ops = per_call.get(k, {})
        self.frames.append(frame)

    def leave(self, module: nn.Module) -> None:
        if not self.frames:
            return
        self.frames.pop()
        if not self.frames:
            self.__exit__(None, None, None)
            self.prov = _Provenance()
            self.weights = {}

    def _layer_of(self, w) -> ComputedLayer | None:
        if not isinstance(w, torch.Tensor):
            return None
        layer = self.weights.get(id(w))
        if layer is not None:
            return layer
        src = self.prov.source(w)
        if src is None:
            return None
        owners = {m for m, _ in src}
        if len(owners) != 1:
            return None
        (owner,) = owners
        return next((la for la in self.layers if str(id(la)) == owner), None)

    def _weighted(self, func: Callable, kind: str, args: tuple, kwargs: dict):
        x, w, _ = operands(kind, args, kwargs)
        layer = self._layer_of(w)
        if layer is None or self.prov.source(x) is not None:
            out = func(*args, **kwargs)
            self.prov.track(args, kwargs, out)
            return out
        return layer.run_op(
            func, kind, args, kwargs, inside=bool(self.frames) and self.frames[-1].module is layer
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward:
            linear = F.__dict__["linear"]

            def mha_linear(*a, **k):
                return self._weighted(linear, "linear", a, k)

            with _linear_replaced(mha_linear):
                return func(*args, **kwargs)
        hit = weighted_kind(func)
        if hit is not None:
            return self._weighted(func, hit[0], args, kwargs)
        if func is torch.einsum:
            product = _einsum_as_product(args, kwargs, lambda t: self._layer_of(t) is not None)
            if product is not None and self.prov.source(product[3][0]) is None:
                fn, kind, _, ops = product
                if self._layer_of(ops[1]).op_kind == kind:
                    return self._weighted(fn, kind, ops, {})
        frame = self.frames[-1] if self.frames else None
        if frame is not None and frame.adds is not None and is_add(*classify(func)):
            k = frame.count
            frame.count += 1
            if k in frame.adds:
                i, attr = frame.adds[k]
                args = list(args)
                args[i] = getattr(frame.module, attr)(args[i])
                args = tuple(args)
        if frame is not None and frame.ops is not None:
            kind = activation_kind(*classify(func))
            if kind is not None:
                k = frame.op_count
                frame.op_count += 1
                spec = frame.ops.get(k)
                if spec is not None:
                    out = _quantized_op(frame.module, func, args, kwargs, spec)
                    self.prov.track(args, kwargs, out)
                    return out
        out = func(*args, **kwargs)
        self.prov.track(args, kwargs, out)
        return out


def _quantized_op(module: nn.Module, func: Callable, args: tuple, kwargs: dict, spec: OpQuantizers):
    """``func(*args, **kwargs)`` with the operands ``spec`` names quantized by ``module``'s quantizers (and
    ``F.silu`` as ``x * sigmoid_quantizer(sigmoid(x))``)."""
    args = list(args)
    for i, attr in spec.operands:
        if i < len(args) and isinstance(args[i], torch.Tensor):
            args[i] = getattr(module, attr)(args[i])
    if spec.sigmoid is not None:
        q = getattr(module, spec.sigmoid)
        if q.mode == "disabled":
            return func(*args, **kwargs)  # the float model's own operation while quantizers are off
        x = args[0] if args else kwargs["input"]
        return x * q(torch.sigmoid(x))
    return func(*args, **kwargs)


def _reset_calls(model: nn.Module, args) -> None:
    model.__dict__["_quantcli_model_dispatch"].calls = {}


def _enter(module: nn.Module, args) -> None:
    module.__dict__["_quantcli_dispatch"].enter(module)


def _leave(module: nn.Module, args, output) -> None:
    module.__dict__["_quantcli_dispatch"].leave(module)


def dispatch_of(model: nn.Module) -> Dispatch:
    """The model's :class:`Dispatch` (made on first use)."""
    d = model.__dict__.get("_quantcli_model_dispatch")
    if d is None:
        d = Dispatch()
        object.__setattr__(model, "_quantcli_model_dispatch", d)
    return d


def hook(module: nn.Module, dispatch: Dispatch) -> None:
    """Enter ``dispatch`` while ``module`` runs (once per module; the hooks are module-level functions reading
    plain attributes, so a deep copy hooks the copy to the copied dispatch)."""
    if module.__dict__.get("_quantcli_dispatch") is not None:
        return
    object.__setattr__(module, "_quantcli_dispatch", dispatch)
    module.register_forward_pre_hook(_enter)
    module.register_forward_hook(_leave, always_call=True)


def convert(
    model: nn.Module, name: str, kind: str, weight_name: str, derived: bool, axis: int, callers: list[str]
) -> ComputedLayer:
    """Make module ``name`` a computed layer, hooked, with its operation's callers hooked too (the
    quantizers are added by the caller, as for any converted layer)."""
    module = model.get_submodule(name) if name else model
    module.__class__ = computed_class(type(module), kind, weight_name, derived, axis)
    d = dispatch_of(model)
    d.layers.append(module)
    hook(module, d)
    for c in callers:
        hook(model.get_submodule(c) if c else model, d)
    return module


def disable_fast_paths(model: nn.Module, quantized: list[nn.Module]) -> list[str]:
    """Hook every module with a fused fast path (:data:`FAST_PATH_MODULES`) that holds or is a quantized
    layer, so that it runs its Python path, which calls them. Returns their names."""
    ids = {id(m) for m in quantized}
    d = dispatch_of(model)
    done = []
    for name, m in model.named_modules():
        if isinstance(m, FAST_PATH_MODULES) and any(id(s) in ids for s in m.modules()):
            hook(m, d)
            done.append(name)
    return done


def quantize_adds(model: nn.Module, owner: nn.Module, adds: dict[int, tuple[int, str]]) -> None:
    """Quantize, as ``owner``'s ``forward`` runs, the operand ``i`` of its ``k``-th own addition with its
    submodule ``attr`` (``adds``: ``{k: (i, attr)}``, additions counted as the recording counts them: those
    ``owner``'s ``forward`` runs itself, not those of modules it calls)."""
    d = dispatch_of(model)
    object.__setattr__(owner, "_quantcli_adds", dict(adds))
    hook(owner, d)
    for child in owner.children():
        hook(child, d)


def quantize_ops(model: nn.Module, owner: nn.Module, per_call: dict[int, dict[int, OpQuantizers]]) -> None:
    """Quantize, as ``owner``'s ``forward`` runs, the operands of its own activation operations
    (:func:`quantcli.nn.recorded_graph.activation_kind`) with its submodules: ``per_call``: ``{call: {k:
    OpQuantizers}}``, the ``call``-th call of ``owner`` in one forward of ``model``, its ``k``-th own such
    operation (counted as the recording counts them: those ``owner``'s ``forward`` runs itself)."""
    d = dispatch_of(model)
    if not model.__dict__.get("_quantcli_counts_calls"):
        object.__setattr__(model, "_quantcli_counts_calls", True)
        model.register_forward_pre_hook(_reset_calls, prepend=True)
    object.__setattr__(owner, "_quantcli_ops", {c: dict(ops) for c, ops in per_call.items()})
    hook(owner, d)
    for child in owner.children():
        hook(child, d)


def unconvert(model: nn.Module, module: ComputedLayer) -> None:
    """Give a computed layer its own class back (its quantizers are removed by the caller)."""
    module.__class__ = type(module).__bases__[1]
    d = dispatch_of(model)
    d.layers = [la for la in d.layers if la is not module]


def weight_operands(model: nn.Module, example: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weight operand each computed layer with a derived weight (``weight_derived``) takes on one forward
    of ``example`` (its weight quantizer's input, by quantizer name); the others' operand is their
    parameter."""
    from quantcli.nn.quantizer_inputs import observe_inputs

    seen: dict[str, torch.Tensor] = {}
    names = [
        f"{name}.weight_quantizer" if name else "weight_quantizer"
        for name, m in model.named_modules()
        if isinstance(m, ComputedLayer) and m.weight_derived
    ]
    observe_inputs(model, example, names, lambda n, x: seen.setdefault(n, x.detach().clone()))
    return seen
