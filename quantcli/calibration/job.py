"""The ``quantcli calibrate`` job as named steps: load the model and its data, smooth (SmoothQuant), calibrate
every amax, meet a quality target, summarise and save. Nothing is printed here; the CLI renders the
:class:`CalibrationOutcome`.

Under ``torchrun`` each rank runs every step on its own share of the data (``rank`` is its
:class:`quantcli.calibration.process_group.Rank`, ``None`` in one process): the statistics are merged inside
:func:`quantcli.calibration.calibrate.calibrate`, only rank 0 writes the checkpoint, and a failure on any rank
inside a :func:`~quantcli.calibration.process_group.one_outcome` block stops every rank there, so all ranks
end the same way.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from quantcli import defaults
from quantcli.calibration.calibrate import CalibrationSummary, resolve_device
from quantcli.calibration.calibrate import calibrate as calibrate_amax
from quantcli.calibration.mixed_precision import (
    MixedPrecisionResult,
    check_target,
    meet_target,
    split_holdout,
)
from quantcli.calibration.process_group import Rank, broadcast_from_rank0, one_outcome
from quantcli.errors import ConfigError, DataError, QuantCliError
from quantcli.files import refuse_overwriting_inputs
from quantcli.inputs import batch_axes
from quantcli.inputs.checkpoint import example_of, save_calibrated, state_snapshot
from quantcli.inputs.data import (
    Batch,
    DataOptions,
    cap_samples,
    describe_preprocessing,
    load_data,
    num_samples,
    refuse_without_data,
    run_model,
)
from quantcli.inputs.loading import load_model
from quantcli.inputs.model_spec import ModelSpec
from quantcli.inputs.precision import describe as describe_precision
from quantcli.inputs.precision import loaded_dtype
from quantcli.inputs.shard import load_shard, strided
from quantcli.nn import QuantConfig, load_config, quantize_model, quantizers
from quantcli.nn.recurrent import QuantLSTM
from quantcli.nn.recurrent import precision as lstm_precision
from quantcli.nn.tensor_quantizer import owner, role

if TYPE_CHECKING:
    from exporters.causal_lm.kv_cache import KVCacheQuant
    from quantcli.calibration.latency_placement import LatencyPlacement
    from quantcli.calibration.smoothquant import SmoothReport
    from quantcli.calibration.weight_rounding import WeightRoundingReport


@dataclass
class CalibrationRequest:
    """What ``quantcli calibrate`` was asked to do: its options, parsed (see ``quantcli calibrate
    --help``)."""

    model: str
    weights: Path | None = None
    data: Path | None = None
    config: str = defaults.CONFIG
    target: str | None = None
    method: str = defaults.METHOD
    percentile: float = defaults.PERCENTILE  # in percent, for method "percentile"
    num_bins: int = defaults.NUM_BINS
    batch_size: int | None = None
    num_samples: int | None = None
    device: str = defaults.DEVICE
    dtype: str = defaults.DTYPE  # what the observing pass computes in (quantcli.calibration.calibrate)
    cuda_graph: bool = False  # on a GPU, batches after the first replayed as a CUDA graph where they qualify
    out: Path | None = None
    trust_pickle: bool = False
    pooling: str = defaults.POOLING
    data_options: DataOptions = field(default_factory=DataOptions)
    fold_bn: bool | None = None
    smoothquant: float | None = None  # alpha
    smoothquant_min_gain: float | None = None  # None: smoothing_gain.MIN_GAIN
    min_cosine: float | None = None
    min_snr: float | None = None  # dB
    holdout: Path | None = None
    max_float_layers: int | None = None
    weight_method: str = defaults.WEIGHT_METHOD  # rtn, gptq or awq (quantcli.calibration.weight_rounding)
    # auto: layers onnxruntime would not run faster quantized stay float; all: every layer
    placement: str = defaults.PLACEMENT
    # the deployment CPU (quantcli.quant.cpu): None keeps the config's (default auto: this machine)
    cpu: str | None = None
    # a causal LM's decode-graph KV cache: float, or int8 with calibrated scales (calibration.kv_cache)
    kv_cache: str = defaults.KV_CACHE


def _nothing_to_quantize(model: str, float_layers: list[dict[str, str]]) -> str:
    """The refusal for a model with no layer to quantize: the first weighted module left float and why (a
    root module computing with several weights, a weight passed to torch.einsum), or that it has none."""
    if not float_layers:
        return (
            f"{model} has no layer to quantize: no convolution, linear or matmul takes a weight of it on the "
            "example batch"
        )
    first = float_layers[0]
    more = f" (and {len(float_layers) - 1} more)" if len(float_layers) > 1 else ""
    where = "the root module" if first["name"] == "" else first["name"]
    return f"{model} has no layer to quantize: {where} ({first['type']}) stays float{more}: {first['reason']}"


@dataclass
class CalibrationJob:
    """A quantized model and its data, ready to calibrate (the result of :meth:`load`)."""

    request: CalibrationRequest
    rank: Rank | None
    config: QuantConfig
    model: nn.Module  # quantized in place
    spec: ModelSpec
    batches: list[Batch]
    holdout: tuple[list[Batch], str] | None  # held-out batches for a quality target, and where they came from
    preprocessing: dict | None  # how text or images became tensors (None for tensor files)
    # the state dict of the model as loaded, before quantcli transformed it (verify's reference)
    original: dict
    weight_rounding: WeightRoundingReport | None = None  # --weight-method gptq/awq: what it did
    # --weight-method gptq: the state dict before GPTQ moved the weights it rounded
    unrounded: dict | None = None
    latency: LatencyPlacement | None = None  # --placement auto for onnxruntime: what place_for_latency chose
    kv_cache: KVCacheQuant | None = None  # --kv-cache int8: the cache's scales
    # the example batch quantize_model read the model's structure from (example_of: made once, a forward
    # tried on it where the batch size is also another axis's size); the checkpoint stores it
    example: Batch | None = None

    @classmethod
    def load(cls, request: CalibrationRequest, rank: Rank | None) -> CalibrationJob:
        """Check the request, load the config, the model and this rank's data, insert the quantizers."""
        with one_outcome():  # every rank loads; a failure on any rank stops all of them here
            _check_request(request, rank)
            cfg = _load_config(request)
            if rank is None:
                resolve_device(request.device)
            model, spec = load_model(
                request.model, request.weights, request.trust_pickle, pooling=request.pooling
            )
            if request.out is None:  # the default name: known once the model is
                refuse_overwriting_inputs(f"{spec.stem}.calib.pt", _inputs(request), "the default --out")
            if request.pooling != "none" and spec.kind != "hf":
                raise QuantCliError("--pooling applies to a Hugging Face model folder's base model")
            _check_kv_cache(request, model)
            batches, prep = _calibration_batches(request, rank, model, spec)
            original = state_snapshot(model)
            example = example_of(batches[0], model) if batches else None
            quantize_model(model, cfg, example=example)
            if not model.quantcli_report.layers:
                raise QuantCliError(_nothing_to_quantize(request.model, model.quantcli_report.float_layers))
            batches, holdout = _holdout(request, rank, spec, model, batches)
        return cls(request, rank, cfg, model, spec, batches, holdout, prep, original, example=example)

    @property
    def report(self):
        """What :func:`quantcli.nn.quantize_model` did (layers, placement, BatchNorm folds, unmatched
        patterns)."""
        return self.model.quantcli_report

    @property
    def out(self) -> Path:
        return self.request.out or Path(f"{self.spec.stem}.calib.pt")

    def smooth(self) -> SmoothReport | None:
        """SmoothQuant before calibration (the quantizers then calibrate the smoothed tensors); ``None`` when
        not asked for."""
        if self.request.smoothquant is None:
            return None
        from quantcli.calibration.float_check import check_unchanged, expected_changes, smoothed_modules
        from quantcli.calibration.smoothquant import smooth_quant

        r = self.request
        gain = {} if r.smoothquant_min_gain is None else {"min_gain": r.smoothquant_min_gain}
        smoothed = smooth_quant(self.model, self.batches, r.smoothquant, device=r.device, **gain)
        reference = self.report.float_reference
        if reference and self.batches:
            folds = getattr(self.model, "quantcli_folded_batchnorm", [])
            skip = expected_changes(folds, smoothed_modules(smoothed), reference)
            check_unchanged(
                self.model,
                self.example,
                reference,
                skip,
                "SmoothQuant",
                "calibrate without --smoothquant, and please report this",
            )
        return smoothed

    def calibrate(self, progress: Callable[[int], None] | None = None) -> CalibrationSummary:
        """Every amax, from this rank's batches merged over the ranks; leaves the model on the CPU."""
        r = self.request
        device = r.device if self.rank is None else self.rank.device
        if r.weight_method == "awq":  # rescales weights: before their amax is calibrated
            from quantcli.calibration.weight_rounding import awq

            self.weight_rounding = awq(self.model, self.batches, device=device)
        summary = calibrate_amax(
            self.model,
            self.batches,
            r.method,
            percentile=r.percentile,
            num_bins=r.num_bins,
            device=device,
            progress=progress,
            dtype=r.dtype,
            cuda_graph=r.cuda_graph,
        )
        if r.weight_method == "gptq":  # rounds within the calibrated grid, on the device calibration used
            from quantcli.calibration.weight_rounding import gptq

            self.unrounded = state_snapshot(self.model)
            self.weight_rounding = gptq(self.model, self.batches)
        self.model.to("cpu")
        return summary

    def place_for_latency(self, summary: CalibrationSummary) -> LatencyPlacement:
        """``--placement auto`` for onnxruntime: keep float the layers onnxruntime would not run faster
        quantized, measured on this machine (:mod:`quantcli.calibration.latency_placement`). Under torchrun
        rank 0 measures and every rank applies its decision, so that all ranks hold the same model."""
        from quantcli.calibration.latency_placement import LatencyPlacement, apply, measure_and_decide

        if self.request.placement == "all":
            self.latency = LatencyPlacement(
                "all", False, "--placement all: every layer quantized as configured"
            )
        elif self.config.target != "onnxruntime":
            self.latency = LatencyPlacement(
                "auto",
                False,
                f"not applicable to the {self.config.target} "
                f"target "
                "(measured for onnxruntime's CPU provider only)",
            )
        else:
            placement = None
            with one_outcome():
                if (self.rank is None or self.rank.rank == 0) and not self.batches:
                    placement = LatencyPlacement(
                        "auto", False, "not measured: no calibration batch on rank 0"
                    )
                elif self.rank is None or self.rank.rank == 0:
                    placement = measure_and_decide(self.model, self.example, self.config.deploy_cpu)
            if self.rank is not None:
                placement = broadcast_from_rank0(placement)
            apply(self.model, placement)
            self.latency = placement
        off = set(self.latency.quantizers_disabled)
        summary.calibrated = [n for n in summary.calibrated if n not in off]
        summary.by_method = [n for n in summary.by_method if n not in off]
        # kept float: not quantized at run time
        summary.dynamic = [n for n in summary.dynamic if n not in off]
        summary.skipped += [n for n in self.latency.quantizers_disabled if n not in summary.skipped]
        return self.latency

    def meet_target(self, summary: CalibrationSummary) -> MixedPrecisionResult | None:
        """Keep the fewest layers in float for --min-cosine/--min-snr (``None`` without a target)."""
        if self.holdout is None:
            return None
        r = self.request
        with tempfile.TemporaryDirectory(prefix="quantcli-target-") as work:
            mixed = meet_target(
                self.model,
                self.holdout[0],
                min_cosine=r.min_cosine,
                min_snr=r.min_snr,
                max_float_layers=r.max_float_layers,
                holdout_name=self.holdout[1],
                fusion=self._fusion_probe(Path(work)),
            )
        summary.calibrated = [n for n in summary.calibrated if n not in mixed.quantizers_disabled]
        summary.skipped += mixed.quantizers_disabled
        return mixed

    def _fusion_probe(self, workdir: Path) -> Callable[[set[str]], dict[str, bool | None]] | None:
        """What onnxruntime fuses with some quantizers off, for the target search's step 6 (the onnxruntime
        target's 8-bit integer layers only; ``None`` otherwise). A graph that does not export or load probes
        as nothing fused: the search then keeps its layers as it chose them."""
        from quantcli.calibration.latency_placement import fusion_probe, placed_layers

        if self.config.target != "onnxruntime" or self.example is None or not placed_layers(self.model):
            return None
        probe = fusion_probe(self.model, self.example, workdir)

        def fused(off: set[str]) -> dict[str, bool | None]:
            try:
                return probe(off)
            except ConfigError:
                raise
            except Exception:  # export or onnxruntime: no fusion to keep
                return {}

        return fused

    def calibrate_kv_cache(self) -> KVCacheQuant | None:
        """``--kv-cache int8``: the cache's scales from the calibration batches, on the final quantized model
        (its keys and values as the graph computes them); None for a float cache."""
        from quantcli.calibration.kv_cache import calibrate_kv_cache, granularity_of

        granularity = granularity_of(self.request.kv_cache)
        if granularity is not None:
            self.kv_cache = calibrate_kv_cache(self.model, self.batches, granularity)
        return self.kv_cache

    def summarise(
        self, summary: CalibrationSummary, mixed: MixedPrecisionResult | None, smoothed: SmoothReport | None
    ) -> dict:
        """The summary the checkpoint stores (and ``--json`` prints)."""
        info = summary.to_dict()
        if mixed is not None:
            info["mixed_precision"] = mixed.to_dict()
        info["config"] = self.config.source
        info["target"] = self.config.target
        enabled = [n for n, q in quantizers(self.model).items() if q.enabled]
        activations = any(role(n) != "weight_quantizer" for n in enabled)
        info["placement"] = placement_summary(
            self.report.placement, self.config.target, activations, weights=bool(enabled)
        )
        if self.latency is not None:
            info["placement"]["latency"] = self.latency.to_dict()
        info["batchnorm"] = {"fold_batchnorm": self.config.fold_batchnorm, **self.report.batchnorm.to_dict()}
        info["layers"] = layers_summary(self.report, self.model, self.latency, summary.not_called)
        info["quantized_layers"] = len(info["layers"]["quantized"])
        info["cpu"] = cpu_summary(
            self.config,
            self.model,
            self.request.cpu,
            self.example,
        )
        info["float_check"] = dict(self.report.float_check)
        if smoothed is not None:
            info["smoothquant"] = smoothed.to_dict()
        info["weight_rounding"] = (
            self.weight_rounding.to_dict()
            if self.weight_rounding is not None
            else {"method": self.request.weight_method}
        )
        if self.preprocessing is not None:
            info["preprocessing"] = describe_preprocessing(self.preprocessing)
        if loaded_dtype(self.model):  # a half-precision model, calibrated in float32
            info["precision"] = describe_precision(loaded_dtype(self.model))
        if self.batches and batch_axes.describe(self.batches[0]):  # inputs whose samples are not on axis 0
            info["batch_axes"] = batch_axes.describe(self.batches[0])
        if self.kv_cache is not None:
            info["kv_cache"] = self.kv_cache.summary()
        return info

    def save(self, info: dict) -> None:
        """Rank 0 writes the checkpoint (atomically); the others write nothing and learn whether it worked."""
        with one_outcome():
            if self.rank is None or self.rank.rank == 0:
                save_calibrated(
                    self.out,
                    self.model,
                    self.spec,
                    self.example,
                    info,
                    self.preprocessing,
                    self.original,
                    self.unrounded,
                    kv_cache=self.kv_cache.to_plain() if self.kv_cache is not None else None,
                )

    def finish(self, summary: CalibrationSummary, smoothed: SmoothReport | None) -> CalibrationOutcome:
        """Keep float the layers that would run slower quantized, meet the quality target, summarise, save."""
        self.place_for_latency(summary)
        mixed = self.meet_target(summary)
        self.calibrate_kv_cache()
        info = self.summarise(summary, mixed, smoothed)
        self.save(info)
        return CalibrationOutcome(self, summary, info, mixed, smoothed)


