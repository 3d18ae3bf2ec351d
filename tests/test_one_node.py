"""A quantize op traces as one node (quantcli/quant/one_node.py): while torch's tracer runs (what the
TorchScript exporter does), the arithmetic of a quantize op's ``forward`` is not recorded, its output is the
same, and the exported graph is what its ``symbolic`` writes. Recorded, the bodies made the quantized
EfficientNet-B0 of the zoo export in 68 s instead of 6.5 s (issue 36: placement exports once)."""

from __future__ import annotations

import io
import warnings

import onnx
import pytest
import torch

from quantcli.quant.one_node import traced_as_one_node, untraced
from quantcli.quant.tensor_quant import FakeTensorQuantFunction, TensorQuantFunction

ARITHMETIC = {"aten::div", "aten::round", "aten::clamp", "aten::mul", "aten::to", "aten::where"}


def _kinds(fn, x) -> tuple[list[str], torch.jit.ScriptFunction]:
    """The kinds of the nodes the tracer recorded while ``fn`` ran (read before its dead-code pass, which
    would drop a recorded body whose outputs the op's node replaced), and the traced function."""
    seen: list[str] = []

    def probe(t):
        out = fn(t)
        seen[:] = [n.kind() for n in torch._C._get_tracing_state().graph().nodes()]
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(probe, (x,), check_trace=False)
    return seen, traced


def test_a_fake_quantizer_traces_as_its_node_alone_with_the_same_output():
    amax = torch.tensor(2.0)
    x = torch.linspace(-3, 3, 61).reshape(1, 61)
    kinds, traced = _kinds(lambda t: FakeTensorQuantFunction.apply(t, amax, 8, False, True), x)
    assert kinds.count("prim::PythonOp") == 1 and not ARITHMETIC & set(kinds), kinds
    expected = torch.clamp(torch.round(x / (2.0 / 127)), -127, 127) * (2.0 / 127)  # independent arithmetic
    assert torch.equal(traced(x), expected)
    assert torch.equal(FakeTensorQuantFunction.apply(x, amax, 8, False, True), expected)


def test_an_op_with_two_outputs_traces_as_one_node():
    x, amax = torch.tensor([[-1.0, 0.26, 0.5, 2.0]]), torch.tensor(1.0)
    kinds, traced = _kinds(lambda t: TensorQuantFunction.apply(t, amax, 8, False, True)[0], x)
    assert kinds.count("prim::PythonOp") == 1 and not ARITHMETIC & set(kinds), kinds
    assert traced(x).tolist() == [[-127.0, 33.0, 64.0, 127.0]]  # round(0.26 * 127) = 33, round(63.5) = 64


def test_gradients_are_untouched_outside_tracing():
    x = torch.tensor([-3.0, -1.0, 0.5, 3.0], requires_grad=True)
    FakeTensorQuantFunction.apply(x, torch.tensor(2.0), 8, False, True).sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 0.0]  # straight-through, clipped outside [-amax, amax]


def test_untraced_is_a_no_op_without_a_tracer_and_restores_it_after_an_error():
    with untraced():
        assert torch.ones(1).add(1).item() == 2.0

    def body(t):
        with pytest.raises(ValueError), untraced():
            raise ValueError("inside")
        return t * 3  # traced again after the error

    kinds, _ = _kinds(body, torch.ones(2))
    assert "aten::mul" in kinds


def test_the_decorator_passes_through_non_tensor_outputs():
    calls = []

    @traced_as_one_node
    def forward(t):
        calls.append(torch._C._get_tracing_state())
        return t + 1, 5

    assert forward(torch.zeros(1))[1] == 5 and calls == [None]


def test_export_writes_the_symbolic_and_no_leftover_of_the_body():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))

        def forward(self, x):
            x = FakeTensorQuantFunction.apply(x, torch.tensor(3.0), 8, False, False)
            w = FakeTensorQuantFunction.apply(self.w, torch.tensor(2.0), 8, False, True)
            return x @ w.t()

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Net(), (torch.randn(2, 3),), buf, dynamo=False, opset_version=13)
    ops = [n.op_type for n in onnx.load_from_string(buf.getvalue()).graph.node]
    assert ops.count("QuantizeLinear") == 2 and ops.count("DequantizeLinear") == 2
    assert not {"Round", "Div", "Clip", "Cast"} & set(ops), ops
