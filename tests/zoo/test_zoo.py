"""The zoo through the real CLI: ``calibrate`` -> ``export`` (both exporters) -> ``verify`` -> ``inspect --runtime``,
for both targets, and independently of verify: the exported graph's cosine to the float model as the factory
builds it, so a PASS on a graph that computes something else fails here. Marker ``zoo`` (``.ci/run``)."""

import json

import numpy as np
import pytest

from tests.helpers import cli
from tests.zoo import registry as zoo

pytestmark = pytest.mark.zoo

#: the exported graph (deployed) against the float model: int8 on these small random models reaches 0.99+; a
#: graph that drops an activation or a layer falls far below (the issue's BatchNormAct2d case: -0.001 and 0.155)
MIN_COSINE_TO_FLOAT = 0.95


def _cases():
    for m in zoo.MODELS:
        for t in zoo.TARGETS:
            for e in zoo.EXPORTERS:
                why = zoo.known_failure(m, e, t)
                marks = [pytest.mark.xfail(strict=False, reason=why)] if why else []
                yield pytest.param(m, e, t, id=f"{m}-{e}-{t}", marks=marks)


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


@pytest.mark.parametrize("model,exporter,target", list(_cases()))
def test_zoo_model_through_the_cli(model, exporter, target, calibrated, tmp_path):
    ck, held = calibrated(model, target)
    graph = tmp_path / f"{model}.onnx"
    r = cli("export", ck, "--onnx", graph, "--exporter", exporter, "--json")
    assert r.exit_code == 0, r.output
    r = cli("verify", graph, "--reference", ck, "--data", held, "--json")
    assert r.exit_code in (0, 1), r.output  # 2 on a graph that loads is an internal error
    report = json.loads(r.stdout)
    failed = [(c["name"], c["value"], c["detail"]) for c in report["checks"] if not c["passed"]]
    # the independent judge: onnxruntime on the graph against the model as the user's factory builds it
    with np.load(held) as z:
        data = {k: z[k] for k in z.files}
    cos = [zoo.cosine(g, f) for g, f in zip(zoo.onnx_outputs(graph, data), zoo.float_outputs(model, data))]
    assert min(cos) >= MIN_COSINE_TO_FLOAT, f"the graph computes something else (cosine {cos}); verify: {failed}"
    assert r.exit_code == 0 and report["passed"], failed
    r = cli("inspect", graph, "--runtime", "onnxruntime", "--json")
    assert r.exit_code == 0, r.output
