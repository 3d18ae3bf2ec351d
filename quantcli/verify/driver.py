"""``verify_onnx``: one pass over the data through the exact and the deployed onnxruntime sessions and the
fake-quant and float PyTorch models, streaming statistics; the per-quantizer evidence on a bounded sample;
then the verdict (:mod:`quantcli.verify.verdict`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from exporters.graph import branch_note, read_onnx
from exporters.onnxruntime.placement import strip_propagated
from quantcli.analysis.saturation import saturating_layers
from quantcli.errors import GraphOutputError, GraphRunError, VerifyError, few
from quantcli.inputs.checkpoint import Calibrated, load_calibrated
from quantcli.inputs.data import Batch, checked_batches, describe, num_samples, output_arrays, run_model
from quantcli.inputs.padding import padding_mask, real_positions
from quantcli.nn.modes import quantizer_modes
from quantcli.nn.recurrent import QuantLSTM
from quantcli.nn.tensor_quantizer import quantizers
from quantcli.quant import cpu as cpu_kinds
from quantcli.verify import cpu_kernels, replay, sessions
from quantcli.verify.outputs import logit_outputs
from quantcli.verify.stats import PairStats, ratio
from quantcli.verify.structure import check_structure
from quantcli.verify.verdict import (
    MAX_DEPLOY_RATIO,
    MAX_REPLAY_OUTPUT,
    MAX_REPLAY_STEPS,
    MAX_RMS_RATIO,
    MAX_TRANSFORM_DEVIATION,
    Check,
    VerifyReport,
    at_least,
    at_most,
)
from quantcli.verify.weights import constant_weights


def _open_exact(model, prov: str, provider: str):
    """The exact session, falling back from CUDA to the CPU when ``auto`` picked a CUDA that cannot load."""
    try:
        return sessions.open_session(model, prov, optimize=False), prov, None
    except VerifyError as e:
        if provider != "auto" or prov == "CPUExecutionProvider":
            raise
        note = f"CUDAExecutionProvider failed ({e}); ran on CPUExecutionProvider"
        return (
            sessions.open_session(model, "CPUExecutionProvider", optimize=False),
            "CPUExecutionProvider",
            note,
        )


def _check_finite(batches: list[Batch]) -> None:
    """Refuse NaN/inf in floating-point inputs: they make every comparison meaningless (NaN != NaN), so
    verify would report a numerical FAIL (exit 1) for what is bad input data."""
    for i, batch in enumerate(batches):
        for name, v in batch.items():
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                bad = int((~torch.isfinite(v)).sum())
                raise VerifyError(
                    f"verification batch {i}: input {name!r} has {bad} non-finite value(s) "
                    f"(NaN or "
                    f"inf); verify needs finite inputs: clean the data"
                )


def verify_onnx(
    onnx_path: str | Path,
    calibrated: Calibrated | str | Path,
    batches: list[Batch] | None = None,
    *,
    provider: str = "auto",
    max_abs_diff: float | None = None,
    min_cosine: float | None = None,
    min_snr: float | None = None,
    per_layer: bool = False,
    deployment: bool = True,
    max_rms_ratio: float = MAX_RMS_RATIO,
    max_deploy_ratio: float = MAX_DEPLOY_RATIO,
    cpu: str | None = None,
) -> VerifyReport:
    """Run every check; returns the report (``report.passed``). Bad input raises VerifyError.

    Args:
        max_abs_diff: also require max |onnxruntime - fake-quant| <= this, per output (absolute units).
        min_cosine, min_snr: quality of the deployed session (default options) against the float model.
        deployment: load the graph with default session options too, and fail if it does not load.
        max_rms_ratio: RMS(onnxruntime - fake-quant) / RMS(fake-quant - float), optimizations off.
        max_deploy_ratio: the same ratio for the deployed session (this machine), and for the emulated kernels
            of a CPU that can saturate (``deployment.saturation``, :mod:`quantcli.verify.cpu_kernels`).
        cpu: the CPU the graph will run on (:mod:`quantcli.quant.cpu`; None or ``auto``: this machine); one
            whose uint8 x int8 kernels can saturate is emulated.
    """
    t0 = time.perf_counter()
    model = read_onnx(onnx_path)
    ckpt = calibrated if isinstance(calibrated, Calibrated) else load_calibrated(calibrated)
    prov = sessions.choose_provider(provider)
    batches = _verification_batches(ckpt, batches)
    floats = _FloatModels(ckpt)  # before constant_weights: a copy made within would share its cached weights
    with constant_weights(ckpt.model):  # each weight quantized once, for every check below
        structure, weight_rows = check_structure(model, ckpt)
        ss = _open_sessions(model, prov, provider, deployment, Path(onnx_path))
        report = VerifyReport(
            str(onnx_path),
            ckpt.path,
            ss.provider,
            len(batches),
            num_samples(batches),
            structure=structure,
            provider_note=ss.provider_note,
        )
        for_onnxruntime = _target(model) == "onnxruntime"
        kind = cpu_kernels.emulated_kind(cpu, cpu_kernels.graph_cpu(model)) if for_onnxruntime else None
        saturation = None
        if kind is not None and saturating_layers(ckpt.model, batches[0], unknown=True):
            saturation = cpu_kernels.Saturation(kind, cpu_kernels.u8s8_layers(onnx_path))
        try:
            cmp = _compare_outputs(
                ss, ckpt, floats, batches, [o.name for o in model.graph.output], max_abs_diff, saturation
            )
        except GraphRunError as e:
            return _graph_failed(report, e, t0)
    lstms = _saturating_lstms(ckpt.model)
    rows = _fidelity(report, cmp, weight_rows, max_rms_ratio, max_abs_diff, lstms)
    _reference_check(report, cmp, ckpt)
    use = cmp.dqual if deployment and ss.deploy_error is None else cmp.qual
    report.quality = {
        "session": "deployed" if use is cmp.dqual else "exact",
        "outputs": {n: use[n].quality() for n in cmp.out_names},
        "exact_outputs": {n: cmp.qual[n].quality() for n in cmp.out_names},
        "exact_samples": cmp.exact_samples,
        "cosine_gap": cmp.cosine_gap() if use is cmp.dqual else {},
    }
    if deployment:
        _deployment_checks(report, model, ss, cmp, max_deploy_ratio, kind, lstms)
    _quality_checks(report, use, cmp.out_names, min_cosine, min_snr)
    if per_layer:
        ranked = sorted(rows.values(), key=lambda r: r["snr_db"] if r["snr_db"] is not None else math.inf)
        report.layers = [{**r, "rank": k} for k, r in enumerate(ranked, start=1)]
    report.seconds = time.perf_counter() - t0
    return report


def _graph_failed(report: VerifyReport, error: GraphRunError, t0: float) -> VerifyReport:
    """The graph loaded but a node failed on inputs the model ran on (the failed check ``graph.runs``, its
    detail names the node), or its outputs are not the model's (``graph.outputs``), with nothing to
    compare."""
    report.checks.append(at_least(error.check, 1, 0, str(error)))
    report.fidelity = {
        "outputs": {},
        "quantizers": {},
        "sample_size": 0,
        "exact_samples": 0,
        "not_replayed": [],
        "failing_quantizers": [],
    }
    report.quality = {
        "session": "exact",
        "outputs": {},
        "exact_outputs": {},
        "exact_samples": 0,
        "cosine_gap": {},
    }
    report.seconds = time.perf_counter() - t0
    return report


def _verification_batches(ckpt: Calibrated, batches: list[Batch] | None) -> list[Batch]:
    """The batches to verify on: the given ones, else the sample model's held-out data or the checkpoint's
    example batch; checked non-empty and finite."""
    if batches is None:
        batches = ckpt.evaluation_batches() or [ckpt.example]
    batches = checked_batches(batches, "verify's batches")
    if not batches:
        raise VerifyError("no verification data")
    _check_finite(batches)
    return batches


@dataclass
class _Sessions:
    """The onnxruntime sessions verify compares: the exact one (optimizations off, with the replay's extra
    outputs) and the deployed one (default options; ``None`` when not asked for or when it failed, with
    ``deploy_error`` saying why)."""

    # the exact session's graph, without the onnxruntime target's propagated Q/DQ copies
    graph: onnx.ModelProto
    exact: Any
    provider: str
    provider_note: str | None
    deployed: Any = None
    deploy_error: str | None = None
    deploy_options: tuple[str, ...] = ()


def _open_sessions(
    model: onnx.ModelProto, prov: str, provider: str, deployment: bool, path: Path
) -> _Sessions:
    # the exact session without the Q/DQ copies the onnxruntime target puts in front of MaxPool/Flatten (the
    # same values): a quantizer's QuantizeLinear then reads the float tensor it quantizes, not
    # already-quantized values
    exact = strip_propagated(model)
    sess, prov, provider_note = _open_exact(
        replay.with_outputs(exact, replay.evidence_outputs(exact)), prov, provider
    )
    ss = _Sessions(exact, sess, prov, provider_note)
    # a TensorRT-target graph is not made for onnxruntime's CPU fusions: its float8 pairs are unguarded
    # (TensorRT needs the DequantizeLinear right before the op), so it is deployed here with the options it
    # needs to load
    ss.deploy_options = _deploy_options(model)
    if deployment:
        try:
            ss.deployed = sessions.open_session(  # the file itself: what a user's session loads
                path,
                prov,
                optimize=True,
                disabled_optimizers=ss.deploy_options,
            )
        except VerifyError as e:
            ss.deploy_error = str(e)
    return ss


@dataclass
class _Comparison:
    """Streaming statistics per graph output, and the per-quantizer evidence of the sample."""

    out_names: list[str]
    fid: dict[str, PairStats] = field(default_factory=dict)  # exact session vs fake-quant
    qerr: dict[str, PairStats] = field(default_factory=dict)  # fake-quant vs float: the quantization error
    # the same, on the inputs the exact session ran
    qerr_exact: dict[str, PairStats] = field(default_factory=dict)
    qual: dict[str, PairStats] = field(default_factory=dict)  # exact session vs float
    dep: dict[str, PairStats] = field(default_factory=dict)  # deployed session vs fake-quant
    dqual: dict[str, PairStats] = field(default_factory=dict)  # deployed session vs float
    # the same, on the inputs the exact session ran: the deployed session's side of cosine_gap (dqual covers
    # every input, qual only those; two cosines over different inputs differ by which inputs they saw)
    dqual_exact: dict[str, PairStats] = field(default_factory=dict)
    evidence: replay.Replay | None = None
    exact_samples: int = 0
    # quantcli's transformed float model vs the model as loaded
    transformed: dict[str, PairStats] | None = None
    # the fake-quant model with a saturating CPU's u8s8 kernels emulated, vs the fake-quant model
    saturation: cpu_kernels.Saturation | None = None
    # (model as loaded, transformed float model, the sample): where reference.transformations looks for the
    # first module that differs when it fails
    transformed_models: tuple | None = None

    def start(self, logits: set[int]) -> None:
        """Fresh statistics; ``logits``: the outputs (by index) whose top-1 agreement is counted."""
        for k, n in enumerate(self.out_names):
            self.fid[n], self.qerr[n], self.qerr_exact[n] = PairStats(), PairStats(), PairStats()
            self.qual[n] = PairStats(top1=k in logits)
            self.dep[n], self.dqual[n] = PairStats(), PairStats(top1=k in logits)
            self.dqual_exact[n] = PairStats()

    def add(
        self,
        batch: Batch,
        ref: list[np.ndarray],
        flt: list[np.ndarray],
        got: list[np.ndarray] | None,
        deployed: list[np.ndarray] | None,
    ) -> None:
        """One batch: fake-quant ``ref``, float ``flt``, exact session ``got``, deployed session
        ``deployed``."""
        if got is not None:
            self.exact_samples += num_samples([batch])
        if len(ref) != len(self.out_names):
            raise GraphOutputError(f"the graph has {len(self.out_names)} output(s), the model {len(ref)}")
        for session, outs in (("exact", got), ("deployed", deployed)):
            for k, n in enumerate(self.out_names if outs is not None else []):
                if np.shape(outs[k]) != np.shape(ref[k]):  # a loadable graph that computes something else
                    raise GraphOutputError(
                        f"output {n!r} of the {session} session has shape "
                        f"{list(np.shape(outs[k]))}, "
                        f"the model's {list(np.shape(ref[k]))}"
                    )
        # per-token outputs at real tokens only: padding's values are never read, and differ at random
        mask = padding_mask(batch)
        ref, flt, got, deployed = (real_positions(mask, o) for o in (ref, flt, got, deployed))
        for k, n in enumerate(self.out_names):
            self.qerr[n].add(ref[k], flt[k])
            if got is not None:
                self.qerr_exact[n].add(ref[k], flt[k])
                self.fid[n].add(got[k], ref[k])
                self.qual[n].add(got[k], flt[k])
            if deployed is not None:
                self.dep[n].add(deployed[k], ref[k])
                self.dqual[n].add(deployed[k], flt[k])
                if got is not None:
                    self.dqual_exact[n].add(deployed[k], flt[k])

    def cosine_gap(self) -> dict[str, float | None]:
        """Per output: the exact session's cosine to the float model less the deployed session's, both on the
        inputs the exact session ran (``exact_samples``; issue 36's figure: u8s8 saturation or a fused kernel
        that loses accuracy makes it positive). None where either cosine is undefined (a zero output)."""
        gaps = {}
        for n in self.out_names:
            exact, deployed = self.qual[n].cosine, self.dqual_exact[n].cosine
            gaps[n] = exact - deployed if exact is not None and deployed is not None else None
        return gaps


def _compare_outputs(
    ss: _Sessions,
    ckpt: Calibrated,
    floats: _FloatModels,
    batches: list[Batch],
    out_names: list[str],
    max_abs_diff: float | None,
    saturation: cpu_kernels.Saturation | None = None,
) -> _Comparison:
    """One pass over the data: the deployed session (what a user ships) against the fake-quant and the float
    model; the exact session runs on every batch only where it is the one judged (no deployed session, or an
    explicit --max-abs-diff), else on the sample, where the replay proves its arithmetic quantizer by
    quantizer. Run within :func:`constant_weights` (verify_onnx): each weight is quantized once."""
    qmodel = ckpt.model
    cmp = _Comparison(out_names, saturation=saturation)
    sample, rest = replay.split_sample(batches)
    for i, batch in enumerate([sample] + rest):
        where = "the first batch" if i == 0 else f"batch {i} ({describe(batch)})"
        inputs = sessions.feeds(ss.exact, batch, where)
        deployed = None
        if ss.deployed is not None:
            try:
                deployed = sessions.run(ss.deployed, inputs, where)
            except VerifyError as e:
                ss.deployed, ss.deploy_error = None, str(e)
        if i == 0:
            ref, flt, got = _sample_pass(ss, cmp, qmodel, floats, batch, where)
            if floats.loaded is not None:
                _compare_transformed(cmp, floats, batch, flt, where)
        else:
            with torch.inference_mode():
                ref = output_arrays(run_model(qmodel, batch, where))
                with floats.reference() as fmodel:
                    flt = output_arrays(run_model(fmodel, batch, where))
            full_exact = ss.deployed is None or max_abs_diff is not None
            got = sessions.run(ss.exact, inputs, where, cmp.out_names) if full_exact else None
        cmp.add(batch, ref, flt, got, deployed)
        if cmp.saturation is not None:
            cmp.saturation.add(qmodel, batch, ref, cmp.out_names, where)
    return cmp


def _sample_pass(
    ss: _Sessions, cmp: _Comparison, qmodel, floats: _FloatModels, batch: Batch, where: str
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """The sample batch: the fake-quant model with its quantizers' outputs captured, the float model (which
    outputs are logits), and the replay against the exact session. Returns (fake-quant, float, exact)
    outputs."""
    with torch.inference_mode(), replay.capture(qmodel, replay.evidence_quantizers(ss.graph)) as seen:
        ref = output_arrays(run_model(qmodel, batch, where))
    with floats.reference() as fmodel:
        flt_t, logits = logit_outputs(fmodel, batch)
    flt = [t.detach().cpu().numpy() for t in flt_t]
    cmp.start(logits)
    cmp.evidence, got = replay.replay(ss.exact, ss.graph, cmp.out_names, qmodel, batch, seen)
    return ref, flt, got


class _FloatModels:
    """The float models verify compares with.

    ``loaded``: the model as loaded, built from the checkpoint's stored original weights (None where it
    stores none). The float model as quantcli transformed it (BatchNorm folding, SmoothQuant, placement
    rewrites) is the quantized model itself with its quantizers off while in use, or, where GPTQ moved the
    weights while rounding them, a copy with the weights as they were
    (:meth:`Calibrated.transformed_float_model`)."""

    def __init__(self, ckpt: Calibrated):
        self.ckpt = ckpt
        self.loaded = ckpt.float_model() if ckpt.has_original else None
        self._copy = ckpt.transformed_float_model() if ckpt.data.get("unrounded") else None

    @contextlib.contextmanager
    def transformed(self) -> Iterator[torch.nn.Module]:
        if self._copy is not None:
            yield self._copy
            return
        with quantizer_modes(self.ckpt.model, "disabled"):
            yield self.ckpt.model

    def reference(self) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """The float reference: the model as loaded, else the transformed one."""
        return contextlib.nullcontext(self.loaded) if self.loaded is not None else self.transformed()


def _compare_transformed(
    cmp: _Comparison, floats: _FloatModels, batch: Batch, flt: list[np.ndarray], where: str
) -> None:
    """The float model as quantcli transformed it (quantizers off) against the model as loaded, on the sample:
    the transformations must compute the same, up to rounding."""
    with torch.inference_mode(), floats.transformed() as tmodel:
        got = output_arrays(run_model(tmodel, batch, where))
    if len(got) != len(cmp.out_names):
        raise VerifyError(
            f"the transformed model has {len(got)} outputs, the graph {len(cmp.out_names)}; export this "
            "checkpoint again with quantcli export"
        )
    cmp.transformed = {n: PairStats() for n in cmp.out_names}
    for k, n in enumerate(cmp.out_names):
        cmp.transformed[n].add(got[k], flt[k])
    cmp.transformed_models = (floats.loaded, batch)


#: ``reference.transformations`` passes a deviation above its limit that is at most this many times the
#: model's own float32 rounding (its float32 outputs against float64's): two float32 computations of one
#: function in different orders differ by about sqrt(2) times either's error; a transformation that changes
#: the model moves its outputs by orders of magnitude more (a fold through GELU: 0.19)
ROUNDING_FACTOR = 2.0


def _float32_noise(model, batch, names: list[str]) -> dict[str, float]:
    """Per output, RMS(float32 - float64) / RMS(float64) of ``model`` (the model as loaded) on ``batch``;
    {} where the model does not run in float64."""
    try:
        with torch.inference_mode():
            single = output_arrays(run_model(model, batch, "the reference's rounding check"))
            wide = copy.deepcopy(model).double()
            doubled = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
            exact = output_arrays(run_model(wide, doubled, "the reference's rounding check"))
    except Exception:
        return {}
    out = {}
    for n, a, b in zip(names, single, exact):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape == b.shape and a.size and np.isfinite(a).all() and np.isfinite(b).all():
            out[n] = float(np.sqrt(((a - b) ** 2).mean()) / max(np.sqrt((b**2).mean()), 1e-30))
    return out


def _reference_check(report: VerifyReport, cmp: _Comparison, ckpt: Calibrated) -> None:
    """``report.reference`` and, where the checkpoint stores the model as loaded,
    ``reference.transformations``: RMS(transformed float - float as loaded) / RMS(float as loaded), the worst
    output; when it fails, its detail names the first module whose output differs
    (:func:`quantcli.calibration.float_check.first_difference`)."""
    if cmp.transformed is None:
        report.reference = {
            "float_model": "as transformed (the checkpoint does not store the model as "
            "loaded: "
            "calibrate again to compare with it)"
        }
        return
    rel = {n: ratio(s.rms, math.sqrt(s.n_ref / max(s.count, 1))) for n, s in cmp.transformed.items()}
    report.reference = {"float_model": "as loaded", "transformed_relative_rms": rel}
    worst = max(rel, key=rel.get)
    check = at_most("reference.transformations", MAX_TRANSFORM_DEVIATION, rel[worst], worst)
    if not check.passed and cmp.transformed_models is not None:
        # a model whose own float32 rounding is that large (LeViT: 1.0e-3 of its output from float64's) is
        # judged against it: the transformed model computes in float32 too
        noise = _float32_noise(*cmp.transformed_models, cmp.out_names).get(worst)
        if noise is not None and rel[worst] <= ROUNDING_FACTOR * noise:
            check.passed = True
            check.detail = (
                f"{check.detail}; within {ROUNDING_FACTOR:g}x the model's own float32 rounding on this batch "
                f"({noise:.3g} of its output, against float64)"
            )
            report.reference["float32_rounding"] = noise
    if any(s.nonfinite for s in cmp.transformed.values()):
        check.passed, check.detail = False, "non-finite values in one model but not the other"
    if not check.passed and cmp.transformed_models is not None:
        from quantcli.calibration.float_check import describe_first, first_difference, smoothed_modules

        fmodel, batch = cmp.transformed_models
        found = first_difference(
            fmodel,
            ckpt.transformed_float_model(),  # a copy of its own: the search hooks every module
            batch,
            ckpt.data.get("batchnorm_folds", []),
            smoothed_modules((ckpt.data.get("calibration") or {}).get("smoothquant")),
        )
        report.reference["first_difference"] = (
            None
            if found is None
            else {"module": found[0], "relative_rms": found[1] if math.isfinite(found[1]) else None}
        )
        check.detail = f"{check.detail}; {describe_first(found)}"
    report.checks.append(check)


def _fidelity(
    report: VerifyReport,
    cmp: _Comparison,
    weight_rows: list[dict[str, Any]],
    max_rms_ratio: float,
    max_abs_diff: float | None,
    lstms: list[str],
) -> dict[str, dict[str, Any]]:
    """The exact session against the fake-quant model: ``report.fidelity`` and the ``fidelity.*`` checks.
    Returns every quantizer's row (weights and activations), by name."""
    sample, out_names = cmp.evidence, cmp.out_names
    outputs: dict[str, Any] = {}
    for n in out_names:
        outputs[n] = {
            **cmp.fid[n].deviation(),
            "quantization_rms": cmp.qerr[n].rms,
            "rms_ratio": ratio(cmp.fid[n].rms, cmp.qerr_exact[n].error_scale),
            "replay_max_abs_diff": sample.output_deviation.get(n),
            "replay_ratio": ratio(sample.output_deviation.get(n, math.inf), cmp.qerr[n].error_scale),
        }
    rows = {r["quantizer"]: r for r in weight_rows + sample.rows}
    replayed = [r for r in sample.rows if r["replay_steps"] is not None]
    failing = sorted(
        (r for r in replayed if r["replay_steps"] > MAX_REPLAY_STEPS), key=lambda r: -r["replay_steps"]
    )
    report.fidelity = {
        "outputs": outputs,
        "quantizers": {
            n: {
                "identical_codes": r["identical_codes"],
                "identical_codes_end_to_end": r["identical_codes_end_to_end"],
                "replay_steps": r.get("replay_steps"),
            }
            for n, r in rows.items()
        },
        "sample_size": sample.samples,
        "exact_samples": cmp.exact_samples,  # inputs the exact session's output statistics cover
        "not_replayed": sample.not_replayed,
        "recurrent_segments": sample.recurrent_segments,  # replayed, not judged (verify.replay)
        "recurrent_outputs": sample.recurrent_outputs,  # the same, of graph outputs
        "failing_quantizers": [r["quantizer"] for r in failing],
    }
    codes = [r["identical_codes"] for r in sample.rows if r["identical_codes"] is not None]
    worst = min(
        sample.rows,
        key=lambda r: r["identical_codes"] if r["identical_codes"] is not None else 1.0,
        default=None,
    )
    report.checks.append(
        at_least(
            "fidelity.codes",
            1.0,
            min(codes, default=1.0),
            _codes_detail(worst) if worst and min(codes, default=1.0) < 1.0 else None,
        )
    )
    steps = max((r["replay_steps"] for r in replayed), default=0.0)
    detail = ", ".join(f"{r['quantizer']} ({r['replay_steps']:.3g} steps)" for r in failing[:5]) or None
    branches = report.structure.get("traced_branches_at_export") or []
    if detail and branches:  # the graph holds one path of a branch on a value: the likely cause
        detail += f": {branch_note(branches)}"
    report.checks.append(at_most("fidelity.replay_steps", MAX_REPLAY_STEPS, steps, detail))
    judged = [n for n in out_names if n not in sample.recurrent_outputs]
    worst_out = max(judged, key=lambda n: outputs[n]["replay_ratio"], default=None)
    check = at_most(
        "fidelity.replay_outputs",
        MAX_REPLAY_OUTPUT,
        outputs[worst_out]["replay_ratio"] if worst_out else 0.0,
        worst_out or f"not judged: the segment before {few(out_names)} holds a DynamicQuantizeLSTM",
    )
    report.checks.append(check)
    worst_out = max(out_names, key=lambda n: outputs[n]["rms_ratio"])
    nonfinite = sum(s.nonfinite_mismatch for s in cmp.fid.values())
    check = at_most("fidelity.rms_ratio", max_rms_ratio, outputs[worst_out]["rms_ratio"], worst_out)
    if nonfinite:
        check.passed, check.detail = (
            False,
            f"{nonfinite} non-finite value(s) in one session but not the other",
        )
    elif not check.passed:
        check.detail = (
            f"{worst_out}: the graph computes something other than the model: {_graph_differs(report, lstms)}"
        )
    report.checks.append(check)
    if max_abs_diff is not None:
        worst_out = max(out_names, key=lambda n: cmp.fid[n].max_abs)
        report.checks.append(
            at_most("fidelity.max_abs_diff", max_abs_diff, cmp.fid[worst_out].max_abs, worst_out)
        )
    return rows


