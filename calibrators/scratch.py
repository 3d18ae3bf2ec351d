"""Buffers the calibrators of one process reuse batch after batch, and the views of them made once.

Per batch and quantizer, a calibrator's work should cost the torch operations that compute something and no
others: an allocation is a torch operation (and page faults on the CPU), a view made per batch is one, and
reading a CPU value with ``float(t)`` or ``t.item()`` is one (``t.numpy()`` of a fresh tensor four). So:

- :func:`scratch`: whole-activation temporaries (``|x|``, scaled values, bin indices) live in one growing
  buffer per role, device and dtype, shared by every calibrator (their work runs one after another, in stream
  order on a GPU, so a buffer is free again when the next calibrator's work starts), and each shape's view of
  it is made on first use and kept.
- :class:`HostMinMax`: on the CPU a batch's min and max are reduced into a buffer allocated once and read
  through a numpy view made once: the values are in host memory, reading them needs no torch operation.
"""

from __future__ import annotations

import numpy as np
import torch

#: device types whose values a calibrator reads on the host as it makes them (free there); on others they stay
#: on the device until folded (:mod:`calibrators.counting`). Tests empty it to run the device path on the CPU.
HOST_READ = {"cpu"}

_MAX_VIEWS = 256  # shapes kept per buffer before the cache is emptied (variable-length batches)
#: values per piece of a ``"chunks"`` view: float32 counts are exact below 2**24
CHUNK = 1 << 24


class _Pool:
    """One growing buffer and its views by shape."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.views: dict[tuple, torch.Tensor] = {}


_pools: dict[tuple, _Pool] = {}
_generation = [0]  # bumped whenever a buffer is replaced: views kept elsewhere are then stale


def generation() -> int:
    """Changes whenever a scratch buffer is replaced (grown, released): a caller that keeps views of scratch
    tensors (to skip even the lookup) makes them again when this changes."""
    return _generation[0]


def scratch(
    role: str, device: torch.device, dtype: torch.dtype, shape: tuple[int, ...], kind=None
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """A contiguous ``shape`` tensor on ``device`` backed by the process's buffer for ``role``: the same
    object for the same arguments (until the buffer grows), so no operation is spent on it after the first
    call. ``kind``: an integer dtype of ``dtype``'s width for the same memory as bit patterns, ``"rows"`` for
    the tensor unbound along its first dimension, ``"chunks"`` for a 1-D one in pieces of ``chunk_size()``
    values. The contents are whatever the last user left; two roles never share memory."""
    shape = tuple(shape)
    pool = _pools.get((role, device, dtype))
    if pool is None:
        pool = _pools[(role, device, dtype)] = _Pool()
    found = pool.views.get((shape, kind))
    if found is not None:
        return found
    if kind is not None:
        base = scratch(role, device, dtype, shape)
        with torch.inference_mode(False):
            if kind == "rows":
                found = base.unbind(0)
            elif kind == "chunks":
                found = base.split(CHUNK)
            else:
                found = base.view(kind)
        pool.views[(shape, kind)] = found
        return found
    n = 1
    for d in shape:
        n *= d
    if pool.buf is None or pool.buf.numel() < n:
        with torch.inference_mode(False):  # written in and out of inference mode alike
            pool.buf = torch.empty(max(n, 1), dtype=dtype, device=device)
        pool.views.clear()
        _generation[0] += 1
    if len(pool.views) >= _MAX_VIEWS:
        pool.views.clear()
    with torch.inference_mode(False):  # a view made in inference mode could not be written outside it
        found = pool.views[(shape, None)] = pool.buf[:n].view(shape)
    return found


def reads_on_host(x: torch.Tensor) -> bool:
    """Whether a calibrator reads what it computes from ``x`` on the host (a CPU tensor with values)."""
    return x.device.type in HOST_READ and x.numel() > 0


def release() -> None:
    """Free every scratch buffer (after calibration: the largest activation's temporaries otherwise stay
    allocated, on a GPU in the caching allocator)."""
    _pools.clear()
    _generation[0] += 1


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (the upper half of a float32's)."""
    return (bits.astype(np.uint16).astype(np.uint32) << 16).view(np.float32)


class HostMinMax:
    """``(min(x), max(x))`` of a CPU tensor as Python floats, for one ``torch.aminmax`` into a buffer made
    once per dtype (the reduction's output dtype is the input's) and no further torch operation."""

    def __init__(self) -> None:
        self._bufs: dict[torch.dtype, tuple] = {}

    def __call__(self, x: torch.Tensor) -> tuple[float, float]:
        entry = self._bufs.get(x.dtype)
        if entry is None:
            entry = self._bufs[x.dtype] = self._make(x.dtype)
        lo, hi, read = entry
        torch.aminmax(x, out=(lo, hi))
        return read()

    @staticmethod
    def _make(dtype: torch.dtype) -> tuple:
        with torch.inference_mode(False):  # written in and out of inference mode alike
            buf = torch.empty(2, dtype=dtype)
            lo, hi = buf.unbind(0)
        if dtype == torch.bfloat16:  # numpy has no bfloat16: read the bits
            with torch.inference_mode(False):
                bits = buf.view(torch.int16).numpy()

            def read() -> tuple[float, float]:
                v = _bf16_values(bits)
                return float(v[0]), float(v[1])

        else:
            arr = buf.numpy()

            def read() -> tuple[float, float]:
                return float(arr[0]), float(arr[1])

        return lo, hi, read


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device`` without synchronising with it: through pinned memory on a GPU (a
    copy from pageable memory would wait for the device)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def persistent():
    """The context state that outlives a batch is allocated in: not inference mode, since such a buffer is
    written both inside ``torch.inference_mode()`` (calibration) and outside it (weights, a second
    calibration), and an inference tensor cannot be updated in place outside inference mode."""
    return torch.inference_mode(False)
