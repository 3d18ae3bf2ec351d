"""``quantcli verify``: check an exported graph in onnxruntime. Exit 0: every check passed; 1: a numerical
check failed; 2: bad input."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from quantcli.cli.files import checkpoint_inputs, external, refuse_inputs
from quantcli.cli.guard import guarded
from quantcli.cli.options import (
    PREPROCESSING,
    THRESHOLDS,
    BatchSizeOpt,
    CpuOpt,
    DataOpt,
    JsonOpt,
    NumSamplesOpt,
    Provider,
    TrustCodeOpt,
)
from quantcli.cli.output import err, fmt, json_text, out, print_json, table

#: verify's ``--decode-steps`` default (an option of decode graphs alone)
DECODE_STEPS = 16


@guarded
@PREPROCESSING.add
@THRESHOLDS.add
def verify(
    onnx_path: Annotated[Path, typer.Argument(help="The exported ONNX file.")],
    reference: Annotated[
        Path, typer.Option("--reference", help="The calibrated checkpoint it was exported from.")
    ],
    data: DataOpt = None,
    provider: Annotated[
        Provider, typer.Option("--provider", help="onnxruntime execution provider.")
    ] = Provider.auto,
    thresholds=None,
    per_layer: Annotated[
        bool, typer.Option("--per-layer", help="Rank quantized layers by their local quantization error.")
    ] = False,
    report_path: Annotated[
        Optional[Path], typer.Option("--report", help="Write every metric as JSON to this file.")
    ] = None,
    batch_size: BatchSizeOpt = None,
    num_samples: NumSamplesOpt = None,
    max_ppl_increase: Annotated[
        Optional[float],
        typer.Option(
            "--max-ppl-increase",
            min=0.0,
            help="Decode graphs (causal LMs): largest perplexity increase over the float model on held-out "
            "text, relative (0.1: 10%; default 0.5).",
        ),
    ] = None,
    min_token_agreement: Annotated[
        Optional[float],
        typer.Option(
            "--min-token-agreement",
            min=0.0,
            max=1.0,
            help="Decode graphs: smallest fraction of greedy decode steps where the graph's next token is "
            "the float model's (default 0.5).",
        ),
    ] = None,
    decode_steps: Annotated[
        int, typer.Option("--decode-steps", min=1, help="Decode graphs: greedy steps per held-out prompt.")
    ] = DECODE_STEPS,
    as_json: JsonOpt = False,
    trust_code: TrustCodeOpt = False,
    preprocessing=None,
    cpu: CpuOpt = None,
) -> int:
    """Check an exported graph in onnxruntime. Exit 0: every check passed; 1: a numerical check failed; 2: bad
    input."""
    from quantcli.files import atomic_write, writable_directory
    from quantcli.inputs.checkpoint import load_calibrated
    from quantcli.inputs.data import DataOptions, cap_samples
    from quantcli.verify import verify_onnx
    from quantcli.verify.causal_lm import MAX_TOKENS, is_decode_graph, verify_decode_graph

    if report_path is not None:
        writable_directory(report_path)  # before the work, not after it
        refuse_inputs(
            report_path,
            [
                ("the graph", onnx_path),
                ("the graph's external data", external(onnx_path)),
                ("the reference checkpoint", reference),
                ("--data", data),
            ],
            "--report",
        )
    ckpt = load_calibrated(reference, trust_code=trust_code)
    if report_path is not None:
        refuse_inputs(report_path, [("the model's file", ckpt.spec.path)], "--report")
    decode = is_decode_graph(onnx_path)
    if decode and (preprocessing is None or preprocessing.max_length is None):
        # calibration's length may be shorter than the sequences a language model is judged on
        preprocessing = preprocessing or DataOptions()
        preprocessing.min_length = MAX_TOKENS
    batches = checkpoint_inputs(ckpt, data, batch_size, num_samples, preprocessing)
    if batches is None and num_samples is not None:
        batches = cap_samples(ckpt.evaluation_batches() or [ckpt.example], num_samples)
    _refuse_options_of_the_other_kind(
        decode, thresholds, per_layer, max_ppl_increase, min_token_agreement, decode_steps
    )
    if decode:
        lm = {
            "max_ppl_increase": max_ppl_increase,
            "min_token_agreement": min_token_agreement,
            "max_rms_ratio": thresholds.get("max_rms_ratio"),
        }
        rep = verify_decode_graph(
            onnx_path,
            ckpt,
            batches or ckpt.evaluation_batches() or [ckpt.example],
            steps=decode_steps,
            **{k: v for k, v in lm.items() if v is not None},
        )
        d = rep.to_dict()
        if report_path is not None:
            atomic_write(report_path, lambda tmp: Path(tmp).write_text(json_text(d) + "\n"))
        if as_json:
            print_json(d)
        else:
            render_lm_verify(rep, onnx_path, reference)
        return 0 if rep.passed else 1
    rep = verify_onnx(
        onnx_path,
        ckpt,
        batches,
        provider=provider.value,
        per_layer=per_layer,
        cpu=cpu.value if cpu is not None else None,
        **thresholds,
    )
    d = rep.to_dict()
    if report_path is not None:
        atomic_write(report_path, lambda tmp: Path(tmp).write_text(json_text(d) + "\n"))
    if as_json:
        print_json(d)
    else:
        render_verify(rep, onnx_path, reference)
    return 0 if rep.passed else 1


def _refuse_options_of_the_other_kind(
    decode: bool, thresholds: dict, per_layer: bool, max_ppl_increase, min_token_agreement, decode_steps: int
) -> None:
    """A gate a CI script sets must not be dropped in silence: a decode graph is judged by perplexity, token
    agreement and decode parity, any other graph by fidelity, deployment and quality checks."""
    from quantcli import defaults
    from quantcli.errors import QuantCliError, flags_apply

    if decode:
        given = [
            f"--{k.replace('_', '-')}" for k in ("max_abs_diff", "min_cosine", "min_snr") if k in thresholds
        ]
        given += [
            f"--{k.replace('_', '-')}"
            for k, default in (("max_deploy_ratio", defaults.MAX_DEPLOY_RATIO),)
            if thresholds.get(k, default) != default
        ]
        given += ["--per-layer"] if per_layer else []
        if given:
            raise QuantCliError(
                f"{', '.join(given)}: for graphs other than decode graphs; a decode graph (a causal LM with "
                "a KV cache) is judged by --max-ppl-increase, --min-token-agreement, --max-rms-ratio and "
                "--decode-steps"
            )
        return
    given = [
        flag
        for flag, v in (
            ("--max-ppl-increase", max_ppl_increase),
            ("--min-token-agreement", min_token_agreement),
        )
        if v is not None
    ]
    given += ["--decode-steps"] if decode_steps != DECODE_STEPS else []
    if given:
        raise QuantCliError(f"{flags_apply(given)} to decode graphs (causal LMs with a KV cache) only")


def render_verify(rep, onnx_path: Path, reference: Path) -> None:
    """The checks, the quality of every output, the per-layer ranking (--per-layer), then PASS or FAIL."""
    out.print(f"verify {onnx_path} against {reference} — {rep.num_samples} samples, {rep.provider}")
    if rep.provider_note:
        err.print(f"warning: {rep.provider_note}")
    st = rep.structure
    if st.get("quantizers_expected", 0) == 0:
        err.print("warning: the graph holds no quantizer: every check compares a float graph with itself")
    out.print(table("checks", ("check", "threshold", "measured", "result", "where"), _check_rows(rep)))
    for p in st["problems"][:20]:
        out.print(f"  structure: {p}")
    for note in st["notes"]:
        out.print(f"  structure (info): {note}")
    for c in rep.checks:
        if not c.passed and c.detail and len(c.detail) > 120:
            out.print(f"  {c.name}: {c.detail}")
    out.print(_qualitytable(rep))
    if rep.deployment.get("error"):
        out.print(f"  deployment: {rep.deployment['error']}")
    for note in rep.deployment.get("notes", []):
        out.print(f"  deployment: {note}")
    out.print(f"  per-quantizer evidence on {rep.fidelity['sample_size']} samples; {rep.seconds:.1f} s")
    if rep.layers:
        out.print(_layerstable(rep.layers))
    out.print("[bold green]PASS[/]" if rep.passed else "[bold red]FAIL[/]", markup=True)


def render_lm_verify(rep, onnx_path: Path, reference: Path) -> None:
    """A decode graph's checks: perplexity, greedy-token agreement, decode/prefill parity; then PASS or
    FAIL."""
    out.print(
        f"verify {onnx_path} against {reference} — decode graph, {rep.num_sequences} held-out sequences"
    )
    rows = (
        (
            c.name,
            ("<= " if c.kind == "max" else ">= ") + fmt(c.threshold),
            fmt(c.value),
            "pass" if c.passed else "FAIL",
            c.detail or "",
        )
        for c in rep.checks
    )
    out.print(table("checks", ("check", "threshold", "measured", "result", "detail"), rows))
    p, g = rep.perplexity, rep.generation
    if p:  # measured (not when the structure check failed first)
        out.print(
            f"  perplexity on {p['tokens']} held-out tokens: float {fmt(p['float'])}, fake-quant "
            f"{fmt(p['fake_quant'])}, graph {fmt(p['graph'])}"
        )
    if g:
        out.print(
            f"  greedy generation, {g['steps']} steps from {g['prompts']} prompts: "
            f"{g['identical_generations']} identical to the float model's; first divergence per prompt "
            f"{g['first_divergence']}"
        )
    out.print("[bold green]PASS[/]" if rep.passed else "[bold red]FAIL[/]", markup=True)


def _check_rows(rep):
    st = rep.structure
    pruned = f", {len(st['pruned'])} pruned (unused)" if st["pruned"] else ""
    yield (
        "structure",
        f"{st['quantizers_expected']} quantizers",
        f"{st['quantizers_found']} found{pruned}, {len(st['problems'])} problem(s)",
        "pass" if st["passed"] else "FAIL",
        ", ".join(st["layers_with_problems"][:3]) or "",
    )
    for c in rep.checks:
        yield (
            c.name,
            ("<= " if c.kind == "max" else ">= ") + fmt(c.threshold),
            fmt(c.value),
            "pass" if c.passed else "FAIL",
            "" if c.passed or not c.detail else c.detail[:120],
        )


def _qualitytable(rep) -> Table:
    dep = rep.deployment.get("outputs", {})
    rows = (
        (
            name,
            fmt(m["cosine"]),
            fmt(m["snr_db"]),
            fmt(m["max_abs_error"]),
            fmt(m.get("top1_agreement")),
            fmt(rep.fidelity["outputs"][name]["rms_ratio"]),
            fmt(dep.get(name, {}).get("rms_ratio")),
        )
        for name, m in rep.quality["outputs"].items()
    )
    return table(
        f"quality vs the float model ({rep.quality['session']} session), deployment vs fake-quant",
        ("output", "cosine", "SNR dB", "max abs err", "top-1 agree", "exact rms ratio", "deployed rms ratio"),
        rows,
    )


def _layerstable(layers: list[dict]) -> Table:
    rows = (
        (
            str(r["rank"]),
            r["quantizer"],
            r["kind"],
            fmt(r["snr_db"]),
            fmt(r["max_abs_error"]),
            fmt(r["identical_codes"]),
            fmt(r["identical_codes_end_to_end"]),
            fmt(r.get("replay_steps")),
        )
        for r in layers
    )
    return table(
        "layers, worst local quantization error first",
        (
            "rank",
            "quantizer",
            "kind",
            "SNR dB",
            "max abs err",
            "identical codes",
            "end to end",
            "replay steps",
        ),
        rows,
    )
