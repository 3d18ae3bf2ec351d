"""Reading ONNX graphs: initializers and constants as numpy, Q/DQ pairs and the quantizer each came from."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from quantcli.errors import VerifyError, first_line
from quantcli.files import readable_file

QUANTIZERS_KEY = "quantcli.quantizers"
#: in the names of the Q/DQ copies :mod:`exporters.onnxruntime.placement` puts in front of ops that commute
# with quantization
PROPAGATED_MARK = "quantcli_propagated"
# JSON list: quantizers removed as dead code (their output is unused)
PRUNED_KEY = "quantcli.pruned_quantizers"
#: JSON list: the model's inputs its forward never reads (DeBERTa-v3's token_type_ids), which the torch
# exporter leaves out of the graph
UNREAD_INPUTS_KEY = "quantcli.unread_inputs"
#: JSON list: DequantizeLinear outputs whose weight codes are stored ``[in, out]`` (``axis=0``), the form
# onnxruntime : runs as MatMulNBits (:mod:`exporters.matmul_nbits`); their quantizer's tensor is ``[out, in]``
KN_WEIGHTS_KEY = "quantcli.kn_weights"
#: the CPU kind the graph's grids were chosen for (quantcli.quant.cpu), onnxruntime target
CPU_KEY = "quantcli.cpu"
#: JSON list: where the model's forward branched on a tensor's value while torchscript traced it
# (``file:line``): the graph holds the path the example batch took
BRANCHES_KEY = "quantcli.traced_branches"


def read_onnx(path: str | Path, weights: bool = True) -> onnx.ModelProto:
    """Load and check an ONNX file; a missing or corrupt file is a one-line error. A graph whose weights are
    external data (export writes them so past 1.8 GB) is checked from its path, as the checker can check a
    model past protobuf's 2 GB only there; ``weights=False`` leaves them on disk (the graph and metadata
    only)."""
    path = Path(path)
    readable_file(path, "ONNX file", ".onnx", "the .onnx file that `quantcli export` wrote", VerifyError)
    try:
        model = onnx.load(str(path), load_external_data=False)
        external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
        onnx.checker.check_model(str(path) if external else model)
        if external and weights:
            onnx.load_external_data_for_model(model, str(path.parent))
    except Exception as e:
        first = first_line(e, 160)
        raise VerifyError(
            f"{path} is not a valid ONNX model ({first}); re-export it with `quantcli export`"
        ) from None
    return model


def name_scopes(node: onnx.NodeProto) -> list[str]:
    """The module paths the dynamo exporter records for ``node`` (``pkg.torch.onnx.name_scopes`` metadata:
    ``['', 'fc1', 'fc1.input_quantizer', 'qdq_3']``), outermost first; ``[]`` for TorchScript nodes."""
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            return [s.strip(" '\"") for s in p.value.strip("[]").split(",")]
    return []


def scope_module_path(parts: list[str]) -> str:
    """The module path of a TorchScript node scope. A child of a Sequential or ModuleList is named
    ``<container scope>.<index>`` (``/layer2/layer2.0/downsample/downsample.0/...`` is module
    ``layer2.0.downsample.0``; nested containers: ``/layers.0/layers.0.1/...`` is ``layers.0.1``)."""
    path: list[str] = []
    previous = None
    for part in parts:
        if previous is not None and part.startswith(previous + "."):
            path.append(part[len(previous) + 1 :])
        else:
            path.append(part)
        previous = part
    return ".".join(path)


def initializer_map(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """Initializer name -> its TensorProto (the proto itself: editing it edits the graph)."""
    return {t.name: t for t in graph.initializer}


def producer_map(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    """Tensor name -> the node that writes it (graph inputs and initializers have none)."""
    return {o: n for n in graph.node for o in n.output}


def consumer_map(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    """Tensor name -> the nodes that read it, in graph order."""
    out: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            out.setdefault(i, []).append(n)
    return out


def to_numpy(t: onnx.TensorProto) -> np.ndarray:
    """Tensor values as numpy; int4/uint4 unpacked to int8/uint8, fp8 as float32."""
    if t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        from onnx import numpy_helper as nh

        arr = nh.to_array(t)
        return arr.astype(np.int8 if t.data_type == onnx.TensorProto.INT4 else np.uint8)
    arr = numpy_helper.to_array(t)
    if t.data_type == onnx.TensorProto.FLOAT8E4M3FN:
        return arr.astype(np.float32)
    return arr


@dataclass
class QdqPair:
    """One DequantizeLinear (and its QuantizeLinear, if the codes are computed at run time)."""

    tensor: str  # the float tensor the pair quantizes (the Q input, or the stored initializer)
    output: str  # the DequantizeLinear output
    quantizer: str | None
    format: str
    axis: int | None
    block_size: int | None
    scale: np.ndarray
    zero_point: np.ndarray
    stored: str  # "runtime" (Q in the graph) or "initializer" (weights stored quantized)
    q_node: str | None
    dq_node: str
    # codes stored [in, out] (MatMulNBits form): the quantizer's weight is their transpose
    transposed: bool = False

    def quantizer_layout(self, values: np.ndarray) -> np.ndarray:
        """``values`` in the layout of the quantizer's own tensor (weight codes or scales of this pair)."""
        return values.T if self.transposed and values.ndim == 2 else values

    def to_row(self) -> dict:
        """The pair as plain data: ``scale``/``zero_point`` as short text for a table, ``scale_values`` and
        ``zero_point_values`` as the numbers themselves (every channel or block, flattened)."""
        s, zp = self.scale, self.zero_point
        return {
            "tensor": self.tensor,
            "output": self.output,
            "quantizer": self.quantizer,
            "format": self.format,
            "axis": self.axis,
            "block_size": self.block_size,
            "scale": values_text(s),
            "zero_point": values_text(zp),
            "scale_values": plain_values(s),
            "zero_point_values": plain_values(zp),
            "stored": self.stored,
        }


