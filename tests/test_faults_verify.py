"""verify gives every graph it can load a verdict (issue 24): graph mutations from the fault campaign."""

import json

import onnx
import pytest

from exporters.graph import initializer_map, is_int32_bias
from tests.helpers import cli
from tests.mutations import add_to_initializer, replace_op, variant


def _verify(graph, ck, tmp_path, name="g.onnx"):
    path = tmp_path / name
    onnx.save(graph, path)
    r = cli("verify", path, "--reference", ck, "--json")
    assert r.exit_code in (0, 1), r.output  # a verdict, never an internal error
    return r.exit_code, json.loads(r.stdout)


def _delete_relu(m, index):
    relu = [n for n in m.graph.node if n.op_type == "Relu"][index]
    for n in m.graph.node:
        for k, x in enumerate(n.input):
            if x == relu.output[0]:
                n.input[k] = relu.input[0]
    m.graph.node.remove(relu)


def _failed(rep):
    return {c["name"]: c["detail"] for c in rep["checks"] if not c["passed"]}


@pytest.mark.parametrize("index", [0, 1, 2])
def test_relu_replaced_by_identity_before_an_unsigned_quantizer(calibrated, exported, tmp_path, index):
    m = onnx.load(exported("digits_cnn"))
    relu = [n for n in m.graph.node if n.op_type == "Relu"][index]
    code, rep = _verify(variant(m, replace_op, "Relu", index), calibrated("digits_cnn"), tmp_path)
    assert code == 1
    detail = _failed(rep)["fidelity.codes"]
    assert "negative value(s)" in detail and "unsigned" in detail
    assert relu.output[0] in detail or relu.input[0] in detail or "/Flatten" in detail  # the tensor, by name


def test_relu_deleted_and_its_consumer_rewired(calibrated, exported, tmp_path):
    code, rep = _verify(
        variant(onnx.load(exported("digits_cnn")), _delete_relu, 1), calibrated("digits_cnn"), tmp_path
    )
    assert code == 1
    assert "fc1.input_quantizer" in _failed(rep)["fidelity.codes"]


def _bias_codes(m, layer):
    inits = initializer_map(m.graph)
    return next(
        n.input[0] for n in m.graph.node if is_int32_bias(n, inits) and n.name.startswith(f"/{layer}/")
    )


@pytest.mark.parametrize("delta", [3, 30, 300])
def test_int32_bias_codes_are_compared_exactly(calibrated, exported, tmp_path, delta):
    m = onnx.load(exported("digits_cnn"))
    codes = _bias_codes(m, "fc1")
    channel = _most_active_fc1_channel(calibrated("digits_cnn"))
    code, rep = _verify(
        variant(m, add_to_initializer, codes, channel, delta), calibrated("digits_cnn"), tmp_path
    )
    assert code == 1
    assert rep["structure"]["layers_with_problems"] == ["fc1.bias"]
    problem = rep["structure"]["problems"][0]
    assert "int32 bias code" in problem and f"channel {channel}:" in problem


def _most_active_fc1_channel(ck):
    """The fc1 channel whose ReLU output is positive on the most held-out samples (an active one)."""
    import torch

    from quantcli import load_calibrated
    from sample_models import SAMPLES

    model, seen = load_calibrated(ck).float_model(), []
    model.fc1.register_forward_hook(lambda _m, _i, out: seen.append(out))
    with torch.no_grad():
        for b in SAMPLES["digits_cnn"].evaluation_batches():
            model(**b)
    active = (torch.cat(seen) > 0).float().mean(0)
    assert active.max() > 0.9
    return int(active.argmax())


def test_unchanged_graph_compares_every_bias(calibrated, exported, tmp_path):
    code, rep = _verify(onnx.load(exported("digits_cnn")), calibrated("digits_cnn"), tmp_path)
    assert code == 0 and rep["structure"]["int32_biases_compared"] == 4  # conv1, conv2, fc1, fc2


