"""quantcli.nn.modes: quantizers switched for a block come back exactly as they were, whatever the block
does."""

import pytest
import torch
from torch import nn

from quantcli.nn import quantize_model, quantizers
from quantcli.nn.modes import keep_float, quantizer_modes


def _model():
    torch.manual_seed(0)
    # symmetric grids: amax alone sets them (an asymmetric one, the onnxruntime default, also needs amin)
    m = quantize_model(
        nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), {"asymmetric_activations": False}
    )
    qs = quantizers(m)
    for q in qs.values():
        q.set_amax(torch.tensor(1.0))
    return m, qs


def test_modes_restored_when_the_block_raises():
    m, qs = _model()
    qs["0.input_quantizer"].set_mode("calibrate")
    qs["2.weight_quantizer"].enabled = False
    qs["2.weight_quantizer"].set_mode("disabled")
    before = {n: q.mode for n, q in qs.items()}
    assert before["0.input_quantizer"] == "calibrate" and before["0.weight_quantizer"] == "quantize"
    with pytest.raises(RuntimeError):
        with quantizer_modes(m, "disabled"):
            assert {q.mode for q in qs.values()} == {"disabled"}
            raise RuntimeError("pass failed")
    assert {n: q.mode for n, q in qs.items()} == before


def test_per_name_modes_leave_the_others_and_respect_enabled():
    m, qs = _model()
    qs["2.input_quantizer"].enabled = False
    qs["2.input_quantizer"].set_mode("disabled")
    x = torch.linspace(-3, 3, 8).reshape(2, 4)
    with quantizer_modes(m, {"0.input_quantizer": "disabled", "2.input_quantizer": "quantize"}):
        assert qs["0.input_quantizer"].mode == "disabled"
        assert qs["2.input_quantizer"].mode == "disabled"  # not enabled: stays off whatever is asked
        assert qs["0.weight_quantizer"].mode == "quantize"  # not named: untouched
        # the first layer reads x unclipped (|x| up to 3 > amax 1): its input quantizer really stands aside
        assert qs["0.input_quantizer"](x).equal(x)
    assert qs["0.input_quantizer"].mode == "quantize"
    # quantizing again: int8 with scale amax / 127 clips -3 to code -128, i.e. -128 / 127
    assert qs["0.input_quantizer"](x)[0, 0].item() == pytest.approx(-128 / 127)


def test_a_list_of_quantizers_and_a_bad_mode():
    m, qs = _model()
    pair = [qs["0.input_quantizer"], qs["0.weight_quantizer"]]
    with quantizer_modes(pair, "disabled"):
        assert [q.mode for q in qs.values()] == ["disabled", "disabled", "quantize", "quantize"]
    assert [q.mode for q in qs.values()] == ["quantize"] * 4
    with pytest.raises(ValueError, match="mode must be one of"):
        with quantizer_modes(m, "off"):
            pass
    assert [q.mode for q in qs.values()] == ["quantize"] * 4  # a half-applied switch is undone too


def test_keep_float_is_permanent():
    m, qs = _model()
    keep_float(qs["0.weight_quantizer"])
    q = qs["0.weight_quantizer"]
    assert not q.enabled and q.mode == "disabled"
    q.set_mode("quantize")
    assert q.mode == "disabled"


def test_keep_float_inside_the_block_outlasts_the_restore():
    # calibrate() pauses quantizers, then switches off those of layers that never ran: they must stay off, not
    # come back in the mode they had before the pause
    m, qs = _model()
    q = qs["2.weight_quantizer"]
    assert q.mode == "quantize"
    with quantizer_modes(m, "disabled"):
        keep_float(q)
    assert (q.enabled, q.mode) == (False, "disabled")
    assert qs["0.weight_quantizer"].mode == "quantize"
    x = torch.linspace(-3, 3, 4)
    assert torch.equal(q(x), x)  # passes values through: no clipping to amax 1.0
