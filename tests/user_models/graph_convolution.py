"""A graph convolutional network as pygcn (Kipf & Welling's reference code) writes it: each layer computes
``torch.mm(adj, torch.mm(x, self.weight)) + self.bias`` with its own ``weight``/``bias`` parameters, its
``forward`` taking the adjacency too; the node classifier is ``torch.addmm(self.bias, h, self.weight)``. No
``nn.Linear`` anywhere: what quantcli quantizes here it finds by the products the forward computes. One graph
per batch file (``BATCH`` nodes): ``x`` is ``(nodes, features)``, ``adj`` the symmetrically normalised
adjacency with self-loops ``(nodes, nodes)``, so the data cannot be re-batched. Random init."""

import math

import numpy as np
import torch
from torch import nn

FEATURES, HIDDEN, CLASSES, BATCH, EDGE_P = 24, 48, 7, 16, 0.2
#: the layers computed with products (no nn.Linear): the zoo counts them with the Linears and Convs
PRODUCT_LAYERS = ("gc1", "gc2", "classifier")
#: the export's ``--dynamic-dim``: the node count is the batch axis of ``x`` and both axes of ``adj``
EXPORT_DIMS = ("adj=1",)


class GraphConvolution(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features))
        stdv = 1.0 / math.sqrt(out_features)  # pygcn's reset_parameters
        self.weight.data.uniform_(-stdv, stdv)
        self.bias.data.uniform_(-stdv, stdv)

    def forward(self, x, adj):
        support = torch.mm(x, self.weight)
        return torch.mm(adj, support) + self.bias


class AddmmClassifier(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(in_features, out_features) / math.sqrt(in_features))
        self.bias = nn.Parameter(torch.randn(out_features) * 0.1)

    def forward(self, h):
        return torch.addmm(self.bias, h, self.weight)


class GCN(nn.Module):
    def __init__(self):
        super().__init__()
        self.gc1 = GraphConvolution(FEATURES, HIDDEN)
        self.gc2 = GraphConvolution(HIDDEN, HIDDEN)
        self.classifier = AddmmClassifier(HIDDEN, CLASSES)

    def forward(self, x, adj):
        h = torch.relu(self.gc1(x, adj))
        h = torch.relu(self.gc2(h, adj))
        return torch.log_softmax(self.classifier(h), dim=1)


def samples(n: int, seed: int) -> dict[str, np.ndarray]:
    """One graph of ``n`` nodes: features with a per-community offset, edges mostly within communities."""
    rng = np.random.default_rng(seed)
    community = rng.integers(0, 3, size=n)
    x = rng.standard_normal((n, FEATURES)) + 0.8 * np.eye(3, FEATURES)[community] * 3
    same = community[:, None] == community[None, :]
    a = rng.random((n, n)) < np.where(same, 2 * EDGE_P, EDGE_P / 4)
    a = np.triu(a, 1)
    a = (a | a.T).astype(np.float64) + np.eye(n)
    d = 1.0 / np.sqrt(a.sum(1))
    return {"x": x.astype(np.float32), "adj": (a * d[:, None] * d[None, :]).astype(np.float32)}


def make() -> nn.Module:
    torch.manual_seed(0)
    return GCN().eval()
