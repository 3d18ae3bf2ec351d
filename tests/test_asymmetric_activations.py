"""The onnxruntime target's default grid for signed activations: uint8 with a zero point
(``asymmetric_activations``), as onnxruntime's own ``quantize_static`` does; the tensorrt target and configs
that say otherwise keep symmetric int8."""

from __future__ import annotations

import json

import pytest
import torch

from quantcli.errors import ConfigError
from quantcli.nn import quantize_model, quantizers
from tests.helpers import cli


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3)
        self.conv2 = torch.nn.Conv2d(8, 8, 3)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        y = self.conv2(torch.relu(self.conv1(x)))  # conv2 reads a ReLU output; fc a signed mean
        return self.fc(y.mean((2, 3)))


def _example():
    return {"x": torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))}


def _grids(config) -> tuple[dict[str, str], torch.nn.Module]:
    m = quantize_model(Net().eval(), config, example=_example())
    return {n: q.desc.format_name for n, q in quantizers(m).items() if not n.endswith("weight_quantizer")}, m


def test_signed_activations_are_asymmetric_on_onnxruntime_and_symmetric_on_tensorrt():
    grids, m = _grids("int8")
    assert grids["conv1.input_quantizer"] == "uint8 asymmetric"  # the image: signed
    assert grids["conv2.input_quantizer"] == "uint8"  # after a ReLU: the unsigned symmetric grid
    assert grids["fc.input_quantizer"] == "uint8 asymmetric"
    assert sorted(m.quantcli_report.placement.asymmetric) == sorted(
        n for n, g in grids.items() if g.endswith("asymmetric")
    )
    assert m.quantcli_config.to_plain()["asymmetric_activations"] is True
    grids, m = _grids({"target": "tensorrt"})
    assert set(grids.values()) == {"int8"} and m.quantcli_config.to_plain()["asymmetric_activations"] is False


def test_a_config_keeps_symmetric_grids():
    grids, _ = _grids({"asymmetric_activations": False})
    assert grids["conv1.input_quantizer"] == "int8" and grids["fc.input_quantizer"] == "int8"
    grids, _ = _grids({"rules": [{"pattern": "fc.input_quantizer", "asymmetric": False}]})
    assert grids["fc.input_quantizer"] == "int8" and grids["conv1.input_quantizer"] == "uint8 asymmetric"
    with pytest.raises(ConfigError, match="does not fit target tensorrt"):
        _grids({"target": "tensorrt", "asymmetric_activations": True})
    with pytest.raises(ConfigError, match="must be true or false"):
        _grids({"asymmetric_activations": "yes"})