def cpu_summary(config: QuantConfig, model: nn.Module, asked: str | None, example=None) -> dict:
    """The deployment CPU the grids were chosen for (:mod:`quantcli.quant.cpu`): its kind, whether it is this
    machine, the weight quantizers put on the 7-bit grid so that its u8s8 kernels cannot saturate, and the
    layers whose weights can still saturate there (``reduce_range: false``), with a one-line ``text``."""
    from quantcli.analysis.saturation import saturating_layers
    from quantcli.nn.config import REDUCED_WEIGHT_BITS
    from quantcli.nn.tensor_quantizer import quantizers
    from quantcli.quant import cpu as cpu_kinds

    kind = config.deploy_cpu
    auto = asked in (None, cpu_kinds.AUTO) and config.cpu == cpu_kinds.detect()
    reduced = [
        n
        for n, q in quantizers(model).items()
        if n.endswith("weight_quantizer") and q.enabled and q.desc.num_bits == REDUCED_WEIGHT_BITS
    ]
    eight_bit = any(
        n.endswith("weight_quantizer") and q.enabled and q.desc.num_bits == 8
        for n, q in quantizers(model).items()
    )
    saturates = cpu_kinds.can_saturate(kind) and config.target == "onnxruntime"
    saturating = saturating_layers(model, example) if saturates else []
    where = f"{kind} ({'this machine' if auto else 'named with --cpu or the config'})"
    if saturating:
        text = (
            f"{where}: the weights of {len(saturating)} layer(s) can saturate its uint8 x int8 kernels "
            f"(reduce_range: {config.reduce_range})"
        )
    elif reduced and saturates:
        text = (
            f"{where}: its uint8 x int8 kernels can saturate, so {len(reduced)} weight quantizer(s) are on "
            "the 7-bit grid (depthwise convolutions keep 8 bits: their kernel cannot saturate)"
        )
    elif reduced:
        text = f"{where}: {len(reduced)} weight quantizer(s) on the 7-bit grid (reduce_range: true)"
    elif not eight_bit:
        text = f"{where}: no 8-bit integer weight (nothing for uint8 x int8 kernels to saturate)"
    elif config.target != "onnxruntime":
        text = f"{where}: 8-bit weights (the {config.target} target runs no uint8 x int8 CPU kernel)"
    else:
        text = f"{where}: " + (
            "8-bit weights (its integer kernels cannot saturate)"
            if not saturates
            else "no 8-bit weight feeds a kernel that can saturate"
        )
    return {
        "kind": kind,
        "this_machine": cpu_kinds.detect(),
        "auto": auto,
        "reduce_range": config.reduce_range,
        "reduced_weights": reduced,
        "saturating_layers": saturating,
        "text": text,
    }


