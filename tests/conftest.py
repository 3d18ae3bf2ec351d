import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# `calibrate --placement auto` (the default) times layers in onnxruntime; what a test asserts must not depend
# on the wall clock. CLIs started in a subprocess inherit this and quantize every layer as configured;
# in-process runs (tests.helpers.cli) unset it and keep the default, auto, with the stub timer below.
os.environ["QUANTCLI_PLACEMENT"] = "all"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


def equal_times(paths, feeds, rounds):
    """A stand-in for onnxruntime's profiler: every node takes no time, so integer kernels are never slower
    than float and `--placement auto` keeps float only the layers onnxruntime does not fuse."""
    return [_NoTime() for _ in paths]


def equal_graph_times(paths, feeds, rounds):
    """A stand-in for whole-graph timing: every graph takes the same time (a tie keeps the per-layer
    choice)."""
    return [1.0 for _ in paths]


class _NoTime(dict):
    """Every node name maps to 0.0 microseconds."""

    def __contains__(self, key):
        return True

    def __getitem__(self, key):
        return 0.0

    def get(self, key, default=None):
        return 0.0


@pytest.fixture(autouse=True, scope="session")
def _stub_placement_timer():
    """Session-wide, so that module- and session-scoped fixtures that calibrate (set up before any
    function-scoped fixture) see it too; a test that installs its own timer with ``monkeypatch`` gets this one
    back afterwards."""
    from quantcli.calibration import latency_placement

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(latency_placement, "TIMER", equal_times)
        mp.setattr(latency_placement, "GRAPH_TIMER", equal_graph_times)
        yield


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def calibrated(tmp_path_factory):
    """Calibrated checkpoints of the sample models, made once per session through the real CLI code path."""
    from tests.helpers import cli

    root = tmp_path_factory.mktemp("calibrated")
    made = {}

    def get(model="digits_cnn", config="int8", method="max"):
        key = (model, config, method)
        if key not in made:
            out = root / f"{model}-{config}-{method}.calib.pt"
            r = cli("calibrate", model, "--config", config, "--method", method, "--out", out, "--json")
            assert r.exit_code == 0, r.output
            made[key] = out
        return made[key]

    return get


@pytest.fixture(scope="session")
def exported(calibrated, tmp_path_factory):
    from tests.helpers import cli

    root = tmp_path_factory.mktemp("exported")
    made = {}

    def get(model="digits_cnn", config="int8", method="max", *extra):
        key = (model, config, method, extra)
        if key not in made:
            ck = calibrated(model, config, method)
            out = root / f"{model}-{config}-{method}-{len(made)}.onnx"
            r = cli("export", ck, "--onnx", out, "--json", *extra)
            assert r.exit_code == 0, r.output
            made[key] = out
        return made[key]

    return get