def _codes_detail(row: dict[str, Any]) -> str:
    """The quantizer whose codes differ most, and the negative values the graph feeds it if it is unsigned."""
    neg = row.get("negative_input")
    if not neg:
        return row["quantizer"]
    return (
        f"{row['quantizer']}: the graph feeds it {neg['count']} negative value(s) (min "
        f"{neg['min']:.4g}) in "
        f"tensor {neg['tensor']}, but it is unsigned (non-negative in the model, e.g. after a ReLU)"
    )


def _deployment_checks(
    report: VerifyReport,
    model: onnx.ModelProto,
    ss: _Sessions,
    cmp: _Comparison,
    max_deploy_ratio: float,
    emulated: str | None,
    lstms: list[str],
) -> None:
    """What a user ships, ``InferenceSession(path)`` with default options on this machine:
    ``report.deployment`` and the ``deployment.*`` checks; and, for a CPU whose u8s8 kernels can saturate,
    the emulated kernels (``deployment.saturation``)."""
    out_names = cmp.out_names
    report.deployment = _deployment(model, out_names, cmp.dep, cmp.fid, cmp.qerr, ss.deploy_error)
    if ss.deploy_options:
        report.deployment["disabled_optimizers"] = list(ss.deploy_options)
        report.deployment["notes"].insert(
            0,
            "target tensorrt: the deployed session leaves out onnxruntime's "
            f"{', '.join(ss.deploy_options)}, which this graph needs to "
            f"load there",
        )
    report.checks.append(
        at_least(
            "deployment.loads",
            1,
            0 if ss.deploy_error else 1,
            ss.deploy_error and f"{ss.deploy_error}; {sessions.deployment_advice(model)}",
        )
    )
    sat = cmp.saturation
    if sat is not None:
        report.deployment["saturation"] = sat.to_dict(cmp.qerr)
    elif emulated is not None:
        report.deployment["saturation"] = {"cpu": emulated, "outputs": {}, "layers": []}
    if ss.deploy_error is None and not ss.deploy_options and _target(model) == "onnxruntime":
        # a TensorRT-target graph ships to TensorRT: onnxruntime's CPU session of it is reported, not judged
        worst_out = max(out_names, key=lambda n: report.deployment["outputs"][n]["rms_ratio"])
        check = at_most(
            "deployment.rms_ratio",
            max_deploy_ratio,
            report.deployment["outputs"][worst_out]["rms_ratio"],
            worst_out,
        )
        if not check.passed:
            exact = report.deployment["outputs"][worst_out]["exact_rms_ratio"]
            if _structure_problem(report) is not None:
                cause = _graph_differs(report, lstms)  # an edited graph: what the structure check found
            elif exact > max_deploy_ratio:
                cause = _graph_cause(exact, report, lstms)
            else:
                cause = _deploy_cause(sat)
            check.detail = f"{worst_out} on this machine ({cpu_kinds.detect()}): {cause}"
        report.checks.append(check)
        report.checks.append(_finite_check(cmp))
    if sat is not None:
        report.checks.append(cpu_kernels.saturation_check(sat, cmp.qerr, max_deploy_ratio))
    elif emulated is not None:
        report.checks.append(
            at_most(
                "deployment.saturation",
                max_deploy_ratio,
                0.0,
                f"no layer's weights can saturate {emulated}'s uint8 x int8 kernels",
            )
        )


