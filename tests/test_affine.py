"""Affine quantization: torchao (``quantize_affine``, ``FakeQuantizeConfig``) and AIMET (``quantize``)
signatures on ONNX arithmetic."""

import pytest
import torch

from quantcli.quant.affine import (
    FakeQuantizeConfig,
    MappingType,
    PerAxis,
    PerGroup,
    ZeroPointDomain,
    choose_qparams_affine,
    dequantize,
    dequantize_affine,
    dtype_range,
    quantize,
    quantize_affine,
    quantize_dequantize,
)

SEED_OUT = [
    0.0,
    0.0,
    0.0,
    0.0,
    0.0,
    0.0,
    -0.0,
    1.0,
    2.0,
    2.0,
    3.0,
    4.0,
    4.0,
    5.0,
    6.0,
    7.0,
    7.0,
    8.0,
    9.0,
    10.0,
    10.0,
    11.0,
    12.0,
    13.0,
    13.0,
    14.0,
    15.0,
    15.0,
    15.0,
    15.0,
    15.0,
    15.0,
]


def seed_input():
    return torch.arange(start=-0.3, end=1.3, step=0.05)


def test_aimet_seed_example_all_overloads():
    x = seed_input()
    scale, offset = torch.tensor(1 / 15), torch.tensor(0.0)
    assert quantize(x, scale, offset, bitwidth=4).tolist() == SEED_OUT
    assert quantize(x, scale, offset, num_steps=15).tolist() == SEED_OUT
    assert quantize(x, scale, offset, qmin=0, qmax=15).tolist() == SEED_OUT


def test_aimet_offset_is_negated_zero_point():
    x = torch.tensor([0.0, 1.0])
    q = quantize(x, torch.tensor(1.0), torch.tensor(-3.0), bitwidth=8)
    assert q.tolist() == [3.0, 4.0]
    assert dequantize(q, torch.tensor(1.0), torch.tensor(-3.0)).tolist() == [0.0, 1.0]


def test_aimet_overload_errors():
    x = seed_input()
    with pytest.raises(TypeError):
        quantize(x, torch.tensor(0.1), torch.tensor(0.0), 4, num_steps=15)
    with pytest.raises(ValueError):
        quantize(x, torch.tensor(0.1), torch.tensor(0.0), qmin=5, qmax=5)


def test_aimet_signed_num_steps():
    q = quantize(
        torch.tensor([-1000.0, 1000.0]), torch.tensor(1.0), torch.tensor(0.0), num_steps=255, signed=True
    )
    assert q.tolist() == [-128.0, 127.0]


def test_aimet_block_size_infer():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 8, generator=g)
    scale = w.reshape(4, 2, 4).abs().amax(-1) / 7
    q1 = quantize(w, scale, torch.zeros_like(scale), bitwidth=4, signed=True, block_size=(-1, -1))
    q2 = quantize(w, scale, torch.zeros_like(scale), bitwidth=4, signed=True, block_size=(1, 4))
    assert torch.equal(q1, q2)
    for b in range(2):
        blk = w[:, 4 * b : 4 * b + 4]
        ref = quantize(blk, scale[:, b : b + 1], torch.zeros(4, 1), bitwidth=4, signed=True)
        assert torch.equal(q1[:, 4 * b : 4 * b + 4], ref)
    qd = quantize_dequantize(w, scale, torch.zeros_like(scale), bitwidth=4, signed=True, block_size=(-1, -1))
    assert (qd - w).abs().max() <= scale.max() / 2 + 1e-6