def values_text(v: np.ndarray) -> str:
    """One value as itself (an integer as an integer), several as ``[min .. max] (count)``."""
    v = np.asarray(v)
    if v.size == 1:
        x = v.reshape(-1)[0]
        return str(int(x)) if np.issubdtype(v.dtype, np.integer) else f"{float(x):.6g}"
    if np.issubdtype(v.dtype, np.integer):
        return f"[{int(v.min())} .. {int(v.max())}] ({v.size})"
    return f"[{float(v.min()):.4g} .. {float(v.max()):.4g}] ({v.size})"


def plain_values(v: np.ndarray) -> list:
    """Flattened values as JSON numbers: integers for integer codes, floats otherwise (float8 zero points)."""
    v = np.asarray(v).reshape(-1)
    return [int(x) for x in v] if np.issubdtype(v.dtype, np.integer) else [float(x) for x in v]


def metadata_json(model: onnx.ModelProto, key: str, default):
    """The JSON value the exporter wrote under ``key`` in the graph's ``metadata_props``; ``default`` where
    it wrote none (older files)."""
    for p in model.metadata_props:
        if p.key == key:
            return json.loads(p.value)
    return default


def quantizer_map(model: onnx.ModelProto) -> dict[str, str]:
    """DequantizeLinear output name -> quantizer name, as written by the exporter into metadata_props."""
    return metadata_json(model, QUANTIZERS_KEY, {})


def is_int32_bias(n: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> bool:
    """A DequantizeLinear of stored int32 codes: the bias of an integer kernel (onnxruntime target)."""
    return (
        n.op_type == "DequantizeLinear"
        and n.input[0] in inits
        and inits[n.input[0]].data_type == onnx.TensorProto.INT32
    )


def kn_weights(model: onnx.ModelProto) -> set[str]:
    """The DequantizeLinear outputs whose weight codes the exporter stored as ``[in, out]`` (empty: none)."""
    return set(metadata_json(model, KN_WEIGHTS_KEY, []))


def traced_branches(model: onnx.ModelProto) -> list[str]:
    """Where the model's forward branched on a tensor's value when it was traced (:data:`BRANCHES_KEY`;
    empty: none, or an older file)."""
    return list(metadata_json(model, BRANCHES_KEY, []))


def branch_note(branches: list[str]) -> str:
    """What a graph traced through data-dependent branches (:func:`traced_branches`) holds, and what to do."""
    where = ", ".join(branches[:3]) + (" ..." if len(branches) > 3 else "")
    return (
        f"the model's forward branches on a tensor's value ({where}): torchscript traced the path the "
        "example batch took, and the graph computes that path for every input. Make the branch independent "
        "of the data, or export with --exporter dynamo, which refuses such a branch"
    )


def pruned_quantizers(model: onnx.ModelProto) -> list[str]:
    """Quantizers the exporter recorded as removed because nothing uses their output (empty for older
    files)."""
    return list(metadata_json(model, PRUNED_KEY, []))


def unread_inputs(model: onnx.ModelProto) -> list[str]:
    """The checkpoint's inputs export recorded as left out of the graph, never read (empty for older
    files)."""
    return list(metadata_json(model, UNREAD_INPUTS_KEY, []))


def is_propagated(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is a Q or DQ copy that only moves a quantizer's Q across commuting ops
    (:data:`PROPAGATED_MARK` in its name or, for a graph whose nodes were renamed, its output's)."""
    return PROPAGATED_MARK in node.name or any(PROPAGATED_MARK in o for o in node.output)


def qdq_pairs(model: onnx.ModelProto) -> list[QdqPair]:
    """Every quantizer's Q/DQ pair; int32 bias DequantizeLinears and the copies that only move a quantizer's Q
    across commuting ops (:data:`PROPAGATED_MARK`) are not quantizers of their own and are left out."""
    from quantcli.quant import formats  # (torch, through the descriptor: not for graph-only readers)

    g = model.graph
    inits = initializer_map(g)
    producers = producer_map(g)
    names = quantizer_map(model)
    kn = kn_weights(model)
    pairs = []
    for n in g.node:
        if n.op_type != "DequantizeLinear" or is_propagated(n) or is_int32_bias(n, inits):
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        src = producers.get(n.input[0])
        zp_name = n.input[2] if len(n.input) > 2 else None
        zp_t = inits.get(zp_name) if zp_name else None
        elem = (
            zp_t.data_type
            if zp_t is not None
            else (inits[n.input[0]].data_type if n.input[0] in inits else 0)
        )
        scale = to_numpy(inits[n.input[1]]) if n.input[1] in inits else np.array(np.nan)
        zp = to_numpy(zp_t) if zp_t is not None else np.zeros(())
        if src is not None and src.op_type == "QuantizeLinear":
            tensor, stored, qn = src.input[0], "runtime", src.name
        else:
            tensor, stored, qn = n.input[0], "initializer", None
        scale_rank = scale.ndim
        pairs.append(
            QdqPair(
                tensor=tensor,
                output=n.output[0],
                quantizer=names.get(n.output[0]),
                format=formats.BY_ELEM_TYPE[elem].name if elem in formats.BY_ELEM_TYPE else f"type{elem}",
                axis=attrs.get("axis", 1) if scale_rank >= 1 and scale.size > 1 else None,
                block_size=attrs.get("block_size") or None,
                scale=scale,
                zero_point=zp,
                stored=stored,
                q_node=qn,
                dq_node=n.name,
                transposed=n.output[0] in kn,
            )
        )
    return pairs