def _saturating_lstms(model: torch.nn.Module) -> list[str]:
    """The quantized LSTM layers (DynamicQuantizeLSTM) with 8-bit weights, where this machine's uint8 x int8
    kernels can saturate (an x86 CPU without VNNI): their graph runs the integer kernel in every session."""
    if not cpu_kinds.can_saturate(cpu_kinds.detect()):
        return []
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, QuantLSTM)
        and any(q.enabled and q.desc.num_bits == 8 for q in quantizers(m).values())
    ]


def _finite_check(cmp: _Comparison) -> Check:
    """``deployment.nonfinite``: the deployed session's outputs are NaN or inf exactly where the fake-quant
    model's are (every other statistic leaves non-finite values out, so a graph producing NaN on some inputs
    would pass on the rest)."""
    counts = {n: cmp.dep[n].nonfinite_mismatch for n in cmp.out_names}
    worst = max(counts, key=counts.get)
    detail = None
    if counts[worst]:
        total = sum(cmp.dep[n].count + cmp.dep[n].nonfinite for n in cmp.out_names)
        detail = (
            f"{worst}: {counts[worst]} value(s) NaN or inf in the deployed session where the fake-quant "
            f"model's are not (or the other way round), of {total}: `quantcli inspect MODEL.onnx --runtime "
            "onnxruntime` shows the graph it runs; an edited graph, or a fused kernel overflowing, makes them"
        )
    return at_most("deployment.nonfinite", 0, sum(counts.values()), detail)


