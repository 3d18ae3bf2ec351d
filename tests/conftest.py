import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# CLIs started in a subprocess inherit this and quantize every layer as configured (what their tests assert
# was written for every layer); in-process runs (tests.helpers.cli) unset it and keep the default, auto.
os.environ["QUANTCLI_PLACEMENT"] = "all"
# The deployment CPU where a test does not name one: x86 without VNNI, whatever runs the tests, so that the
# grids (7-bit weights) and latency placement's decisions the tests assert do not change with the machine
# (a VNNI CPU's kernel costs keep small layers float). detect() still reads this machine, and tests about
# the deployment CPU name theirs or unset this.
os.environ["QUANTCLI_CPU"] = "x86-avx2"

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
