"""NVIDIA-style quantize ops (pytorch-quantization's ``tensor_quant``): forward, backward, validation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantcli import fake_affine_tensor_quant, fake_tensor_quant, scaled_e4m3
from quantcli.quant import tensor_quant
from quantcli.quant.tensor_quant import (
    FakeTensorQuantFunction,
    LegacyFakeTensorQuantFunction,
    ScaledQuantDescriptor,
    TensorQuantFunction,
)


def test_aliases():
    x = torch.tensor([0.3, -2.0])
    assert torch.equal(
        tensor_quant(x, torch.tensor(1.0))[0], TensorQuantFunction.apply(x, torch.tensor(1.0))[0]
    )
    assert tensor_quant.tensor_quant == TensorQuantFunction.apply
    assert fake_tensor_quant == FakeTensorQuantFunction.apply
    from quantcli import QuantDescriptor

    assert QuantDescriptor is ScaledQuantDescriptor


def test_tensor_quant_hand_vector():
    x = torch.tensor([-2.0, -1.0, 0.0, 0.49, 0.5, 1.0, 3.0])
    codes, scale = tensor_quant(x, torch.tensor(1.0), 8, False, True)
    # onnx scale 1/127; 0.49 * 127 = 62.23; 0.5 * 127 = 63.5 -> 64 (even); clamp at +-127 (narrow)
    assert codes.tolist() == [-127.0, -127.0, 0.0, 62.0, 64.0, 127.0, 127.0]
    assert scale.item() == pytest.approx(127.0)
    assert torch.allclose(codes / scale, fake_tensor_quant(x, torch.tensor(1.0), 8, False, True), atol=1e-7)


def test_narrow_vs_full_range():
    x = torch.tensor([-5.0])
    assert tensor_quant(x, torch.tensor(1.0), 8, False, True)[0].item() == -127
    assert tensor_quant(x, torch.tensor(1.0), 8, False, False)[0].item() == -128


def test_unsigned():
    x = torch.tensor([0.0, 0.5, 1.0, 2.0])
    codes, _ = tensor_quant(x, torch.tensor(1.0), 8, True)
    # the float32 scale fl(1/255) is a little above 1/255, so 0.5 / scale = 127.4999924 -> 127 (ONNX divides)
    assert codes.tolist() == [0.0, 127.0, 255.0, 255.0]


def test_unsigned_negative_input_is_an_error():
    with pytest.raises(TypeError, match="negative input"):
        fake_tensor_quant(torch.tensor([-0.1, 1.0]), torch.tensor(1.0), 8, True)


@pytest.mark.parametrize(
    "op",
    [
        lambda x: fake_tensor_quant(x, torch.tensor(100.0)),
        lambda x: tensor_quant.tensor_quant(x, torch.tensor(100.0)),
        lambda x: fake_affine_tensor_quant(x, torch.tensor(-100.0), torch.tensor(100.0)),
        lambda x: scaled_e4m3(x, torch.tensor(100.0)),
    ],
    ids=["fake", "codes", "affine", "e4m3"],
)
def test_integer_input_is_an_error(op):
    """An int64 tensor used to come back truncated in its own dtype ([1, 2, 300] -> [0, 2, 100])."""
    with pytest.raises(TypeError, match="floating-point tensor, got torch.int64"):
        op(torch.tensor([1, 2, 300]))


def test_negative_amax_and_bad_bits():
    with pytest.raises(ValueError, match="-0.5"):
        fake_tensor_quant(torch.ones(3), torch.tensor(-0.5))
    with pytest.raises(ValueError, match="17"):
        fake_tensor_quant(torch.ones(3), torch.tensor(1.0), 17)


def test_per_channel_equals_loop_over_channels():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 3, 3, 3, generator=g)
    amax = w.abs().amax(dim=(1, 2, 3), keepdim=True)
    amax[2] = 0.0  # a dead channel
    y = fake_tensor_quant(w, amax, 8)
    for c in range(6):
        assert torch.equal(y[c], fake_tensor_quant(w[c], amax[c].reshape(()), 8))
    assert torch.isfinite(y).all() and (y[2] == 0).all()


def test_blocked_equals_loop_over_blocks():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4, 64, generator=g)
    amax = w.reshape(4, 4, 16).abs().amax(-1)  # block 16 along the last axis
    y = fake_tensor_quant(w, amax, 4)
    for r in range(4):
        for b in range(4):
            blk = w[r, b * 16 : (b + 1) * 16]
            assert torch.equal(y[r, b * 16 : (b + 1) * 16], fake_tensor_quant(blk, amax[r, b], 4))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs(dtype):
    x = torch.linspace(-2, 2, 101).to(dtype)
    y = fake_tensor_quant(x, torch.tensor(2.0), 8)
    assert y.dtype == dtype
    ref = fake_tensor_quant(x.float(), torch.tensor(2.0), 8)
    assert torch.allclose(y.float(), ref.to(dtype).float())


def test_ste_with_clipping():
    x = torch.tensor([-3.0, -1.0, 0.2, 1.0, 3.0], requires_grad=True)
    fake_tensor_quant(x, torch.tensor(1.0)).sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]


def test_legacy_ste_passes_everything():
    x = torch.tensor([-3.0, 0.2, 3.0], requires_grad=True)
    LegacyFakeTensorQuantFunction.apply(x, torch.tensor(1.0)).sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 1.0]


def test_learned_amax_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, dtype=torch.float64, generator=g) * 2
    # per-tensor and per-channel amax; finite differences agree away from rounding boundaries
    for amax in (torch.tensor(1.3, dtype=torch.float64), torch.tensor([[1.1], [2.7]], dtype=torch.float64)):
        xin = x.reshape(2, 32) if amax.dim() else x
        amax = amax.clone().requires_grad_(True)
        assert torch.autograd.gradcheck(
            lambda a, xin=xin: FakeTensorQuantFunction.apply(xin, a, 8, False, False),
            (amax,),
            eps=1e-7,
            atol=1e-5,
        )


def test_learned_amax_gradient_value():
    amax = torch.tensor(1.0, requires_grad=True)
    x = torch.tensor([0.5, 2.0])  # codes 64 (63.5 -> 64) and 127 (clipped)
    fake_tensor_quant(x, amax, 8, False, True).sum().backward()
    assert amax.grad.item() == pytest.approx((64 + 127) / 127)


def test_affine_uint8_hand_vector():
    x = torch.tensor([-1.0, 0.0, 0.5, 3.0, 9.0])
    y = fake_affine_tensor_quant(x, -1.0, 3.0, 8)
    scale = torch.tensor(4.0) / 255
    zp = torch.round(torch.tensor(1.0) / scale)  # 64
    expect = (torch.clamp(torch.round(x / scale) + zp, 0, 255) - zp) * scale
    assert torch.equal(y, expect)
    assert y[1].item() == 0.0  # zero is exact


def test_scaled_e4m3():
    x = torch.tensor([0.0, 1.0, -1.0, 100.0, 1e6])
    y = scaled_e4m3(x, torch.tensor(448.0), 4, 3)
    assert y.tolist()[:3] == [0.0, 1.0, -1.0]
    # e4m3 spacing is 8 in [64, 128): 100 lies halfway between 96 (mantissa 0b100) and 104 (0b101); a tie goes
    # to the even mantissa
    assert y[3].item() == 96.0
    assert y[4].item() == 448.0
    with pytest.raises(ValueError, match="E4M3"):
        scaled_e4m3(x, torch.tensor(1.0), 5, 2)


finite = st.floats(-1e4, 1e4, allow_nan=False, width=32)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(finite, min_size=1, max_size=64),
    st.floats(0.0010000000474974513, 1e3, width=32),
    st.integers(2, 16),
    st.booleans(),
)
def test_properties_bounds_idempotence_error(xs, amax, num_bits, narrow):
    x = torch.tensor(xs, dtype=torch.float32)
    a = torch.tensor(amax, dtype=torch.float32)
    y = fake_tensor_quant(x, a, num_bits, False, narrow)
    codes, _ = tensor_quant(x, a, num_bits, False, narrow)
    bound = 2 ** (num_bits - 1) - 1
    assert codes.max() <= bound and codes.min() >= (-bound if narrow else -bound - 1)
    # idempotence: quantizing a fake-quantized tensor changes nothing
    assert torch.equal(fake_tensor_quant(y, a, num_bits, False, narrow), y)
    # inside the range the error is at most half a step
    scale = a / bound
    inside = x.abs() <= a
    assert ((x - y).abs()[inside] <= scale / 2 * (1 + 1e-5) + 1e-12).all()
    # monotone
    order = torch.argsort(x)
    assert (torch.diff(y[order]) >= 0).all()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 5), min_size=2, max_size=4),
    st.data(),
    st.integers(2, 8),
    st.booleans(),
)
def test_property_per_axis_equals_per_slice(shape, data, num_bits, narrow):
    axis = data.draw(st.integers(0, len(shape) - 1))
    seed = data.draw(st.integers(0, 2**16))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3
    reduce = tuple(d for d in range(len(shape)) if d != axis)
    amax = x.abs().amax(dim=reduce, keepdim=True) * data.draw(st.sampled_from([0.0, 0.5, 1.0]))
    y = fake_tensor_quant(x, amax, num_bits, False, narrow)
    for i in range(shape[axis]):
        xs, a = x.select(axis, i), amax.select(axis, i).reshape(())
        assert torch.equal(y.select(axis, i), fake_tensor_quant(xs, a, num_bits, False, narrow))
