"""Mistakes a careless user makes, each refused with one line and exit 2 (they ended in an internal error,
exit 3, before): found by trying every command with bad input."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from quantcli.files import no_space
from tests.helpers import assert_clean_error, cli, cli_subprocess


def test_rules_that_are_not_a_list(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("rules: 5\n")
    assert_clean_error(cli("calibrate", "digits_cnn", "--config", cfg), "rules", "must be a list", "got int")


def test_export_to_an_empty_name(calibrated, tmp_path):
    assert_clean_error(cli("export", calibrated(), "--onnx", ""), "--onnx", "names no file")


@pytest.fixture(scope="module")
def decode_graph(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode")
    ck, path = root / "tl.calib.pt", root / "tl.onnx"
    assert cli("calibrate", "tiny_llama", "--num-samples", "8", "--out", ck).exit_code == 0
    assert cli("export", ck, "--onnx", path).exit_code == 0
    return ck, path


def test_generate_refuses_a_negative_seed_and_a_corrupt_graph(decode_graph, tmp_path):
    _, path = decode_graph
    r = cli("generate", path, "--prompt", "hi", "--seed", "-1")
    assert r.exit_code == 2 and "--seed" in r.output and "Traceback" not in r.output
    corrupt = tmp_path / "cut.onnx"
    corrupt.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert_clean_error(cli("generate", corrupt, "--prompt", "hi"), "not a valid ONNX model")


def test_verify_of_a_decode_graph_refuses_ids_outside_its_vocabulary(decode_graph, tmp_path):
    ck, path = decode_graph
    data = tmp_path / "oov.npz"
    np.savez(data, input_ids=np.arange(300, 400, dtype=np.int64).reshape(2, 50))
    assert_clean_error(cli("verify", path, "--reference", ck, "--data", data), "vocabulary of 256")


def test_torch_zip_writer_short_write_counts_as_a_full_disk():
    # what torch.save raised on a full 120 KiB tmpfs
    e = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 29440 vs 29328")
    assert no_space(e) and not no_space(RuntimeError("some other failure"))


def test_json_is_strict_where_a_quantizer_adds_no_error():
    """An SNR of a quantizer that changes nothing is infinite: written as "inf", which every JSON parser reads
    (Python's json wrote Infinity, which JavaScript's and jq refuse)."""
    import json

    from quantcli.cli.output import json_text

    text = json_text({"snr_db": float("inf"), "rows": [{"x": float("-inf")}, float("nan"), 1.5]})
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict constant {c}")) == {
        "snr_db": "inf",
        "rows": [{"x": "-inf"}, "nan", 1.5],
    }


def test_generate_refuses_to_run_past_the_graphs_context(decode_graph):
    """tiny_llama's rotary tables hold 512 positions: onnxruntime failed past them (GroupQueryAttention),
    and a --standard-ops graph generated garbage."""
    _, path = decode_graph
    # 512 + 1 - 2: the last token generated is never fed back, so 511 run within the 512 positions
    assert_clean_error(
        cli("generate", path, "--prompt", "hi", "--max-new-tokens", "600"), "context of 512", "to 511"
    )
    r = cli("generate", path, "--prompt", "hi", "--max-new-tokens", "511", "--json")
    assert r.exit_code == 0, r.output


def test_verify_refuses_a_checkpoint_with_an_amax_deleted(calibrated, exported, tmp_path):
    import torch

    ck = torch.load(calibrated(), weights_only=False)
    del ck["state_dict"]["conv1.input_quantizer.amax"]
    damaged = tmp_path / "damaged.calib.pt"
    torch.save(ck, damaged)
    assert_clean_error(
        cli("verify", exported(), "--reference", damaged), "conv1.input_quantizer", "have no amax"
    )


@pytest.mark.parametrize(
    "key,values,says",
    [
        ("conv1.weight_quantizer.amax", [3, 1, 1, 1], "has 16 along axis 0"),  # per channel, 3 of 16
        ("fc1.input_quantizer.amax", [5], "per tensor (one value)"),  # a scalar made a vector
    ],
)
def test_an_amax_edited_to_the_wrong_shape_is_refused(calibrated, tmp_path, key, values, says):
    """A hand-edited amax that does not fit its tensor ended export and verify in an internal error (exit 3:
    "The expanded size of the tensor (16) must match the existing size (3)")."""
    import torch

    ck = torch.load(calibrated(), weights_only=False)
    ck["state_dict"][key] = torch.full(values, 0.5)
    edited = tmp_path / "edited.calib.pt"
    torch.save(ck, edited)
    graph = tmp_path / "m.onnx"
    assert_clean_error(cli("export", edited, "--onnx", graph), key.rpartition(".")[0], says, "edited")
    assert not graph.exists()


def test_amax_shape_error_accepts_what_calibration_makes():
    from quantcli.nn.tensor_quantizer import amax_shape_error

    assert amax_shape_error(1, (8, 16), None, None) is None
    assert amax_shape_error(16, (16, 3, 3, 3), 0, None) is None
    assert amax_shape_error(1, (16, 3, 3, 3), 0, None) is None  # one value broadcasts
    assert amax_shape_error(12, (4, 3, 5), (0, 1), None) is None
    assert amax_shape_error(8 * 3, (8, 40), None, (-1, 16)) is None  # 40 = 16 + 16 + a partial 8
    assert "24 blocks (3 of 16 along dim 1)" in amax_shape_error(8 * 2, (8, 40), None, (-1, 16))
    assert "has 16 along axis 0" in amax_shape_error(3, (16, 3, 3, 3), 0, None)
    assert "one value" in amax_shape_error(16, (8, 16), None, None)


def test_inspect_for_cuda_without_a_gpu(exported):
    """onnxruntime-gpu lists its CUDA provider on a machine without a GPU: inspect reported CPU kernels as the
    CUDA session's."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is usable here")
    r = cli("inspect", exported(), "--runtime", "onnxruntime", "--provider", "cuda")
    assert_clean_error(r, "--provider cuda")


