"""--weight-method gptq/awq under torch.distributed: two ranks (CPU, Gloo), each with its own share of the
sample decoder's calibration batches, end with the checkpoint one process makes from all of them, tensor for
tensor."""

from __future__ import annotations

import os

import pytest
import torch

WORLD = 2
METHODS = ("gptq", "awq")


def _batches() -> list[dict[str, torch.Tensor]]:
    from sample_models import SAMPLES

    return SAMPLES["tiny_lm"].calibration_batches()[:5]  # odd: the strided shares differ in size


def _state(method: str, batches: list) -> dict[str, torch.Tensor]:
    from quantcli import calibrate
    from quantcli.calibration.weight_rounding import awq, gptq
    from quantcli.inputs.loading import load_model
    from quantcli.nn import quantize_model

    model, _ = load_model("tiny_lm")
    quantize_model(model, {"preset": "int4-weight-only"})
    if method == "awq":
        awq(model, batches, device="cpu")
    calibrate(model, batches, device="cpu")
    if method == "gptq":
        gptq(model, batches)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _rank(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        share = _batches()[rank::WORLD]
        torch.save({m: _state(m, share) for m in METHODS}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    import torch.multiprocessing as mp

    d = tmp_path_factory.mktemp("wr_ranks")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(str(d / "init"), str(d)), nprocs=WORLD, join=True)
    return [torch.load(d / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


@pytest.mark.parametrize("method", METHODS)
def test_two_ranks_give_the_one_process_weights(ranks, method):
    want = _state(method, _batches())
    for r in range(WORLD):
        got = ranks[r][method]
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (r, k)
    # and the statistics mattered: one rank's share alone gives other weights
    alone = _state(method, _batches()[0::WORLD])
    assert any(not torch.equal(alone[k], want[k]) for k in want if k.endswith(".weight"))


def test_torchrun_cli_gptq_writes_the_one_process_checkpoint(tmp_path):
    import json
    import subprocess
    import sys

    from tests.helpers import cli

    one, two = tmp_path / "one.calib.pt", tmp_path / "two.calib.pt"
    args = [
        "calibrate",
        "tiny_lm",
        "--config",
        "int4-weight-only",
        "--weight-method",
        "gptq",
        "--num-samples",
        "96",
        "--json",
        "--device",
        "cpu",
    ]
    r = cli(*args, "--out", one)
    assert r.exit_code == 0, r.output
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "quantcli",
            *args,
            "--out",
            str(two),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["ranks"] == 2 and info["weight_rounding"]["rows"] == 96 * 64
    a, b = torch.load(one, weights_only=True), torch.load(two, weights_only=True)
    assert a["state_dict"].keys() == b["state_dict"].keys()
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
