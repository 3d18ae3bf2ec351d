"""Integer codes equal onnxruntime's QuantizeLinear on the same float32 scale (ONNX QuantizeLinear)."""

import numpy as np
import pytest
import torch
from onnx import TensorProto

from quantcli.quant import arithmetic, tensor_quant
from quantcli.quant.arithmetic import affine_qparams
from tests.ort_util import ort_quantize_linear

N = 100_000


def _values(rng, scale):
    x = rng.standard_normal(N).astype(np.float32) * 60 * float(np.max(scale))
    # exact ties: (k + 0.5) * scale for a range of k, plus values beyond the range
    k = np.arange(-140, 140, dtype=np.float32)
    ties = ((k + 0.5) * np.float32(np.max(scale))).astype(np.float32)
    return np.concatenate([x, ties, np.float32([1e6, -1e6, 0.0, -0.0])])


@pytest.mark.parametrize("amax", [3.7, 127 * 2.0**-5])
def test_int8_per_tensor(amax, rng):
    # 3.7 gives an inexact scale (its "ties" are near-ties); 127 * 2**-5 gives scale 2**-5 and exact ties
    amax = torch.tensor(amax)
    x = _values(rng, amax.item() / 127)
    codes, _ = tensor_quant(torch.from_numpy(x), amax, 8, False, False)
    scale = arithmetic.symmetric_scale(amax, 127).numpy()
    if scale == 2.0**-5:
        assert _count_ties(x, scale) >= 280
    ort = ort_quantize_linear(x, scale, np.int8(0), TensorProto.INT8)
    assert np.array_equal(codes.numpy(), ort)


def _ties(scale: float, lo: int, hi: int) -> np.ndarray:
    """(k + 0.5) * scale for k in [lo, hi): exact ties when ``scale`` is a power of two (no rounding
    anywhere)."""
    return ((np.arange(lo, hi, dtype=np.float64) + 0.5) * scale).astype(np.float32)


def _count_ties(x: np.ndarray, scale) -> int:
    """How many x / scale are exactly halfway between two integers (float64 is exact for power-of-two
    scales)."""
    r = np.asarray(x, np.float64) / np.asarray(scale, np.float64)
    return int(np.sum(r - np.floor(r) == 0.5))