def test_inspect_refuses_options_that_would_do_nothing(exported):
    """``--provider`` without ``--runtime``, and ``--trust-code`` on an ONNX file, were accepted, ignored."""
    r = cli("inspect", exported(), "--provider", "cpu")
    assert_clean_error(r, "--provider", "give --runtime too")
    r = cli("inspect", exported(), "--trust-code")
    assert_clean_error(r, "--trust-code", "is an ONNX file")
    r = cli("inspect", exported(), "--runtime", "onnxruntime", "--provider", "cpu", "--json")
    assert r.exit_code == 0, r.output


def test_sparse_data_is_refused(tmp_path):
    import torch

    x = torch.zeros(8, 1, 8, 8)
    x[0, 0, 0, 0] = 1
    torch.save({"x": x.to_sparse()}, tmp_path / "sparse.pt")
    r = cli("calibrate", "digits_cnn", "--data", tmp_path / "sparse.pt", "--out", tmp_path / "d.calib.pt")
    assert_clean_error(r, "sparse_coo tensor", "to_dense")
    assert not (tmp_path / "d.calib.pt").exists()


@pytest.mark.parametrize(
    "command,option,value",
    [
        ("verify", "--batch-size", "0"),
        ("analyze", "--batch-size", "-3"),
        ("calibrate", "--num-samples", "0"),
    ],
)
def test_counts_below_one_are_refused(calibrated, exported, tmp_path, command, option, value):
    """verify and analyze ran with ``--batch-size 0`` or ``-3`` as if it were not given (a subprocess: the
    entry point turns the usage error into one line)."""
    args = {
        "verify": [exported(), "--reference", calibrated()],
        "analyze": [calibrated(), "--out", tmp_path / "a"],
        "calibrate": ["digits_cnn", "--out", tmp_path / "c.calib.pt"],
    }[command]
    r = cli_subprocess(command, *args, option, value)
    assert_clean_error(r, option, "greater than or equal to 1")


def test_analyze_a_checkpoint_whose_name_is_not_utf8(calibrated, tmp_path):
    """A file name with a byte that is not UTF-8 (Python decodes it as a lone surrogate) stopped analyze with
    an internal error while writing report.html."""
    import os
    import shutil

    name = tmp_path / os.fsdecode(b"run\xff.calib.pt")
    shutil.copy(calibrated(), name)
    out = tmp_path / "report"
    # a real stdout (it escapes surrogates, click's does not); --json: ASCII, so the pipe decodes it
    r = cli_subprocess("analyze", name, "--out", out, "--json")
    assert r.returncode == 0, r.stderr
    assert "run\\udcff.calib.pt" in (out / "report.html").read_text(encoding="utf-8")


FORWARDS = """
import torch
from torch import nn


class VarArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, *xs):
        return self.fc(xs[0])


class Keywords(VarArgs):
    def forward(self, **kw):
        return self.fc(kw["x"])


def varargs():
    return VarArgs()


def keywords():
    return Keywords()
"""