def _graph_cause(exact_ratio: float, report: VerifyReport, lstms: list[str]) -> str:
    """What a failed ``deployment.rms_ratio`` means when the exact session (no fusions, no integer kernels) is
    already that far from the fake-quant model on the same inputs: the graph itself computes something
    else."""
    off = f"the exact session is already {exact_ratio:.3g}x off on the same inputs (exact_rms_ratio)"
    if _structure_problem(report) is None and lstms:  # the integer kernel is in the graph: every session
        return f"{off}: {_lstm_cause(lstms)}"
    return (
        f"{off}, so the graph itself computes something other than the model, not onnxruntime's kernels: "
        + _graph_differs(report, lstms)
    )


def _structure_problem(report: VerifyReport) -> str | None:
    """The structure check's first problem, where it failed (an edited scale or weight); else None."""
    structure = report.structure or {}
    problems = structure.get("problems") or []
    return None if structure.get("passed", True) or not problems else problems[0]


def _lstm_cause(lstms: list[str]) -> str:
    """LSTM layers whose integer kernel saturates on this CPU (it is in the graph, not a fusion: the exact
    session runs it too)."""
    return (
        f"the LSTM layer(s) {', '.join(lstms)} run onnxruntime's DynamicQuantizeLSTM, whose uint8 x int8 "
        f"kernels saturate on this CPU ({cpu_kinds.detect()}) with their 8-bit weights: calibrate for "
        f"this CPU (--cpu {cpu_kinds.detect()}: 7-bit weights) ({cpu_kinds.remedy_link()})"
    )