def test_a_graph_without_metadata_says_the_metadata_is_missing(calibrated, exported, tmp_path):
    m = onnx.load(exported("digits_cnn"))
    del m.metadata_props[:]
    code, rep = _verify(m, calibrated("digits_cnn"), tmp_path)
    assert code == 1
    problems = rep["structure"]["problems"]
    assert len(problems) == 1 and "quantcli.quantizers metadata" in problems[0]
    assert "not checked" in problems[0] and "Q/DQ pair missing" not in problems[0]


def _node(m, name):
    return next(n for n in m.graph.node if n.name == name)


def _swap_inputs(m, name):
    n = _node(m, name)
    n.input[0], n.input[1] = n.input[1], n.input[0]


def _identity(m, name):
    n = _node(m, name)
    n.op_type = "Identity"
    del n.attribute[:]
    del n.input[1:]


def test_last_layer_replaced_by_identity_is_a_verdict(calibrated, exported, tmp_path):
    """The graph loads and runs but its output has another shape: a failed check, not an exit-2 error."""
    code, rep = _verify(
        variant(onnx.load(exported("digits_cnn")), _identity, "/fc2/Gemm"), calibrated("digits_cnn"), tmp_path
    )
    assert code == 1
    assert "[16, 64], the model's [16, 10]" in _failed(rep)["graph.outputs"]


@pytest.mark.parametrize(
    "node", ["/conv1/weight_quantizer/DequantizeLinear", "/Flatten/quantcli_propagated/DQ"]
)
def test_graph_onnxruntime_cannot_load_is_named_not_an_internal_error(calibrated, exported, tmp_path, node):
    """Swapped DequantizeLinear inputs: the structure check read them before onnxruntime refused the graph and
    crashed (a tensor size mismatch, a KeyError); the user gets onnxruntime's reason."""
    from tests.helpers import assert_clean_error

    path = tmp_path / "g.onnx"
    onnx.save(variant(onnx.load(exported("digits_cnn")), _swap_inputs, node), path)
    assert_clean_error(
        cli("verify", path, "--reference", calibrated("digits_cnn")), "onnxruntime cannot load"
    )


def _propagated_copies(m):
    from exporters.graph import is_propagated

    return [n for n in m.graph.node if n.op_type == "DequantizeLinear" and is_propagated(n)]


def test_renamed_nodes_keep_the_qdq_copies_across_commuting_ops_copies(calibrated, exported, tmp_path):
    """verify found the copies the export puts in front of MaxPool/Flatten by node name: a graph whose nodes
    were renamed (outputs bit-identical) failed fidelity.replay_steps by half a step at fc1's input."""
    m = onnx.load(exported("digits_cnn"))
    assert _propagated_copies(m)
    for i, n in enumerate(m.graph.node):
        n.name = f"node_{i}"
    code, rep = _verify(m, calibrated("digits_cnn"), tmp_path)
    assert code == 0, _failed(rep)


@pytest.mark.parametrize("factor", [2.0, 0.25])
def test_a_copy_across_commuting_ops_with_another_scale_fails_the_structure_check(
    calibrated, exported, tmp_path, factor
):
    """The exact session runs without those copies, so a copy whose scale was changed (x2: outputs off by
    about the quantization error, so the deployed session's ratio stayed under its bound) passed."""
    from onnx import numpy_helper

    m = onnx.load(exported("digits_cnn"))
    dq = _propagated_copies(m)[-1]
    inits = initializer_map(m.graph)
    scale = numpy_helper.to_array(inits[dq.input[1]]) * factor
    m.graph.initializer.append(numpy_helper.from_array(scale.astype("float32"), "changed_scale"))
    q = next(n for n in m.graph.node if n.output[0] == dq.input[0])
    q.input[1] = dq.input[1] = "changed_scale"
    code, rep = _verify(m, calibrated("digits_cnn"), tmp_path)
    assert code == 1
    assert dq.name in _failed(rep)["structure"] and "another scale or zero point" in _failed(rep)["structure"]