@pytest.mark.parametrize(
    "factory,data,says",
    [
        ("varargs", "x.npz", "forward(self, *args) takes its inputs by position"),
        # was "arr_0 is positional argument 0, but forward takes 0 ()"
        ("varargs", "arr.npz", "forward(self, *args) takes its inputs by position"),
        ("keywords", "x.npy", "for forward(**kw), save an .npz of the names it reads"),
    ],
)
def test_a_forward_without_named_parameters_is_explained(tmp_path, factory, data, says):
    """Both said "forward takes no arguments" (or that input 'x' "is not an argument of forward()")."""
    (tmp_path / "m.py").write_text(FORWARDS)
    x = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.savez(tmp_path / "x.npz", x=x)
    np.savez(tmp_path / "arr.npz", x)
    r = cli(
        "calibrate", f"{tmp_path / 'm.py'}:{factory}", "--data", tmp_path / data, "--out", tmp_path / "c.pt"
    )
    assert_clean_error(r, says)


def test_forward_kwargs_with_named_data_calibrates_exports_and_verifies(tmp_path):
    (tmp_path / "m.py").write_text(FORWARDS)
    np.savez(tmp_path / "x.npz", x=np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32))
    ck, graph = tmp_path / "c.calib.pt", tmp_path / "m.onnx"
    r = cli("calibrate", f"{tmp_path / 'm.py'}:keywords", "--data", tmp_path / "x.npz", "--out", ck)
    assert r.exit_code == 0, r.output
    assert cli("export", ck, "--onnx", graph).exit_code == 0
    r = cli("verify", graph, "--reference", ck, "--data", tmp_path / "x.npz")
    assert r.exit_code == 0, r.output


ROOT_WITH_WEIGHTS = """
import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 3, 3, 3) * 0.3)
        self.w2 = nn.Parameter(torch.randn(10, 8) * 0.2)

    def forward(self, x):
        x = F.relu(F.conv2d(x, self.w1, padding=1)).mean((2, 3))
        return F.linear(x, self.w2)


def make():
    torch.manual_seed(0)
    return Net().eval()
"""


def test_a_model_whose_root_computes_with_several_weights_is_told_why_nothing_is_quantized(tmp_path):
    """It said the model "has no Linear/Conv/ConvTranspose layers to quantize", although it convolves."""
    (tmp_path / "net.py").write_text(ROOT_WITH_WEIGHTS)
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((8, 3, 8, 8)).astype(np.float32))
    spec = f"{tmp_path / 'net.py'}:make"
    r = cli("calibrate", spec, "--data", tmp_path / "x.npy", "--out", tmp_path / "c.pt")
    assert_clean_error(r, "the root module (Net) stays float", "2 weights in separate operations (w1, w2)")


def test_settings_that_would_do_nothing_are_refused(decode_graph, tmp_path):
    """--percentile under another method, --num-bins under max, --batch-size for a directory of batch files,
    and --float-kv-cache for a checkpoint whose cache is float already, were accepted and did nothing."""
    assert_clean_error(
        cli("calibrate", "digits_cnn", "--method", "max", "--percentile", "99", "--out", tmp_path / "m.pt"),
        "--percentile applies to --method percentile",
    )
    assert_clean_error(
        cli("calibrate", "digits_cnn", "--method", "max", "--num-bins", "512", "--out", tmp_path / "m.pt"),
        "--num-bins applies to the histogram methods",
    )
    assert not (tmp_path / "m.pt").exists()
    # --batch-size with a directory of batch files (used one per file): it said "64 samples in 2 batches"
    from tests import user_models

    calib, _ = user_models.write_data("dlrm", tmp_path)
    spec = user_models.spec("dlrm")
    r = cli("calibrate", spec, "--data", calib, "--batch-size", 8, "--out", tmp_path / "m.pt")
    assert_clean_error(r, "--batch-size applies to whole arrays", "directory of batch files")
    assert not (tmp_path / "m.pt").exists()
    ck, _ = decode_graph  # calibrated without --kv-cache int8
    r = cli("export", ck, "--onnx", tmp_path / "f.onnx", "--float-kv-cache")
    assert_clean_error(r, "--float-kv-cache", "no int8 KV cache")
    assert not (tmp_path / "f.onnx").exists()


def test_text_and_image_options_with_other_data_are_refused(tmp_path):
    """--tokenizer, --max-length with image or tensor data, and --image-size, --mean, --std with text or
    tensor data, were accepted and did nothing."""
    x = tmp_path / "x.npy"
    np.save(x, np.zeros((4, 1, 8, 8), np.float32))
    out = tmp_path / "m.calib.pt"
    for extra, words in (
        (["--max-length", "32"], ["--max-length", "applies to text data", "tensor data"]),
        (["--image-size", "32", "--mean", "0.5"], ["--image-size, --mean", "apply to image data"]),
    ):
        r = cli("calibrate", "digits_cnn", "--data", x, "--out", out, *extra)
        assert_clean_error(r, *words)
        assert not out.exists()
    texts = tmp_path / "t.txt"
    texts.write_text("one line\n")
    r = cli("calibrate", "text_encoder", "--data", texts, "--out", out, "--std", "0.2")
    assert_clean_error(r, "--std", "applies to image data", "a text file")


