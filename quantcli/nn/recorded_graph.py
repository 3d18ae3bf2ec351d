"""The model's graph as the exporter sees it: one forward on the example inputs, recorded op by op.

Both ONNX exporters read a model by running it: the TorchScript exporter traces one forward, the dynamo
exporter's ``torch.export`` (non-strict) runs the Python code of ``forward`` on the example inputs. Python
control flow on arguments or values, shapes unpacked into Python numbers and modules called twice are resolved
by that run, and what the graph records is what ran. Placement decisions and BatchNorm folding read the same
thing here: a ``TorchFunctionMode`` sees every torch function and tensor method called from Python, and module
hooks see every module call, while :func:`record` runs ``forward`` once on the example batch.

The result has the shape of a ``torch.fx`` graph (nodes with ``op``, ``target``, ``args``, ``users`` and
``meta["nn_module_stack"]``), so one analysis serves both. ``torch.fx`` symbolic tracing stays for what a
recording cannot do: rewriting a block's ``forward`` (TensorRT's residual quantizers) and analysing a model
for which no example batch exists (``quantize_model`` called without one).

Nodes:
* ``placeholder``: a tensor argument of ``forward``.
* ``call_module``: a call of a leaf module (target: its qualified name). Its ``args`` are its tensor
  arguments.
* ``call_function``: a torch function (target: the function, e.g. ``torch.nn.functional.relu``,
  ``torch.flatten``, ``operator.getitem`` for tensor indexing). A ``torch.nn.functional.pad`` node has
  ``meta["zero_pad"]``: whether it pads with zeros.
* ``call_method``: a tensor method (target: its name, ``"view"``; operators by their method, ``x + y`` is
  ``"add"``, ``x += y`` is ``"add_"``).

A layer the model computes functionally (:mod:`quantcli.nn.computed`: a convolution, linear or matmul that a
forward calls with a module's weight) is recorded where its operation runs, as one ``call_module`` node of
that layer whose only argument is the operation's input (:func:`layer_call`); the ops of the forward around
it (a padding, a residual branch) are recorded as they run.

A tensor argument that no recorded node produced (a parameter, a buffer, a constant) is ``None`` in ``args``;
an in-place op makes its node the producer of the tensor from then on. ``meta["call"]`` numbers the call of
the innermost enclosing module (a module called twice records its ops twice, with two numbers);
``meta["ndim"]`` is the number of dimensions of a node's first output tensor.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from quantcli.errors import DataError, first_line
from quantcli.nn.forward_call import call_forward
from quantcli.nn.fresh_inputs import fresh


@dataclass(eq=False)
class RecordedNode:
    """One recorded call, shaped like a ``torch.fx.Node`` for the analyses that read either."""

    name: str
    op: str
    target: Any
    args: tuple = ()
    users: dict = field(default_factory=dict)  # consumer -> None, in call order (as fx keeps them)
    meta: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        target = self.target if isinstance(self.target, str) else _func_name(self.target)
        return f"{self.name}({self.op} {target})"


@dataclass
class RecordedGraph:
    """The nodes in the order they ran; ``module_inputs``: for each call of a module recorded op by op (not a
    leaf), the producers of its positional tensor arguments (None: not produced by a recorded node)."""

    nodes: list[RecordedNode] = field(default_factory=list)
    module_inputs: dict[str, list[list[RecordedNode | None]]] = field(default_factory=dict)
    #: for each module recorded op by op, the call numbers (``meta["call"]`` of its own nodes) of its calls
    module_calls: dict[str, list[int]] = field(default_factory=dict)


def _zero_pad(args: tuple, kwargs: dict) -> bool:
    """Whether a ``torch.nn.functional.pad`` call pads with zeros (``mode="constant"``, no value or 0)."""
    mode = kwargs.get("mode", args[2] if len(args) > 2 else "constant")
    value = kwargs.get("value", args[3] if len(args) > 3 else None)
    return mode == "constant" and (value is None or value == 0)


_ADAPTIVE_AVG_POOLS = (
    torch.nn.functional.adaptive_avg_pool1d,
    torch.nn.functional.adaptive_avg_pool2d,
    torch.nn.functional.adaptive_avg_pool3d,
)


def to_one_position(output_size) -> bool:
    """Whether an adaptive pooling's ``output_size`` (an int or one per spatial axis) is one position."""
    sizes = output_size if isinstance(output_size, (tuple, list)) else (output_size,)
    return all(s == 1 for s in sizes)


def _global_pool(args: tuple, kwargs: dict) -> bool:
    """Whether an adaptive average pooling call pools every spatial position into one (output size 1)."""
    return to_one_position(kwargs.get("output_size", args[1] if len(args) > 1 else None))


