"""Quantizers in the model: TensorQuantizer, quant layers, in-place replacement, config rules."""

import pytest
import torch
from torch import nn

from quantcli import QuantDescriptor, quantize_model
from quantcli.calibration.calibrate import calibrate
from quantcli.errors import ConfigError
from quantcli.nn import TensorQuantizer, load_config, quantizers
from quantcli.nn.modules import QuantConvTranspose2d, QuantLinear


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.deconv = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.conv1d = nn.Conv1d(4, 4, 1)
        self.head = nn.Linear(4, 2)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        y = self.deconv(torch.relu(self.conv(x)))
        y = y.mean(dim=(2, 3))
        y = self.conv1d(y.unsqueeze(-1)).squeeze(-1)
        return self.head(self.norm(y))


def _batches(n=3):
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(4, 3, 10, 10, generator=g)} for _ in range(n)]


def test_replacement_keeps_names_params_hooks_state_dict():
    torch.manual_seed(0)
    m = Net().eval()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    calls = []
    m.head.register_forward_hook(lambda *a: calls.append(1))
    weight_obj = m.conv.weight
    quantize_model(m)
    assert isinstance(m.head, QuantLinear) and isinstance(m.deconv, QuantConvTranspose2d)
    assert m.conv.weight is weight_obj
    assert isinstance(m.norm, nn.LayerNorm) and not hasattr(m.norm, "input_quantizer")
    sd = m.state_dict()
    for k, v in before.items():
        assert torch.equal(sd[k], v)
    assert set(sd) == set(before)  # amax buffers appear only once calibrated
    calibrate(m, _batches(), device="cpu")
    m(**_batches(1)[0])
    assert calls
    # an asymmetric quantizer (the onnxruntime target's signed activations) also holds its minimum
    assert set(m.state_dict()) - set(before) == {f"{n}.amax" for n in quantizers(m)} | {
        f"{n}.amin" for n, q in quantizers(m).items() if q.desc.asymmetric
    }
    assert {n for n, q in quantizers(m).items() if q.desc.asymmetric} >= {
        "conv.input_quantizer",
        "head.input_quantizer",
    }


def test_weight_axis_output_channel_and_transposed():
    m = quantize_model(Net().eval())
    calibrate(m, _batches(), device="cpu")
    assert m.conv.weight_quantizer.amax.shape == (8, 1, 1, 1)
    assert m.deconv.weight_quantizer.amax.shape == (1, 4, 1, 1)  # axis 1 for transposed convs
    assert m.head.weight_quantizer.amax.shape == (2, 1)
    assert m.head.input_quantizer.amax.shape == ()
    w = m.conv.weight.detach()
    assert torch.equal(m.conv.weight_quantizer.amax.flatten(), w.abs().amax(dim=(1, 2, 3)))


def test_quantized_forward_matches_functional():
    # the tensorrt target: quantized input and weight, float bias (the onnxruntime target's int32 bias is
    # tested in test_placement.py)
    m = quantize_model(Net().eval(), {"preset": "int8-per-tensor", "target": "tensorrt"})
    calibrate(m, _batches(), device="cpu")
    x = _batches(1)[0]["x"]
    from quantcli import fake_tensor_quant

    q = m.conv
    want = torch.nn.functional.conv2d(
        fake_tensor_quant(x, q.input_quantizer.amax, 8, False, False),
        fake_tensor_quant(q.weight, q.weight_quantizer.amax, 8, False, False),
        q.bias,
    )
    got = q(x)
    assert torch.equal(got, want)


def test_calibrate_mode_only_observes():
    q = TensorQuantizer(QuantDescriptor(), name="q")
    q.start_calibration("max")
    x = torch.randn(10)
    assert q(x) is x
    q.load_calib_amax()
    assert q.mode == "quantize" and q.amax.item() == x.abs().max().item()


def test_presets():
    for preset, check in {
        "int8": lambda m: m.head.weight_quantizer.desc.axis == 0,
        "int8-per-tensor": lambda m: m.head.weight_quantizer.desc.axis is None,
        "fp8": lambda m: m.head.input_quantizer.desc.is_fp8 and m.head.weight_quantizer.desc.is_fp8,
        "int4-weight-only": lambda m: (
            not m.head.input_quantizer.enabled
            and m.head.weight_quantizer.desc.num_bits == 4
            and m.conv.weight_quantizer.desc.block_sizes == {1: 128}
        ),
        "uint8-asymmetric": lambda m: m.head.input_quantizer.desc.asymmetric,
    }.items():
        m = quantize_model(Net().eval(), preset)
        assert check(m), preset


def test_rules_later_win_field_by_field(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "preset: int8\nrules:\n  - {pattern: '*', num_bits: 6}\n  - {pattern: 'head.*', narrow_range: "
        "true}\n  - {pattern: 'head.input_quantizer', enable: false}\n  - {pattern: 'nothing.matches.*', "
        "num_bits: 4}\n"
    )
    m = quantize_model(Net().eval(), str(cfg))
    assert m.head.weight_quantizer.desc.num_bits == 6 and m.head.weight_quantizer.desc.narrow_range
    assert m.head.weight_quantizer.desc.axis == 0  # from the preset, untouched
    assert not m.head.input_quantizer.enabled
    assert m.conv.input_quantizer.desc.num_bits == 6 and not m.conv.input_quantizer.desc.narrow_range
    assert m.quantcli_report.unmatched_patterns == ["nothing.matches.*"]