def test_preprocessing_options_without_data_and_a_distributed_timeout_in_one_process_are_refused(tmp_path):
    """A sample model calibrates on its bundled tensors: --max-length, --tokenizer, --image-size, --mean and
    --std were accepted there and did nothing; so was --dist-timeout in a run not started by torchrun."""
    out = tmp_path / "m.calib.pt"
    for model, extra, words in (
        ("text_encoder", ["--max-length", "16"], ["--max-length applies to a text file", "bundled data"]),
        (
            "digits_cnn",
            ["--image-size", "8", "--std", "0.2"],
            ["--image-size, --std apply to", "bundled data"],
        ),
        ("digits_cnn", ["--dist-timeout", "5"], ["--dist-timeout applies to a calibration run by torchrun"]),
    ):
        assert_clean_error(cli("calibrate", model, "--out", out, *extra), *words)
        assert not out.exists()


def test_data_options_without_data_are_refused_by_verify_and_analyze(calibrated, exported, tmp_path):
    """Without --data, verify and analyze use the checkpoint's stored batches: --tokenizer (even a missing
    folder), --image-size, --mean and --batch-size were accepted there and did nothing, exit 0; calibrate's
    --batch-size on a sample model too."""
    ck = calibrated()
    for command, args in (
        ("verify", [exported(), "--reference", ck]),
        ("analyze", [ck, "--out", tmp_path / "a"]),
    ):
        for extra, words in (
            (
                ["--tokenizer", str(tmp_path / "missing")],
                ["--tokenizer applies to a text file", "without --data"],
            ),
            (["--image-size", "8", "--mean", "0.5"], ["--image-size, --mean apply to", "without --data"]),
            (["--batch-size", "4"], ["--batch-size applies to whole arrays", "without --data"]),
        ):
            assert_clean_error(cli(command, *args, *extra), *words)
    assert not (tmp_path / "a").exists()
    r = cli("calibrate", "digits_cnn", "--batch-size", "4", "--out", tmp_path / "c.pt")
    assert_clean_error(r, "--batch-size applies to whole arrays", "bundled data")
    assert not (tmp_path / "c.pt").exists()


def test_a_directory_given_for_a_checkpoint_or_a_graph_is_named_as_one(calibrated, exported, tmp_path):
    """A directory was "calibrated checkpoint DIR does not exist" (inspect, export, verify's --reference) and
    "ONNX file DIR does not exist": it exists; it is a directory, and the file wanted may be in it."""
    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copy(calibrated(), folder / "m.calib.pt")
    for r in (cli("inspect", folder), cli("export", folder, "--onnx", tmp_path / "m.onnx")):
        assert_clean_error(r, f"calibrated checkpoint {folder} is a directory", "(m.calib.pt is there)")
    r = cli("verify", folder, "--reference", calibrated())
    assert_clean_error(r, f"ONNX file {folder} is a directory", "the .onnx file that `quantcli export` wrote")
    assert not (tmp_path / "m.onnx").exists()


def test_causal_lm_options_on_another_model_are_refused(calibrated, tmp_path):
    """--no-kv-cache and --standard-ops on a CNN's checkpoint were accepted and did nothing."""
    for flag in ("--no-kv-cache", "--standard-ops"):
        r = cli("export", calibrated("digits_cnn"), "--onnx", tmp_path / "m.onnx", flag)
        assert_clean_error(r, flag, "apply to causal LMs")
        assert not (tmp_path / "m.onnx").exists()


