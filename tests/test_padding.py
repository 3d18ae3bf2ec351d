"""Quality at real tokens only (``quantcli/inputs/padding.py``): verify and calibrate's quality target leave
the positions a batch's ``attention_mask`` marks as padding out of cosine, SNR and the error ratios."""

import json

import numpy as np
import onnxruntime as ort
import torch

from quantcli.inputs.padding import padding_mask, real_positions
from tests.helpers import cli

NET = """
import torch
from torch import nn


class PaddedScores(nn.Module):
    '''Per-token scores whose padded positions are 100x the real ones' (a value nothing reads).'''

    def __init__(self):
        super().__init__()
        self.embed, self.fc = nn.Embedding(50, 16), nn.Linear(16, 8)

    def forward(self, input_ids, attention_mask):
        h = self.embed(input_ids)
        h = torch.where(attention_mask[..., None].bool(), h, h * 100.0)
        return self.fc(h)


def make():
    torch.manual_seed(0)
    return PaddedScores().eval()
"""


def _tokens(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, 13, n)
    mask = (np.arange(12)[None] < lengths[:, None]).astype(np.int64)
    return {"input_ids": rng.integers(1, 50, (n, 12)) * mask, "attention_mask": mask}


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_real_positions_keeps_per_token_outputs_at_real_tokens():
    batch = {"attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}
    mask = padding_mask(batch)
    per_token, pooled = torch.arange(12.0).reshape(2, 3, 2), torch.ones(2, 3)
    got = real_positions(mask, [per_token, pooled, None])
    assert torch.equal(got[0], per_token[torch.tensor(mask)]) and got[0].shape == (3, 2)
    assert got[1] is pooled and got[2] is None  # 2-D: per sample, not per token
    assert padding_mask({"attention_mask": torch.ones(2, 3)}) is None and padding_mask({"x": 1}) is None


def test_verify_judges_quality_at_real_tokens(tmp_path):
    """A Mistral with a sliding window failed --min-cosine 0.99 at the default batch size (0.980) and passed
    at --batch-size 1 (0.9998): right-padded rows' logits, which nothing reads, were in the cosine. Here the
    padded positions are large and quantize finely, so with them the cosine is 0.99995; at real tokens, which
    is what verify reports now, it is what onnxruntime's graph and the float model give there, computed
    here."""
    (tmp_path / "net.py").write_text(NET)
    np.savez(tmp_path / "calib.npz", **_tokens(64, 1))
    held = _tokens(32, 2)
    np.savez(tmp_path / "held.npz", **held)
    ck, graph = tmp_path / "m.calib.pt", tmp_path / "m.onnx"
    spec = f"{tmp_path / 'net.py'}:make"
    r = cli("calibrate", spec, "--data", tmp_path / "calib.npz", "--out", ck, "--placement", "all")
    assert r.exit_code == 0, r.output
    assert cli("export", ck, "--onnx", graph).exit_code == 0
    r = cli("verify", graph, "--reference", ck, "--data", tmp_path / "held.npz", "--json")
    assert r.exit_code == 0, r.output
    reported = json.loads(r.stdout)["quality"]["outputs"]["output_0"]["cosine"]

    import importlib.util

    spec_ = importlib.util.spec_from_file_location("padded_net", tmp_path / "net.py")
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    with torch.no_grad():
        want = mod.make()(**{k: torch.from_numpy(v) for k, v in held.items()}).numpy()
    got = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"]).run(None, held)[0]
    real = held["attention_mask"].astype(bool)
    assert abs(reported - _cosine(got[real], want[real])) < 1e-6
    assert _cosine(got, want) - reported > 0.01  # with the padding: a different, higher figure


def test_the_quality_target_is_measured_at_real_tokens(tmp_path):
    """calibrate --min-cosine measures with the same rule (quantcli.analysis.sensitivity.measure): its
    cosine is the fake-quant model's against the float one at real tokens."""
    from quantcli import calibrate, quantize_model
    from quantcli.analysis.sensitivity import measure, reference_outputs

    ns: dict = {}
    exec(NET, ns)  # noqa: S102 - the factory above, as a user's file would define it
    batches = [{k: torch.from_numpy(v) for k, v in _tokens(32, s).items()} for s in (1, 2)]
    model = quantize_model(ns["make"](), "int8", example=batches[0])
    calibrate(model, batches[:1], device="cpu")
    held = batches[1:]
    got = measure(model, held, reference_outputs(model, held)).cosine
    with torch.no_grad():
        q, f = model(**held[0]).numpy(), ns["make"]()(**held[0]).numpy()
    real = held[0]["attention_mask"].numpy().astype(bool)
    assert abs(got - _cosine(q[real], f[real])) < 1e-6 and _cosine(q, f) - got > 0.01