def test_int8_per_axis(rng):
    # power-of-two scales (amax = 127 * 2**e), so the appended (k + 0.5) * scale values are exact ties
    exps = [-3, -1, 2, -10]
    amax = torch.tensor([127.0 * 2.0**e for e in exps]).reshape(4, 1)
    scale = arithmetic.symmetric_scale(amax, 127).reshape(-1).numpy()
    assert scale.tolist() == [2.0**e for e in exps]
    x = rng.standard_normal((4, N // 4)).astype(np.float32) * 3
    x = np.concatenate([x, np.stack([_ties(2.0**e, -140, 140) for e in exps])], axis=1)
    assert all(_count_ties(x[c], scale[c]) >= 280 for c in range(4))
    codes, _ = tensor_quant(torch.from_numpy(x), amax, 8, False, False)
    ort = ort_quantize_linear(x, scale, np.zeros(4, np.int8), TensorProto.INT8, axis=0)
    assert np.array_equal(codes.numpy(), ort)
    assert codes[0, N // 4 + 140].item() == 0.0 and codes[0, N // 4 + 141].item() == 2.0  # 0.5 -> 0, 1.5 -> 2


def test_uint8_with_zero_point(rng):
    scale, zp = affine_qparams(-1.3, 4.1, 8)
    x = rng.uniform(-2, 5, N).astype(np.float32)
    ties = ((np.arange(-60, 200, dtype=np.float32) + 0.5) * scale.numpy()).astype(np.float32)
    x = np.concatenate([x, ties])
    codes = arithmetic.quantize_linear(torch.from_numpy(x), scale, zp, 0, 255)
    ort = ort_quantize_linear(x, scale.numpy(), np.uint8(zp.item()), TensorProto.UINT8)
    assert np.array_equal(codes.numpy(), ort)


def test_int4_blocked_opset21(rng):
    w = rng.standard_normal((32, 4096)).astype(np.float32)  # 131072 values
    w[:, :8] = (np.arange(8, dtype=np.float32) + 0.5) * 0.25  # ties in one block
    amax = torch.from_numpy(np.abs(w).reshape(32, 128, 32).max(-1))
    amax[:, 0] = 7 * 0.25
    codes, _ = tensor_quant(torch.from_numpy(w), amax, 4, False, False)
    scale = arithmetic.symmetric_scale(amax, 7).numpy()
    ort = ort_quantize_linear(
        w, scale, np.zeros(scale.shape, np.int8), TensorProto.INT4, axis=1, block_size=32, opset=21
    )
    assert np.array_equal(codes.numpy(), ort)


def _e4m3_midpoints() -> np.ndarray:
    """Every value exactly halfway between two neighbouring finite E4M3 numbers, both signs, and beyond
    448."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64).numpy()
    grid = np.unique(grid[np.isfinite(grid)])
    mids = (grid[:-1] + grid[1:]) / 2
    return np.concatenate([mids, [464.0, 480.0, 1e4]]).astype(np.float32)


@pytest.mark.parametrize("amax", [10.0, 448.0, 28.0])
def test_fp8_e4m3_opset19(amax, rng):
    # amax 448 and 28 give power-of-two scales (1, 2**-4): every midpoint times the scale is an exact tie,
    # which both sides must round to the even mantissa; amax 10 gives an inexact scale (ties only
    # approximately)
    scale = arithmetic.symmetric_scale(torch.tensor(amax), arithmetic.FP8_E4M3_MAX)
    ties = (_e4m3_midpoints().astype(np.float64) * float(scale)).astype(np.float32)
    x = np.concatenate(
        [rng.standard_normal(N).astype(np.float32) * amax / 2, ties, np.float32([1e4, -1e4, 0.0, amax])]
    )
    ours = arithmetic.quantize_e4m3(torch.from_numpy(x), scale).to(torch.float32).numpy()
    ort = ort_quantize_linear(x, scale.numpy(), np.zeros((), np.float32), TensorProto.FLOAT8E4M3FN, opset=19)
    assert np.array_equal(ours, ort)
    if amax != 10.0:
        assert float(scale) in (1.0, 2.0**-4)
        mid = {100.0: 96.0, -100.0: -96.0, 0.5 * 2.0**-9: 0.0, 464.0: 448.0, 1.0625: 1.0, 1.1875: 1.25}
        for v, q in mid.items():  # hand-picked ties: to the even mantissa, or saturated at 448
            i = int(np.nonzero(ties == np.float32(v * float(scale)))[0][0])
            assert ours[N + i] == q, v


@pytest.mark.parametrize("num_bits", [2, 6, 8])
def test_narrow_grids_match_after_clip(num_bits, rng):
    # grids narrower than the ONNX type are clipped in float before QuantizeLinear: same codes
    bound = 2 ** (num_bits - 1) - 1
    amax = torch.tensor(bound * 0.125)  # scale 2**-3: exact ties, inside the grid and beyond its ends
    ties = _ties(0.125, -bound - 4, bound + 4)
    x = torch.from_numpy(np.concatenate([rng.standard_normal(N).astype(np.float32) * bound * 0.25, ties]))
    codes, _ = tensor_quant(x, amax, num_bits, False, True)
    s = arithmetic.symmetric_scale(amax, bound)
    assert s.item() == 0.125 and _count_ties(x.numpy(), 0.125) >= 2 * bound + 8
    lo, hi = (torch.tensor(float(-bound)) * s), (torch.tensor(float(bound)) * s)
    clipped = torch.minimum(torch.maximum(x, lo), hi).numpy()
    ort = ort_quantize_linear(clipped, s.numpy(), np.int8(0), TensorProto.INT8)
    assert np.array_equal(codes.numpy(), ort)
    tail = codes[N:].numpy()  # codes of the ties, from -bound - 3.5 up: to even, then narrow at both ends
    # numpy rounds half to even
    want = np.clip(np.round(np.arange(-bound - 4, bound + 4) + 0.5), -bound, bound)
    assert np.array_equal(tail, want)
