"""``SignedHistogramCalibrator``: a streaming histogram of ``x`` itself (both signs), per tensor, in one pass.

The histogram of an asymmetric quantizer's input (:mod:`calibrators.two_sided`). Bin ``f`` counts the values
with ``trunc(x / w) == f``, ``w = 2**e / num_bins``, for ``f`` in ``(-num_bins, num_bins)``: the range is
``(-2**e, 2**e)``, ``e`` the smallest exponent with every ``|x|`` seen so far ``< 2**e``. Stored at ``f +
num_bins`` (index 0 stays empty). Truncation makes each sign's bins those of :class:`HistogramCalibrator`'s
``|x|``: ``hist[:, num_bins + k]`` and ``hist[:, num_bins - k]`` hold ``x`` and ``-x`` in ``[k w, (k + 1) w)``
for ``k >= 1``; bin ``f = 0`` holds ``(-w, w)``, the zero bin of both sides (where a value of either sign is
counted as a zero of the other side anyway, :meth:`SignedHistogramCalibrator.sides`).

Exactly order-invariant for the reason :mod:`calibrators.histogram_calibrator` gives for ``|x|``: when the
range doubles ``k`` times, bin ``f`` goes to ``trunc(f / 2**k)``, and ``trunc(trunc(y) / 2**k) == trunc(y /
2**k)``, so the histogram is the one that would have been built over the final range from the start. One
pass per batch (scale, truncate, count) where a histogram of each sign would take two, over tensors of the
batch's size.

One exponent serves both signs, so the shorter side has fewer bins than a histogram of its own would give it:
still as many per unit as a symmetric quantizer's histogram of ``|x|`` has, that is four or more per
quantization step of the full range.
"""

from __future__ import annotations

import math

import torch

from calibrators import shared
from calibrators.base import Calibrator
from calibrators.histogram_calibrator import count_bins, index_dtype
from quantcli import defaults