def layers_summary(
    report, model: nn.Module, latency: LatencyPlacement | None = None, not_called: list[str] | None = None
) -> dict:
    """The layers quantized (converted by quantize_model with a quantizer still enabled), the weighted modules
    left float and why (:mod:`quantcli.nn.linear_like`; a converted layer whose quantizers the preset, a rule
    or the quality target disabled, or that never ran on the calibration data: ``not_called`` quantizers), the
    parametrized weights stored as values, and a one-line ``text``."""
    modules = dict(model.named_modules())
    idle = {owner(q) for q in not_called or ()}

    def why_disabled(n: str) -> str:
        if n in slower:
            return f"latency placement: {slower[n]}"
        if n in idle:
            return "it never ran on the calibration data (its operation was not computed)"
        return "its quantizers are disabled (preset, config rule or quality target)"

    def enabled(name: str) -> bool:
        if isinstance(modules[name], QuantLSTM):  # one quantizer per weight, under l<k>
            return any(q.enabled for q in quantizers(modules[name]).values())
        return any(
            getattr(getattr(modules[name], f"{k}_quantizer", None), "enabled", False)
            for k in ("input", "weight")
        )

    slower = {
        d.layer: d.reason for d in (latency.layers if latency is not None else []) if d.decision == "float"
    }
    quantized = [n for n in report.layers if enabled(n) and n not in slower]
    floats = [
        *report.float_layers,
        *(
            {
                "name": n,
                "type": type(modules[n]).__name__.removeprefix("Quant"),
                "reason": why_disabled(n),
            }
            for n in report.layers
            if not enabled(n) or n in slower
        ),
    ]
    # every recurrent layer by name, quantized or not, with what it runs as
    recurrent = [
        {"name": n, "type": "LSTM", "precision": lstm_precision(modules[n])}
        for n in report.layers
        if isinstance(modules[n], QuantLSTM)
    ] + [
        {"name": f["name"], "type": f["type"], "precision": f"float: {f['reason']}"}
        for f in report.float_layers
        if isinstance(modules.get(f["name"]), nn.RNNBase)
    ]
    text = f"{len(quantized)} quantized"
    if recurrent:
        text += "; recurrent: " + "; ".join(f"{r['name']} ({r['type']}) {r['precision']}" for r in recurrent)
    named = {r["name"] for r in recurrent}
    others = [f for f in floats if f["name"] not in named]  # recurrent ones: said above
    if others:
        shown = "; ".join(
            f"{f['name'] or 'the root module'} ({f['type']}: {f['reason']})" for f in others[:3]
        )
        text += f"; {len(others)} weighted module(s) left float: {shown}" + (
            " ..." if len(others) > 3 else ""
        )
    weights = [w for w in report.float_weights if w["layer"] in quantized]
    if weights:
        shown = "; ".join(f"{w['name']} ({w['reason']})" for w in weights[:3])
        text += f"; {len(weights)} weight(s) of quantized layers left float: {shown}" + (
            " ..." if len(weights) > 3 else ""
        )
    return {
        "quantized": quantized,
        "float": floats,
        "float_weights": weights,
        "resolved_parametrizations": list(report.resolved_parametrizations),
        "recurrent": recurrent,
        "text": text,
    }