def _spatial_mean(args: tuple, kwargs: dict) -> bool:
    """Whether a ``torch.mean`` / ``Tensor.mean`` call averages a 4-D or 5-D tensor over exactly its spatial
    axes (``x.mean((2, 3))``, ``dim=[-2, -1]``, with or without ``keepdim``): a global average pooling, as
    the export writes it (``ReduceMean``, rewritten to ``GlobalAveragePool``)."""
    x = args[0] if args else kwargs.get("input")
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if not isinstance(x, torch.Tensor) or x.dim() not in (4, 5) or dim is None:
        return False
    if kwargs.get("dtype") is not None:
        return False
    try:
        axes = sorted(int(d) % x.dim() for d in (dim if isinstance(dim, (tuple, list)) else (dim,)))
    except (TypeError, ValueError):  # named dimensions
        return False
    return axes == list(range(2, x.dim()))


def _func_name(func: Callable) -> str:
    return getattr(func, "__name__", type(func).__name__)


_DUNDER_METHODS = {
    "__add__": "add",
    "__radd__": "add",
    "__iadd__": "add_",
    "__mul__": "mul",
    "__rmul__": "mul",
    "__imul__": "mul_",
    "__sub__": "sub",
    "__isub__": "sub_",
    "__truediv__": "div",
    "__itruediv__": "div_",
    "__matmul__": "matmul",
}


def _classify(func: Callable) -> tuple[str, Any]:
    """``(op, target)`` of a function the mode saw: a tensor method by name, anything else as itself."""
    name = _func_name(func)
    if name == "__getitem__":
        return "call_function", operator.getitem
    if (
        getattr(torch.Tensor, name, None) is func
        or getattr(func, "__objclass__", None) is torch._C.TensorBase
    ):
        return "call_method", _DUNDER_METHODS.get(name, name)
    return "call_function", func


#: the additions a forward can compute (``x + y``, ``x += y``, ``torch.add``), as a graph node's (op, target)
ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add}
ADD_METHODS = ("add", "add_", "__add__")


def is_add(op: str, target: Any) -> bool:
    """Whether a node's ``(op, target)`` (or :func:`classify`'s, for a function a mode sees) is an
    addition."""
    return (op == "call_function" and target in ADD_FUNCTIONS) or (
        op == "call_method" and target in ADD_METHODS
    )


#: the elementwise and pooling operations onnxruntime's CPU provider runs on codes between a DQ and a Q
#: (``QLinearSigmoid``, ``QLinearMul``, ``QLinearGlobalAveragePool``; ``F.silu`` exports as Sigmoid + Mul), as
#: a recorded node's ``(op, target)``: kind
_ACTIVATION_OPS: dict[tuple[str, Any], str] = {
    ("call_function", torch.sigmoid): "sigmoid",
    ("call_method", "sigmoid"): "sigmoid",
    ("call_function", torch.nn.functional.silu): "silu",
    ("call_function", torch.mul): "mul",
    ("call_function", operator.mul): "mul",
    ("call_method", "mul"): "mul",
    **{("call_function", f): "global_pool" for f in _ADAPTIVE_AVG_POOLS},
    ("call_function", torch.mean): "global_pool",
    ("call_method", "mean"): "global_pool",
}

#: the means among them: a global pooling only over the spatial axes (:func:`_spatial_mean`)
MEAN_OPS = {("call_function", torch.mean), ("call_method", "mean")}


def activation_kind(op: str, target: Any) -> str | None:
    """``sigmoid``, ``silu``, ``mul`` or ``global_pool`` (an adaptive average pooling, of any output size, or
    a mean, over any axes: a node's ``meta["global_pool"]`` says whether it pools to one position) for a
    node's ``(op, target)`` (or :func:`classify`'s), else None."""
    try:
        return _ACTIVATION_OPS.get((op, target))
    except TypeError:  # an unhashable target
        return None


def classify(func: Callable) -> tuple[str, Any]:
    """``(op, target)`` of a function a ``TorchFunctionMode`` sees, as a recorded node has them."""
    return _classify(func)


#: the recordings under way (innermost last): :func:`layer_call` records into the last
_RECORDING: list[_Recorder] = []


def layer_call(module: nn.Module, inputs: list[torch.Tensor], run: Callable[[], Any]) -> Any:
    """``run()``: one operation of ``module``, a layer the model computes functionally; while a recording is
    under way, recorded as one ``call_module`` node of ``module`` with ``inputs`` as its arguments, and
    nothing of what ``run`` calls (its quantizers) recorded beside it, as for a leaf module's call."""
    rec = _RECORDING[-1] if _RECORDING else None
    name = rec.names.get(id(module)) if rec is not None else None
    if rec is None or name is None or rec.leaf_depth > 0:
        return run()
    rec.alive.extend(inputs)
    node = rec.node("call_module", name, inputs)
    rec.leaf_depth += 1
    try:
        out = run()
    finally:
        rec.leaf_depth -= 1
    rec.produced(node, out)
    return out


