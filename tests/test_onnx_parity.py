"""Integer codes equal onnxruntime's QuantizeLinear on the same float32 scale (DESIGN.md 'Numerics')."""

import numpy as np
import pytest
import torch
from onnx import TensorProto

from quantcli import arithmetic as ar
from quantcli import tensor_quant
from quantcli.tensor_quant import affine_qparams
from tests.ort_util import ort_quantize_linear

N = 100_000


def _values(rng, scale):
    x = rng.standard_normal(N).astype(np.float32) * 60 * float(np.max(scale))
    # exact ties: (k + 0.5) * scale for a range of k, plus values beyond the range
    k = np.arange(-140, 140, dtype=np.float32)
    ties = ((k + 0.5) * np.float32(np.max(scale))).astype(np.float32)
    return np.concatenate([x, ties, np.float32([1e6, -1e6, 0.0, -0.0])])


def test_int8_per_tensor(rng):
    amax = torch.tensor(3.7)
    x = _values(rng, 3.7 / 127)
    codes, _ = tensor_quant(torch.from_numpy(x), amax, 8, False, False)
    scale = ar.symmetric_scale(amax, 127).numpy()
    ort = ort_quantize_linear(x, scale, np.int8(0), TensorProto.INT8)
    assert np.array_equal(codes.numpy(), ort)


def test_int8_per_axis(rng):
    amax = torch.tensor([0.5, 2.0, 7.3, 1e-3]).reshape(4, 1)
    x = rng.standard_normal((4, N // 4)).astype(np.float32) * 3
    codes, _ = tensor_quant(torch.from_numpy(x), amax, 8, False, False)
    scale = ar.symmetric_scale(amax, 127).reshape(-1).numpy()
    ort = ort_quantize_linear(x, scale, np.zeros(4, np.int8), TensorProto.INT8, axis=0)
    assert np.array_equal(codes.numpy(), ort)


def test_uint8_with_zero_point(rng):
    scale, zp = affine_qparams(-1.3, 4.1, 8)
    x = rng.uniform(-2, 5, N).astype(np.float32)
    ties = ((np.arange(-60, 200, dtype=np.float32) + 0.5) * scale.numpy()).astype(np.float32)
    x = np.concatenate([x, ties])
    codes = ar.quantize_linear(torch.from_numpy(x), scale, zp, 0, 255)
    ort = ort_quantize_linear(x, scale.numpy(), np.uint8(zp.item()), TensorProto.UINT8)
    assert np.array_equal(codes.numpy(), ort)


def test_int4_blocked_opset21(rng):
    w = rng.standard_normal((32, 4096)).astype(np.float32)  # 131072 values
    w[:, :8] = (np.arange(8, dtype=np.float32) + 0.5) * 0.25  # ties in one block
    amax = torch.from_numpy(np.abs(w).reshape(32, 128, 32).max(-1))
    amax[:, 0] = 7 * 0.25
    codes, _ = tensor_quant(torch.from_numpy(w), amax, 4, False, False)
    scale = ar.symmetric_scale(amax, 7).numpy()
    ort = ort_quantize_linear(w, scale, np.zeros(scale.shape, np.int8), TensorProto.INT4, axis=1,
                              block_size=32, opset=21)
    assert np.array_equal(codes.numpy(), ort)


def test_fp8_e4m3_opset19(rng):
    amax = torch.tensor(10.0)
    x = np.concatenate([rng.standard_normal(N).astype(np.float32) * 5, np.float32([1e4, -1e4, 0.0, 10.0])])
    scale = ar.symmetric_scale(amax, ar.FP8_E4M3_MAX)
    ours = ar.quantize_e4m3(torch.from_numpy(x), scale).to(torch.float32).numpy()
    ort = ort_quantize_linear(x, scale.numpy(), np.zeros((), np.float32), TensorProto.FLOAT8E4M3FN, opset=19)
    assert np.array_equal(ours, ort)


@pytest.mark.parametrize("num_bits", [2, 6, 8])
def test_narrow_grids_match_after_clip(num_bits, rng):
    # grids narrower than the ONNX type are clipped in float before QuantizeLinear: same codes
    amax = torch.tensor(1.0)
    x = torch.from_numpy(rng.standard_normal(N).astype(np.float32) * 2)
    codes, _ = tensor_quant(x, amax, num_bits, False, True)
    bound = 2 ** (num_bits - 1) - 1
    s = ar.symmetric_scale(amax, bound)
    lo, hi = (torch.tensor(float(-bound)) * s), (torch.tensor(float(bound)) * s)
    clipped = torch.minimum(torch.maximum(x, lo), hi).numpy()
    ort = ort_quantize_linear(clipped, s.numpy(), np.int8(0), TensorProto.INT8)
    assert np.array_equal(codes.numpy(), ort)