@dataclass
class CalibrationOutcome:
    """What a calibration did, for the CLI to render."""

    job: CalibrationJob
    summary: CalibrationSummary
    info: dict  # as stored in the checkpoint
    mixed: MixedPrecisionResult | None
    smoothed: SmoothReport | None

    @property
    def target_met(self) -> bool:
        return self.mixed is None or self.mixed.met

    def to_dict(self) -> dict:
        """``--json``'s data: the stored summary, the file written and the config patterns that matched
        nothing."""
        return {
            **self.info,
            "out": str(self.job.out),
            "unmatched_patterns": self.job.report.unmatched_patterns,
        }


def _inputs(request: CalibrationRequest) -> list[tuple[str, Path | None]]:
    """Every file or folder calibrate reads, named as the user gave it."""
    model = request.model.rsplit(":", 1)[0] if ":" in request.model else request.model
    config = Path(request.config)
    opts = request.data_options
    return [
        ("the model", Path(model) if Path(model).exists() else None),
        ("--weights", request.weights),
        ("--data", request.data),
        ("--holdout", request.holdout),
        ("--config", config if config.is_file() else None),
        ("--tokenizer", getattr(opts, "tokenizer", None)),
    ]


def _check_request(request: CalibrationRequest, rank: Rank | None) -> None:
    if request.out is not None:
        refuse_overwriting_inputs(request.out, _inputs(request), "--out")
    if request.batch_size is not None and request.batch_size <= 0:
        raise QuantCliError(f"--batch-size must be positive, got {request.batch_size}")
    if request.smoothquant is not None and rank is not None:
        raise QuantCliError("--smoothquant runs in one process; run calibrate without torchrun to smooth")
    from quantcli.calibration.kv_cache import granularity_of

    if granularity_of(request.kv_cache) is not None and rank is not None:
        raise QuantCliError("--kv-cache int8 runs in one process; run calibrate without torchrun")
    if request.placement not in ("auto", "all"):
        raise QuantCliError(f"--placement must be auto or all, got {request.placement!r}")
    if request.weight_method not in ("rtn", "gptq", "awq"):
        raise QuantCliError(f"--weight-method must be rtn, gptq or awq, got {request.weight_method!r}")
    if request.smoothquant is not None and not 0.0 <= request.smoothquant <= 1.0:
        raise QuantCliError(f"--smoothquant alpha must be in [0, 1], got {request.smoothquant}")
    if request.smoothquant_min_gain is not None:
        if request.smoothquant is None:
            raise QuantCliError("--smoothquant-min-gain applies to --smoothquant: pass --smoothquant too")
        if not request.smoothquant_min_gain >= 0.0:
            raise QuantCliError(
                f"--smoothquant-min-gain must be a number >= 0, got {request.smoothquant_min_gain}"
            )


