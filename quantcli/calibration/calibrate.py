"""``calibrate(model, batches, method=...)``: fill every enabled quantizer's amax.

Weights are calibrated from the weights themselves (max, per channel or per block, unless the weight
descriptor asks for a histogram). Activations: one pass of the data through the float model in
``torch.inference_mode()`` with the input quantizers observing and every other quantizer disabled (no fake
quantization during the pass), then each calibrator's amax search. Calibrators collect on the model's device.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from calibrators.base import refuse_nonfinite
from calibrators.batched import search_histograms, search_ranges
from calibrators.distributed import merge_calibrators, world_size
from calibrators.folding import fold_together
from calibrators.methods import CALIBRATION_METHODS, HISTOGRAM_METHODS
from calibrators.scratch import release as release_scratch
from calibrators.shared import shared_observations, shared_searches
from calibrators.two_sided import METHODS as TWO_SIDED_METHODS
from quantcli import defaults
from quantcli.calibration import auto_method, cuda_graph
from quantcli.calibration.int32_bias import WidenedWeights, fit_int32_biases
from quantcli.calibration.process_group import one_outcome, sum_over_ranks
from quantcli.errors import CalibrationError, QuantCliError
from quantcli.inputs.data import Batch, checked_batches, num_samples, run_model, to_device
from quantcli.nn.amax_checks import amax_span, checked_together
from quantcli.nn.dynamic import count_calls
from quantcli.nn.modes import keep_float, quantizer_modes
from quantcli.nn.tensor_quantizer import owner, quantizer_name, quantizers, role

METHODS = CALIBRATION_METHODS  # kept importable under its old name


@dataclass
class CalibrationSummary:
    method: str
    device: str
    num_batches: int
    num_samples: int
    calibrated: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # disabled or dynamic
    # quantized at run time (int8-dynamic): nothing to calibrate
    dynamic: list[str] = field(default_factory=list)
    # on no forward path: disabled, with their layer's weights
    not_called: list[str] = field(default_factory=list)
    amax_min: float | None = None
    amax_max: float | None = None
    seconds: float = 0.0
    settings: dict = field(default_factory=dict)
    ranks: int = 1  # torch.distributed ranks whose batches were merged
    auto: dict = field(default_factory=dict)  # --method auto: quantizer -> chosen method, amax, local errors
    # asymmetric activation quantizers calibrated from their min and max (method max or entropy)
    min_max: list[str] = field(default_factory=list)
    # activation quantizers whose every amax is 0: they saw only zeros, so their inputs quantize to 0
    zero_amax: list[str] = field(default_factory=list)
    # batches observed by replaying a CUDA graph of the observing pass (quantcli.calibration.cuda_graph)
    graph_replays: int = 0
    # layers whose weight range was widened so their int32 bias fits (quantcli.calibration.int32_bias)
    widened: list[WidenedWeights] = field(default_factory=list)
    # the calibrated quantizers whose amax the method chose (activations; weights of a histogram descriptor):
    # none, and the method, its percentile and bins changed nothing
    by_method: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "device": self.device,
            "num_batches": self.num_batches,
            "num_samples": self.num_samples,
            "quantizers_calibrated": len(self.calibrated),
            "quantizers_skipped": len(self.skipped),
            "calibrated": self.calibrated,
            "skipped": self.skipped,
            "not_called": self.not_called,
            "dynamic": self.dynamic,
            "amax_min": self.amax_min,
            "amax_max": self.amax_max,
            "seconds": round(self.seconds, 4),
            "settings": self.settings,
            "ranks": self.ranks,
            **({"auto": self.auto} if self.auto else {}),
            "min_max": self.min_max,
            "zero_amax": self.zero_amax,
            "graph_replays": self.graph_replays,
            "widened_for_int32_bias": [w.to_dict() for w in self.widened],
            "calibrated_by_method": len(self.by_method),
        }

    def method_unused(self) -> bool:
        """Whether the requested method (not ``max``), its percentile and bins chose no amax: the config
        calibrates no activation (weight-only, dynamic)."""
        return self.method != defaults.METHOD and not self.by_method

    def method_ignored_by(self) -> list[str]:
        """The asymmetric activation quantizers the requested method did not apply to (entropy, which searches
        a symmetric threshold: they took their min and max)."""
        return self.min_max if self.method != "max" else []


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cuda`` without a GPU is an error."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise QuantCliError(
                f"--device {device} was asked for, but no CUDA GPU is available; use --device cpu or auto"
            )
        dev = torch.device(device)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise QuantCliError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) present")
        return dev
    raise QuantCliError(f"unknown --device {device!r}; use auto, cpu or cuda[:i]")


def calibrate(
    model: nn.Module,
    batches: Sequence[Batch],
    method: str = "max",
    *,
    percentile: float = defaults.PERCENTILE,
    num_bins: int = defaults.NUM_BINS,
    device: str | torch.device = "auto",
    progress: Callable[[int], None] | None = None,
    group=None,
    dtype: str | torch.dtype | None = None,
    cuda_graph: bool = False,
) -> CalibrationSummary:
    """Calibrate every enabled, static quantizer of a quantized ``model`` in place.

    Under ``torch.distributed`` (the default process group is initialised, or ``group`` is given) call it on
    every rank with that rank's own batches (a rank may have none): each calibrator's statistics are merged
    across the ranks before amax is computed (:mod:`calibrators.distributed`), so every rank gets the amax one
    process would get over all the ranks' batches, bit for bit (with a power-of-two ``num_bins``). An error on
    one rank raises on every rank (:mod:`quantcli.calibration.process_group`); the summary counts every rank's
    batches. Every rank of the group must call it (to calibrate on one rank alone, pass a group of that rank
    only).

    Args:
        batches: keyword batches for ``model(**batch)`` (this rank's share under ``torch.distributed``).
        method: activation amax method: ``max``, ``entropy``, ``mse``, ``percentile``, or ``auto`` (per
            quantizer the candidate of those four with the smallest error of its layer's output against the
            float layer's, on a bounded sample of the calibration inputs: :mod:`calibrators.auto`).
        percentile: for ``percentile``, in percent.
        num_bins: histogram bins (a power of two keeps histograms exactly order-invariant).
        device: ``auto``, ``cpu``, ``cuda[:i]`` or a ``torch.device``.
        progress: called with the batch index after each batch.
        group: the ``torch.distributed`` process group to merge over (default: the default group, if any).
        dtype: the floating dtype the model computes in while its activations are observed: ``bfloat16`` or
            ``float16`` (half precision, as LLMs run on a GPU), ``float32``, or ``None``/``"model"`` for the
            model's own. The floating inputs are cast to it too. Statistics are float32 either way, and the
            weights (calibrated before, from the model's own), their amax and every tensor of the model are
            exactly as they were afterwards: only the activation amax reflect the half-precision run.
        cuda_graph: on a GPU, where every observing quantizer's calibrator is per tensor (a max or min/max, an
            ``|x|`` or two-sided histogram: any method but ``auto``, per-tensor activations) and the batches
            have one shape, observe the batches after the first by replaying a CUDA graph of the pass
            (:mod:`quantcli.calibration.cuda_graph`; the same amax). Off by default: its logic is tested on
            the CPU, but it has not yet run on a GPU (issue 38).
    """
    ranks = world_size(group)
    t0 = time.perf_counter()
    if method == "auto" and ranks > 1:
        raise CalibrationError(
            "--method auto chooses from each rank's own input sample; run it in one process"
        )
    with one_outcome(group):
        compute = compute_dtype(dtype)
        qs, dev, acts = _prepare(model, batches, method, percentile, num_bins, device, alone=ranks == 1)
    auto = auto_method.start(model, acts, len(batches)) if method == "auto" else None
    # quantizers that observe nothing, whose calls are counted: a layer that never runs is left out as for
    # the observing ones
    counted = {n: q for n, q in qs.items() if q.enabled and q.dynamic_uint8} | _weight_only(qs)
    try:
        # activations are calibrated on the float model (as TensorRT does): every other quantizer stands
        # aside, so the pass costs a forward plus the observers and nothing else
        with quantizer_modes([q for q in qs.values() if q.mode == "quantize"], "disabled"):
            with running_in(model, compute):
                # --method auto's hooks run per batch in Python: a replay would not run them
                wanted = cuda_graph and auto is None
                graphed = _graphed_pass(model, batches, acts, counted, dev, wanted, alone=ranks == 1)
                total_batches, total_samples, calls = _observe_activations(
                    model, batches, dev, counted, progress, group, compute, graphed
                )
            summary = CalibrationSummary(
                method,
                str(dev),
                total_batches,
                total_samples,
                settings={"percentile": percentile, "num_bins": num_bins},
                ranks=ranks,
                graph_replays=graphed.replays if graphed is not None else 0,
            )
            _activation_amax(qs, acts, calls, method, {"percentile": percentile}, summary, auto, group)
    except CalibrationError as e:
        if "non-finite" in str(e) and _in_float16(model, compute):
            raise CalibrationError(
                f"{e}; the model computes in float16 here, whose largest value is 65504: an activation "
                "beyond it overflows to inf (calibrate with --dtype float32 or bfloat16)"
            ) from None
        raise
    finally:
        _stop_observers(acts, auto)
        release_scratch()  # the largest activation's temporaries
    _summarise(qs, summary, lambda: fit_int32_biases(model))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    summary.seconds = time.perf_counter() - t0
    return summary


def _in_float16(model: nn.Module, compute: torch.dtype | None) -> bool:
    """Whether the observing pass ran in float16 (``--dtype float16``, or a float16 model's own dtype)."""
    if compute is not None:
        return compute == torch.float16
    return any(p.dtype == torch.float16 for p in model.parameters())


#: calibrate's ``dtype`` choices (``--dtype``): ``model`` keeps the model's own
COMPUTE_DTYPES = {
    "model": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def compute_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``dtype`` as a floating torch dtype, or ``None`` for the model's own."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype in COMPUTE_DTYPES:
        return COMPUTE_DTYPES[dtype]
    raise CalibrationError(f"unknown dtype {dtype!r}; choose one of {', '.join(COMPUTE_DTYPES)}")


@contextlib.contextmanager
def running_in(model: nn.Module, dtype: torch.dtype | None):
    """Within the block the model's floating parameters and buffers are ``dtype`` (the quantizers' own amax
    and amin stay float32); afterwards each is its original tensor again, exactly (not a cast back)."""
    if dtype is None:
        yield
        return
    own = {id(t) for q in quantizers(model).values() for t in (*q.parameters(False), *q.buffers(False))}
    swapped = []
    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            if t.is_floating_point() and t.dtype != dtype and id(t) not in own:
                swapped.append((t, t.data))
                t.data = t.data.to(dtype)
    try:
        yield
    finally:
        for t, data in swapped:
            t.data = data


def _weight_only(qs: dict) -> dict:
    """The enabled weight quantizers of layers whose input no enabled quantizer observes (weight-only layers,
    int4 MatMulNBits), by name."""
    out = {}
    for name, q in qs.items():
        if role(name) == "weight_quantizer" and q.enabled:
            qi = qs.get(quantizer_name(owner(name), "input_quantizer"))
            if qi is None or not qi.enabled:
                out[name] = q
    return out


def _graphed_pass(
    model: nn.Module, batches, acts: dict, counted: dict, dev: torch.device, wanted: bool, alone: bool
):
    """The CUDA graph the batches after the first are observed by, where it is ``wanted`` and the calibration
    qualifies (:func:`quantcli.calibration.cuda_graph.plan`; ``alone``: in one process); else ``None``."""
    if not wanted or not cuda_graph.plan(batches, acts, counted, dev, alone):
        return None
    return cuda_graph.GraphedPass(
        acts, lambda b: run_model(model, b, where="the captured calibration pass"), len(batches)
    )


def _observe_activations(
    model: nn.Module,
    batches: Sequence[Batch],
    dev: torch.device,
    counted: dict,
    progress: Callable[[int], None] | None,
    group,
    compute: torch.dtype | None = None,
    graphed: cuda_graph.GraphedPass | None = None,
) -> tuple[int, int, dict[str, int]]:
    """The observing pass over this rank's batches (floating inputs cast to ``compute`` where given), the
    batches after the first replayed as ``graphed`` where given and it can be captured. Returns (batches,
    samples, calls of each ``counted`` quantizer), summed over every rank."""
    seen = [0, 0]  # batches, samples
    with one_outcome(group), torch.inference_mode(), count_calls(counted) as calls:
        for i, batch in enumerate(batches):
            if any(v.device != dev for v in batch.values()):  # (a no-op move is an operation per input)
                batch = to_device(batch, dev)
            if compute is not None:
                batch = {k: v.to(compute) if v.is_floating_point() else v for k, v in batch.items()}
            if graphed is not None and i == 1 and not _captured(graphed, batch):
                graphed = None  # observed batch by batch
            if graphed is not None and i > 0:
                graphed.replay(batch)
            else:
                with shared_observations():  # q/k/v-style quantizers of one tensor observe it once
                    run_model(model, batch, where=f"calibration batch {i}")
            seen[0] += 1
            seen[1] += num_samples([batch])
            if progress is not None:
                progress(i)
    if graphed is not None:
        graphed.finish()
    total_batches, total_samples, *dynamic_calls = sum_over_ranks(seen + list(calls.values()), group)
    if total_batches == 0:
        raise CalibrationError("no calibration batches on any rank")
    return total_batches, total_samples, dict(zip(calls, dynamic_calls))


def _captured(graphed: cuda_graph.GraphedPass, batch: Batch) -> bool:
    """Capture the observing pass on ``batch``'s inputs; False where it cannot be (an operation that reads
    back to the host, a quantizer called twice): nothing was observed then."""
    try:
        graphed.capture(batch)
    except (RuntimeError, QuantCliError, cuda_graph.CaptureRefused):
        return False
    return True


def _activation_amax(
    qs: dict,
    acts: dict,
    calls: dict[str, int],
    method: str,
    kwargs: dict,
    summary: CalibrationSummary,
    auto: auto_method.AutoRun | None,
    group,
) -> None:
    """Every activation amax from the statistics merged over the ranks; quantizers whose layer never ran (a
    dynamic one never called, or an observer that saw nothing) are left out and reported."""
    cals = [q.calibrator for q in acts.values() if q.calibrator is not None]
    merge_calibrators(cals, group)
    # equal histograms (q/k/v of one input) search amax once; every calibrator's non-finite batches and every
    # amax are checked all at once (on a GPU, no synchronisation per quantizer)
    with one_outcome(group), shared_searches(), checked_together():
        fold_together(part for c in cals for part in c.parts())  # a few operations for all, not a dozen each
        refuse_nonfinite(cals)
        _load_activation_amax(qs, acts, method, kwargs, summary, auto)
    for name, n_calls in calls.items():
        if n_calls == 0:
            _leave_out(qs, name, summary)
        elif qs[name].dynamic_uint8:
            summary.dynamic.append(name)


def _stop_observers(acts: dict, auto: auto_method.AutoRun | None) -> None:
    """Remove ``--method auto``'s hooks and the calibrators of quantizers still observing (after an error):
    every activation quantizer quantizes again."""
    if auto is not None:
        auto.stop()
    for q in acts.values():
        if q.mode == "calibrate":
            q.calibrator = None
            q.set_mode("quantize")


def _widest(q) -> torch.Tensor:
    """The largest magnitude a quantizer's range reaches: its amax's, or its amin's where it has one."""
    top = q.amax.abs().max()
    return top if q.amin is None else torch.maximum(top, q.amin.abs().max())


#: an activation range below this is taken as zero (the quantizer saw only zeros): float32 rounding noise or
#: denormals (a random-init model's 2.5e-39), whose scale, and its product with a weight's scale (an int32
#: bias's), would be subnormal or 0, and the bias codes infinite
NEGLIGIBLE_AMAX = 2.0**-64


def _summarise(qs: dict, summary: CalibrationSummary, fit_biases: Callable[[], list]) -> None:
    """Which quantizers were calibrated (and the range of their amax, read in one go) and which skipped;
    activation ranges below :data:`NEGLIGIBLE_AMAX` flushed to zero (``zero_amax``), then ``fit_biases()``
    (the int32 biases' weight widening, which needs every input scale final)."""

    def amaxes() -> list[torch.Tensor]:
        return [qs[n].amax for n in summary.calibrated]

    for name, q in qs.items():
        if name in summary.not_called:
            continue
        if q.enabled and not q.desc.dynamic and q.amax is not None:
            summary.calibrated.append(name)
            if not name.endswith("weight_quantizer") or q.desc.calib_method == "histogram":
                summary.by_method.append(name)
        else:
            summary.skipped.append(name)
    calibrated = amaxes()
    if any(a.numel() for a in calibrated):
        summary.amax_min, summary.amax_max = amax_span(calibrated)
    if summary.amax_min is not None and summary.amax_min < NEGLIGIBLE_AMAX:
        # some amax is (about) 0 somewhere: which activation quantizers saw only zeros
        acts = [
            (n, q)
            for n, q in qs.items()
            if n in summary.calibrated and not n.endswith("weight_quantizer") and q.amax.numel()
        ]
        if acts:  # one read for all (on a GPU, one synchronisation); an asymmetric range's amin counts too
            dev = acts[0][1].amax.device
            tops = torch.stack([_widest(q).to(dev) for _, q in acts]).tolist()
            summary.zero_amax = [n for (n, _), top in zip(acts, tops) if top < NEGLIGIBLE_AMAX]
            for (_, q), top in zip(acts, tops):
                if 0 < top < NEGLIGIBLE_AMAX:
                    q.set_amax(torch.zeros_like(q.amax))
                    if q.amin is not None:
                        q.amin = torch.zeros_like(q.amin)
                    summary.amax_min = 0.0
    summary.widened = fit_biases()
    if summary.widened:  # weight ranges grew
        summary.amax_min, summary.amax_max = amax_span(amaxes())


def _check_two_sided_bins(qs: dict, method: str, num_bins: int) -> None:
    """The search of an asymmetric range (:mod:`calibrators.two_sided`) halves its histogram's range exactly:
    ``num_bins`` a power of two. Refused before any batch runs, naming the quantizer and what to pass."""
    if num_bins & (num_bins - 1) == 0 or (method not in TWO_SIDED_METHODS and method != "auto"):
        return
    asym = [n for n, q in qs.items() if q.enabled and q.desc.asymmetric and not q.desc.dynamic]
    if asym:
        low = 1 << (num_bins.bit_length() - 1)
        raise CalibrationError(
            f"--num-bins {num_bins}: the {method} search of an asymmetric range ({asym[0]}, uint8 with a "
            f"zero point: the onnxruntime target's grid for signed activations) needs a power of two; pass "
            f"{low} or {low * 2}, or set asymmetric_activations: false in a config file"
        )


def _prepare(model: nn.Module, batches, method: str, percentile: float, num_bins: int, device, alone: bool):
    """Check the arguments, move the model, calibrate the weights and start the activation calibrators.
    Returns ``(quantizers, device, activation quantizers)``."""
    if method not in METHODS:
        raise CalibrationError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if not 0 < percentile <= 100:
        raise CalibrationError(f"--percentile must be in (0, 100], got {percentile}")
    if not isinstance(num_bins, int) or num_bins < 16:
        raise CalibrationError(f"--num-bins must be an int >= 16, got {num_bins}")
    batches = checked_batches(batches, "calibrate's batches")
    if alone and not batches:  # under torch.distributed a rank may have none (checked over all ranks)
        raise CalibrationError("no calibration batches")
    qs = quantizers(model)
    if not qs:
        raise CalibrationError("the model has no quantizers; run quantize_model(model, config) first")
    _check_two_sided_bins(qs, method, num_bins)
    dev = resolve_device(device)
    # one walk over the modules' own dictionaries (parameters() and buffers() each walk them again with names,
    # and eval() sets every module's flag through Module.__setattr__): a few milliseconds of a GPU host's time
    # on a model of a few hundred modules
    modules = list(model.modules())
    if any(m.training for m in modules):
        model.eval()
    tensors = (t for m in modules for d in (m._parameters, m._buffers) for t in d.values() if t is not None)
    if any(t.device != dev for t in tensors):
        model.to(dev)  # (moving walks every module even when nothing moves)
    _calibrate_weights(model, qs, method, num_bins, {"percentile": percentile})
    return qs, dev, _start_observers(model, qs, method, num_bins)


def _weight_method(q, method: str) -> str:
    """A weight quantizer's amax method: max, or the descriptor's histogram method (``mse`` under ``--method
    auto``)."""
    return (method if method != "auto" else "mse") if q.desc.calib_method == "histogram" else "max"


def _weight_from_forward(model: nn.Module, name: str) -> bool:
    """Whether weight quantizer ``name`` is calibrated on what its layer's operation takes as the forward runs
    (a layer the model computes functionally, :mod:`quantcli.nn.computed`: the operand may be computed from
    the parameter, as weight standardisation does) rather than on the layer's ``weight``."""
    parent = model.get_submodule(owner(name))
    return bool(getattr(parent, "weight_from_forward", False))


def _calibrate_weights(model: nn.Module, qs: dict, method: str, num_bins: int, kwargs: dict) -> None:
    """Every enabled weight quantizer's amax from the weights themselves (the same on every rank: nothing to
    merge): max, or the descriptor's histogram method (``mse`` under ``--method auto``). Weights a computed
    layer's operation takes are observed in the forward instead (:func:`_start_observers`).

    A symmetric max (the usual case) is one reduction per weight (``TensorQuantizer.calibrate_max``), and
    every amax is checked at the end in one read (:mod:`quantcli.nn.amax_checks`): on a GPU, no
    synchronisation per weight."""
    with checked_together("the weight holds NaN or inf: check the checkpoint"):
        for name, q in qs.items():
            if not name.endswith("weight_quantizer") or not q.enabled or q.desc.dynamic:
                continue
            if _weight_from_forward(model, name):
                continue
            parent = model.get_submodule(owner(name))
            wmethod = _weight_method(q, method)
            if wmethod == "max" and not q.desc.asymmetric:
                q.calibrate_max(parent.weight)
                continue
            q.start_calibration(wmethod, num_bins)
            q.collect(parent.weight.detach())
            q.load_calib_amax(wmethod, **kwargs)


def _start_observers(model: nn.Module, qs: dict, method: str, num_bins: int) -> dict:
    """Switch every enabled, static activation quantizer, and every weight quantizer that observes its
    operation's operand (:func:`_weight_from_forward`), to observing; returns them by name, weights first (an
    activation's ``--method auto`` choice runs its layer with the weight quantized)."""
    weights = {
        n: q
        for n, q in qs.items()
        if n.endswith("weight_quantizer")
        and q.enabled
        and not q.desc.dynamic
        and _weight_from_forward(model, n)
    }
    acts = {
        n: q for n, q in qs.items() if not n.endswith("weight_quantizer") and q.enabled and not q.desc.dynamic
    }
    for q in weights.values():
        q.start_calibration(_weight_method(q, method), num_bins)
    for q in acts.values():
        q.start_calibration("mse" if method == "auto" else method, num_bins)  # auto: a histogram
    return {**weights, **acts}


def _search_together(acts: dict, method: str, kwargs: dict) -> None:
    """Every activation quantizer's histogram search at once, per kind of search (:mod:`calibrators.batched`):
    each quantizer's ``load_calib_amax`` below then takes its kept result. ``--method auto`` compares every
    histogram method."""
    methods = HISTOGRAM_METHODS if method == "auto" else (method,) if method in HISTOGRAM_METHODS else ()
    _search_all([q.calibrator for q in acts.values() if q.calibrator is not None], methods, kwargs)


def _search_all(cals: list, methods, kwargs: dict) -> None:
    """:mod:`calibrators.batched` over ``cals`` for each of ``methods``, with the keyword arguments
    ``load_calib_amax`` passes each method (``percentile`` to the percentile search only)."""
    for m in methods:
        kw = {"percentile": kwargs["percentile"]} if m == "percentile" and "percentile" in kwargs else {}
        search_histograms(cals, m, kw)
        search_ranges(cals, m, kw)


def _load_activation_amax(
    qs: dict,
    acts: dict,
    method: str,
    kwargs: dict,
    summary: CalibrationSummary,
    auto: auto_method.AutoRun | None = None,
) -> None:
    """Each observing quantizer's amax from its calibrator; layers that never ran are disabled and
    reported."""
    _search_together(acts, method, kwargs)
    activations = {}
    for name, q in acts.items():
        if q.calibrator is not None and q.calibrator.num_batches == 0:
            # the layer never ran (an unused head, a branch the data did not take): nothing to calibrate,
            # and nothing of it reaches an exported graph
            _leave_out(qs, name, summary)
            q.calibrator = None
            continue
        if name.endswith("weight_quantizer"):  # a computed layer's operand, observed in the forward
            q.load_calib_amax(_weight_method(q, method), **kwargs)
            continue
        if q.desc.asymmetric and method in ("max", "entropy"):
            summary.min_max.append(name)
        activations[name] = q
    if auto is not None:
        summary.auto.update(auto.choose_all(activations, kwargs))
        return
    for q in activations.values():
        q.load_calib_amax(auto_method.FALLBACK if method == "auto" else method, **kwargs)


def _leave_out(qs: dict, name: str, summary: CalibrationSummary) -> None:
    """Disable an activation quantizer whose layer never ran, and its layer's weight quantizer; report
    both."""
    for qn in dict.fromkeys((name, quantizer_name(owner(name), "weight_quantizer"))):
        if qn in qs:
            keep_float(qs[qn])
            summary.not_called.append(qn)


def recompute_amax(model: nn.Module, method: str, *, percentile: float = defaults.PERCENTILE) -> list[str]:
    """Recompute every activation amax with another histogram method from the histograms the last
    ``calibrate(..., method in {entropy, mse, percentile})`` collected: no second pass over the data.
    Returns the quantizers updated."""
    if method not in HISTOGRAM_METHODS:
        raise CalibrationError(
            f"recompute needs a histogram method (entropy, mse, percentile), got {method!r}"
        )
    done = []
    kept = [q.histogram for q in quantizers(model).values() if q.histogram is not None and q.enabled]
    _search_all(kept, (method,), {"percentile": percentile})
    with shared_searches():
        for name, q in quantizers(model).items():
            if q.histogram is not None and q.enabled:
                q.recompute_amax(method, percentile=percentile)
                done.append(name)
    if not done:
        raise CalibrationError("no histograms kept: calibrate with entropy, mse or percentile first")
    return done
