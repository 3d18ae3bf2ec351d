"""Counting the torch operations ``calibrate()`` dispatches per quantizer per batch (a ``TorchDispatchMode``):
the hardware-independent measure of what observing costs beside the forward pass. Used by the tests and by
``benchmarks.bench_gpu_calibration``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts every operation dispatched while active (views and in-place updates included: each is a call
    through the dispatcher, and on a GPU most are a kernel launch)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@dataclass
class CalibrationOps:
    """What :func:`calibration_ops` measured."""

    per_quantizer_batch: float  # operations per observing quantizer per batch, beyond the plain forward
    quantizers: int  # observing (activation) quantizers
    batches: int  # batches averaged over (every one but the first)
    calibrate_ops: int  # operations dispatched over those batches while calibrating
    plain_ops: int  # operations of the plain forward pass over the same batches


def calibration_ops(model, batches: list, method: str, device: str = "cpu") -> CalibrationOps:
    """Calibrate ``model`` (quantized, on ``device``) on ``batches`` and count the operations dispatched from
    the end of the first batch to the end of the last (the first allocates state; the searches after the last
    are not per batch), less those of a plain forward pass of the same batches with every quantizer disabled,
    per observing quantizer per batch. Batches kept on a device are folded every
    :data:`calibrators.counting.FOLD_EVERY` batches: pass more than that many for the fold's share."""
    from quantcli.calibration.calibrate import calibrate
    from quantcli.inputs.data import run_model
    from quantcli.nn import quantizers
    from quantcli.nn.modes import quantizer_modes

    counter = OpCounter()
    marks: list[int] = []
    with counter:
        summary = calibrate(
            model, batches, method, device=device, progress=lambda i: marks.append(counter.count)
        )
    observing = [n for n in summary.calibrated if not n.endswith("weight_quantizer")]
    calibrating = marks[-1] - marks[0]
    plain = OpCounter()
    with quantizer_modes(list(quantizers(model).values()), "disabled"), torch.inference_mode():
        run_model(model, batches[0])  # as calibrate's first batch: not counted
        with plain:
            for b in batches[1:]:
                run_model(model, b)
    n = len(batches) - 1
    return CalibrationOps(
        (calibrating - plain.count) / (len(observing) * n), len(observing), n, calibrating, plain.count
    )


def searches_not_counted(monkeypatch, counter) -> None:
    """While ``calibrate()``'s histogram searches run, ``counter.paused`` is True: their operations and reads
    are per chunk of histogram rows, not per quantizer, and a test of what calibrating costs per quantizer
    leaves them out."""
    from quantcli.calibration import calibrate as calibrate_module

    search_all = calibrate_module._search_all

    def paused(*args, **kwargs):
        counter.paused = True
        try:
            return search_all(*args, **kwargs)
        finally:
            counter.paused = False

    monkeypatch.setattr(calibrate_module, "_search_all", paused)
