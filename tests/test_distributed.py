"""Data-parallel calibration on torch.distributed: N ranks give the one-process result, amax for amax.

Two CPU processes with Gloo run every scenario in one spawn (starting a process costs seconds here); the test
process computes each one-process reference itself and compares state dicts with ``torch.equal``. The real
CLI runs once under ``torchrun`` and once as two hand-started ranks that fail.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tests.helpers import cli

WORLD = 2
PER_CHANNEL = {
    "digits_cnn": [{"pattern": "*input_quantizer", "axis": 1}],
    "text_encoder": [{"pattern": "*input_quantizer", "axis": -1}],
}


@dataclass(frozen=True)
class Scenario:
    model: str
    config: str  # a preset, or "per-channel" (every activation quantizer per channel)
    method: str
    layout: str  # how the batches are shared out: strided, blocks, uneven, rank0_empty, rank1_empty
    num_bins: int = 2048

    @property
    def id(self) -> str:
        return f"{self.model}-{self.config}-{self.method}-{self.layout}-{self.num_bins}"


METHODS = ("max", "entropy", "mse", "percentile")
SCENARIOS = (
    [Scenario(m, "int8", meth, "strided") for m in ("digits_cnn", "text_encoder") for meth in METHODS]
    + [
        Scenario(m, "per-channel", meth, "strided", 128)
        for m in ("digits_cnn", "text_encoder")
        for meth in METHODS
    ]
    + [
        Scenario("digits_cnn", "uint8-asymmetric", "max", "strided"),
        Scenario("digits_cnn", "uint8-asymmetric", "mse", "strided"),
        Scenario("digits_cnn", "uint8-asymmetric", "percentile", "uneven"),
        Scenario("digits_cnn", "int8", "entropy", "blocks"),
        Scenario("digits_cnn", "int8", "entropy", "uneven"),
        Scenario("digits_cnn", "int8", "percentile", "rank0_empty"),
        Scenario("digits_cnn", "per-channel", "max", "blocks"),
        Scenario("text_encoder", "int8", "mse", "uneven"),
        Scenario("text_encoder", "per-channel", "percentile", "rank1_empty", 128),
    ]
)


def _batches(model: str) -> list[dict[str, torch.Tensor]]:
    """Five batches: an odd count, so the strided shares are uneven too."""
    from sample_models import SAMPLES

    return SAMPLES[model].calibration_batches()[:5]


def _share(batches: list, layout: str, rank: int) -> list:
    half = (len(batches) + 1) // 2
    return {
        "strided": batches[rank::WORLD],
        "blocks": batches[:half] if rank == 0 else batches[half:],
        "uneven": batches[:1] if rank == 0 else batches[1:],
        "rank0_empty": [] if rank == 0 else batches,
        "rank1_empty": batches if rank == 0 else [],
    }[layout]


def _quantized(sc: Scenario, target: str | None = None):
    from quantcli.inputs.loading import load_model
    from quantcli.nn import quantize_model

    model, _ = load_model(sc.model)
    if sc.config == "per-channel":
        cfg = {"rules": PER_CHANNEL[sc.model]}
    else:
        cfg = {"preset": sc.config}
    return quantize_model(model, {**cfg, **({"target": target} if target else {})})


def _calibrated_state(sc: Scenario, batches: list) -> tuple[dict, dict]:
    """(state dict: weights, amax and amin of every quantizer; summary) after calibrating on ``batches``."""
    from quantcli import calibrate

    model = _quantized(sc)
    summary = calibrate(model, batches, sc.method, num_bins=sc.num_bins, device="cpu")
    enabled = {n: m.enabled for n, m in model.named_modules() if hasattr(m, "start_calibration")}
    return {k: v.clone() for k, v in model.state_dict().items()}, {**summary.to_dict(), "enabled": enabled}


# ------------------------------------------------------------------------ synthetic calibrator-level merges


def _synthetic_batches(rank: int) -> list[torch.Tensor]:
    """(batch, 4 channels, 16) values whose ranges differ by rank and by channel: rank 1 reaches 2**6,
    rank 0 stays below 1, so merging re-bins rank 0's histograms by several doublings."""
    g = torch.Generator().manual_seed(100 + rank)
    scale = torch.tensor([0.7, 3.0, 0.01, 40.0]) if rank == 1 else torch.tensor([0.3, 0.9, 0.002, 0.5])
    return [torch.randn(8, 4, 16, generator=g) * scale.view(1, 4, 1) for _ in range(3)]


