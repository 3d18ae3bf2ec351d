"""GPTQ (quantcli.calibration.gptq) against an independent reference: a plain numpy loop over the columns of a
64x64 layer, no lazy blocks, float64 -- the algorithm as the paper's equations state it."""

import numpy as np
import pytest
import torch

from quantcli.calibration.gptq import HessianAccumulator, gptq_weights


def _reference(
    w: np.ndarray, x: np.ndarray, scale: np.ndarray, qmin: int, qmax: int, damp: float
) -> np.ndarray:
    """Each column as it was when rounded: q_j = clip(round(w_j / s_j)) s_j, then the later columns move by
    -(w_j - q_j) / U_jj * U_j,j+1: with U the upper Cholesky factor of (H + damp mean(diag H) I)^-1, H = 2 X.T
    X."""
    h = 2.0 * x.T.astype(np.float64) @ x.astype(np.float64)
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    h += damp * np.mean(np.diag(h)) * np.eye(len(h))
    u = np.linalg.cholesky(np.linalg.inv(h)).T  # upper: inv(h) = u.T @ u
    w = w.astype(np.float64).copy()
    w[:, dead] = 0
    before = np.zeros(w.shape, np.float32)
    for j in range(w.shape[1]):
        col = w[:, j].astype(np.float32)
        before[:, j] = col
        q = np.clip(np.round(col / scale[:, j]), qmin, qmax) * scale[:, j]
        e = (w[:, j] - q.astype(np.float64)) / u[j, j]
        w[:, j:] -= np.outer(e, u[j, j:])
    return before


def _layer(rng, n=512, k=64, out=64):
    # correlated inputs with a few loud channels: where GPTQ's compensation differs most from rounding
    mix = rng.standard_normal((k, k)).astype(np.float32) / np.sqrt(k)
    x = (rng.standard_normal((n, k)).astype(np.float32) @ mix) * np.where(np.arange(k) % 16 == 0, 8.0, 1.0)
    x[:, 5] = 0.0  # a dead input channel
    w = rng.standard_normal((out, k)).astype(np.float32) * 0.1
    return x.astype(np.float32), w


@pytest.mark.parametrize("block", [16, 64])
def test_gptq_equals_a_plain_loop_over_columns(rng, block):
    x, w = _layer(rng)
    amax = np.abs(w.reshape(64, -1, block)).max(-1).astype(np.float32)  # blocked along the input dimension
    scale = np.repeat(amax / np.float32(7), block, axis=1)
    acc = HessianAccumulator(64)
    for chunk in np.array_split(x, 5):  # streaming: five batches of different sizes
        acc.add(torch.from_numpy(chunk))
    assert acc.rows == 512
    got = gptq_weights(
        torch.from_numpy(w), acc.hessian, torch.from_numpy(amax), 4, damp=0.01, lazy=24, dtype=torch.float64
    ).numpy()
    want = _reference(w, x, scale, -8, 7, 0.01)
    assert np.allclose(got, want, rtol=1e-9, atol=1e-12)
    codes_got, codes_want = np.clip(np.round(got / scale), -8, 7), np.clip(np.round(want / scale), -8, 7)
    assert np.array_equal(codes_got, codes_want)
    assert np.all(got[:, 5] == 0)  # the dead channel's weights are zeroed, as the reference does


def _output_error(w, q, x):
    return float(np.sum((x.astype(np.float64) @ (w - q).T.astype(np.float64)) ** 2))


def test_gptq_lowers_the_layer_output_error_against_rounding(rng):
    x, w = _layer(rng)
    amax = np.abs(w.reshape(64, -1, 32)).max(-1).astype(np.float32)
    scale = np.repeat(amax / np.float32(7), 32, axis=1)
    acc = HessianAccumulator(64)
    acc.add(torch.from_numpy(x))
    before = gptq_weights(torch.from_numpy(w), acc.hessian, torch.from_numpy(amax), 4).numpy()  # float32 path
    q_gptq = np.clip(np.round(before / scale), -8, 7) * scale
    q_rtn = np.clip(np.round(w / scale), -8, 7) * scale
    assert _output_error(w, q_gptq, x) < 0.6 * _output_error(w, q_rtn, x)
    # float32 working precision: the same codes as the float64 reference on all but a handful of ties
    want = _reference(w, x, scale, -8, 7, 0.01)
    assert np.mean(np.round(before / scale) == np.round(want / scale)) > 0.99


def test_the_quantizer_maps_gptq_weights_to_gptq_codes(rng):
    """The fake-quant of what gptq_weights returns is the codes it chose (the exported graph stores those)."""
    from quantcli.quant.arithmetic import fake_quant_symmetric
    from quantcli.quant.granularity import expand_amax

    x, w = _layer(rng)
    amax = torch.from_numpy(np.abs(w.reshape(64, -1, 32)).max(-1).astype(np.float32))
    acc = HessianAccumulator(64)
    acc.add(torch.from_numpy(x))
    before = gptq_weights(torch.from_numpy(w), acc.hessian, amax, 4)
    fq = fake_quant_symmetric(before, expand_amax(amax, (64, 64)), 4)
    scale = np.repeat(amax.numpy() / np.float32(7), 32, axis=1)
    assert np.array_equal(
        fq.numpy(), (np.clip(np.round(before.numpy() / scale), -8, 7) * scale).astype(np.float32)
    )