def _check_kv_cache(request: CalibrationRequest, model: nn.Module) -> None:
    """``--kv-cache int8`` before anything is calibrated: only a model with a decode graph has a cache."""
    from exporters.causal_lm.export import decodable
    from quantcli.calibration.kv_cache import granularity_of

    if granularity_of(request.kv_cache) is None:
        return
    why = decodable(model)[1]
    if why:
        raise QuantCliError(
            f"--kv-cache {request.kv_cache} needs a causal LM that gets a decode graph: {why}"
        )


def _load_config(request: CalibrationRequest) -> QuantConfig:
    cfg = load_config(request.config)
    if request.fold_bn is not None:
        cfg.fold_batchnorm = request.fold_bn
    if request.target is not None:
        cfg = dataclasses.replace(cfg, target=request.target)  # validated like a config file's target
    if request.cpu is not None:
        cfg = dataclasses.replace(cfg, cpu=request.cpu)
    # auto is this machine: the checkpoint stores the kind it was, so a model rebuilt elsewhere is the same
    cfg = dataclasses.replace(cfg, cpu=cfg.deploy_cpu)
    if request.method == "entropy" and cfg.asymmetric_activations is None:
        # entropy searches a symmetric threshold: left to its default, the grid is one it can calibrate
        cfg = dataclasses.replace(cfg, asymmetric_activations=False)
    return cfg