def _synthetic_calibrators():
    from calibrators import HistogramCalibrator, MaxCalibrator, MinMaxCalibrator
    from calibrators.signed_histogram import SignedHistogramCalibrator

    return {
        "hist": HistogramCalibrator(axis=None, num_bins=2048),
        "hist_signed": SignedHistogramCalibrator(num_bins=2048),
        "hist_axis": HistogramCalibrator(axis=1, num_bins=256),
        "hist_skip": HistogramCalibrator(axis=1, num_bins=128, skip_zeros=True),
        "max_axis": MaxCalibrator(axis=1),
        "minmax": MinMaxCalibrator(),
    }


def _synthetic_state(cals: dict) -> dict:
    out = {}
    for k, c in cals.items():
        if k.startswith("hist"):
            out[k] = (c.hist, c.range_exponent())
        elif k == "minmax":
            out[k] = c.compute_range()
        else:
            out[k] = c.compute_amax()
    return out


# ------------------------------------------------------------------------------------------ the ranks


def _rank(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from calibrators.distributed import merge_calibrators
    from quantcli import calibrate
    from quantcli.errors import QuantCliError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    results: dict = {}
    try:
        for sc in SCENARIOS:
            results[sc.id] = _calibrated_state(sc, _share(_batches(sc.model), sc.layout, rank))

        cals = _synthetic_calibrators()
        for x in _synthetic_batches(rank):
            for c in cals.values():
                c.collect(x)
        results["synthetic_exponents"] = {
            k: c.range_exponent() for k, c in cals.items() if k.startswith("hist")
        }
        merge_calibrators(list(cals.values()))
        results["synthetic"] = _synthetic_state(cals)

        def failure(fn):
            try:
                fn()
            except QuantCliError as e:
                return type(e).__name__, str(e)
            return None

        sc = Scenario("digits_cnn", "int8", "max", "strided")
        good = _batches("digits_cnn")[:1]
        bad = [{"x": good[0]["x"].clone().fill_(float("nan"))}]
        results["nan_on_rank1"] = failure(
            lambda: calibrate(_quantized(sc), bad if rank else good, device="cpu")
        )
        wrong = [{"x": torch.zeros(4, 3, 8, 8)}]  # three channels for a one-channel conv
        results["bad_shape_on_rank0"] = failure(
            lambda: calibrate(_quantized(sc), good if rank else wrong, device="cpu")
        )
        other = Scenario("digits_cnn", "per-channel" if rank else "int8", "entropy", "strided")
        # the tensorrt target's placement is the same for both configs: only the activation axis differs
        results["ranks_disagree"] = failure(
            lambda: calibrate(_quantized(other, "tensorrt"), good, "entropy", device="cpu")
        )
        results["no_batches_anywhere"] = failure(lambda: calibrate(_quantized(sc), [], device="cpu"))
        results["bins_disagree"] = failure(
            lambda: calibrate(_quantized(sc), good, "mse", num_bins=1024 if rank else 2048, device="cpu")
        )
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    import torch.multiprocessing as mp

    d = tmp_path_factory.mktemp("ranks")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(str(d / "init"), str(d)), nprocs=WORLD, join=True)
    return [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda s: s.id)
def test_ranks_give_the_one_process_checkpoint(ranks, sc):
    state, summary = _calibrated_state(sc, _batches(sc.model))
    for r in range(WORLD):
        got, got_summary = ranks[r][sc.id]
        assert got.keys() == state.keys()
        for k in state:
            assert got[k].dtype == state[k].dtype and torch.equal(got[k], state[k]), (r, k, got[k], state[k])
        assert got_summary["enabled"] == summary["enabled"]
        assert got_summary["num_batches"] == 5 and got_summary["num_samples"] == summary["num_samples"]
        assert got_summary["ranks"] == WORLD and summary["ranks"] == 1
        assert got_summary["calibrated"] == summary["calibrated"]


