"""The zoo's shared fixture: each model calibrated once per session and target, through the real CLI."""

import pytest

from tests.helpers import cli
from tests.zoo import registry as zoo


@pytest.fixture(scope="session")
def calibrated(tmp_path_factory):
    """(model, target) -> (checkpoint, held-out .npz), calibrated once per session."""
    root, done = tmp_path_factory.mktemp("zoo"), {}

    def get(model: str, target: str):
        if (model, target) not in done:
            calib, held = zoo.write_data(model, root)
            ck = root / f"{model}.{target}.calib.pt"
            r = cli("calibrate", zoo.spec(model), "--data", calib, "--target", target, "--out", ck, "--json")
            assert r.exit_code == 0, r.output
            done[model, target] = ck, held
        return done[model, target]

    return get