def test_the_cli_reports_them_and_entropy_keeps_symmetric_grids(tmp_path):
    out = tmp_path / "d.pt"
    r = cli("calibrate", "digits_cnn", "--placement", "all", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["placement"]["asymmetric"] == ["conv1.input_quantizer"]
    assert "1 signed activation on uint8 with a zero point" in info["placement"]["text"]
    # entropy searches a symmetric threshold: left to the default, the grid is one it calibrates (no warning
    # that it did not apply), and the checkpoint records that
    r = cli("calibrate", "digits_cnn", "--placement", "all", "--method", "entropy", "--out", out, "--json")
    assert r.exit_code == 0 and "warning: --method" not in r.stderr, r.output
    assert json.loads(r.stdout)["placement"]["asymmetric"] == []
    assert torch.load(out, weights_only=True)["quant_config"]["asymmetric_activations"] is False
    cfg = tmp_path / "asym.yaml"
    cfg.write_text("asymmetric_activations: true\n")
    r = cli("calibrate", "digits_cnn", "--config", cfg, "--target", "tensorrt", "--out", tmp_path / "t.pt")
    assert r.exit_code == 2 and "does not fit target tensorrt" in r.output
    assert not (tmp_path / "t.pt").exists()


def test_a_checkpoint_from_before_the_default_reloads_symmetric(tmp_path):
    """A checkpoint whose quant_config has no ``asymmetric_activations`` was calibrated on symmetric grids: it
    must rebuild them, not the new default (an asymmetric quantizer would read its missing amin as 0)."""
    from quantcli.inputs.checkpoint import load_calibrated

    out = tmp_path / "old.pt"
    cfg = tmp_path / "sym.yaml"
    cfg.write_text("asymmetric_activations: false\n")
    assert cli("calibrate", "digits_cnn", "--config", cfg, "--placement", "all", "--out", out).exit_code == 0
    sym = load_calibrated(out).model
    data = torch.load(out, weights_only=True)
    del data["quant_config"]["asymmetric_activations"]
    torch.save(data, out)
    ck = load_calibrated(out)
    assert not any(q.desc.asymmetric for q in quantizers(ck.model).values())
    from sample_models import digits_cnn

    x = digits_cnn.calibration_batches(16)[0]
    with torch.no_grad():
        assert torch.equal(ck.model(**x), sym(**x))


@pytest.mark.parametrize("method", ["max", "mse", "percentile", "entropy"])
def test_scale_amax_scales_both_ends_of_an_asymmetric_range(method):
    """``scale_amax`` was applied to symmetric quantizers only: an asymmetric one (every signed activation of
    the int8 preset on onnxruntime) kept its calibrated range, without a word."""
    from quantcli.nn.tensor_quantizer import TensorQuantizer
    from quantcli.quant.descriptor import QuantDescriptor

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 2 + 0.5
    ranges = {}
    for scale in (None, 0.5):
        q = TensorQuantizer(QuantDescriptor(num_bits=8, asymmetric=True, scale_amax=scale), name="x")
        q.start_calibration(method)
        q(x)
        q.load_calib_amax(method, percentile=99.9)
        ranges[scale] = (float(q.amin), float(q.amax))
    (lo, hi), (lo_half, hi_half) = ranges[None], ranges[0.5]
    assert lo < 0 < hi
    assert lo_half == pytest.approx(lo / 2, rel=1e-6) and hi_half == pytest.approx(hi / 2, rel=1e-6)


@pytest.mark.parametrize("preset", ["uint8-asymmetric", "int8-dynamic"])
def test_tensorrt_refuses_presets_and_rules_with_asymmetric_activations(preset, tmp_path):
    """``--target tensorrt --config uint8-asymmetric`` (or int8-dynamic, DynamicQuantizeLinear's uint8) gave
    activations with zero points (126) that TensorRT does not run: the preset slipped past the rule that
    refuses ``asymmetric_activations: true``."""
    from quantcli.nn.config import QuantConfig

    with pytest.raises(ConfigError, match=f"preset {preset} quantizes activations on an asymmetric uint8"):
        QuantConfig(preset=preset, target="tensorrt")
    with pytest.raises(ConfigError, match=r"rule 0 \('fc.\*'\) makes quantizers asymmetric"):
        QuantConfig(target="tensorrt", rules=[{"pattern": "fc.*", "asymmetric": True}])
    QuantConfig(preset=preset)  # onnxruntime runs both
    r = cli("calibrate", "digits_cnn", "--config", preset, "--target", "tensorrt", "--out", tmp_path / "t.pt")
    assert r.exit_code == 2 and "TensorRT does not run" in r.output and not (tmp_path / "t.pt").exists()


def test_a_dynamic_rule_is_dynamicquantizelinears_uint8(tmp_path):
    """A rule ``dynamic: true`` on an int8 config calibrated, and export refused the checkpoint ("dynamic
    quantizers cannot be exported as static Q/DQ"): dynamic quantization exports only as
    DynamicQuantizeLinear, uint8 with a zero point, which the rule now sets (a rule saying otherwise is
    refused)."""
    from quantcli.nn.config import QuantConfig

    cfg = QuantConfig(rules=[{"pattern": "fc1.input_quantizer", "dynamic": True}])
    assert cfg.rules[0] == {
        "pattern": "fc1.input_quantizer",
        "dynamic": True,
        "asymmetric": True,
        "num_bits": 8,
    }
    for bad in ({"asymmetric": False}, {"num_bits": 4}):
        with pytest.raises(ConfigError, match="DynamicQuantizeLinear, which is asymmetric uint8"):
            QuantConfig(rules=[{"pattern": "fc1.input_quantizer", "dynamic": True, **bad}])
    config = tmp_path / "dyn.yaml"
    config.write_text("preset: int8\nrules:\n  - pattern: fc1.input_quantizer\n    dynamic: true\n")
    ck, graph = tmp_path / "d.calib.pt", tmp_path / "d.onnx"
    r = cli("calibrate", "digits_cnn", "--config", config, "--placement", "all", "--out", ck)
    assert r.exit_code == 0, r.output
    r = cli("export", ck, "--onnx", graph)
    assert r.exit_code == 0, r.output
    import onnx

    ops = [n.op_type for n in onnx.load(str(graph)).graph.node]
    assert "DynamicQuantizeLinear" in ops and "MatMulInteger" in ops
