"""How fast onnxruntime's integer kernels are against float ones, per CPU kind: a measured table, and the
ratio it predicts for a layer.

``kernel_costs.json`` (beside this module) holds, per CPU kind (:mod:`quantcli.quant.cpu`), rows measured by
``python -m benchmarks.bench_kernel_costs --write`` on a named machine: the time of a chain of four identical
quantized layers that onnxruntime fuses into integer kernels (``QLinearConv``, ``QLinearMatMul``; their Q/DQ
included) over the same chain in float, for convolutions, depthwise convolutions and matrix products of a
range of shapes; and single stems (a convolution of the graph input's few channels, its input Q included).
A layer's predicted ratio is that of the nearest row of its kind, in log2 of the row's features
(:func:`predict`): a table, not a stopwatch, so the same model gets the same decisions on every call and on
every machine, and a graph made for another CPU is decided by that CPU's row set.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

TABLE = Path(__file__).with_name("kernel_costs.json")

CONV, DEPTHWISE, GEMM, STEM = "conv", "depthwise", "gemm", "stem"
#: a convolution that reads at most this many input channels (groups 1) is a :data:`STEM`: an image's RGB or
#: a spectrogram's one channel. Its reduction is a few dozen products, which the integer kernels pad and
#: reorder for (NCHW to NHWC) while the float one runs it directly: on an AVX-512 VNNI CPU a 3 -> 32 3x3 stem
#: ran 1.3-2.6x slower quantized and a 1 -> 32 one 2.8x, where the nearest chain row (a 1x1 conv of 32
#: channels) predicted 0.78x. Its own rows keep them apart; a table without stem rows predicts from its conv
#: rows (:func:`nearest`).
STEM_CHANNELS = 4


@dataclass(frozen=True)
class LayerShape:
    """What decides a quantized layer's kernel speed.

    ``op``: :data:`CONV` (any convolution but a depthwise one or a stem), :data:`DEPTHWISE`, :data:`STEM`
    (:data:`STEM_CHANNELS`), or :data:`GEMM` (Linear, MatMul). ``reduction``: products summed per output
    (``cin/groups * prod(kernel)``; the input features of a GEMM). ``outputs``: output channels (GEMM: output
    features). ``positions``: output positions per sample (spatial positions; a GEMM's rows per sample, e.g.
    tokens)."""

    op: str
    reduction: int
    outputs: int
    positions: int

    def features(self) -> tuple[float, float, float]:
        return (
            math.log2(max(1, self.reduction)),
            math.log2(max(1, self.outputs)),
            math.log2(max(1, self.positions)),
        )

    def describe(self) -> str:
        what = {CONV: "conv", DEPTHWISE: "depthwise conv", STEM: "stem conv", GEMM: "matmul"}[self.op]
        return f"{what} {self.reduction}x{self.outputs} at {self.positions} positions"


@dataclass(frozen=True)
class Row:
    """One measured chain: its layer shape and int8 time over float time."""

    shape: LayerShape
    ratio: float


@dataclass(frozen=True)
class Prediction:
    ratio: float
    row: Row  # the nearest measured row
    shape: LayerShape | None = None  # the layer's own, where it is not the row's

    def describe(self) -> str:
        own = self.shape.describe() if self.shape is not None else None
        measured = self.row.shape.describe()
        if own is None or own == measured:
            return f"{self.ratio:.2f}x float as measured for {measured}"
        return f"{self.ratio:.2f}x float (this {own}; the nearest measured: {measured})"


@functools.lru_cache(maxsize=1)
def _load() -> dict:
    return json.loads(TABLE.read_text())


def table(kind: str) -> dict | None:
    """The table of a CPU kind (``rows``, ``measured_on``, ``command``, ``onnxruntime``), None if not
    measured."""
    return _load().get(kind)


def rows(kind: str) -> list[Row]:
    t = table(kind)
    if t is None:
        return []
    return [
        Row(LayerShape(r["op"], r["reduction"], r["outputs"], r["positions"]), r["int8_ms"] / r["float_ms"])
        for r in t["rows"]
    ]


def nearest(shape: LayerShape, measured: list[Row]) -> Row | None:
    """The row of ``shape.op`` nearest ``shape`` in log2 of its features (ties: the first row); a stem, in a
    table without stem rows, the nearest conv row."""
    same = [r for r in measured if r.shape.op == shape.op]
    if not same and shape.op == STEM:
        same = [r for r in measured if r.shape.op == CONV]
    if not same:
        return None
    f = shape.features()
    return min(same, key=lambda r: sum((a - b) ** 2 for a, b in zip(f, r.shape.features())))


def predict(kind: str, shape: LayerShape) -> Prediction | None:
    """The int8/float time ratio a CPU of ``kind`` runs ``shape`` at, from its table; for ``any``, the most
    favourable ratio among the kinds measured (a layer is slower for a fleet only where it is slower on every
    kind); None where no table has a row of its op."""
    kinds = [k for k in _load() if k != "any"] if kind == "any" else [kind]
    found = [(r, k) for k in kinds if (r := nearest(shape, rows(k))) is not None]
    if not found:
        return None
    row = min(found, key=lambda rk: rk[0].ratio)[0]
    return Prediction(row.ratio, row, shape)
