"""Dynamic image size (issue 35, item 7): a fully convolutional net calibrated at 32x32, exported with
``--dynamic-dim image=2,3``, runs and verifies at 48x48; exported without it, verify's refusal names the
remedy."""

import json

import numpy as np
import onnx
import pytest

from tests import user_models
from tests.helpers import assert_clean_error, cli

FCN = user_models.module("fully_convolutional")


@pytest.fixture(scope="module")
def fcn(tmp_path_factory):
    root = tmp_path_factory.mktemp("fcn")
    calib, held = user_models.write_data("fully_convolutional", root)
    _, other = user_models.write_data("fully_convolutional", root, size=FCN.OTHER_IMAGE)
    ck = root / "fcn.calib.pt"
    r = cli("calibrate", user_models.spec("fully_convolutional"), "--data", calib, "--out", ck)
    assert r.exit_code == 0, r.output
    return ck, held, other


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_verified_at_two_sizes(fcn, exporter, tmp_path):
    ck, held, other = fcn
    graph = tmp_path / "fcn.onnx"
    r = cli("export", ck, "--onnx", graph, "--exporter", exporter, "--dynamic-dim", "image=2,3", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["dynamic_dims"] == {"image": [0, 2, 3]}
    onnx_model = onnx.load(graph)
    dims = onnx_model.graph.input[0].type.tensor_type.shape.dim
    # the names both exporters give the axes (dynamo's own were torch.export's symbols, s77, s53)
    assert [d.dim_param or d.dim_value for d in dims] == ["batch", 3, "image_2", "image_3"]
    out = onnx_model.graph.output[0].type.tensor_type.shape.dim
    assert out[0].dim_param == "batch"
    for data in (held, other):
        r = cli("verify", graph, "--reference", ck, "--data", data)
        assert r.exit_code == 0, r.output
    (batch,) = user_models.read_data(other)
    got = user_models.onnx_outputs(graph, batch)[0]
    assert got.shape == (len(batch["image"]), FCN.CLASSES, FCN.OTHER_IMAGE // 2, FCN.OTHER_IMAGE // 2)
    assert user_models.cosine(got, user_models.float_outputs("fully_convolutional", batch)[0]) > 0.98


def test_a_fixed_size_graph_names_the_remedy(fcn, tmp_path):
    """Was: "input 'image' has shape [16, 3, 48, 48] but the graph expects ['batch', 3, 32, 32]" and nothing
    more."""
    ck, _, other = fcn
    graph = tmp_path / "fixed.onnx"
    assert cli("export", ck, "--onnx", graph).exit_code == 0
    r = cli("verify", graph, "--reference", ck, "--data", other)
    assert_clean_error(r, "fixed size on axes 2, 3", "--dynamic-dim image=2,3")


def test_data_with_other_channels_is_not_told_to_export_them_dynamic(fcn, tmp_path):
    """An image batch with 1 channel for a 3-channel graph was told to export with ``--dynamic-dim image=1``,
    which no weight allows."""
    ck, _, _ = fcn
    graph = tmp_path / "m.onnx"
    assert cli("export", ck, "--onnx", graph).exit_code == 0
    gray = np.random.default_rng(0).standard_normal((4, 1, 32, 32)).astype(np.float32)
    np.savez(tmp_path / "gray.npz", image=gray)
    r = cli("verify", graph, "--reference", ck, "--data", tmp_path / "gray.npz")
    assert_clean_error(r, "is its channels, which the model's weights fix at 3", "NCHW")
    assert "--dynamic-dim" not in r.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (("--dynamic-dim", "image=4"), ["image", "4 axes", "axis 4 does not exist"]),
        (("--dynamic-dim", "pixels=2"), ["no input 'pixels'", "image"]),
        (("--dynamic-dim", "image=a,b"), ["NAME=AXES"]),
        (("--dynamic-dim", "2,3", "--static-shapes"), ["--static-shapes"]),
    ],
)
def test_bad_dynamic_dims_are_one_line(fcn, tmp_path, args, words):
    ck, _, _ = fcn
    r = cli("export", ck, "--onnx", tmp_path / "m.onnx", *args)
    assert_clean_error(r, *words)
    assert not (tmp_path / "m.onnx").exists()


def test_data_with_other_features_is_not_told_to_export_them_dynamic(tmp_path):
    """10 features for a Linear(16, ...) graph were told to re-export with ``--dynamic-dim x=1``, which no
    weight allows."""
    from tests.test_calibrate_cli import MLP

    (tmp_path / "mlp.py").write_text(MLP)
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.standard_normal((32, 16)).astype(np.float32))
    np.save(tmp_path / "narrow.npy", rng.standard_normal((8, 10)).astype(np.float32))
    ck, graph = tmp_path / "m.calib.pt", tmp_path / "m.onnx"
    assert (
        cli("calibrate", f"{tmp_path / 'mlp.py'}:make", "--data", tmp_path / "x.npy", "--out", ck).exit_code
        == 0
    )
    assert cli("export", ck, "--onnx", graph).exit_code == 0
    r = cli("verify", graph, "--reference", ck, "--data", tmp_path / "narrow.npy")
    assert_clean_error(r, "is its features, which the model's weights fix at 16")
    assert "--dynamic-dim" not in r.stderr


def test_a_conv1d_graph_at_another_length_is_told_both_readings_of_its_last_axis(tmp_path):
    """A keyword spotter's (N, MFCC, frames) at other frames was told "the last axis of a 3-D float input is
    its features, which the model's weights fix": for a Conv1d it is the length, which --dynamic-dim frees.
    The message now gives both readings, and the option it names runs the graph at that length."""
    from tests import user_models

    calib, _ = user_models.write_data("keyword_spotter", tmp_path)
    ck, graph = tmp_path / "kws.calib.pt", tmp_path / "kws.onnx"
    spec = user_models.spec("keyword_spotter")
    assert cli("calibrate", spec, "--data", calib, "--out", ck, "--placement", "all").exit_code == 0
    assert cli("export", ck, "--onnx", graph).exit_code == 0
    longer = user_models.module("keyword_spotter").samples(8, 3)["mfcc"]
    longer = np.concatenate([longer, longer], axis=2)  # 98 frames
    np.savez(tmp_path / "long.npz", mfcc=longer)
    r = cli("verify", graph, "--reference", ck, "--data", tmp_path / "long.npz")
    assert_clean_error(r, "either its features", "--dynamic-dim mfcc=2")
    assert cli("export", ck, "--onnx", graph, "--dynamic-dim", "mfcc=2").exit_code == 0
    r = cli("verify", graph, "--reference", ck, "--data", tmp_path / "long.npz")
    assert r.exit_code == 0, r.output