def test_a_rules_granularity_replaces_the_inherited_one():
    """docs/calibration.md's config example (``num_bits: 4, block_sizes: {-1: 64}`` on the int8 preset)
    failed: "axis must be None when block_sizes is given", the axis the preset's per-channel weights set. A
    rule's blocks replace the inherited axis, and a rule's axis the inherited blocks."""
    rule = {"pattern": "head.weight_quantizer", "block_sizes": {-1: 4}}
    m = quantize_model(Net().eval(), {"preset": "int8", "rules": [rule]})
    assert m.head.weight_quantizer.desc.block_sizes == {-1: 4} and m.head.weight_quantizer.desc.axis is None
    assert m.conv.weight_quantizer.desc.axis == 0  # not matched: the preset's
    rule = {"pattern": "conv.weight_quantizer", "axis": 0}
    m = quantize_model(Net().eval(), {"preset": "int4-weight-only", "rules": [rule]})
    assert m.conv.weight_quantizer.desc.axis == 0 and m.conv.weight_quantizer.desc.block_sizes is None


def test_json_config_and_list_of_rules(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('[{"pattern": "conv.*", "enable": false}]')
    m = quantize_model(Net().eval(), str(p))
    assert not m.conv.weight_quantizer.enabled and m.head.weight_quantizer.enabled


@pytest.mark.parametrize(
    "content, match",
    [
        ("rules:\n  - {pattern: '*', bogus: 1}\n", "bogus"),
        ("preset: int3\n", "int3"),
        ("colour: blue\n", "colour"),
        ("rules:\n  - {num_bits: 4}\n", "pattern"),
        ("rules: [\n", "cannot parse"),
        # where: YAML's first line ("while scanning a quoted scalar") said neither where nor what
        (
            'preset: int8\nrules:\n  - pattern: "head.*\n    enable: false\n',
            r"line 5, column 1: found unexpected end of stream \(scanning a quoted scalar from line 3, col",
        ),
    ],
)
def test_bad_configs(tmp_path, content, match):
    p = tmp_path / "bad.yaml"
    p.write_text(content)
    with pytest.raises(ConfigError, match=match):
        load_config(str(p))


def test_bad_field_value_names_quantizer():
    with pytest.raises(ConfigError, match="head.weight_quantizer"):
        quantize_model(Net().eval(), {"rules": [{"pattern": "head.weight_quantizer", "num_bits": 40}]})


def test_learn_amax_is_a_parameter():
    q = TensorQuantizer(QuantDescriptor(amax=2.0, learn_amax=True), name="q")
    assert isinstance(q.amax, nn.Parameter)
    x = torch.tensor([0.5, 3.0])
    q(x).sum().backward()
    assert q.amax.grad is not None


def test_dynamic_quantizer_computes_amax_per_call():
    q = TensorQuantizer(QuantDescriptor(dynamic=True, axis=0), name="q")
    x = torch.tensor([[0.7, -2.0], [0.5, 0.1]])
    y = q(x)
    # row 0: amax 2, scale 2/127: 0.7 -> code round(44.45) = 44; row 1: amax 0.5, scale 0.5/127: 0.1 ->
    # round(25.4) = 25. An identity gives 0.7 and 0.1; one amax for the whole tensor (2) gives 0.1 -> 6 *
    # 2/127 = 0.0945.
    want = torch.tensor([[44 * 2.0 / 127, -2.0], [0.5, 25 * 0.5 / 127]])
    assert torch.allclose(y, want, rtol=0, atol=1e-6)
    # amax follows each call's input
    assert q(x * 4)[1, 1].item() == pytest.approx(4 * 25 * 0.5 / 127, abs=1e-6)


def test_histogram_methods_recompute_without_new_data():
    from quantcli.calibration.calibrate import recompute_amax

    # symmetric grids, which entropy calibrates (asymmetric ones take their min and max under it)
    m = quantize_model(Net().eval(), {"asymmetric_activations": False})
    calls = []
    m.conv.register_forward_hook(lambda *a: calls.append(1))
    calibrate(m, _batches(), "entropy", device="cpu")
    n_calls = len(calls)
    entropy = m.conv.input_quantizer.amax.clone()
    done = recompute_amax(m, "percentile", percentile=100.0)
    assert len(calls) == n_calls  # the model did not run again
    assert "conv.input_quantizer" in done
    # percentile 100 is the end of the last non-empty bin: at least the max seen
    assert m.conv.input_quantizer.amax >= max(b["x"].abs().max() for b in _batches()) - 1e-6
    assert not torch.equal(m.conv.input_quantizer.amax, entropy)