def _data_options(request: CalibrationRequest, spec: ModelSpec) -> DataOptions:
    opts = request.data_options
    opts.model_folder = spec.path if spec.kind == "hf" else None
    opts.batch_size_given = request.batch_size is not None
    return opts


def _calibration_batches(
    request: CalibrationRequest, rank: Rank | None, model: nn.Module, spec: ModelSpec
) -> tuple[list[Batch], dict | None]:
    """This rank's calibration batches (all of them in one process) and their preprocessing."""
    batch_size = request.batch_size or defaults.BATCH_SIZE
    if request.data is not None:
        opts = _data_options(request, spec)
        if rank is None:
            return load_data(request.data, model, batch_size, request.num_samples, opts)
        return load_shard(
            request.data, model, rank.rank, rank.world_size, batch_size, request.num_samples, opts
        )
    if spec.kind == "sample":
        from sample_models import SAMPLES

        refuse_without_data(  # the bundled batches are tensors already
            request.data_options,
            request.batch_size is not None,
            f"{request.model} calibrates on its bundled data without --data",
        )
        batches = cap_samples(SAMPLES[spec.spec].calibration_batches(), request.num_samples)
        return (batches if rank is None else strided(batches, rank.rank, rank.world_size)), None
    raise DataError(f"{request.model} is not a sample model, so it needs calibration data: pass --data FILE")


