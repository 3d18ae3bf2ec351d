"""What ``calibrate()`` dispatches outside its batches, counted (issue 38): hardware-independent, so a CPU
shows what a GPU would launch and wait for.

On the device path (run on the CPU: nothing read per batch, batches folded, asymmetric mse ranges searched
together, the searches in chunks as large as on a GPU with memory to spare), for each model and method: the
torch operations and the host reads (``item``,
``float``, ``bool`` of a tensor: on a GPU, each a synchronisation) before the first batch (the weights' amax,
with the first batch's forward), per batch, and after the last batch (checks, searches, summary), per weight
and per activation quantizer. Reads made by stacking many values into one copy (``tolist``) are not
``item``\\s and not counted: they are one per call, not per quantizer.

    python -m benchmarks.count_calibration_work [--models resnet,bert] [--methods max,entropy,mse]
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import setup_threads, table

#: candidate-bin elements a histogram search takes at once on a GPU with memory to spare
#: (:func:`calibrators.histogram._chunk_elements`): every quantizer's search in one chunk, as there
GPU_CHUNK = 1 << 27


class _Phases(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.phase = "weights + batch 0"
        self.ops: Counter = Counter()
        self.reads: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[self.phase] += 1
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads[self.phase] += 1
        return func(*args, **(kwargs or {}))


def _workloads() -> dict:
    from benchmarks.sized_models import BertBaseLike, ResNet50Like

    g = torch.Generator().manual_seed(0)
    return {
        "resnet": (lambda: ResNet50Like(0.25), lambda: {"x": torch.randn(2, 3, 64, 64, generator=g)}),
        "bert": (
            lambda: BertBaseLike(0.25),
            lambda: {"input_ids": torch.randint(0, 1000, (2, 32), generator=g)},
        ),
    }


def count(name: str, method: str, batches: int = 3) -> dict:
    import calibrators.batched as batched
    import calibrators.histogram as histogram
    import calibrators.scratch as scratch
    from quantcli.calibration.calibrate import calibrate
    from quantcli.nn import quantize_model, quantizers

    build, batch = _workloads()[name]
    torch.manual_seed(0)
    model = quantize_model(build().eval())
    data = [batch() for _ in range(batches)]
    saved = scratch.HOST_READ, batched.mse_together, histogram._chunk_elements
    scratch.HOST_READ, batched.mse_together = set(), lambda device: True
    histogram._chunk_elements = lambda device: GPU_CHUNK
    phases = _Phases()

    def progress(i):
        phases.phase = "batches" if i < batches - 1 else "end"

    try:
        with phases:
            calibrate(model, data, method, device="cpu", progress=progress)
    finally:
        scratch.HOST_READ, batched.mse_together, histogram._chunk_elements = saved
    qs = quantizers(model)
    weights = sum(1 for n, q in qs.items() if n.endswith("weight_quantizer") and q.enabled)
    acts = sum(1 for n, q in qs.items() if not n.endswith("weight_quantizer") and q.enabled)
    first = "weights + batch 0"
    return {
        "model": f"{name} ({weights} weights, {acts} activations)",
        "method": method,
        "ops before batch 1": phases.ops[first],
        "reads before batch 1": phases.reads[first],
        "ops per batch": phases.ops["batches"] // max(1, batches - 1),
        "reads per batch": phases.reads["batches"] // max(1, batches - 1),
        "ops after": phases.ops["end"],
        "ops after / activation": f"{phases.ops['end'] / max(1, acts):.1f}",
        "reads after": phases.reads["end"],
    }


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet,bert")
    p.add_argument("--methods", default="max,entropy,mse,percentile")
    a = p.parse_args(argv)
    setup_threads(1)
    rows = [count(m, meth) for m in a.models.split(",") for meth in a.methods.split(",")]
    print("calibrate() on the device path (emulated on the CPU), 3 batches: operations and host reads")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
