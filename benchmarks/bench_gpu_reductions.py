"""Reading a batch's activations for their extremes on a GPU, five ways (issue 38).

Observing a batch under ``max`` is, on the device, one reduction per activation quantizer. On the lent H200
that reduction (``torch.aminmax``) took 17-23% of the ResNet-50-shaped model's forward pass at batch 64, at
about a third of the memory's bandwidth, above the 15% the issue's 1.15x leaves whatever the host does (a
CUDA graph of the pass took 11.4 ms a batch with the reductions against 9.1 without). This measures the
alternatives on the very tensors the model's activation quantizers observe in one batch (captured by hooks on
the quantizers):

- ``aminmax``: ``torch.aminmax`` of each (what a device max or min/max calibrator runs now);
- ``norm``: ``torch.linalg.vector_norm(x, inf)`` of each: ``max |x|``, all a symmetric max calibrator keeps;
- ``foreach_norm``: ``torch._foreach_norm`` of them all at once (multi-tensor kernels: the batch's reductions
  launched together, at the end of its forward pass);
- ``two_stage``: ``amax`` over rows of 2**16 values, then over those (more blocks for a mid-sized tensor);
- ``amin_amax``: an ``amin`` and an ``amax`` of each (two passes, one accumulator each).

Per model: the plain forward pass per batch, each way's time per batch and its share of the forward pass,
whether its values equal ``aminmax``'s (as ``max(-min, max)``, the symmetric amax), and whether a NaN placed
in one tensor makes that tensor's result NaN (a calibrator must refuse such a batch, naming it).

    python -m benchmarks.bench_gpu_reductions [--device cuda|cpu] [--quick] [--models resnet,bert,decoder]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import machine, median_time, setup_threads, table

WAYS = ("aminmax", "norm", "foreach_norm", "two_stage", "amin_amax")
ROWS = 1 << 16


def symmetric_amax(way: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``max |x|`` of each tensor (float32, 0-d), computed the way named."""
    inf = float("inf")
    if way == "aminmax":
        return [torch.maximum(-lo, hi).float() for lo, hi in (torch.aminmax(t) for t in tensors)]
    if way == "norm":
        return [torch.linalg.vector_norm(t, inf).float() for t in tensors]
    if way == "foreach_norm":
        return [v.float() for v in torch._foreach_norm(tensors, inf)]
    if way == "two_stage":
        out = []
        for t in tensors:
            flat = t.reshape(-1)
            cut = flat.numel() // ROWS * ROWS
            parts = [flat[:cut].view(-1, ROWS).abs().amax(1)] if cut else []
            if cut < flat.numel():
                parts.append(flat[cut:].abs().amax().reshape(1))
            out.append(torch.cat(parts).amax().float())
        return out
    if way == "amin_amax":
        return [torch.maximum(-t.amin(), t.amax()).float() for t in tensors]
    raise ValueError(way)


def _observed(model, batch) -> list[torch.Tensor]:
    """The tensors the model's enabled activation quantizers take in one forward pass of ``batch``."""
    from quantcli.nn import quantizers
    from quantcli.nn.modes import quantizer_modes

    qs = quantizers(model)
    seen: list[torch.Tensor] = []
    hooks = [
        q.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        for n, q in qs.items()
        if q.enabled and not n.endswith("weight_quantizer")
    ]
    try:
        with quantizer_modes(list(qs.values()), "disabled"), torch.inference_mode():
            model(**batch)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _timed(fn, device: torch.device, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs after two untimed ones, the device synchronised."""
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    return median_time(fn, repeat=reps, warmup=2, sync=sync) * 1e3


def measure(name: str, device: torch.device, quick: bool, reps: int) -> list[dict]:
    from benchmarks.bench_gpu_calibration import _built, workloads
    from quantcli.nn import quantizers
    from quantcli.nn.modes import quantizer_modes

    w = next(v for k, v in workloads().items() if k.startswith(name))
    model = _built(w, device, quick)
    batch = w.batches(device, quick)[0]
    tensors = _observed(model, batch)
    qs = list(quantizers(model).values())

    def plain():
        with quantizer_modes(qs, "disabled"), torch.inference_mode():
            model(**batch)

    forward = _timed(plain, device, reps)
    values = sum(t.numel() for t in tensors)
    reference = torch.stack(symmetric_amax("aminmax", tensors))
    poisoned = [t.clone() for t in tensors[:2]]
    poisoned[1].view(-1)[poisoned[1].numel() // 2] = float("nan")
    rows = []
    for way in WAYS:
        try:
            ms = _timed(lambda way=way: symmetric_amax(way, tensors), device, reps)
            same = torch.equal(torch.stack(symmetric_amax(way, tensors)), reference)
            nan = symmetric_amax(way, poisoned)
            kept = bool(torch.isnan(nan[1])) and not bool(torch.isnan(nan[0]))
        except Exception as e:  # noqa: BLE001 - a way this torch or device lacks is reported, not fatal
            rows.append({"model": w.name, "way": way, "ms / batch": f"failed: {type(e).__name__}: {e}"[:80]})
            continue
        rows.append(
            {
                "model": f"{w.name}: {len(tensors)} tensors, {values / 1e6:.0f} M values",
                "way": way,
                "forward ms": f"{forward:.2f}",
                "ms / batch": f"{ms:.3f}",
                "share of forward": f"{100 * ms / forward:.1f}%",
                "GB/s": f"{sum(t.numel() * t.element_size() for t in tensors) / ms / 1e6:.0f}",
                "equal to aminmax": "yes" if same else "NO",
                "NaN kept": "yes" if kept else "NO",
            }
        )
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="the models and batches shrunk (a CPU run)")
    p.add_argument("--models", default="resnet,bert,decoder")
    p.add_argument("--reps", type=int, default=None, help="timed runs per way (default 20, --quick 3)")
    a = p.parse_args(argv)
    setup_threads(1)
    device = torch.device(a.device)
    reps = a.reps or (3 if a.quick else 20)
    print(f"reductions of one batch's observed activations on {device}; {machine()}")
    if a.quick:
        print("(--quick: every model shrunk; the names are the full workloads')")
    if device.type == "cuda":
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    rows = []
    for m in a.models.split(","):
        rows += measure(m, device, a.quick, reps)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the model and its captured activations are gone
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
