"""A DLRM-style recommender: dense features through a bottom MLP, categorical features through one
``nn.EmbeddingBag`` (sum) per table, concatenated into a top MLP. The sparse inputs are laid out as DLRM's
reference code lays them out: ``indices`` ``(tables, bags_total)`` and ``offsets`` ``(tables, batch)`` — the
batch is on axis 1 of ``offsets``, and ``indices`` has no batch axis at all. So the data comes in batch files
of ``BATCH`` samples (a directory), which cannot be re-batched. Random init."""

import numpy as np
import torch
from torch import nn

DENSE, TABLES, ROWS, DIM, BAG, BATCH = 13, 3, 100, 16, 3, 32


class DLRM(nn.Module):
    def __init__(self):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(DENSE, 32), nn.ReLU(), nn.Linear(32, DIM), nn.ReLU())
        self.tables = nn.ModuleList(nn.EmbeddingBag(ROWS, DIM, mode="sum") for _ in range(TABLES))
        self.top = nn.Sequential(nn.Linear(DIM * (TABLES + 1), 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, dense, indices, offsets):
        x = self.bottom(dense)
        bags = [t(indices[k], offsets[k]) for k, t in enumerate(self.tables)]
        return self.top(torch.cat([x, *bags], dim=1))


def samples(n: int, seed: int) -> dict[str, np.ndarray]:
    """One batch of ``n`` samples: ``n * BAG`` indices per table, cut into ``n`` non-empty bags at random
    points (the same cuts in every table, as the ``(tables, bags_total)`` layout needs)."""
    rng = np.random.default_rng(seed)
    total = n * BAG
    cuts = np.sort(rng.choice(np.arange(1, total), size=n - 1, replace=False))
    offsets = np.concatenate([[0], cuts]).astype(np.int64)
    return {
        "dense": rng.standard_normal((n, DENSE)).astype(np.float32),
        "indices": rng.integers(0, ROWS, size=(TABLES, total)).astype(np.int64),
        "offsets": np.tile(offsets, (TABLES, 1)),
    }


def make() -> nn.Module:
    torch.manual_seed(0)
    return DLRM().eval()