class SignedHistogramCalibrator(Calibrator):
    """Collects ``hist`` of shape ``(1, 2 * num_bins)`` (see the module); :meth:`sides` gives the histograms
    of ``max(x, 0)`` and ``max(-x, 0)`` that :mod:`calibrators.two_sided` searches."""

    def __init__(self, num_bits: int = 8, num_bins: int = defaults.NUM_BINS, name: str | None = None):
        super().__init__(num_bits, None, False, name)
        if not isinstance(num_bins, int) or num_bins < 2 or num_bins & (num_bins - 1):
            raise ValueError(f"num_bins must be a power of two >= 2, got {num_bins!r}")
        self.num_bins = num_bins
        self._hist: torch.Tensor | None = None  # (1, 2 * num_bins) int64
        self._exp_int: int | None = None  # the range is (-2**exp, 2**exp): a Python int on the CPU path,
        self._exp: torch.Tensor | None = None  # else a (1,) int64 tensor on the histogram's device
        self._buf_f: torch.Tensor | None = None
        self._buf_i: torch.Tensor | None = None
        self._views: tuple | None = None  # (n, float32 view, index view) of the buffers
        self._spiky = False  # the last CPU batch had one dominant bin

    @property
    def counts_width(self) -> int:
        """Entries of :attr:`hist` per channel."""
        return 2 * self.num_bins

    def collect(self, x: torch.Tensor, extent=None) -> None:
        """Add one batch (any float dtype, any device). ``extent``: ``max |x|`` over every batch so far, this
        one included, where the caller holds it already (a Python float on the CPU, a 0-d tensor on a
        device; the caller then also refused a non-finite batch); else it is read from ``x``."""
        self._kept_shape = ()  # per tensor
        flat = x.detach().reshape(-1)
        if not (flat.device.type == "cpu" and (self._hist is None or self._exp_int is not None)):
            self._collect_device(flat, extent)
            return
        if extent is None:
            lo, hi = torch.aminmax(flat)
            extent = max(-float(lo), float(hi))
            if not math.isfinite(extent):
                self._note_finite(torch.tensor(extent))
        exp = math.frexp(extent)[1]  # extent < 2**exp
        if self._exp_int is not None:
            exp = max(exp, self._exp_int)
        key = ("signed_histogram", self.num_bins)
        hit = shared.lookup(x, key)  # q/k/v quantizers of one input: counted once
        if hit is not None and hit[1] <= exp:  # counts no coarser than this calibrator's own range
            self._add(*hit, exp)
            return
        counts = self._count(flat, exp)
        self._add(counts, exp, exp)
        shared.store(x, key, (counts, exp))

    def _count(self, flat: torch.Tensor, exp: int) -> torch.Tensor:
        """``(1, 2 * num_bins)`` counts of one CPU batch over ``(-2**exp, 2**exp)``: scale, truncate,
        count."""
        a, idx = self._scratch(flat.numel())
        nb = self.num_bins
        if flat.dtype == torch.float32:
            torch.mul(flat, math.ldexp(float(nb), -exp), out=a)  # x / w, exact: w is a power of two
        else:
            a.copy_(flat)  # any float dtype in, float32 out
            a.mul_(math.ldexp(float(nb), -exp))
        idx.copy_(a)  # truncation, to integers in (-nb, nb)
        idx.add_(nb)
        counts, self._spiky = count_bins(idx, 2 * nb, self._spiky)
        return counts.view(1, -1)

    def _add(self, counts: torch.Tensor, counts_exp: int, exp: int) -> None:
        """Add ``counts`` made over ``(-2**counts_exp, 2**counts_exp)`` with the state brought to ``exp``,
        both re-binned up to it."""
        if self._hist is None:
            self._hist = torch.zeros_like(counts)
        elif exp > self._exp_int:
            self._hist = signed_merged(self._hist, torch.tensor([exp - self._exp_int]), self.num_bins)
        if counts_exp < exp:
            counts = signed_merged(counts, torch.tensor([exp - counts_exp]), self.num_bins)
        self._hist += counts
        self._exp_int = exp
        self._batches += 1

    def _collect_device(self, flat: torch.Tensor, extent) -> None:
        """The same on a device, with no host read: the exponent stays a tensor, the merge always runs."""
        if extent is None:
            lo, hi = torch.aminmax(flat)
            extent = torch.maximum(-lo, hi).float()
            self._note_finite(extent)
        extent = torch.as_tensor(extent, dtype=torch.float32, device=flat.device).reshape(1)
        exp = torch.frexp(extent)[1].to(torch.long)
        nb = self.num_bins
        if self._hist is None:
            self._hist = torch.zeros(1, self.counts_width, dtype=torch.long, device=flat.device)
            self._exp = torch.where(torch.isfinite(extent), exp, torch.zeros_like(exp))
        else:
            if self._exp is None:  # the CPU path's state, carried over to this device
                self._exp = torch.tensor([self._exp_int], device=flat.device)
                self._hist = self._hist.to(flat.device)
            new = torch.maximum(self._exp, torch.where(torch.isfinite(extent), exp, self._exp))
            self._hist = signed_merged(self._hist, new - self._exp, nb)
            self._exp = new
        self._exp_int = None  # the tensor path owns the exponent now
        scale = torch.ldexp(torch.full((1,), float(nb), device=flat.device), -self._exp.to(torch.int32))
        a = (flat.float() * scale).trunc_().add_(nb)
        idx = a.nan_to_num_(0.0).clamp_(0, 2 * nb - 1).to(torch.long)  # only a refused batch falls outside
        ones = torch.ones((), dtype=torch.long, device=flat.device).expand(idx.numel())
        self._hist.view(-1).index_add_(0, idx, ones)
        self._batches += 1

    def _scratch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reusable CPU float32 / bin-index buffers of ``n`` elements (the views of the last size kept: a
        quantizer sees one size batch after batch)."""
        if self._views is not None and self._views[0] == n:
            return self._views[1], self._views[2]
        f, i = self._buf_f, self._buf_i
        if f is None or f.numel() < n:
            f = torch.empty(n, dtype=torch.float32)
            i = torch.empty(n, dtype=index_dtype(self.counts_width))
            self._buf_f, self._buf_i = f, i
        self._views = (n, f[:n], i[:n])
        return self._views[1], self._views[2]

    @property
    def hist(self) -> torch.Tensor:
        """``(1, 2 * num_bins)`` counts (a copy)."""
        self._check_ready()
        return self._hist.clone()

    def sides(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(histogram of max(x, 0), histogram of max(-x, 0), their edges)``: ``num_bins`` counts each over
        the edges ``[0, 2**e]`` (float64, ``num_bins + 1``), each the histogram ``HistogramCalibrator`` would
        make of it over that range, on the CPU (where the range searches run). A value of the other sign is a
        zero of each: counted in its bin 0."""
        h = self.hist[0].cpu()
        nb = self.num_bins
        pos, neg = h[nb:].clone(), h[1 : nb + 1].flip(0)
        pos[0] += h[:nb].sum()
        neg[0] += h[nb + 1 :].sum()
        top = torch.ldexp(torch.ones((), dtype=torch.float64), self.range_exponent().cpu()[0].to(torch.int32))
        return pos, neg, top * torch.arange(nb + 1, dtype=torch.float64) / nb

    def range_exponent(self) -> torch.Tensor | None:
        """``(1,)`` int64 ``e``: the histogram covers ``(-2**e, 2**e)``; ``None`` before data."""
        if self._hist is None:
            return None
        return torch.tensor([self._exp_int]) if self._exp_int is not None else self._exp.clone()

    def counts_over(self, exp: torch.Tensor) -> torch.Tensor:
        """``(1, 2 * num_bins)`` int64: the counts re-binned onto ``(-2**exp, 2**exp)``, no narrower than
        :meth:`range_exponent`, exactly as ``collect`` re-bins when the range grows."""
        if self._hist is None:
            raise ValueError(f"{self.label}: no data collected")
        own = self.range_exponent()
        shift = exp.to(device=own.device, dtype=torch.long).reshape(-1) - own
        if bool((shift < 0).any()):
            raise ValueError(f"{self.label}: counts_over needs a range at least as wide as the histogram's")
        return signed_merged(self._hist, shift, self.num_bins)

    def load_merged(
        self, hist: torch.Tensor, exp: torch.Tensor, num_batches: int, amax_shape: tuple[int, ...] = ()
    ) -> None:
        """Take ``hist`` over ``(-2**exp, 2**exp)``, merged over every rank's ``num_batches`` batches, as the
        state."""
        self._hist = hist.to(torch.long).reshape(1, -1).clone()
        exp = exp.to(device=hist.device, dtype=torch.long).reshape(1).clone()
        cpu = hist.device.type == "cpu"
        self._exp, self._exp_int = (None, int(exp[0])) if cpu else (exp, None)
        self._merged_from_ranks(num_batches, ())

    def compute_amax(self, *_, **__) -> torch.Tensor:
        raise TypeError(
            f"{self.label}: a signed histogram gives a range (calibrators.two_sided), not an amax"
        )

    def reset(self) -> None:
        super().reset()
        self._hist = self._exp = self._exp_int = None
        self._buf_f = self._buf_i = self._views = None
        self._spiky = False

    def __repr__(self) -> str:
        return f"SignedHistogramCalibrator(num_bits={self.num_bits}, num_bins={self.num_bins})"


def signed_merged(hist: torch.Tensor, shift: torch.Tensor, nb: int) -> torch.Tensor:
    """``hist`` (channels, 2 nb), bin ``f + nb`` holding ``trunc(x / w) == f``, re-binned onto a range
    ``2**shift[c]`` times wider: bin ``f`` goes to ``trunc(f / 2**shift[c])``."""
    shift = shift.reshape(-1).clamp(min=0, max=62).to(hist.device).unsqueeze(1)
    f = torch.arange(-nb, nb, device=hist.device).unsqueeze(0)
    dst = torch.bitwise_right_shift(f.abs(), shift).mul_(f.sign()).add_(nb)
    out = torch.zeros_like(hist)
    out.scatter_add_(1, dst.expand_as(hist), hist)
    return out
