"""``reduce_range``: 8-bit weights on a 7-bit grid, so a non-VNNI u8s8 kernel's 16-bit pair sums cannot
saturate."""

import onnx
import pytest
import torch
from onnx import numpy_helper

from quantcli.errors import ConfigError
from quantcli.nn import load_config, quantize_model
from quantcli.nn.tensor_quantizer import quantizers
from quantcli.verify import verify_onnx
from sample_models.digits_cnn import build
from tests.helpers import cli
from tests.reference_u8s8 import saturating_dot


def test_reduce_range_puts_8_bit_weights_on_a_7_bit_narrow_grid():
    cfg = load_config(
        {
            "preset": "int8",
            "reduce_range": True,
            "rules": [{"pattern": "fc2.weight_quantizer", "num_bits": 4}],
        }
    )
    qs = quantizers(quantize_model(build(), cfg))
    assert (qs["conv1.weight_quantizer"].desc.num_bits, qs["conv1.weight_quantizer"].desc.narrow_range) == (
        7,
        True,
    )
    assert qs["fc1.weight_quantizer"].desc.axis == 0  # the preset's per-channel axis is kept
    assert qs["fc2.weight_quantizer"].desc.num_bits == 4  # a rule's own width is left alone
    assert qs["conv1.input_quantizer"].desc.num_bits == 8  # activations keep 8 bits
    assert load_config(cfg.to_plain()).reduce_range is True
    assert load_config("int8").reduce_range == "auto"  # the deployment CPU decides (tests/test_saturation.py)
    with pytest.raises(ConfigError, match="reduce_range"):
        load_config({"reduce_range": "yes"})


def test_reduced_weights_export_as_int8_codes_within_63_and_stay_exact(tmp_path):
    cfg = tmp_path / "rr.yaml"
    cfg.write_text("preset: int8\nreduce_range: true\n")
    ck, out = tmp_path / "rr.calib.pt", tmp_path / "rr.onnx"
    assert cli("calibrate", "digits_cnn", "--config", cfg, "--out", ck, "--json").exit_code == 0
    assert cli("export", ck, "--onnx", out, "--json").exit_code == 0
    m = onnx.load(str(out))
    weights = [
        numpy_helper.to_array(t)
        for t in m.graph.initializer
        if t.data_type == onnx.TensorProto.INT8 and len(t.dims) > 1
    ]
    assert len(weights) == 4
    assert all(w.min() >= -63 and w.max() <= 63 for w in weights)
    assert max(int(abs(w).max()) for w in weights) == 63  # the grid is used up to its bound
    rep = verify_onnx(out, ck, deployment=False)
    assert rep.passed and all(v["identical_codes"] == 1.0 for v in rep.fidelity["quantizers"].values())


def test_saturating_dot_clips_pairs_like_vpmaddubsw():
    a = torch.tensor([[255, 255, 1, 2]])
    w = torch.tensor([[127], [127], [-3], [5]])
    got, saturated, pairs = saturating_dot(a, w)
    # pair 1: 255*127*2 = 64770 -> 32767; pair 2: -3 + 10 = 7
    assert got.tolist() == [[32767 + 7]] and (saturated, pairs) == (1, 2)
    got, saturated, _ = saturating_dot(torch.tensor([[255, 0, 255]]), torch.tensor([[-128], [127], [-128]]))
    assert got.tolist() == [[-32640 + -32640]] and saturated == 0  # 255 * -128 fits; an odd K is padded


def test_seven_bit_weights_never_saturate():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (64, 96), generator=g)
    w = torch.randint(-63, 64, (96, 16), generator=g)
    w[:, 0] = 63  # the worst case: full-scale activations times the largest codes
    a[0] = 255
    got, saturated, _ = saturating_dot(a, w)
    assert saturated == 0 and torch.equal(got, a @ w)
    w[0:2, 1] = 127  # 8-bit codes: the same activations saturate
    assert saturating_dot(a, w)[1] > 0
