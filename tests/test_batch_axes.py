"""Inputs whose samples are not on axis 0 (issue 35, item 6), and EmbeddingBag through the TorchScript
exporter (item 5): a DLRM-style model whose ``offsets`` are ``(tables, batch)`` and whose ``indices`` have no
batch axis, calibrated from a directory of batch files, exported and verified."""

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from exporters.fold import drop_unused_initializers
from quantcli.errors import DataError
from quantcli.inputs import batch_axes as ba
from quantcli.inputs.checkpoint import example_of
from quantcli.inputs.data import cap_samples, load_batches
from tests import user_models
from tests.helpers import assert_clean_error, cli

DLRM = user_models.module("dlrm")


def _dlrm_batch(n=32, seed=0):
    return {k: torch.from_numpy(v) for k, v in DLRM.samples(n, seed).items()}


def test_batch_first_inputs_keep_axis_0():
    b = {"x": torch.zeros(8, 3), "ids": torch.zeros(8, 5, dtype=torch.long), "t": torch.tensor(1.0)}
    assert ba.batch_axes(b) == {"x": 0, "ids": 0, "t": None}
    assert ba.describe(b) == "" and ba.batch_size(b) == 8


def test_the_features_decide_the_batch_axis():
    """dense (32, 13) float: 32 samples; offsets (3, 32): axis 1; indices (3, 96): none."""
    b = _dlrm_batch()
    assert ba.batch_axes(b) == {"dense": 0, "indices": None, "offsets": 1}
    assert ba.batch_size(b) == 32
    assert ba.describe(b) == "indices: none (passed whole), offsets: axis 1"


def test_cutting_follows_each_inputs_axis():
    b = {"x": torch.arange(24.0).reshape(6, 4), "lengths_t": torch.arange(12).reshape(2, 6)}
    part = ba.take(b, 2, 5)
    assert torch.equal(part["x"], b["x"][2:5]) and torch.equal(part["lengths_t"], b["lengths_t"][:, 2:5])
    first, rest = ba.split(b, 4)
    assert first["lengths_t"].shape == (2, 4) and rest["lengths_t"].shape == (2, 2)


def test_a_batch_with_an_unbatched_input_is_not_cut():
    """The example a checkpoint stores keeps the whole batch (indices cannot be cut); --num-samples that would
    cut it is refused with the input named and what to do."""
    b = _dlrm_batch()
    ex = example_of(b)
    assert {k: tuple(v.shape) for k, v in ex.items()} == {k: tuple(v.shape) for k, v in b.items()}
    with pytest.raises(DataError, match=r"input 'indices' \[3, 96\] has no axis of 32 samples.*directory"):
        cap_samples([b], 10)


GCN = user_models.module("graph_convolution")


def test_a_graph_whose_nodes_are_on_both_axes_of_its_adjacency_is_not_cut():
    """A pygcn-style model takes one graph: features ``(nodes, 24)`` and an adjacency ``(nodes, nodes)``. Cut
    to 8 samples on axis 0 alone, the adjacency was ``(8, 16)`` and calibration failed on the example batch
    ("mat1 and mat2 shapes cannot be multiplied"). Given the model, the example is the cut batch where the
    model runs on it and the whole batch where it does not; a batch-first model whose batch size is also a
    feature size is still cut."""
    graph = {k: torch.from_numpy(v) for k, v in GCN.samples(16, 0).items()}
    assert {k: tuple(v.shape) for k, v in example_of(graph).items()} == {"x": (8, 24), "adj": (8, 16)}
    whole = example_of(graph, GCN.make())
    assert {k: tuple(v.shape) for k, v in whole.items()} == {"x": (16, 24), "adj": (16, 16)}
    assert torch.equal(whole["adj"], graph["adj"])

    class Square(torch.nn.Module):  # 16 samples of 16 features: cut, as it runs on 8
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 2)

        def forward(self, x):
            return self.fc(x)

    cut = example_of({"x": torch.randn(16, 16)}, Square())
    assert tuple(cut["x"].shape) == (8, 16)


