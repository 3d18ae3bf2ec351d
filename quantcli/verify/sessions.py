"""onnxruntime sessions for verify: which provider, the exact session (optimizations off) and the deployed one
(``InferenceSession(path)`` with default options), feeding batches, and what to tell a user when the deployed
session does not load.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch

from quantcli.errors import GraphRunError, VerifyError, first_line
from quantcli.inputs.data import Batch

#: onnxruntime's log severity: fatal only. Its errors reach the user as the one-line error quantcli raises (a
#: VerifyError quoting the runtime's message); its own coloured ``[E:onnxruntime:...]`` lines would repeat
# them.
RUNTIME_LOG_SEVERITY = 4


def runtime():
    """``onnxruntime``, its default logger limited to :data:`RUNTIME_LOG_SEVERITY`."""
    import onnxruntime as ort

    ort.set_default_logger_severity(RUNTIME_LOG_SEVERITY)
    return ort


def choose_provider(provider: str = "auto") -> str:
    """``auto``/``cpu``/``cuda`` -> an onnxruntime execution provider name (``auto``: CUDA if usable)."""
    ort = runtime()

    available = ort.get_available_providers()
    cuda_ok = "CUDAExecutionProvider" in available and torch.cuda.is_available()
    if provider == "auto":
        return "CUDAExecutionProvider" if cuda_ok else "CPUExecutionProvider"
    if provider == "cpu":
        return "CPUExecutionProvider"
    if provider == "cuda":
        if not cuda_ok:
            raise VerifyError(
                "--provider cuda: onnxruntime's CUDAExecutionProvider or a CUDA GPU is not "
                "available "
                "here; use --provider cpu or auto"
            )
        return "CUDAExecutionProvider"
    raise VerifyError(f"unknown --provider {provider!r}; use auto, cpu or cuda")


def open_session(
    model: onnx.ModelProto | bytes | Path,
    provider: str,
    optimize: bool,
    disabled_optimizers: tuple[str, ...] = (),
):
    """An ``InferenceSession`` on ``provider``.

    ``optimize=False``: every graph optimization off, so each node computes exactly its ONNX definition (the
    session the fake-quant model is compared with). ``optimize=True``: onnxruntime's default level
    (``ORT_ENABLE_ALL``), the session a user deploys. Besides the level, only the log level (no warnings about
    CUDA libraries on CPU machines) and the thread count (torch's, so that timings compare) are set; neither
    changes which graph onnxruntime builds.
    ``disabled_optimizers``: onnxruntime optimizers left out (what a graph not made for onnxruntime's CPU
    fusions, e.g. a TensorRT-target float8 graph, needs to load there).
    """
    ort = runtime()
    so = ort.SessionOptions()
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = RUNTIME_LOG_SEVERITY
    so.intra_op_num_threads = max(1, torch.get_num_threads())
    # a path: the file as it ships (its external data read by onnxruntime itself, as a user's session does)
    data = (
        str(model)
        if isinstance(model, Path)
        else model
        if isinstance(model, bytes)
        else model.SerializeToString()
    )
    try:
        if disabled_optimizers:
            return ort.InferenceSession(
                data, so, providers=[provider], disabled_optimizers=list(disabled_optimizers)
            )
        return ort.InferenceSession(data, so, providers=[provider])
    except Exception as e:
        raise VerifyError(f"onnxruntime cannot load the model: {first_line(e, 240)}") from None


def deployment_advice(model: onnx.ModelProto) -> str:
    """What to do when the graph does not load with default session options."""
    from exporters.onnxruntime.compat import session_needs

    needs = session_needs(model)
    if needs.disabled_optimizers:
        return (
            "re-export it for the onnxruntime target (`target: onnxruntime` in the config, the "
            "default), which "
            "guards float8 pairs, or deploy it with InferenceSession(path, disabled_optimizers="
            f"{list(needs.disabled_optimizers)}) ({needs.reasons[0]})"
        )
    return (
        "`quantcli inspect MODEL.onnx --runtime onnxruntime` shows what onnxruntime does with it; a "
        "different "
        "--config or --opset, or another onnxruntime version, may avoid the failing fusion"
    )


_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
}


def feeds(sess, batch: Batch, where: str) -> dict[str, np.ndarray]:
    """The batch as onnxruntime inputs, with one-line errors for missing inputs, wrong dtypes and shapes."""
    out = {}
    for i in sess.get_inputs():
        if i.name not in batch:
            raise VerifyError(f"{where}: the ONNX input {i.name!r} has no data (data has {', '.join(batch)})")
        v = batch[i.name].detach().cpu()
        want = _ORT_TYPES.get(i.type)
        if want is not None and np.issubdtype(want, np.integer) and v.dtype.is_floating_point:
            raise VerifyError(
                f"{where}: input {i.name!r} is {str(v.dtype).replace('torch.', '')} but the "
                f"graph "
                f"expects {i.type}"
            )
        arr = v.numpy()
        out[i.name] = arr.astype(want, copy=False) if want is not None else arr
        if len(i.shape) != arr.ndim or any(isinstance(d, int) and d != s for d, s in zip(i.shape, arr.shape)):
            raise VerifyError(
                f"{where}: input {i.name!r} has shape {list(arr.shape)} but the graph expects {i.shape}"
                + _fixed_size_remedy(i.name, i.shape, arr.shape, np.issubdtype(arr.dtype, np.floating))
            )
    return out


def _fixed_size_remedy(name: str, graph_shape: list, shape: tuple[int, ...], floating: bool = True) -> str:
    """Where the data's rank fits and only sizes the graph fixed differ: how to export the graph so that
    those axes may vary (``quantcli export --dynamic-dim``), unless the axis is one the weights fix."""
    if len(graph_shape) != len(shape):
        return ""
    fixed = [a for a, (d, s) in enumerate(zip(graph_shape, shape)) if isinstance(d, int) and d != s]
    last = len(shape) - 1
    if floating and len(shape) == 3 and fixed == [last]:  # (N, L, F) features, or (N, C, L) a length
        return (
            f"; the last axis of a 3-D float input is either its features (N, L, F: a Linear's, which the "
            f"model's weights fix at {graph_shape[last]}: check the data's feature count and layout) or its "
            f"length (N, C, L: a Conv1d's, which the graph fixed: export it again with `quantcli export ... "
            f"--dynamic-dim {name}={last}` to run it at other lengths)"
        )
    if floating and len(shape) in (2, 3) and last in fixed:  # (N, F) or (N, L, F): a Linear's features
        return (
            f"; the last axis of a {len(shape)}-D float input is its features, which the model's weights fix "
            f"at {graph_shape[last]}, not a size to export as dynamic: check the data's feature count and "
            "layout"
        )
    if len(shape) in (4, 5) and 1 in fixed:  # an image's (or volume's) channels: the weights fix them
        return (
            f"; axis 1 of a {len(shape)}-D input is its channels, which the model's weights fix at "
            f"{graph_shape[1]}, not a size to export as dynamic: check the data's channel count and layout "
            f"(channels first, N{'CDHW' if len(shape) == 5 else 'CHW'})"
        )
    axes = ",".join(map(str, fixed))
    where = f"axis {axes}" if len(fixed) == 1 else f"axes {', '.join(map(str, fixed))}"
    return (
        f"; the graph was exported with a fixed size on {where}: export it again with "
        f"`quantcli export ... --dynamic-dim {name}={axes}` to run it at other sizes"
    )


#: onnxruntime's words for a node that failed while running (not for inputs it refused before running any)
NODE_FAILED = "Non-zero status code returned while running"


def run(sess, inputs: dict[str, np.ndarray], where: str, names: list[str] | None = None) -> list[np.ndarray]:
    """The session's outputs; a node failing at run time raises :class:`GraphRunError`, anything else (inputs
    refused) :class:`VerifyError`."""
    try:
        return sess.run(names, inputs)
    except Exception as e:
        kind = GraphRunError if NODE_FAILED in str(e) else VerifyError
        raise kind(f"onnxruntime failed on {where}: {first_line(e, 240)}") from None
