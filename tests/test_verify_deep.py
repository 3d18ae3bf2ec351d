"""verify on a deep transformer (structured.deep_encoder: 6-layer BERT, hidden 384, unused pooler): a correct
export passes with the default thresholds and the pooler is reported pruned; mutations that keep every Q/DQ
intact fail through the fidelity check and name the quantizer that reads the changed segment.

One export is shared by the module (few samples, 16 tokens); mutations edit copies in memory.
"""

import json

import onnx
import pytest
import torch

from exporters.graph import pruned_quantizers, qdq_pairs
from tests.helpers import cli
from tests.mutations import add_to_initializer, add_to_input_of, initializer_values, replace_op, variant

pytest.importorskip("transformers")

POOLER = ["bert.pooler.dense.input_quantizer", "bert.pooler.dense.weight_quantizer"]
TOKENS = 16


def _short(batches, samples):
    return [{k: v[:samples, :TOKENS].contiguous() for k, v in b.items()} for b in batches]


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    from quantcli.inputs.checkpoint import load_calibrated
    from sample_models import structured

    root = tmp_path_factory.mktemp("deep")
    torch.save(_short(structured.deep_encoder_batches("calib", 32), 16), root / "calib.pt")
    torch.save(_short(structured.deep_encoder_batches("eval", 8), 8), root / "eval.pt")
    ck, path = root / "deep.calib.pt", root / "deep.onnx"
    r = cli(
        "calibrate",
        "sample_models.structured:deep_encoder",
        "--data",
        root / "calib.pt",
        "--out",
        ck,
        "--json",
    )
    assert r.exit_code == 0, r.output
    r = cli("export", ck, "--onnx", path, "--json")
    assert r.exit_code == 0, r.output
    ckpt = load_calibrated(ck)
    return {
        "root": root,
        "ck": ck,
        "path": path,
        "export": json.loads(r.stdout),
        "ckpt": ckpt,
        "model": onnx.load(str(path)),
        "batches": torch.load(root / "eval.pt"),
    }


def test_correct_export_passes_and_the_pooler_is_pruned_not_missing(deep):
    assert deep["export"]["pruned_quantizers"] == POOLER
    assert pruned_quantizers(deep["model"]) == POOLER
    r = cli("verify", deep["path"], "--reference", deep["ck"], "--data", deep["root"] / "eval.pt", "--json")
    rep = json.loads(r.stdout)
    assert r.exit_code == 0, [c for c in rep["checks"] if not c["passed"]]
    st = rep["structure"]
    assert st["passed"] and st["pruned"] == POOLER and st["problems"] == []
    assert st["quantizers_expected"] == st["quantizers_found"] + 2
    # an embedding, not logits: no top-1 agreement
    assert "top1_agreement" not in rep["quality"]["outputs"]["output_0"]
    # the deep network flips codes end to end, the replay does not let them accumulate
    replay = max(
        q["replay_steps"] for q in rep["fidelity"]["quantizers"].values() if q["replay_steps"] is not None
    )
    assert replay < 0.01


def _verify(deep, model, tmp_path):
    from quantcli.verify import verify_onnx

    path = tmp_path / f"m{len(list(tmp_path.iterdir()))}.onnx"
    onnx.save(model, str(path))
    return verify_onnx(path, deep["ckpt"], deep["batches"], deployment=False)


def _scale(model, quantizer):
    return float(next(p for p in qdq_pairs(model) if p.quantizer == quantizer).scale)


def test_mutations_that_keep_every_qdq_fail_through_fidelity(deep, tmp_path):
    model = deep["model"]
    reader = "bert.encoder.layer.0.output.dense.input_quantizer"  # reads GELU(intermediate.dense(...))
    channel = 777  # an outlier FFN channel: its pre-activation is large, GELU passes a bias change on whole
    bias = variant(
        model,
        add_to_input_of,
        "/bert/encoder/layer.0/intermediate/",
        "bert.encoder.layer.0.intermediate.dense.bias",
        channel,
        3 * _scale(model, reader),
    )
    gain = "bert.encoder.layer.2.output.LayerNorm.weight"  # a LayerNorm: no quantizer of its own
    outlier = 17  # structured.OUTLIER_DIMS[0]: its gain sets the next quantizers' (per-tensor) step
    norm = variant(
        model, add_to_initializer, gain, outlier, 0.1 * float(initializer_values(model, gain)[outlier])
    )
    softmax = variant(model, replace_op, "Softmax", 3)  # the attention probabilities of layer 3
    cases = [
        (bias, reader),
        (norm, "bert.encoder.layer.3.attention.self."),
        (softmax, "bert.encoder.layer.3.attention.output.dense.input_quantizer"),
    ]
    for mutated, where in cases:
        rep = _verify(deep, mutated, tmp_path)
        failed = {c.name for c in rep.checks if not c.passed}
        assert rep.structure["passed"] and "fidelity.replay_steps" in failed, (where, failed)
        assert rep.fidelity["failing_quantizers"][0].startswith(where), (
            where,
            rep.fidelity["failing_quantizers"],
        )