def _graph_differs(report: VerifyReport, lstms: list[str]) -> str:
    """Why the graph computes something else: the structure check's first problem where it found one; a
    branch on a tensor's value the export traced through (the graph holds one path); LSTM layers whose
    integer kernel saturates on this CPU; else what to try."""
    problem = _structure_problem(report)
    branches = report.structure.get("traced_branches_at_export") or []
    found = ""
    if problem is not None:
        found = f"the structure check found the graph differs from the checkpoint ({problem}): "
    if branches:
        return found + branch_note(branches)
    if found:
        return found + "export the checkpoint again"
    return _lstm_cause(lstms) if lstms else _GRAPH_DIFFERS


#: what to try when the exact session differs from the fake-quant model by more than quantization explains
_GRAPH_DIFFERS = (
    "an op translated differently, a branch on a size or value the trace fixed, or a model that rebuilds "
    "differently from its checkpoint (a buffer set at random and not saved); export with the other "
    "--exporter and compare"
)


def _deploy_cause(sat: cpu_kernels.Saturation | None) -> str:
    """What a failed ``deployment.rms_ratio`` likely means: the layers whose u8s8 kernels saturate, where the
    emulation saw any on this machine's kind, else onnxruntime's fused kernels rounding differently."""
    here = cpu_kinds.detect()
    # ``--cpu any`` emulates the saturating kernels, which are this machine's where it has them
    same = sat is not None and (sat.kind == here or (sat.kind == "any" and cpu_kinds.can_saturate(here)))
    ranked = sat.ranked() if same else []
    if ranked:
        return (
            f"onnxruntime's uint8 x int8 kernels saturate in {len(ranked)} layer(s), worst {ranked[0].layer} "
            f"(deployment.saturation names them); {cpu_kernels.remedy(here)}"
        )
    return (
        "onnxruntime's fused integer kernels compute differently from the exact session (requantized int32 "
        "biases, MatMulNBits on int8 activations, float accumulation order): `quantcli inspect MODEL.onnx "
        "--runtime onnxruntime` lists them"
    )


