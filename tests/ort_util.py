"""ONNX graphs run in onnxruntime with optimizations off: exported files next to their PyTorch model, and
one-node models built with onnx.helper."""

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper


def run_model(model, feeds: dict) -> list:
    """Every output of ``model`` (a ModelProto, or the path of an ONNX file) on numpy ``feeds``."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    sess = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def onnx_and_torch(model, module: torch.nn.Module, batch: dict) -> tuple[np.ndarray, np.ndarray]:
    """The first output of the ONNX ``model`` (ModelProto or path) in onnxruntime and of the PyTorch
    ``module`` on one ``batch`` of tensors: the two sides of a parity check."""
    got = run_model(model, {k: v.numpy() for k, v in batch.items()})[0]
    with torch.inference_mode():
        want = module(**batch).numpy()
    return got, want


def _zp_tensor(zp: np.ndarray, elem_type: int) -> onnx.TensorProto:
    return helper.make_tensor("zp", elem_type, list(zp.shape), zp.flatten().tolist())


def ort_quantize_linear(x, scale, zp, elem_type, axis=None, block_size=None, opset=13):
    x = np.asarray(x, np.float32)
    """Integer (or fp8) codes from onnxruntime's QuantizeLinear, cast to float32 inside the graph."""
    attrs = {}
    if axis is not None:
        attrs["axis"] = axis
    if block_size is not None:
        attrs["block_size"] = block_size
    xi = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))
    yo = helper.make_tensor_value_info("y", TensorProto.FLOAT, list(x.shape))
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], **attrs),
        helper.make_node("Cast", ["q"], ["y"], to=TensorProto.FLOAT),
    ]
    inits = [
        numpy_helper.from_array(np.asarray(scale, np.float32), "s"),
        _zp_tensor(np.asarray(zp), elem_type),
    ]
    graph = helper.make_graph(nodes, "q", [xi], [yo], inits)
    ir = 10 if opset >= 21 else 9 if opset >= 19 else 8
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir)
    onnx.checker.check_model(model)
    return run_model(model, {"x": np.asarray(x, np.float32)})[0]