def test_an_unsigned_quantizer_on_a_tensor_with_negative_values_is_refused_by_name(tmp_path):
    """``unsigned: true`` on a weight or an input that holds negative values: calibrate wrote the checkpoint
    (latency placement said "not decided: TypeError") and export ended in an internal error (exit 3)."""
    for pattern, extra in (
        ("layers.0.out.weight_quantizer", ""),
        ("layers.0.attention.output.input_quantizer", "    asymmetric: false\n"),
    ):
        config = tmp_path / "unsigned.yaml"
        config.write_text(f'preset: int8\nrules:\n  - pattern: "{pattern}"\n    unsigned: true\n{extra}')
        out = tmp_path / "m.calib.pt"
        r = cli("calibrate", "text_encoder", "--config", config, "--out", out)
        assert_clean_error(r, f"{pattern} is unsigned", "negative values (min -", "set `unsigned: false`")
        assert not out.exists()
    # kept as configured, the checkpoint is written; export refuses it the same way
    r = cli("calibrate", "text_encoder", "--config", config, "--placement", "all", "--out", out)
    assert r.exit_code == 0, r.output
    graph = tmp_path / "m.onnx"
    r = cli("export", out, "--onnx", graph)
    assert_clean_error(r, "layers.0.attention.output.input_quantizer is unsigned", "negative values")
    assert not graph.exists()


def test_a_rule_setting_calib_method_for_activations_is_refused(tmp_path):
    """calib_method chooses a weight quantizer's amax method; activations take calibrate's --method, so a
    rule for input quantizers alone did nothing, silently. A rule for every quantizer ("*") may mean the
    weights' and is taken."""
    out = tmp_path / "m.calib.pt"
    config = tmp_path / "c.yaml"
    config.write_text('preset: int8\nrules:\n  - pattern: "*.input_quantizer"\n    calib_method: histogram\n')
    r = cli("calibrate", "digits_cnn", "--config", config, "--out", out)
    assert_clean_error(r, "calib_method applies to weight quantizers", "--method")
    assert not out.exists()
    config.write_text('preset: int8\nrules:\n  - pattern: "*"\n    calib_method: histogram\n')
    assert cli("calibrate", "digits_cnn", "--config", config, "--out", out).exit_code == 0


@pytest.mark.parametrize(
    "rule, says",
    [
        # export: internal error (exit 3), "The expanded size of the tensor (64) must match ... (128)"
        (
            '  - pattern: "fc2.weight_quantizer"\n    axis: 1\n',
            "axis 1 is not the weight's output channel axis (0)",
        ),
        # export: "amax holds 256 values ... the checkpoint was edited or is damaged"
        (
            '  - pattern: "fc2.input_quantizer"\n    num_bits: 4\n    block_sizes: {-1: 16}\n',
            "fc2.input_quantizer: block_sizes applies to weight quantizers",
        ),
        # export: "a dynamic activation quantizer exports as DynamicQuantizeLinear -> MatMulInteger in a ..."
        (
            '  - pattern: "conv2.input_quantizer"\n    dynamic: true\n',
            "conv2.input_quantizer: dynamic quantization applies to the inputs of Linear layers",
        ),
        # export: "amax of shape (10, 32) ... is neither per-tensor, per-axis nor blocked along one axis"
        (
            '  - pattern: "fc2.weight_quantizer"\n    num_bits: 4\n    block_sizes: {-1: 1}\n',
            "fc2.weight_quantizer: a block size of 1 gives every weight its own scale",
        ),
    ],
)
def test_a_rule_that_export_could_not_write_is_refused_by_calibrate(tmp_path, rule, says):
    """Each rule calibrated (exit 0) into a checkpoint that export then failed on."""
    config, out = tmp_path / "c.yaml", tmp_path / "m.calib.pt"
    config.write_text(f"preset: int8\nrules:\n{rule}")
    r = cli("calibrate", "digits_cnn", "--config", config, "--placement", "all", "--out", out)
    assert_clean_error(r, says)
    assert not out.exists()
    # the same fields where they do export: per output channel, blocks of a weight, a Linear's dynamic input
    config.write_text(
        'preset: int8\nrules:\n  - pattern: "fc2.weight_quantizer"\n    axis: -2\n'
        '  - pattern: "fc1.weight_quantizer"\n    num_bits: 4\n    block_sizes: {-1: 16}\n'
        '  - pattern: "fc1.input_quantizer"\n    dynamic: true\n'
    )
    r = cli("calibrate", "digits_cnn", "--config", config, "--placement", "all", "--out", out)
    assert r.exit_code == 0, r.output


def test_a_holdout_the_model_cannot_take_is_named(tmp_path):
    """A --holdout of the wrong shape failed in the search with "forward(x: float32[10, 3]) failed on batch
    0", which named no file."""
    np.save(tmp_path / "bad.npy", np.zeros((10, 3), np.float32))
    out = tmp_path / "m.calib.pt"
    r = cli(
        "calibrate", "digits_cnn", "--min-cosine", "0.99", "--holdout", tmp_path / "bad.npy", "--out", out
    )
    assert_clean_error(r, f"failed on --holdout {tmp_path / 'bad.npy'}'s first batch", "float32[10, 3]")
    assert not out.exists()
