"""u8s8 saturation: the kernel arithmetic (quantcli.quant.u8s8) against a brute-force reference and against
onnxruntime's own AVX2 kernels, the deployment CPU's kinds (quantcli.quant.cpu), the grids calibrate chooses
for them, and verify judging the CPU that deploys.

Tests marked ``kernels`` compare with onnxruntime's integer kernels on a CPU without VNNI: they run natively
on such a CPU, and on any x86 machine under ``qemu-x86_64 -cpu Haswell`` (.ci/run does so on hosts with VNNI);
elsewhere they are skipped.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from quantcli import calibrate, quantize_model
from quantcli.analysis.saturation import Emulation, saturating_layers, weight_columns
from quantcli.errors import ConfigError
from quantcli.nn import load_config
from quantcli.nn.tensor_quantizer import quantizers
from quantcli.quant import cpu as cpu_kinds
from quantcli.quant import u8s8
from tests.helpers import assert_clean_error, cli
from tests.reference_u8s8 import saturating_dot

AVX2_HERE = cpu_kinds.detect() == "x86-avx2"
kernels = pytest.mark.kernels
needs_avx2 = pytest.mark.skipif(
    not AVX2_HERE, reason="compares with onnxruntime's kernels of an x86 CPU without VNNI (run under qemu)"
)


# ------------------------------------------------------------------------------------------ the arithmetic


def test_saturated_sums_equal_the_brute_force_kernel_on_random_codes():
    g = torch.Generator().manual_seed(0)
    total = 0
    for m, k, n in ((7, 33, 5), (64, 96, 16), (3, 2, 40)):
        a = torch.randint(0, 256, (m, k), generator=g)
        w = torch.randint(-128, 128, (k, n), generator=g)
        err, sat, pairs = u8s8.saturated_sums(a, w, chunk_elements=37)  # many small chunks
        ref, ref_sat, ref_pairs = saturating_dot(a, w)
        assert torch.equal(a @ w + err, ref)
        assert (sat, pairs) == (ref_sat, ref_pairs)
        total += sat
    assert total > 0


def test_hand_worked_pairs():
    # (255*127 + 255*127) = 64770 clips to 32767; (-3 + 2*5) = 7 does not
    err, sat, pairs = u8s8.saturated_sums(
        torch.tensor([[255, 255, 1, 2]]), torch.tensor([[127], [127], [-3], [5]])
    )
    assert err.tolist() == [[32767 - 64770]] and (sat, pairs) == (1, 2)
    # opposite signs and 255 * -128 fit; an odd K is padded with a zero column
    err, sat, _ = u8s8.saturated_sums(torch.tensor([[255, 0, 255]]), torch.tensor([[-128], [127], [-128]]))
    assert err.tolist() == [[0]] and sat == 0


def test_candidate_pairs_are_exactly_the_pairs_that_can_clip():
    w = torch.tensor([[127, 64, -100, 127, 63], [2, 64, -100, -127, 63]])  # K = 2: one pair per column
    assert u8s8.candidate_pairs(w).tolist() == [[True, False, True, False, False]]
    assert not u8s8.can_saturate(torch.randint(-63, 64, (512, 64)))  # 7-bit codes: 255 * 126 fits
    assert not u8s8.can_saturate(torch.tensor([[127], [127]]), a_max=128)  # 128 * 254 fits


@pytest.mark.parametrize(
    "nd, groups, stride, dilation, padding",
    [(2, 1, 1, 1, 1), (2, 2, 2, 2, 2), (1, 1, 1, 1, 1), (3, 1, 1, 1, 0), (2, 3, 1, 1, 1)],
)
def test_conv_rows_and_columns_are_the_convolution(nd, groups, stride, dilation, padding):
    """(rows - zp) @ columns, group by group, is F.conv of (codes - zp): the rows and columns agree on K's
    order and the padding is the zero point."""
    g = torch.Generator().manual_seed(nd + groups)
    cin, cout, zp = 6, 6, 100
    a = torch.randint(0, 256, (2, cin, *(7,) * nd), generator=g)
    w = torch.randint(-128, 128, (cout, cin // groups, *(3,) * nd), generator=g)
    k = (3,) * nd
    rows, out = u8s8.conv_rows(a, k, (stride,) * nd, ((padding, padding),) * nd, (dilation,) * nd, groups, zp)
    cols = u8s8.conv_weight_columns(w, groups)
    got = torch.cat([(rows[i] - zp) @ cols[i] for i in range(groups)], dim=1)
    conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
    want = conv(
        (a - zp).double(), w.double(), stride=stride, padding=padding, dilation=dilation, groups=groups
    )
    assert torch.equal(got.reshape(2, *out, cout).movedim(-1, 1).double(), want)


# ------------------------------------------------------------------------------------------ the CPU kinds


@pytest.mark.parametrize(
    "machine, cpuid, proc, kind",
    [
        (
            "x86_64",
            {"AVX2": True, "AVX512F": True, "AVX512VNNI": True},
            {"avx2", "avx512f", "avx512_vnni"},
            "x86-vnni",
        ),
        ("x86_64", {"AVX2": True}, {"avx2"}, "x86-avx2"),
        ("x86_64", {"AVX2": True, "AVX512F": True}, {"avx2", "avx512f"}, "x86-avx2"),  # AVX-512 without VNNI
        ("x86_64", {"AVX2": True}, {"avx2", "avx_vnni"}, "x86-vnni"),  # AVX-VNNI (not among numpy's features)
        # qemu -cpu Haswell on a VNNI host: /proc/cpuinfo is the host's, CPUID the emulated CPU's
        ("x86_64", {"AVX2": True}, {"avx2", "avx512f", "avx512_vnni", "avx_vnni"}, "x86-avx2"),
        ("aarch64", {}, set(), "arm64"),
        ("ppc64le", {}, set(), "any"),
    ],
)
def test_cpu_kind_from_cpuid_and_cpuinfo(machine, cpuid, proc, kind):
    assert cpu_kinds.kind_from(machine, cpuid, proc) == kind


def test_resolve_and_saturating_kinds(monkeypatch):
    monkeypatch.delenv("QUANTCLI_CPU", raising=False)
    assert cpu_kinds.resolve("auto") == cpu_kinds.detect() == cpu_kinds.resolve(None)
    assert [k for k in cpu_kinds.KINDS if cpu_kinds.can_saturate(k)] == ["x86-avx2", "any"]
    with pytest.raises(ConfigError, match="unknown CPU kind 'avx2'; choose one of auto, x86-avx2"):
        cpu_kinds.resolve("avx2")


def test_quantcli_cpu_names_the_deployment_cpu_where_cpu_is_auto(monkeypatch, tmp_path):
    """A build machine is not the deployment machine: ``QUANTCLI_CPU`` is what auto means (a named --cpu
    wins), while detect() stays this machine (what onnxruntime's kernels here compute)."""
    here = cpu_kinds.detect()
    other = "arm64" if here != "arm64" else "x86-avx2"
    monkeypatch.setenv("QUANTCLI_CPU", other)
    assert cpu_kinds.resolve("auto") == cpu_kinds.resolve(None) == other
    assert cpu_kinds.resolve("x86-vnni") == "x86-vnni" and cpu_kinds.detect() == here
    assert load_config({"cpu": "auto"}).to_plain()["cpu"] == other
    monkeypatch.setenv("QUANTCLI_CPU", "auto")
    assert cpu_kinds.resolve(None) == here
    monkeypatch.setenv("QUANTCLI_CPU", "avx2")
    r = cli("calibrate", "digits_cnn", "--num-samples", "64", "--out", tmp_path / "c.pt")
    assert_clean_error(r, "QUANTCLI_CPU='avx2' is not a CPU kind", "x86-avx2")
    assert not (tmp_path / "c.pt").exists()


# ------------------------------------------------------------------------------------------ grids


class _Mixed(nn.Module):
    """A convolution, a depthwise one, a grouped one and a Linear."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = self.grouped(self.dw(F.relu(self.conv(x))))
        return self.fc(x.mean((2, 3)))


def _weight_bits(cfg) -> dict[str, int]:
    qs = quantizers(quantize_model(_Mixed(), cfg))
    return {n.split(".")[0]: q.desc.num_bits for n, q in qs.items() if n.endswith("weight_quantizer")}


def test_auto_reduces_the_weights_of_kernels_that_can_saturate_on_a_saturating_cpu():
    assert _weight_bits({"cpu": "x86-avx2"}) == {"conv": 7, "dw": 8, "grouped": 7, "fc": 7}
    assert _weight_bits({"cpu": "any"}) == {"conv": 7, "dw": 8, "grouped": 7, "fc": 7}
    for kind in ("x86-vnni", "arm64"):
        assert _weight_bits({"cpu": kind}) == {"conv": 8, "dw": 8, "grouped": 8, "fc": 8}
    assert _weight_bits({"cpu": "x86-avx2", "reduce_range": False}) == {
        "conv": 8,
        "dw": 8,
        "grouped": 8,
        "fc": 8,
    }
    assert _weight_bits({"cpu": "x86-vnni", "reduce_range": True}) == {
        "conv": 7,
        "dw": 7,
        "grouped": 7,
        "fc": 7,
    }
    # TensorRT runs on GPUs: the CPU does not change its grids
    assert _weight_bits({"cpu": "x86-avx2", "target": "tensorrt"})["conv"] == 8


def test_the_config_stores_the_kind_auto_resolved_to(monkeypatch):
    monkeypatch.delenv("QUANTCLI_CPU", raising=False)
    cfg = load_config({"cpu": "auto"})
    assert cfg.to_plain()["cpu"] == cpu_kinds.detect()
    assert load_config({"cpu": "x86-avx2"}).to_plain()["cpu"] == "x86-avx2"
    with pytest.raises(Exception, match="unknown cpu 'avx2'"):
        load_config({"cpu": "avx2"})


def _calibrated(cpu: str, reduce_range="auto"):
    from sample_models import digits_cnn as dc

    torch.manual_seed(0)
    m = quantize_model(
        dc.build(), {"cpu": cpu, "reduce_range": reduce_range}, example=dc.calibration_batches()[0]
    )
    calibrate(m, dc.calibration_batches()[:2], device="cpu")
    return m.eval(), dc


def test_saturating_layers_reads_the_codes():
    m, _ = _calibrated("x86-vnni")
    assert saturating_layers(m) == ["conv1", "conv2", "fc1", "fc2"]
    m, _ = _calibrated("x86-avx2")
    assert saturating_layers(m) == []


# ------------------------------------------------------------------------------------------ onnxruntime


def _qdq_conv(w_codes, w_scale, x_scale, x_zp, y_scale, y_zp, groups, strides, dilations, shape):
    """Q -> DQ -> Conv (DQ'd int8 weights per channel, padding 1) -> Q: what onnxruntime fuses into
    QLinearConv."""
    cout, nd = w_codes.shape[0], w_codes.ndim - 2
    inits = [
        numpy_helper.from_array(w_codes.astype(np.int8), "wq"),
        numpy_helper.from_array(w_scale.astype(np.float32), "ws"),
        numpy_helper.from_array(np.zeros(cout, np.int8), "wzp"),
        numpy_helper.from_array(np.array(x_scale, np.float32), "xs"),
        numpy_helper.from_array(np.array(x_zp, np.uint8), "xzp"),
        numpy_helper.from_array(np.array(y_scale, np.float32), "ys"),
        numpy_helper.from_array(np.array(y_zp, np.uint8), "yzp"),
    ]
    conv = dict(group=groups, pads=[1] * (2 * nd), strides=strides, dilations=dilations)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xzp"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xzp"], ["xd"]),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wzp"], ["wd"], axis=0),
        helper.make_node("Conv", ["xd", "wd"], ["c"], **conv),
        helper.make_node("QuantizeLinear", ["c", "ys", "yzp"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, None)],
        inits,
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


def test_the_tensorrt_target_keeps_8_bit_weights_and_says_why(tmp_path):
    """``--target tensorrt --cpu x86-avx2`` said "8-bit weights (its integer kernels cannot saturate)" of a
    CPU whose kernels can: TensorRT runs none of them."""
    import json

    ck = tmp_path / "t.calib.pt"
    r = cli("calibrate", "digits_cnn", "--target", "tensorrt", "--cpu", "x86-avx2", "--out", ck, "--json")
    assert r.exit_code == 0, r.output
    cpu = json.loads(r.stdout)["cpu"]
    assert cpu["reduced_weights"] == []
    assert cpu["text"].endswith("8-bit weights (the tensorrt target runs no uint8 x int8 CPU kernel)"), cpu


@pytest.mark.parametrize("preset", ["int4-weight-only", "fp8"])
def test_a_calibration_without_8_bit_integer_weights_says_so_in_the_cpu_row(tmp_path, preset):
    """An int4 or fp8 calibration's cpu row said "8-bit weights (its integer kernels cannot saturate)"."""
    import json

    ck = tmp_path / "t.calib.pt"
    r = cli("calibrate", "digits_cnn", "--config", preset, "--cpu", "x86-vnni", "--out", ck, "--json")
    assert r.exit_code == 0, r.output
    text = json.loads(r.stdout)["cpu"]["text"]
    assert text.endswith("no 8-bit integer weight (nothing for uint8 x int8 kernels to saturate)"), text


@kernels
@needs_avx2
@pytest.mark.parametrize(
    "nd, groups, stride, dilation, x_zp",
    [(2, 1, 1, 1, 128), (2, 2, 2, 2, 100), (1, 1, 1, 1, 128), (3, 1, 1, 1, 128)],
)
def test_the_emulated_kernel_is_onnxruntimes_avx2_kernel(nd, groups, stride, dilation, x_zp):
    """onnxruntime's QLinearConv on this CPU and the emulated int32 sums, requantized the same way, give the
    same output codes, including where pairs clip."""
    import onnxruntime as ort

    rng = np.random.default_rng(nd * 10 + groups)
    cin = cout = 8
    w = rng.standard_normal((cout, cin // groups, *(3,) * nd)).astype(np.float32)
    ws = (np.abs(w).reshape(cout, -1).max(1) / 127).astype(np.float32)
    wq = np.clip(np.round(w / ws.reshape(-1, *[1] * (nd + 1))), -127, 127)
    x = (rng.standard_normal((2, cin, *(9,) * nd)) * 3).astype(np.float32)
    xs, ys, yzp = np.float32(0.02), np.float32(0.5), 128
    m = _qdq_conv(wq, ws, xs, x_zp, ys, yzp, groups, [stride] * nd, [dilation] * nd, x.shape)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    deployed = sess.run(None, {"x": x})[0]
    a = torch.from_numpy(np.clip(np.round(x / xs) + x_zp, 0, 255)).long()
    rows, out = u8s8.conv_rows(a, (3,) * nd, (stride,) * nd, ((1, 1),) * nd, (dilation,) * nd, groups, x_zp)
    cols = u8s8.conv_weight_columns(torch.from_numpy(wq).long(), groups)
    sums, saturated = [], 0
    for i in range(groups):
        err, sat, _ = u8s8.saturated_sums(rows[i], cols[i])
        sums.append((rows[i] - x_zp) @ cols[i] + err)
        saturated += sat
    acc = torch.cat(sums, 1).double() * float(xs) * torch.from_numpy(ws).double()
    codes = torch.clamp(torch.round(acc / float(ys)) + yzp, 0, 255).reshape(2, *out, cout).movedim(-1, 1)
    assert saturated > 0  # the case saturates, so this compares the clipping too
    assert np.array_equal(codes.numpy().astype(np.uint8), deployed)


@kernels
@needs_avx2
def test_the_emulated_model_is_the_deployed_session(tmp_path):
    """digits_cnn on 8-bit weights (grids for a CPU with VNNI): the deployed session on this CPU saturates,
    and the fake-quant model under Emulation computes what it computes."""
    import onnxruntime as ort

    from exporters import export_onnx

    m, dc = _calibrated("x86-vnni")
    batch = dc.evaluation_batches()[0]
    export_onnx(m, dc.calibration_batches()[0], tmp_path / "m.onnx")
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), so, providers=["CPUExecutionProvider"])
    deployed = sess.run(None, {k: v.numpy() for k, v in batch.items()})[0]
    with torch.inference_mode():
        fake = m(**batch).numpy()
        with Emulation(m) as emu:
            emulated = m(**batch).numpy()
    assert np.abs(deployed - fake).max() > 0.5  # it saturates
    assert np.abs(emulated - deployed).max() < 1e-4 * np.abs(deployed).max()
    assert emu.layers["conv1"].saturated > 0


# ------------------------------------------------------------------------------------------ the CLI


@pytest.fixture(scope="module")
def saturating_graph(tmp_path_factory):
    """digits_cnn calibrated for a CPU with VNNI (8-bit weights) and exported."""
    d = tmp_path_factory.mktemp("sat")
    ck, onnx_path = d / "v.calib.pt", d / "v.onnx"
    r = cli("calibrate", "digits_cnn", "--cpu", "x86-vnni", "--placement", "all", "--out", ck, "--json")
    assert r.exit_code == 0, r.output
    assert cli("export", ck, "--onnx", onnx_path, "--json").exit_code == 0
    return ck, onnx_path


def test_verify_fails_a_graph_that_saturates_on_the_named_cpu_and_names_the_layer(saturating_graph):
    import json

    ck, onnx_path = saturating_graph
    r = cli("verify", onnx_path, "--reference", ck, "--cpu", "x86-avx2", "--json")
    assert r.exit_code == 1, r.output
    rep = json.loads(r.stdout)
    check = next(c for c in rep["checks"] if c["name"] == "deployment.saturation")
    assert not check["passed"] and check["value"] > 1.0
    assert "conv1 (" in check["detail"] and "--cpu x86-avx2" in check["detail"]
    assert "docs/calibration.md#the-deployment-cpu---cpu" in check["detail"]
    assert rep["deployment"]["saturation"]["layers"][0]["layer"] == "conv1"


def test_verify_passes_the_same_graph_for_a_cpu_with_vnni_when_this_machine_has_it(saturating_graph):
    import json

    ck, onnx_path = saturating_graph
    r = cli("verify", onnx_path, "--reference", ck, "--cpu", "x86-vnni", "--json")
    rep = json.loads(r.stdout)
    names = [c["name"] for c in rep["checks"]]
    if AVX2_HERE:  # the deployed session here saturates, whatever --cpu says
        assert r.exit_code == 1 and "deployment.saturation" in names
    else:
        assert r.exit_code == 0 and "deployment.saturation" not in names


def test_calibrate_warns_when_reduce_range_false_leaves_weights_that_saturate(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cpu: x86-avx2\nreduce_range: false\n")
    r = cli(
        "calibrate", "digits_cnn", "--config", cfg, "--placement", "all", "--out", tmp_path / "c.calib.pt"
    )
    assert r.exit_code == 0
    assert "can saturate with the 8-bit weights of conv1, conv2, fc1, fc2 (reduce_range: false)" in r.stderr


def test_default_grid_for_any_cpu_passes_the_saturation_check(tmp_path):
    import json

    ck, onnx_path = tmp_path / "a.calib.pt", tmp_path / "a.onnx"
    r = cli("calibrate", "digits_cnn", "--cpu", "any", "--placement", "all", "--out", ck, "--json")
    info = json.loads(r.stdout)
    assert info["cpu"]["kind"] == "any" and len(info["cpu"]["reduced_weights"]) == 4
    assert cli("export", ck, "--onnx", onnx_path).exit_code == 0
    r = cli("verify", onnx_path, "--reference", ck, "--json")
    rep = json.loads(r.stdout)
    check = next(c for c in rep["checks"] if c["name"] == "deployment.saturation")  # the graph's own kind
    assert r.exit_code == 0 and check["passed"] and check["value"] == 0.0


@kernels
def test_verify_fails_the_saturating_convnext_style_block_and_passes_the_default_grid(tmp_path):
    """Issue 36's case: a ConvNeXt-style block (depthwise 7x7, channels-last LayerNorm, GELU, layer scale)
    calibrated for a CPU with VNNI loses accuracy where x86 without VNNI runs it: verify --cpu x86-avx2 fails
    it and names a pointwise Linear; the default grid (auto) passes verify on this machine, and its deployed
    session's cosine to float is within 0.002 of the exact session's."""
    import json

    rng = np.random.default_rng(0)
    np.save(tmp_path / "c.npy", rng.standard_normal((64, 3, 32, 32)).astype(np.float32))
    np.save(tmp_path / "v.npy", rng.standard_normal((32, 3, 32, 32)).astype(np.float32))
    model = "sample_models.structured:convnext_style"

    def run(name, *cal, verify=()):
        ck, path = tmp_path / f"{name}.calib.pt", tmp_path / f"{name}.onnx"
        r = cli("calibrate", model, "--data", tmp_path / "c.npy", "--placement", "all", "--out", ck, *cal)
        assert r.exit_code == 0, r.output
        assert cli("export", ck, "--onnx", path).exit_code == 0
        r = cli("verify", path, "--reference", ck, "--data", tmp_path / "v.npy", "--json", *verify)
        return r.exit_code, json.loads(r.stdout)

    code, rep = run("vnni", "--cpu", "x86-vnni", verify=("--cpu", "x86-avx2"))
    check = next(c for c in rep["checks"] if c["name"] == "deployment.saturation")
    assert code == 1 and not check["passed"] and check["value"] > 5
    assert rep["deployment"]["saturation"]["layers"][0]["layer"].split(".")[-1] in (
        "pwconv1",
        "pwconv2",
        "stem",
    )
    code, rep = run("auto")
    assert code == 0, rep["checks"]
    assert abs(rep["quality"]["cosine_gap"]["output_0"]) <= 0.002  # exact less deployed, the same inputs


class _SlicedWeight(nn.Module):
    """A layer whose operation takes a slice (or a transpose) of its parameter, not the parameter."""

    def __init__(self, transpose: bool):
        super().__init__()
        self.transpose = transpose
        self.W = nn.Parameter(torch.randn(16, 32) if transpose else torch.randn(10, 16) * 3)

    def forward(self, x):
        return F.linear(x, self.W.t() if self.transpose else self.W[:6])


class _Net(nn.Module):
    def __init__(self, transpose: bool):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.head = _SlicedWeight(transpose)

    def forward(self, x):
        return self.head(F.relu(self.fc(x)))


@pytest.mark.parametrize("transpose", [False, True], ids=["slice", "transpose"])
def test_layers_whose_weight_operand_is_derived_are_judged_on_it(transpose, tmp_path):
    """saturating_layers quantizes the operand the layer's operation takes (a slice or a transpose of the
    parameter, recorded on one forward), not the parameter: before, its amax did not fit the parameter and
    calibrate's summary and verify stopped with an internal error."""
    torch.manual_seed(0)
    batches = [{"x": torch.randn(16, 8)} for _ in range(2)]
    model = quantize_model(_Net(transpose).eval(), load_config({"cpu": "x86-vnni"}), example=batches[0])
    calibrate(model, batches, "max", device="cpu")
    head = model.head
    operand = head.W.t() if transpose else head.W[:6]
    with torch.no_grad():
        cols = weight_columns(head, head.weight_quantizer(operand))
    want = ["head"] if any(u8s8.can_saturate(c) for c in cols) else []
    got = saturating_layers(model, batches[0])
    assert [n for n in got if n == "head"] == want
    assert "head" not in saturating_layers(model) and "head" in saturating_layers(model, unknown=True)


class _Attention(nn.Module):
    """``nn.MultiheadAttention`` (self-attention): its packed ``in_proj`` and its ``out_proj`` run inside
    ``F.multi_head_attention_forward``, where no torch function mode sees them."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        with torch.no_grad():  # weights whose 8-bit codes fill the grid, so that pairs of products saturate
            self.attn.in_proj_weight.uniform_(-1, 1)
            self.attn.out_proj.weight.uniform_(-1, 1)

    def forward(self, x):
        a, _ = self.attn(x, x, x, need_weights=False)
        return a.mean(1)


def _attention(cpu: str):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.rand(16, 12, 32, generator=g) * 4 - 2} for _ in range(3)]
    model = quantize_model(_Attention().eval(), load_config({"cpu": cpu}), example=batches[0])
    calibrate(model, batches[:2], device="cpu")
    return model.eval(), batches[2]


def test_multihead_attentions_projections_are_emulated():
    """verify --cpu x86-avx2 passed a graph whose nn.MultiheadAttention saturated on AVX2 (the deployed
    session off by 10x the quantization error under qemu -cpu Haswell): the emulation never saw the
    attention's projections, so it recorded no layer."""
    model, batch = _attention("x86-vnni")
    assert {"attn", "attn.out_proj"} <= set(saturating_layers(model))
    with torch.inference_mode(), Emulation(model) as emu:
        model(**batch)
    assert emu.layers["attn"].saturated > 0 and emu.layers["attn.out_proj"].saturated > 0
    # every product pair of both projections was looked at: rows x outputs x K/2 (16 rows of 12 tokens)
    assert emu.layers["attn"].pairs == emu.layers["attn.out_proj"].pairs * 3
    model, batch = _attention("x86-avx2")  # 7-bit weights: nothing saturates
    with torch.inference_mode(), Emulation(model) as emu:
        model(**batch)
    assert set(emu.layers) == {"attn", "attn.out_proj"} and not any(s.saturated for s in emu.layers.values())


@kernels
@needs_avx2
def test_the_emulated_attention_is_the_deployed_session(tmp_path):
    """The same model exported: onnxruntime runs in_proj as MatMulIntegerToFloat and out_proj as QGemm, and on
    a CPU without VNNI both saturate as the emulation says."""
    import onnxruntime as ort

    from exporters import export_onnx

    model, batch = _attention("x86-vnni")
    export_onnx(model, batch, tmp_path / "m.onnx")
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), so, providers=["CPUExecutionProvider"])
    deployed = sess.run(None, {"x": batch["x"].numpy()})[0]
    with torch.inference_mode():
        fake = model(**batch).numpy()
        with Emulation(model) as emu:
            emulated = model(**batch).numpy()
    scale = np.abs(deployed).max()
    assert np.abs(deployed - fake).max() > 0.05 * scale  # it saturates
    assert np.abs(emulated - deployed).max() < 1e-4 * scale
    assert emu.layers["attn"].saturated > 0