def test_smoothquant_runs_where_the_batch_size_is_also_a_sequence_length(tmp_path):
    """Batches of 16 sequences of 16 tokens: the batch size is the size of a second axis, so the example batch
    is tried on the model before it is cut, and at SmoothQuant the model's quantizers were not calibrated yet:
    the forward raised "amax is not set; calibrate the model first" and calibrate exited 2."""
    tokens = user_models.module("transformer_encoder").samples(64, 0)["tokens"]
    assert tokens.shape[1] == 16
    np.savez(tmp_path / "x.npz", tokens=tokens)
    r = cli(
        "calibrate",
        user_models.spec("transformer_encoder"),
        "--data",
        tmp_path / "x.npz",
        "--batch-size",
        "16",
        "--smoothquant",
        "0.5",
        "--out",
        tmp_path / "m.calib.pt",
    )
    assert r.exit_code == 0, r.output


def test_a_graph_model_calibrates_exports_and_verifies_from_batch_files(tmp_path):
    """Through the CLI: calibrated from batch files of one graph each, every layer quantized (two
    ``torch.mm`` graph convolutions and an ``addmm`` classifier); the dynamo export names the adjacency
    axis the model ties to the node count (exit 2, no file) and exports with it."""
    calib, held = user_models.write_data("graph_convolution", tmp_path)
    ck, graph = tmp_path / "gcn.calib.pt", tmp_path / "gcn.onnx"
    r = cli("calibrate", user_models.spec("graph_convolution"), "--data", calib, "--out", ck, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    layers = set(info["layers"]["quantized"]) | {f["name"] for f in info["layers"]["float"]}
    assert layers == {"gc1", "gc2", "classifier"}, info["layers"]
    assert not [f for f in info["layers"]["float"] if not f["reason"].startswith("latency placement")]
    r = cli("export", ck, "--onnx", graph, "--exporter", "dynamo")
    assert_clean_error(r, "--dynamic-dim adj=1 to make them dynamic too")
    assert not graph.exists()
    r = cli("export", ck, "--onnx", graph, "--exporter", "dynamo", "--dynamic-dim", "adj=1")
    assert r.exit_code == 0, r.output
    r = cli("verify", graph, "--reference", ck, "--data", held)
    assert r.exit_code == 0, r.output


def test_whole_arrays_are_split_along_each_axis(tmp_path):
    """An .npz of 64 samples with offsets-like (tables, batch) integers: batches of 16 cut both on their
    axes."""

    class M(torch.nn.Module):
        def forward(self, x, lengths_t):
            return x.sum(1) + lengths_t.sum(0)

    x = np.random.default_rng(0).standard_normal((64, 5)).astype(np.float32)
    lengths = np.arange(3 * 64).reshape(3, 64)
    np.savez(tmp_path / "d.npz", x=x, lengths_t=lengths)
    batches = load_batches(tmp_path / "d.npz", M(), batch_size=16)
    assert [tuple(b["lengths_t"].shape) for b in batches] == [(3, 16)] * 4
    assert np.array_equal(batches[1]["lengths_t"].numpy(), lengths[:, 16:32])


def test_initializers_read_only_inside_a_loop_body_are_kept():
    """TorchScript exports EmbeddingBag as a Loop whose body reads outer constants by name: dropping them as
    unused left the body reading nothing ("Nodes in a graph must be topologically sorted")."""
    body = helper.make_graph(
        [helper.make_node("Add", ["x_in", "outer_c"], ["x_out"])],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_in", TensorProto.FLOAT, [1]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_out", TensorProto.FLOAT, [1]),
        ],
        nodes_extra := [],
    )
    del nodes_extra
    body.node.insert(0, helper.make_node("Identity", ["cond"], ["cond_out"]))
    g = helper.make_graph(
        [helper.make_node("Loop", ["n", "", "x"], ["y"], body=body)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        [
            onnx.numpy_helper.from_array(np.array(3, np.int64), "n"),
            onnx.numpy_helper.from_array(np.array([1.0], np.float32), "outer_c"),
            onnx.numpy_helper.from_array(np.array([9.0], np.float32), "unused"),
        ],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    drop_unused_initializers(m)
    assert [t.name for t in m.graph.initializer] == ["n", "outer_c"]
    onnx.checker.check_model(m)


@pytest.fixture(scope="module")
def dlrm(tmp_path_factory):
    """The DLRM-style model calibrated from a directory of 32-sample batch files (was: "Sizes of tensors must
    match ... Expected size 8 but got size 32", the example batch cut on axis 0)."""
    root = tmp_path_factory.mktemp("dlrm")
    calib, held = user_models.write_data("dlrm", root)
    ck = root / "dlrm.calib.pt"
    r = cli("calibrate", user_models.spec("dlrm"), "--data", calib, "--out", ck, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["batch_axes"] == "indices: none (passed whole), offsets: axis 1"
    return ck, held


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_dlrm_exports_and_verifies(dlrm, exporter, tmp_path):
    """TorchScript: was "the exported graph failed the ONNX checker: Nodes in a graph must be topologically
    sorted, however input '/tables.0/Constant_1_output_0' of node:". The graph's batch is on axis 1 of offsets
    and every axis of indices is dynamic; onnxruntime's outputs agree with the float model."""
    ck, held = dlrm
    graph = tmp_path / "dlrm.onnx"
    r = cli("export", ck, "--onnx", graph, "--exporter", exporter, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["dynamic_dims"] == {"dense": [0], "indices": [0, 1], "offsets": [1]}
    dims = {
        i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
        for i in onnx.load(graph).graph.input
    }
    assert dims["offsets"][0] == 3 and isinstance(dims["offsets"][1], str)
    r = cli("verify", graph, "--reference", ck, "--data", held, "--json")
    assert r.exit_code == 0, r.output
    for batch in user_models.read_data(held):
        got = user_models.onnx_outputs(graph, batch)[0]
        want = user_models.float_outputs("dlrm", batch)[0]
        assert user_models.cosine(got, want) > 0.99


def test_num_samples_that_would_cut_a_dlrm_batch_is_refused(tmp_path):
    calib, _ = user_models.write_data("dlrm", tmp_path)
    r = cli(
        "calibrate",
        user_models.spec("dlrm"),
        "--data",
        calib,
        "--num-samples",
        "40",
        "--out",
        tmp_path / "c.pt",
    )
    assert_clean_error(r, "--num-samples 40", "'indices'", "no axis of 32 samples")


class _TwoInputs(torch.nn.Module):
    def forward(self, image, table, scale=None):
        return image.mean((1, 2, 3)) + table.sum(1)


def test_a_pt_tuple_is_one_batch_of_forwards_arguments_in_order(tmp_path):
    """``torch.save((image, table))``, as ``forward(*args)`` takes them, was read as two batches of ``image``
    ("forward needs argument(s) table"); a list stays a list of batches, and its error says how to give every
    input."""
    g = torch.Generator().manual_seed(0)
    image, table = torch.randn(32, 3, 4, 4, generator=g), torch.randn(32, 5, generator=g)
    torch.save((image, table), tmp_path / "t.pt")
    batches = load_batches(tmp_path / "t.pt", _TwoInputs(), batch_size=16)
    assert [sorted(b) for b in batches] == [["image", "table"]] * 2
    assert torch.equal(batches[1]["table"], table[16:]) and torch.equal(batches[0]["image"], image[:16])
    torch.save((image, table, torch.ones(32), torch.ones(32)), tmp_path / "four.pt")
    with pytest.raises(DataError, match="a tuple of 4 tensors is one batch of forward's arguments in order"):
        load_batches(tmp_path / "four.pt", _TwoInputs())
    torch.save([image, table], tmp_path / "l.pt")
    with pytest.raises(DataError, match="needs argument.* table .*a tuple in forward's order"):
        load_batches(tmp_path / "l.pt", _TwoInputs())


def test_a_sequence_first_rnn_and_its_initial_state_are_cut_on_their_batch_axis():
    """``x`` ``(time, batch, features)`` and ``h0`` ``(layers, batch, hidden)``: their first axes differ, so
    the batch was taken as x's time axis and h0 had none. The one size both have is the batch."""
    batch = {"x": torch.randn(7, 16, 10), "h0": torch.randn(1, 16, 12)}
    assert ba.batch_axes(batch) == {"x": 1, "h0": 1}
    assert ba.batch_size(batch) == 16
    # two shared sizes decide nothing: the first input's first axis, as before
    assert ba.batch_axes({"x": torch.randn(7, 16, 10), "h0": torch.randn(1, 16, 7)})["x"] == 0
