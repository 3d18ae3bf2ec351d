"""A quantize op traces as one node: its body runs with torch's tracer off while ``torch.onnx.export``
(TorchScript) traces the model.

The TorchScript exporter records an ``autograd.Function`` as a ``prim::PythonOp`` and copies every op its
``forward`` ran into a subgraph of that node, found by a walk from the start of the graph; the node's
``symbolic`` then replaces it all. A fake quantizer's body is a dozen ops (scale, round, clamp, casts), so a
model with hundreds of quantizers traced a graph four times the size of its float one, and the exporter's
passes (``_jit_pass_lint`` among them) and that walk grew faster than the graph: the quantized EfficientNet-B0
of the model zoo exported in 68 s where its float model takes 1 s. With the body untraced, the trace holds the
op's node alone; the values it computes are the same, so what the traced Python sees is unchanged, and the
exported graph is the one its ``symbolic`` writes (less the dead ``Cast`` nodes the copied bodies left).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """Ops run inside are not recorded by a running trace (constants computed for the graph: amax, int32
    bias codes); a no-op when nothing traces."""
    state = torch._C._get_tracing_state()
    if state is None:
        yield
        return
    torch._C._set_tracing_state(None)
    try:
        yield
    finally:
        torch._C._set_tracing_state(state)


def _detached(out):
    # the tracer names an output by the trace of the tensor returned; a tensor made with the tracer off has
    # none, and one that will require grad cannot become a constant: a detach, traced, gives it one
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, tuple):
        return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in out)
    return out


def traced_as_one_node(forward: Callable) -> Callable:
    """Decorate an ``autograd.Function``'s ``forward`` (under ``@staticmethod``): outside tracing it is called
    as it is; while tracing, its ops are not recorded."""

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        if torch._C._get_tracing_state() is None:
            return forward(*args, **kwargs)
        with untraced():
            out = forward(*args, **kwargs)
        return _detached(out)

    return wrapper