class _Recorder(TorchFunctionMode):
    def __init__(self, names: dict[int, str] | None = None) -> None:
        super().__init__()
        self.names = names or {}  # id(module) -> qualified name
        self.graph = RecordedGraph()
        self.producer: dict[int, RecordedNode] = {}
        # keeps every seen tensor alive, so no id is reused while recording
        self.alive: list[torch.Tensor] = []
        self.leaf_depth = 0  # > 0 inside a leaf module's forward: its own ops are not recorded
        self.stack: list[tuple[str, str, int]] = []  # enclosing non-leaf modules (name, class, call number)
        self.calls = 0  # non-leaf module calls so far: tells two calls of one module apart
        self.pending: list[RecordedNode] = []  # leaf module calls entered, not yet returned

    def node(self, op: str, target: Any, inputs: list) -> RecordedNode:
        args = tuple(self.producer.get(id(t)) for t in inputs if isinstance(t, torch.Tensor))
        n = RecordedNode(
            f"n{len(self.graph.nodes)}",
            op,
            target,
            args,
            meta={
                "nn_module_stack": {name: cls for name, cls, _ in self.stack if name},
                "call": self.stack[-1][2] if self.stack else 0,
            },
        )
        for a in args:
            if a is not None:
                a.users.setdefault(n, None)
        self.graph.nodes.append(n)
        return n

    def produced(self, node: RecordedNode, outputs: Any) -> None:
        for t in tree_flatten(outputs)[0]:
            if isinstance(t, torch.Tensor):
                node.meta.setdefault("ndim", t.dim())  # of its first output
                self.alive.append(t)
                self.producer[id(t)] = node

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.leaf_depth == 0:
            flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            results = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            if results:
                op, target = _classify(func)
                self.alive.extend(flat)
                node = self.node(op, target, flat)
                if func is torch.nn.functional.pad:
                    node.meta["zero_pad"] = _zero_pad(args, kwargs)
                if func in _ADAPTIVE_AVG_POOLS:
                    node.meta["global_pool"] = _global_pool(args, kwargs)
                elif (op, target) in MEAN_OPS:
                    node.meta["global_pool"] = _spatial_mean(args, kwargs)
                self.produced(node, out)
        return out


def _hooks(model: nn.Module, rec: _Recorder, is_leaf: Callable[[str, nn.Module], bool]) -> list:
    handles = []
    for name, m in model.named_modules():
        leaf = is_leaf(name, m) and m is not model

        def pre(module, args, kwargs, name=name, leaf=leaf):
            if rec.leaf_depth == 0:
                if leaf:
                    flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
                    rec.alive.extend(flat)
                    rec.pending.append(rec.node("call_module", name, flat))
                else:
                    rec.calls += 1
                    rec.stack.append((name, type(module).__name__, rec.calls))
                    rec.graph.module_inputs.setdefault(name, []).append(
                        [rec.producer.get(id(t)) for t in args if isinstance(t, torch.Tensor)]
                    )
                    rec.graph.module_calls.setdefault(name, []).append(rec.calls)
            if leaf:
                rec.leaf_depth += 1

        def post(module, args, kwargs, output, name=name, leaf=leaf):
            if leaf:
                rec.leaf_depth -= 1
            if rec.leaf_depth == 0:
                if leaf:
                    rec.produced(rec.pending.pop(), output)
                else:
                    rec.stack.pop()

        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))
    return handles


#: what a forward that does not fit the example batch raises
FORWARD_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError, AssertionError)


def forward_failed(example: Mapping[str, torch.Tensor], e: BaseException, doing: str) -> DataError:
    """The one-line error for a forward that failed on the example batch: its inputs' dtypes and shapes, what
    quantcli was doing, the model's own first line."""
    shapes = ", ".join(
        f"{k}: {str(v.dtype).replace('torch.', '')}{list(v.shape)}"
        for k, v in example.items()
        if isinstance(v, torch.Tensor)
    )
    return DataError(f"forward({shapes}) failed on the example batch ({doing}): {first_line(e)}")


def record(
    model: nn.Module, example: Mapping[str, torch.Tensor], is_leaf: Callable[[str, nn.Module], bool]
) -> RecordedGraph:
    """Run ``model(**example)`` once (no gradients, eval mode, every quantizer passing values through) and
    return what ran. ``is_leaf(name, module)``: modules recorded as one ``call_module`` node (the others are
    recorded op by op inside). Raises :class:`quantcli.errors.DataError` when the forward fails."""
    from quantcli.nn.tensor_quantizer import TensorQuantizer

    rec = _Recorder({id(m): n for n, m in model.named_modules()})
    example = fresh(example)  # the placeholders are these copies, which the forward may change in place
    for k, v in example.items():
        if isinstance(v, torch.Tensor):
            rec.alive.append(v)
            rec.produced(rec.node("placeholder", k, []), v)
    quantizers = [m for m in model.modules() if isinstance(m, TensorQuantizer)]
    modes = [q.mode for q in quantizers]
    training = {m: m.training for m in model.modules()}
    handles = _hooks(model, rec, is_leaf)
    try:
        for q in quantizers:
            q.mode = "disabled"
        model.eval()
        _RECORDING.append(rec)
        with torch.no_grad(), rec:
            call_forward(model, example)
    except FORWARD_ERRORS as e:
        raise forward_failed(example, e, "reading the model's graph") from None
    finally:
        if rec in _RECORDING:
            _RECORDING.remove(rec)
        for h in handles:
            h.remove()
        for q, mode in zip(quantizers, modes):
            q.mode = mode
        for m, t in training.items():
            m.training = t
    return rec.graph
