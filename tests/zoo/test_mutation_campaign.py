"""The mutation campaign (issue 23): tests/mutations.py's kinds of graph edits on six zoo models' exports (the
TorchScript exporter, the onnxruntime target), each through ``quantcli verify``: every arithmetic change exits
1 and a failed check names the tensor; every equivalent rewrite exits 0 or 1; nothing exits 2 (an internal
error on a graph that loads). Marker ``zoo``."""

import json

import onnx
import pytest

from tests.helpers import cli
from tests.zoo import campaign

pytestmark = pytest.mark.zoo

MODELS = ["resnet", "efficientnet", "vit", "segformer", "bert", "whisper_encoder"]
MUTATIONS = {name: (edit, True) for name, edit in campaign.ARITHMETIC} | {
    name: (edit, False) for name, edit in campaign.EQUIVALENT
}


@pytest.fixture(scope="session")
def exported(calibrated, tmp_path_factory):
    root, done = tmp_path_factory.mktemp("campaign"), {}

    def get(model):
        if model not in done:
            ck, held = calibrated(model, "onnxruntime")
            graph = root / f"{model}.onnx"
            r = cli("export", ck, "--onnx", graph, "--exporter", "torchscript")
            assert r.exit_code == 0, r.output
            done[model] = ck, held, onnx.load(str(graph))
        return done[model]

    return get


def named_failures(report: dict) -> list[str]:
    """The failed checks that name where (a quantizer, a layer, an output), and the structure's named
    problems."""
    out = [f"{c['name']}: {c['detail']}" for c in report["checks"] if not c["passed"] and c.get("detail")]
    return out + [f"structure: {n}" for n in report["structure"].get("layers_with_problems", [])]


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("model", MODELS)
def test_mutation(model, mutation, exported, tmp_path):
    ck, held, graph = exported(model)
    edit, arithmetic = MUTATIONS[mutation]
    mutated = onnx.ModelProto()
    mutated.CopyFrom(graph)
    where = edit(mutated)
    if where is None:
        pytest.skip(f"{model}'s graph has nothing {mutation} applies to")
    path = tmp_path / "mutated.onnx"
    onnx.save(mutated, str(path))
    r = cli("verify", path, "--reference", ck, "--data", held, "--json")
    # 2: an internal error on a loadable graph
    assert r.exit_code in (0, 1), f"{mutation} at {where}: {r.output}"
    if arithmetic:
        report = json.loads(r.stdout)
        assert r.exit_code == 1, f"{mutation} at {where} passed verify"
        assert named_failures(report), (
            f"{mutation} at {where}: no failed check names where: {report['checks']}"
        )