def test_merged_histograms_equal_one_process_histograms_bin_for_bin(ranks):
    cals = _synthetic_calibrators()
    for r in range(WORLD):
        for x in _synthetic_batches(r):
            for c in cals.values():
                c.collect(x)
    want = _synthetic_state(cals)
    # the ranks' own ranges differed before the merge: rank 0's bins were really re-binned
    for k in ("hist", "hist_signed", "hist_axis", "hist_skip"):
        assert (ranks[0]["synthetic_exponents"][k] < ranks[1]["synthetic_exponents"][k]).all()
        assert torch.equal(ranks[1]["synthetic_exponents"][k], want[k][1])
    for r in range(WORLD):
        got = ranks[r]["synthetic"]
        for k, v in want.items():
            for a, b in zip(got[k] if isinstance(v, tuple) else [got[k]], v if isinstance(v, tuple) else [v]):
                assert torch.equal(a, b), (r, k)


def test_an_error_on_one_rank_raises_the_same_error_on_every_rank(ranks):
    own, other = ranks[1]["nan_on_rank1"], ranks[0]["nan_on_rank1"]
    assert own[0] == other[0] == "CalibrationError"
    assert "non-finite" in own[1] and other[1] == f"rank 1: {own[1]}"
    own, other = ranks[0]["bad_shape_on_rank0"], ranks[1]["bad_shape_on_rank0"]
    assert own[0] == other[0] == "DataError" and other[1] == f"rank 0: {own[1]}"
    a, b = ranks[0]["ranks_disagree"], ranks[1]["ranks_disagree"]
    assert a == b and a[0] == "CalibrationError" and "differ between ranks" in a[1]
    a, b = ranks[0]["bins_disagree"], ranks[1]["bins_disagree"]
    assert a == b and a[0] == "CalibrationError" and "calibrate different quantizers" in a[1]
    assert (
        ranks[0]["no_batches_anywhere"]
        == ranks[1]["no_batches_anywhere"]
        == ("CalibrationError", "no calibration batches on any rank")
    )


# ------------------------------------------------------------------------------------------ the CLI


def test_torchrun_cli_writes_the_one_process_checkpoint(tmp_path):
    one, two = tmp_path / "one.calib.pt", tmp_path / "two.calib.pt"
    r = cli("calibrate", "digits_cnn", "--method", "entropy", "--out", one, "--json", "--device", "cpu")
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
            "calibrate",
            "digits_cnn",
            "--method",
            "entropy",
            "--out",
            str(two),
            "--json",
            "--device",
            "cpu",
        ],  # Gloo, also on a host with fewer GPUs than ranks
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)  # one JSON document: rank 0 alone prints
    assert info["ranks"] == 2 and info["num_samples"] == 512 and info["num_batches"] == 8
    a, b = torch.load(one, weights_only=True), torch.load(two, weights_only=True)
    assert a["state_dict"].keys() == b["state_dict"].keys()
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    assert torch.equal(a["inputs"]["example"]["x"], b["inputs"]["example"]["x"])
    # no temp files left
    assert sorted(x.name for x in tmp_path.iterdir()) == ["one.calib.pt", "two.calib.pt"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_fail_together_and_report_once(tmp_path):
    """Two ranks started by hand, as torchrun starts them. Rank 1's file cannot be read; rank 0 never opens it
    (each rank reads only its own files of a directory), so the one error line names rank 1."""
    from sample_models import digits_cnn

    data = tmp_path / "batches"
    data.mkdir()
    for i, b in enumerate(digits_cnn.calibration_batches()[:4]):
        np.savez(data / f"b{i}.npz", x=b["x"].numpy())
    (data / "b1.npz").write_bytes(b"not a zip file")
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "quantcli",
                    "calibrate",
                    "digits_cnn",
                    "--data",
                    str(data),
                    "--out",
                    str(tmp_path / "out.calib.pt"),
                    "--device",
                    "cpu",
                ],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    text = "".join(o + e for o, e in outs)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: rank 1: cannot read") and "b1.npz" in lines[0], (
        text
    )
    assert not (tmp_path / "out.calib.pt").exists()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["batches"]


