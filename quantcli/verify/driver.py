"""``verify_onnx``: one pass over the data through the exact and the deployed onnxruntime sessions and the
fake-quant and float PyTorch models, streaming statistics; the per-quantizer evidence on a bounded sample;
then the verdict (:mod:`quantcli.verify.verdict`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from exporters.graph import read_onnx
from exporters.ort_placement import strip_propagated
from quantcli.checkpoint import Calibrated, load_calibrated
from quantcli.data import Batch, describe, flat_outputs, num_samples, run_model
from quantcli.errors import VerifyError
from quantcli.verify import replay as rp
from quantcli.verify import sessions
from quantcli.verify.outputs import logit_outputs
from quantcli.verify.stats import PairStats, ratio
from quantcli.verify.structure import check_structure
from quantcli.verify.verdict import (
    DEPLOY_GAP_FACTOR,
    DEPLOY_GAP_FLOOR,
    MAX_REPLAY_OUTPUT,
    MAX_REPLAY_STEPS,
    MAX_RMS_RATIO,
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
        return sessions.open_session(model, "CPUExecutionProvider", optimize=False), "CPUExecutionProvider", note


def _numpy(out) -> list[np.ndarray]:
    return [t.detach().cpu().numpy() for t in flat_outputs(out)]


def _check_finite(batches: list[Batch]) -> None:
    """Refuse NaN/inf in floating-point inputs: they make every comparison meaningless (NaN != NaN), so
    verify would report a numerical FAIL (exit 1) for what is bad input data."""
    for i, batch in enumerate(batches):
        for name, v in batch.items():
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                bad = int((~torch.isfinite(v)).sum())
                raise VerifyError(f"verification batch {i}: input {name!r} has {bad} non-finite value(s) (NaN or "
                                  f"inf); verify needs finite inputs: clean the data")


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
    max_deploy_ratio: float | None = None,
) -> VerifyReport:
    """Run every check; returns the report (``report.passed``). Bad input raises VerifyError.

    Args:
        max_abs_diff: also require max |onnxruntime - fake-quant| <= this, per output (absolute units).
        min_cosine, min_snr: quality of the deployed session (default options) against the float model.
        deployment: load the graph with default session options too, and fail if it does not load.
        max_rms_ratio: RMS(onnxruntime - fake-quant) / RMS(fake-quant - float), optimizations off.
        max_deploy_ratio: the same ratio for the deployed session, as a check (reported either way).
    """
    t0 = time.perf_counter()
    model = read_onnx(onnx_path)
    ckpt = calibrated if isinstance(calibrated, Calibrated) else load_calibrated(calibrated)
    prov = sessions.choose_provider(provider)
    if batches is None:
        batches = ckpt.evaluation_batches() or [ckpt.example]
    if not batches:
        raise VerifyError("no verification data")
    _check_finite(batches)
    structure, weight_rows = check_structure(model, ckpt)
    qmodel, fmodel = ckpt.model, ckpt.float_model()

    out_names = [o.name for o in model.graph.output]
    # the exact session without the Q/DQ copies the onnxruntime target puts in front of MaxPool/Flatten (the same
    # values): a quantizer's QuantizeLinear then reads the float tensor it quantizes, not already-quantized values
    exact = strip_propagated(model)
    sess, prov, provider_note = _open_exact(rp.with_outputs(exact, rp.evidence_outputs(exact)), prov, provider)
    dsess, deploy_error = None, None
    # a TensorRT-target graph is not made for onnxruntime's CPU fusions: its float8 pairs are unguarded (TensorRT
    # needs the DequantizeLinear right before the op), so it is deployed here with the options it needs to load
    deploy_options = _deploy_options(model)
    if deployment:
        try:
            dsess = sessions.open_session(model, prov, optimize=True, disabled_optimizers=deploy_options)
        except VerifyError as e:
            deploy_error = str(e)

    # one pass over the data: the deployed session (what a user ships) against the fake-quant and the float
    # model; the exact session runs on every batch only where it is the one judged (no deployed session, or an
    # explicit --max-abs-diff), else on the sample, where the replay proves its arithmetic quantizer by quantizer
    sample, rest = rp.split_sample(batches)
    evidence_names = rp.evidence_quantizers(exact)
    fid: dict[str, PairStats] = {}  # exact session vs fake-quant
    qerr: dict[str, PairStats] = {}  # fake-quant vs float: the quantization error, the unit of fidelity
    qerr_exact: dict[str, PairStats] = {}  # the same, on the inputs the exact session ran
    qual: dict[str, PairStats] = {}  # exact session vs float
    dep: dict[str, PairStats] = {}  # deployed session vs fake-quant
    dqual: dict[str, PairStats] = {}  # deployed session vs float
    logits: set[int] = set()
    evidence, exact_samples = None, 0
    with constant_weights(qmodel), constant_weights(fmodel):
        for i, batch in enumerate([sample] + rest):
            where = "the first batch" if i == 0 else f"batch {i} ({describe(batch)})"
            inputs = sessions.feeds(sess, batch, where)
            deployed = None
            if dsess is not None:
                try:
                    deployed = sessions.run(dsess, inputs, where)
                except VerifyError as e:
                    dsess, deploy_error = None, str(e)
            with torch.inference_mode():
                if i == 0:
                    with rp.capture(qmodel, evidence_names) as seen:
                        ref = _numpy(run_model(qmodel, batch, where))
                else:
                    ref = _numpy(run_model(qmodel, batch, where))
            if i == 0:
                flt_t, logits = logit_outputs(fmodel, batch)
                flt = [t.detach().cpu().numpy() for t in flt_t]
                for k, n in enumerate(out_names):
                    fid[n], qerr[n], qerr_exact[n] = PairStats(), PairStats(), PairStats()
                    qual[n] = PairStats(top1=k in logits)
                    dep[n], dqual[n] = PairStats(), PairStats(top1=k in logits)
                evidence, got = rp.replay(sess, exact, out_names, qmodel, batch, seen)
                del seen
            else:
                with torch.inference_mode():
                    flt = _numpy(run_model(fmodel, batch, where))
                full_exact = dsess is None or max_abs_diff is not None
                got = sessions.run(sess, inputs, where, out_names) if full_exact else None
            if got is not None:
                exact_samples += int(next(iter(batch.values())).shape[0])
            if len(ref) != len(out_names):
                raise VerifyError(f"the graph has {len(out_names)} outputs, the model {len(ref)}")
            for k, n in enumerate(out_names):
                qerr[n].add(ref[k], flt[k])
                if got is not None:
                    qerr_exact[n].add(ref[k], flt[k])
                    fid[n].add(got[k], ref[k])
                    qual[n].add(got[k], flt[k])
                if deployed is not None:
                    dep[n].add(deployed[k], ref[k])
                    dqual[n].add(deployed[k], flt[k])

    report = VerifyReport(str(onnx_path), ckpt.path, prov, len(batches), num_samples(batches), structure=structure,
                          provider_note=provider_note)
    sample = evidence
    # fidelity: the exact session against the fake-quant model
    outputs: dict[str, Any] = {}
    for n in out_names:
        outputs[n] = {**fid[n].deviation(), "quantization_rms": qerr[n].rms,
                      "rms_ratio": ratio(fid[n].rms, qerr_exact[n].rms),
                      "replay_max_abs_diff": sample.output_deviation.get(n),
                      "replay_ratio": ratio(sample.output_deviation.get(n, math.inf), qerr[n].rms)}
    rows = {r["quantizer"]: r for r in weight_rows + sample.rows}
    replayed = [r for r in sample.rows if r["replay_steps"] is not None]
    failing = sorted((r for r in replayed if r["replay_steps"] > MAX_REPLAY_STEPS), key=lambda r: -r["replay_steps"])
    report.fidelity = {
        "outputs": outputs,
        "quantizers": {n: {"identical_codes": r["identical_codes"],
                           "identical_codes_end_to_end": r["identical_codes_end_to_end"],
                           "replay_steps": r.get("replay_steps")} for n, r in rows.items()},
        "sample_size": sample.samples,
        "exact_samples": exact_samples,  # inputs the exact session's output statistics cover
        "not_replayed": sample.not_replayed,
        "failing_quantizers": [r["quantizer"] for r in failing],
    }
    codes = [r["identical_codes"] for r in sample.rows if r["identical_codes"] is not None]
    worst = min(sample.rows, key=lambda r: r["identical_codes"] if r["identical_codes"] is not None else 1.0,
                default=None)
    report.checks.append(at_least("fidelity.codes", 1.0, min(codes, default=1.0),
                                  worst["quantizer"] if worst and min(codes, default=1.0) < 1.0 else None))
    steps = max((r["replay_steps"] for r in replayed), default=0.0)
    report.checks.append(at_most("fidelity.replay_steps", MAX_REPLAY_STEPS, steps,
                                 ", ".join(f"{r['quantizer']} ({r['replay_steps']:.3g} steps)" for r in failing[:5])
                                 or None))
    worst_out = max(out_names, key=lambda n: outputs[n]["replay_ratio"])
    report.checks.append(at_most("fidelity.replay_outputs", MAX_REPLAY_OUTPUT, outputs[worst_out]["replay_ratio"],
                                 worst_out))
    worst_out = max(out_names, key=lambda n: outputs[n]["rms_ratio"])
    nonfinite = sum(s.nonfinite for s in fid.values())
    check = at_most("fidelity.rms_ratio", max_rms_ratio, outputs[worst_out]["rms_ratio"], worst_out)
    if nonfinite:
        check.passed, check.detail = False, f"{nonfinite} non-finite value(s) in one session but not the other"
    report.checks.append(check)
    if max_abs_diff is not None:
        worst_out = max(out_names, key=lambda n: fid[n].max_abs)
        report.checks.append(at_most("fidelity.max_abs_diff", max_abs_diff, fid[worst_out].max_abs, worst_out))

    # deployment: what a user ships, InferenceSession(path) with default options
    use = dqual if deployment and deploy_error is None else qual
    report.quality = {"session": "deployed" if use is dqual else "exact",
                      "outputs": {n: use[n].quality() for n in out_names},
                      "exact_outputs": {n: qual[n].quality() for n in out_names}}
    if deployment:
        report.deployment = _deployment(model, out_names, dep, fid, qerr, deploy_error)
        if deploy_options:
            report.deployment["disabled_optimizers"] = list(deploy_options)
            report.deployment["notes"].insert(0, "target tensorrt: the deployed session leaves out onnxruntime's "
                                                 f"{', '.join(deploy_options)}, which this graph needs to load there")
        report.checks.append(at_least("deployment.loads", 1, 0 if deploy_error else 1,
                                      deploy_error and f"{deploy_error}; {sessions.deployment_advice(model)}"))
        if max_deploy_ratio is not None and deploy_error is None:
            worst_out = max(out_names, key=lambda n: report.deployment["outputs"][n]["rms_ratio"])
            report.checks.append(at_most("deployment.rms_ratio", max_deploy_ratio,
                                         report.deployment["outputs"][worst_out]["rms_ratio"], worst_out))
    for flag, metric, name in ((min_cosine, "cosine", "quality.min_cosine"), (min_snr, "snr_db", "quality.min_snr_db")):
        if flag is None:
            continue
        values = {n: use[n].quality()[metric] for n in out_names}
        if any(v is None for v in values.values()):
            raise VerifyError(f"--{name.split('.min_')[1].replace('_db', '').replace('_', '-')} cannot be "
                              "evaluated: an output is all zeros")
        worst_out = min(values, key=values.get)
        report.checks.append(at_least(name, flag, values[worst_out], worst_out))
    if per_layer:
        ranked = sorted(rows.values(), key=lambda r: r["snr_db"] if r["snr_db"] is not None else math.inf)
        report.layers = [{**r, "rank": k} for k, r in enumerate(ranked, start=1)]
    report.seconds = time.perf_counter() - t0
    return report


def _deploy_options(model) -> tuple[str, ...]:
    """The optimizers the deployed session leaves out: none for the onnxruntime target (its graphs load with
    default options, or fail ``deployment.loads``), what the graph needs for a TensorRT-target graph."""
    meta = {p.key: p.value for p in model.metadata_props}
    if meta.get("quantcli.target") != "tensorrt":
        return ()
    from exporters.ort_compat import session_needs

    return tuple(session_needs(model).disabled_optimizers)


def _deployment(model, out_names, dep, fid, qerr, error) -> dict[str, Any]:
    """The deployed session against the fake-quant model, per output, and what a large gap likely means."""
    section: dict[str, Any] = {"graph_optimization": "ORT_ENABLE_ALL", "error": error, "outputs": {}, "notes": []}
    if error:
        return section
    for n in out_names:
        r = ratio(dep[n].rms, qerr[n].rms)
        exact = ratio(fid[n].rms, qerr[n].rms)
        section["outputs"][n] = {**dep[n].deviation(), "rms_ratio": r, "exact_rms_ratio": exact}
        if r > DEPLOY_GAP_FLOOR and r > DEPLOY_GAP_FACTOR * exact:
            vnni = sessions.cpu_has_vnni()
            cpu = ("this CPU has no VNNI, so onnxruntime's u8s8 integer kernels can saturate 16-bit partial sums: "
                   "`reduce_range: true` in the config (README, reduce_range) is the usual remedy"
                   if vnni is False else
                   "on x86 CPUs without VNNI the usual cause is u8s8 saturation (`reduce_range: true`, README); "
                   "otherwise onnxruntime's fused integer kernels round differently (requantized int32 biases, "
                   "MatMulNBits on int8 activations): `quantcli inspect MODEL.onnx --runtime onnxruntime` lists them")
            section["notes"].append(f"{n}: the deployed session deviates from the fake-quant model {r:.3g}x the "
                                    f"quantization error, {r / max(exact, 1e-12):.3g}x the exact session's; {cpu}")
    return section