def _quality_checks(
    report: VerifyReport,
    use: dict[str, PairStats],
    out_names: list[str],
    min_cosine: float | None,
    min_snr: float | None,
) -> None:
    """``--min-cosine`` / ``--min-snr`` on the judged session (deployed, else exact) against the float
    model."""
    for flag, metric, name in (
        (min_cosine, "cosine", "quality.min_cosine"),
        (min_snr, "snr_db", "quality.min_snr_db"),
    ):
        if flag is None:
            continue
        values = {n: use[n].quality()[metric] for n in out_names}
        if any(v is None for v in values.values()):
            raise VerifyError(
                f"--{name.split('.min_')[1].replace('_db', '').replace('_', '-')} cannot be "
                "evaluated: an output is all zeros"
            )
        worst_out = min(values, key=values.get)
        report.checks.append(at_least(name, flag, values[worst_out], worst_out))


def _target(model: onnx.ModelProto) -> str:
    """The runtime the graph was made for (``quantcli.target``; graphs without it: onnxruntime)."""
    return {p.key: p.value for p in model.metadata_props}.get("quantcli.target", "onnxruntime")


def _deploy_options(model) -> tuple[str, ...]:
    """The optimizers the deployed session leaves out: none for the onnxruntime target (its graphs load with
    default options, or fail ``deployment.loads``), what the graph needs for a TensorRT-target graph."""
    if _target(model) != "tensorrt":
        return ()
    from exporters.onnxruntime.compat import session_needs

    return tuple(session_needs(model).disabled_optimizers)


def _deployment(model, out_names, dep, fid, qerr, error) -> dict[str, Any]:
    """The deployed session against the fake-quant model, per output, and what a large gap likely means."""
    section: dict[str, Any] = {
        "graph_optimization": "ORT_ENABLE_ALL",
        "cpu": cpu_kinds.detect(),
        "error": error,
        "outputs": {},
        "notes": [],
    }
    if error:
        return section
    for n in out_names:
        r = ratio(dep[n].rms, qerr[n].error_scale)
        exact = ratio(fid[n].rms, qerr[n].error_scale)
        section["outputs"][n] = {**dep[n].deviation(), "rms_ratio": r, "exact_rms_ratio": exact}
    return section