def _holdout(
    request: CalibrationRequest, rank: Rank | None, spec: ModelSpec, model: nn.Module, batches: list[Batch]
) -> tuple[list[Batch], tuple[list[Batch], str] | None]:
    """``(calibration batches, (held-out batches, where they came from) or None)`` for
    --min-cosine/--min-snr."""
    r = request
    if r.min_cosine is None and r.min_snr is None:
        if r.holdout is not None or r.max_float_layers is not None:
            raise QuantCliError("--holdout and --max-float-layers go with --min-cosine or --min-snr")
        return batches, None
    check_target(r.min_cosine, r.min_snr)
    if rank is not None:
        raise QuantCliError("--min-cosine/--min-snr search in one process; run calibrate without torchrun")
    if r.holdout is not None:
        held, _ = load_data(
            r.holdout, model, r.batch_size or defaults.BATCH_SIZE, None, _data_options(r, spec)
        )
        if held:  # the model takes them (else the search's first pass failed naming a "batch 0")
            import torch

            from quantcli.analysis.sensitivity import quantizing

            with quantizing(model, active=()), torch.inference_mode():
                run_model(model, held[0], where=f"--holdout {r.holdout}'s first batch")
        return batches, (held, str(r.holdout))
    if spec.kind == "sample":
        from sample_models import SAMPLES

        return batches, (SAMPLES[spec.spec].evaluation_batches(), f"{spec.spec}'s held-out split")
    calib, held = split_holdout(batches)
    return calib, (held, f"the last {num_samples(held)} samples of --data")