def test_torchrun_environment_and_rank_device(monkeypatch):
    from quantcli.calibration.process_group import rank_device, torchrun_environment
    from quantcli.errors import QuantCliError

    monkeypatch.delenv("RANK", raising=False)
    assert torchrun_environment() is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert torchrun_environment() is None  # one rank: an ordinary process
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert torchrun_environment() == (1, 4, 1)
    assert rank_device("cpu", 1) == torch.device("cpu")
    with pytest.raises(QuantCliError, match="cuda:LOCAL_RANK"):
        rank_device("cuda:0", 1)
    if not torch.cuda.is_available():
        assert rank_device("auto", 1) == torch.device("cpu")
        with pytest.raises(QuantCliError, match="no CUDA GPU"):
            rank_device("cuda", 1)


def test_shards_partition_the_one_process_batches(tmp_path):
    """Every tensor format: the ranks' shares are the one-process batches at positions r, r+N, ... (a
    directory of batch files by file; single .npy/.pt files memory-mapped); together, each batch exactly
    once."""
    from quantcli.inputs.data import load_batches
    from quantcli.inputs.loading import load_model
    from quantcli.inputs.shard import load_shard

    model, _ = load_model("digits_cnn")
    x = np.random.default_rng(0).standard_normal((70, 1, 8, 8)).astype(np.float32)
    np.save(tmp_path / "all.npy", x)
    torch.save(torch.from_numpy(x), tmp_path / "all.pt")
    torch.save([{"x": torch.from_numpy(x[i : i + 9])} for i in range(0, 70, 9)], tmp_path / "list.pt")
    folder = tmp_path / "folder"
    folder.mkdir()
    for i in range(5):
        np.savez(folder / f"b{i}.npz", x=x[i * 14 : (i + 1) * 14])
    for path, kwargs in [
        (tmp_path / "all.npy", {"batch_size": 16}),
        (folder, {}),
        (folder, {"num_samples": 40}),
        (tmp_path / "all.npy", {"batch_size": 16, "num_samples": 50}),
        (tmp_path / "all.pt", {"batch_size": 16}),
        (tmp_path / "list.pt", {}),
    ]:
        whole = load_batches(path, model, kwargs.get("batch_size", 32), kwargs.get("num_samples"))
        for world in (2, 3, 7):
            shares = [load_shard(path, model, r, world, **kwargs)[0] for r in range(world)]
            for r, share in enumerate(shares):
                want = whole[r::world]
                assert len(share) == len(want) and all(
                    torch.equal(a["x"], b["x"]) for a, b in zip(share, want)
                )
            assert sum(len(s) for s in shares) == len(whole)


def test_a_rank_decodes_only_the_images_of_its_own_batches(tmp_path):
    from PIL import Image

    from quantcli.errors import DataError
    from quantcli.inputs.data import DataOptions, load_data
    from quantcli.inputs.loading import load_model
    from quantcli.inputs.shard import load_shard

    model, _ = load_model("digits_cnn")
    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(1)
    for i in range(7):
        Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8)).save(folder / f"img{i}.png")
    opts = DataOptions(image_size="8", mean="0.5", std="0.25")
    whole, prep = load_data(folder, model, 2, None, opts)
    for world in (2, 3):
        shares = [load_shard(folder, model, r, world, 2, None, opts) for r in range(world)]
        for r, (share, share_prep) in enumerate(shares):
            assert share_prep["size"] == prep["size"]
            want = whole[r::world]
            assert len(share) == len(want) and all(torch.equal(a["x"], b["x"]) for a, b in zip(share, want))
    (folder / "img2.png").write_bytes(b"not a png")  # in batch 1: rank 1's of 2
    with pytest.raises(DataError, match="img2.png"):
        load_data(folder, model, 2, None, opts)
    with pytest.raises(DataError, match="img2.png"):
        load_shard(folder, model, 1, 2, 2, None, opts)
    assert len(load_shard(folder, model, 0, 2, 2, None, opts)[0]) == 2  # never opened img2.png
