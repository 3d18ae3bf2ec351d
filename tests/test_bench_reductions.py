"""benchmarks.bench_gpu_reductions' ways of reducing a batch's activations give max |x| exactly (what the GPU
comparison checks them by), and keep a NaN."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_gpu_reductions import ROWS, WAYS, symmetric_amax


@pytest.mark.parametrize("way", WAYS)
def test_every_way_gives_max_abs_of_each_tensor(way):
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 5, generator=g),
        torch.randn(2 * ROWS + 17, generator=g) * 4,  # rows of ROWS and a remainder
        -torch.rand(ROWS, generator=g) - 1,  # every value negative: the max |x| is -min
        torch.randn(7, 9, generator=g).to(torch.bfloat16),
    ]
    got = symmetric_amax(way, tensors)
    for t, v in zip(tensors, got):
        assert v.dtype == torch.float32 and v.shape == ()
        assert v.item() == t.float().abs().max().item()
    poisoned = [tensors[0].clone(), tensors[1].clone()]
    poisoned[1][ROWS + 3] = float("nan")
    nan = symmetric_amax(way, poisoned)
    assert not torch.isnan(nan[0]) and torch.isnan(nan[1])