def _count(items, noun: str) -> str:
    """``"1 Conv input"``, ``"3 Conv inputs"``."""
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def placement_summary(placement, target: str, activations: bool = True, weights: bool = True) -> dict:
    """What the target's placement did (:mod:`quantcli.nn.placement`), as JSON data and one line of text.
    ``activations``: whether any activation quantizer is enabled; without one (weight-only) the placement of
    activation grids, output quantizers and int32 biases applies to nothing. ``weights``: whether any
    quantizer is (none: every layer float)."""
    if placement is None:
        return {"analysed": False, "text": "no placement analysis"}
    d = placement.to_dict()
    if not weights:
        d["weight_only"] = False
        d["text"] = "nothing quantized: every layer stays float (see the layers row)"
        return d
    if not activations:
        d["weight_only"] = True
        d["text"] = "weight-only: activations stay float (no activation quantizer enabled), biases stay float"
        return d
    if target == "tensorrt":
        d["text"] = (
            "quantized inputs and weights of every layer, no output quantizers, "
            f"{_count(placement.residual_quantized, 'residual skip input')} quantized (NVIDIA's placement)"
        )
        if placement.residual_untraced:
            d["text"] += (
                f"; {len(placement.residual_untraced)} blocks with a residual Add left as they are "
                f"(torch.fx cannot rewrite them: {', '.join(placement.residual_untraced)})"
            )
        if not placement.analysed:
            d["text"] = (
                f"{placement.note}: quantized inputs and weights of every layer, skip inputs not quantized"
            )
    elif not placement.analysed:
        d["text"] = (
            f"{placement.note}: per-layer placement (inputs and weights of every layer, int32 "
            f"biases); "
            "post-ReLU inputs and Convs that need an output quantizer are not detected, so such Convs may "
            "stay in float in onnxruntime"
        )
    else:
        d["text"] = (
            f"{_count(placement.unsigned_inputs, 'post-ReLU input')} on the uint8 grid, "
            f"{_count(placement.output_quantized, 'output quantizer')}, int32 biases"
        )
        extra = [
            (placement.residual_quantized, "residual skip input", "quantized (QLinearAdd)"),
            (placement.pool_inputs, "pooling input", "quantized (QLinear(Global)AveragePool)"),
            (placement.input_before, "Conv input", "quantized before its zero padding"),
            (
                getattr(placement, "activation_quantized", []),
                "sigmoid/multiplication operand",
                "quantized (QLinearSigmoid/QLinearMul)",
            ),
            (placement.asymmetric, "signed activation", "on uint8 with a zero point"),
        ]
        d["text"] += "".join(f", {_count(names, what)} {rest}" for names, what, rest in extra if names)
    return d
