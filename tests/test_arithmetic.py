"""The one arithmetic (ONNX QuantizeLinear / DequantizeLinear), hand-worked."""

from fractions import Fraction

import pytest
import torch

from quantcli.quant import arithmetic


def test_bounds_and_ranges():
    assert arithmetic.symmetric_bound(8) == 127
    assert arithmetic.symmetric_bound(8, unsigned=True) == 255
    assert arithmetic.symmetric_bound(4) == 7
    assert arithmetic.integer_range(8) == (-128, 127)
    assert arithmetic.integer_range(8, narrow_range=True) == (-127, 127)
    assert arithmetic.integer_range(8, unsigned=True) == (0, 255)
    assert arithmetic.integer_range(4, unsigned=True, narrow_range=True) == (0, 15)


@pytest.mark.parametrize("bad", [1, 17, 0, -3])
def test_bad_num_bits_names_value(bad):
    with pytest.raises(ValueError, match=str(bad)):
        arithmetic.check_num_bits(bad)


def test_num_bits_type():
    with pytest.raises(TypeError):
        arithmetic.check_num_bits(8.0)
    with pytest.raises(TypeError):
        arithmetic.check_num_bits(True)


def test_ties_round_half_to_even():
    scale = torch.tensor(1.0)
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, -128.5])
    q = arithmetic.quantize_linear(x, scale, 0, -128, 127)
    assert q.tolist() == [0.0, 2.0, 2.0, -0.0, -2.0, -2.0, 126.0, 127.0, -128.0]


def test_divide_not_reciprocal_multiply():
    # ONNX's QuantizeLinear divides. float32(0.3) = 0.300000011920928955078125 lies above 0.3, so 2.25 / s is
    # 7.49999970..., just below the tie: correctly rounded float32 division gives 7.4999995, code 7. The
    # reciprocal route rounds 1/s first and lands exactly on the tie 7.5, which rounds half to even: code 8.
    x = torch.tensor([2.25], dtype=torch.float32)
    s = torch.tensor(0.3, dtype=torch.float32)
    exact = Fraction(2.25) / Fraction(float(s))  # exact rational arithmetic, independent of torch
    assert exact < Fraction(15, 2)
    assert (x * (1 / s)).item() == 7.5  # the two routes really differ on this value
    assert arithmetic.quantize_linear(x, s, 0, -128, 127).item() == 7.0


def test_saturation():
    q = arithmetic.quantize_linear(torch.tensor([1e9, -1e9]), torch.tensor(1.0), 0, -128, 127)
    assert q.tolist() == [127.0, -128.0]


def test_zero_point_added_after_rounding():
    q = arithmetic.quantize_linear(torch.tensor([0.5, 1.5]), torch.tensor(1.0), 10, 0, 255)
    assert q.tolist() == [10.0, 12.0]


def test_dead_channel_is_zero_without_nan():
    amax = torch.tensor([[0.0], [2.0]])
    x = torch.tensor([[5.0, -3.0], [1.0, -5.0]])
    y = arithmetic.fake_quant_symmetric(x, amax, 8)
    assert torch.isfinite(y).all()
    assert y[0].tolist() == [0.0, 0.0]
    assert y[1, 1].item() == pytest.approx(-128 * (2.0 / 127))


def test_negative_amax_rejected():
    with pytest.raises(ValueError, match="-1"):
        arithmetic.check_amax(torch.tensor([1.0, -1.0]))


def test_e4m3_saturates_at_448_and_keeps_sign():
    y = arithmetic.fake_quant_e4m3(torch.tensor([1000.0, -1000.0, 448.0, 0.0]), torch.tensor(448.0))
    assert y.tolist() == [448.0, -448.0, 448.0, 0.0]


def test_e4m3_dead_amax():
    y = arithmetic.fake_quant_e4m3(torch.tensor([3.0, -2.0]), torch.tensor(0.0))
    assert y.tolist() == [0.0, 0.0]