def test_torchao_block_size_table():
    # the table in seed 000, for a (3, 3, 10, 10) tensor
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 3, 10, 10, generator=g)
    cases = {
        "per_tensor": (3, 3, 10, 10),
        "per_axis0": (1, 3, 10, 10),
        "per_axis1": (3, 1, 10, 10),
        "per_group_last": (3, 3, 10, 2),
        "per_group_axis3": (3, 3, 2, 10),
    }
    for name, bs in cases.items():
        scale, zp = choose_qparams_affine(x, MappingType.SYMMETRIC, bs, torch.int8)
        nblocks = tuple(n // b for n, b in zip(x.shape, bs))
        assert tuple(scale.shape) == nblocks, name
        q = quantize_affine(x, bs, scale, zp, torch.int8)
        assert q.dtype == torch.int8
        # each block quantized on its own equals the whole
        if name == "per_axis1":
            for c in range(3):
                qc = quantize_affine(
                    x[:, c : c + 1], (3, 1, 10, 10), scale[:, c : c + 1], zp[:, c : c + 1], torch.int8
                )
                assert torch.equal(q[:, c : c + 1], qc)
        dq = dequantize_affine(q, bs, scale, zp, torch.int8)
        assert (dq - x).abs().max() <= scale.max() / 2 + 1e-6


def test_symmetric_scale_is_amax_over_127_where_torchao_divides_by_127_5():
    # A documented difference from torchao (README, Python API): its choose_qparams_affine divides max|x| by
    # (qmax - qmin) / 2 = 127.5 for int8; quantcli divides by 127, its symmetric scale amax / bound, so that
    # +-amax land on codes +-127 exactly as in the rest of quantcli and in the exported graph.
    x = torch.tensor([[-2.54, 1.0]])
    scale, zp = choose_qparams_affine(x, MappingType.SYMMETRIC, (1, 2), torch.int8)
    assert scale.item() == (torch.tensor(2.54) / 127).item()
    assert scale.item() != pytest.approx(2.54 / 127.5, rel=1e-4)
    assert zp.item() == 0
    q = quantize_affine(x, (1, 2), scale, zp, torch.int8)
    # -amax on -127; torchao's scale would put it at about -127.5, the grid's edge
    assert q.tolist() == [[-127, 50]]


def test_torchao_asymmetric_uint8_zero_exact():
    x = torch.tensor([[-1.0, 0.0, 2.0, 3.0]])
    scale, zp = choose_qparams_affine(x, MappingType.ASYMMETRIC, (1, 4), torch.uint8)
    q = quantize_affine(x, (1, 4), scale, zp, torch.uint8)
    assert q.dtype == torch.uint8 and q.min() == 0 and q.max() == 255
    dq = dequantize_affine(q, (1, 4), scale, zp, torch.uint8)
    assert dq[0, 1].item() == 0.0


def test_torchao_float_zero_point_domain():
    x = torch.tensor([[1.0, 1.5, 2.0, 3.0]])
    scale, zp = choose_qparams_affine(
        x,
        MappingType.ASYMMETRIC,
        (1, 4),
        torch.uint4,
        preserve_zero=False,
        zero_point_domain=ZeroPointDomain.FLOAT,
    )
    q = quantize_affine(x, (1, 4), scale, zp, torch.uint4, zero_point_domain=ZeroPointDomain.FLOAT)
    assert q.min() == 0 and q.max() == 15
    dq = dequantize_affine(q, (1, 4), scale, zp, torch.uint4, zero_point_domain=ZeroPointDomain.FLOAT)
    assert (dq - x).abs().max() <= scale.item() / 2 + 1e-6


@pytest.mark.parametrize("bits", range(1, 8))
def test_sub_byte_dtypes(bits):
    s_lo, s_hi = dtype_range(getattr(torch, f"int{bits}"))
    u_lo, u_hi = dtype_range(getattr(torch, f"uint{bits}"))
    assert (s_lo, s_hi) == (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    assert (u_lo, u_hi) == (0, 2**bits - 1)
    x = torch.linspace(-3, 3, 32).reshape(1, 32)
    q = quantize_affine(x, (1, 32), torch.tensor(0.01), torch.tensor(0), getattr(torch, f"int{bits}"))
    assert q.min() == s_lo and q.max() == s_hi


def test_quant_range_outside_dtype_rejected():
    with pytest.raises(ValueError, match="range"):
        quantize_affine(torch.ones(1, 2), (1, 2), torch.tensor(1.0), None, torch.int4, -9, 7)


def test_fake_quantize_config_seed_examples():
    c = FakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)
    assert c.mapping_type is MappingType.ASYMMETRIC
    assert FakeQuantizeConfig(torch.int4, "per_channel").granularity == PerAxis(0)
    assert (
        FakeQuantizeConfig(torch.int4, PerAxis(0), MappingType.SYMMETRIC).mapping_type
        is MappingType.SYMMETRIC
    )
    for c in (
        FakeQuantizeConfig(torch.int4, group_size=32),
        FakeQuantizeConfig(torch.int4, group_size=32, is_symmetric=True),
        FakeQuantizeConfig(torch.int4, "per_group", group_size=32, is_symmetric=True),
        FakeQuantizeConfig(torch.int4, PerGroup(32), MappingType.SYMMETRIC),
    ):
        assert c.granularity == PerGroup(32) and c.group_size == 32
        assert c.block_size((8, 64)) == (1, 32)
        d = c.to_descriptor()
        assert d.num_bits == 4 and d.block_sizes == {-1: 32}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"granularity": "per_group"}, "group_size"),
        ({"granularity": "per_block"}, "per_block"),
        (
            {"granularity": "per_channel", "mapping_type": MappingType.SYMMETRIC, "is_symmetric": False},
            "contradicts",
        ),
        ({"granularity": "per_channel", "range_learning": True}, "is_dynamic=False"),
        ({}, "granularity or group_size"),
        ({"granularity": "per_channel", "group_size": 8}, "group_size"),
    ],
)
def test_fake_quantize_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FakeQuantizeConfig(torch.int8, **kwargs)


def test_fake_quantize_config_fake_quantize_per_token():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, generator=g)
    c = FakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)
    y = c.fake_quantize(x)
    for r in range(4):
        step = (x[r].max() - x[r].min()) / 255
        assert (y[r] - x[r]).abs().max() <= step / 2 + 1e-6
