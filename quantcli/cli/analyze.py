"""``quantcli analyze``: rank quantizers by sensitivity, with statistics and plots (an HTML report and
JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from calibrators.methods import AMAX_METHODS
from quantcli import defaults
from quantcli.cli.files import checkpoint_inputs, refuse_inputs
from quantcli.cli.guard import guarded
from quantcli.cli.options import PREPROCESSING, BatchSizeOpt, CalibratedArg, DataOpt, JsonOpt, TrustCodeOpt
from quantcli.cli.output import fmt, json_text, out, print_json, progress, table


@guarded
@PREPROCESSING.add
def analyze(
    calibrated: CalibratedArg,
    data: DataOpt = None,
    out_dir: Annotated[
        Optional[Path],
        typer.Option(
            "--out", help="Folder for report.html and analysis.json (default <checkpoint>.analysis)."
        ),
    ] = None,
    num_samples: Annotated[
        int,
        typer.Option(
            "--num-samples",
            help="Samples the sensitivity passes use (two passes per quantizer; at least 1); statistics "
            "use all the data.",
        ),
    ] = defaults.SENSITIVITY_SAMPLES,
    batch_size: BatchSizeOpt = None,
    as_json: JsonOpt = False,
    trust_code: TrustCodeOpt = False,
    preprocessing=None,
) -> None:
    """Rank quantizers by sensitivity, with statistics and plots: an HTML report and JSON."""
    from quantcli.analysis.analyze import analyze as run_analysis
    from quantcli.analysis.report_html import render
    from quantcli.files import write_together
    from quantcli.inputs.checkpoint import load_calibrated

    out_dir = _analysis_folder(
        out_dir or Path(f"{calibrated.with_suffix('').name}.analysis"),
        [("the checkpoint", calibrated), ("--data", data)],
    )
    ckpt = load_calibrated(calibrated, trust_code=trust_code)
    _analysis_folder(out_dir, [("the model's file", ckpt.spec.path)])
    batches = checkpoint_inputs(ckpt, data, batch_size, None, preprocessing)
    if batches is None:
        batches = ckpt.evaluation_batches() or [ckpt.example]
    with progress(100, "analyzing", not as_json) as advance:
        rep = run_analysis(
            ckpt,
            batches,
            sample_samples=num_samples,
            progress=None if advance is None else (lambda stage, k, n: advance(int(99 * k / n))),
        )
    d = rep.to_dict()
    write_together(out_dir, {"analysis.json": json_text(d, indent=1) + "\n", "report.html": render(d)})
    html_path, json_path = out_dir / "report.html", out_dir / "analysis.json"
    if as_json:
        print_json({**d, "report": str(html_path), "json": str(json_path)})
    else:
        render_analyze(d, calibrated, html_path, json_path)


def _analysis_folder(out_dir: Path, inputs) -> Path:
    """``--out``, checked before the analysis runs: a writable folder (existing or not) in an existing
    directory, whose report files are none of the files read."""
    from quantcli.errors import QuantCliError
    from quantcli.files import writable_directory

    if out_dir.exists() and not out_dir.is_dir():
        raise QuantCliError(f"--out {out_dir} is a file; give a folder")
    writable_directory(out_dir / "report.html" if out_dir.is_dir() else out_dir)
    for name in ("report.html", "analysis.json"):
        refuse_inputs(out_dir / name, inputs, "--out")
    return out_dir


def render_analyze(d: dict, calibrated: Path, html_path: Path, json_path: Path) -> None:
    """The 20 most sensitive quantizers, with each amax method's amax, the time, the files written."""
    ov = d["overall"]
    rows = (
        (
            str(r["rank"]),
            r["quantizer"],
            fmt(r["only_enabled"]["cosine"]),
            fmt(r["only_enabled"]["snr_db"]),
            fmt((r["only_disabled"] or {}).get("cosine")),
            fmt(r["outlier_ratio"]),
            fmt(r["amax"]) if r.get("amin") is None else f"{fmt(r['amin'])} .. {fmt(r['amax'])}",
            *(fmt((r["method_amax"] or {}).get(m)) for m in AMAX_METHODS),
        )
        for r in d["quantizers"][:20]
    )
    out.print(
        table(
            f"quantcli analyze {calibrated}: {d['num_samples']} samples, sensitivity on "
            f"{d['sensitivity_samples']}; all on: cosine {fmt(ov['cosine'])}, SNR "
            f"{fmt(ov['snr_db'])} dB",
            (
                "rank",
                "quantizer",
                "cos only on",
                "SNR only on",
                "cos only off",
                "outlier ratio",
                "amax",
                *AMAX_METHODS,
            ),
            rows,
        )
    )
    if len(d["quantizers"]) > 20:
        out.print(f"... {len(d['quantizers']) - 20} more in the report")
    sec = d["seconds"]
    out.print(
        f"time {sec['total']:.2f} s (statistics {sec['statistics']:.2f} s, sensitivity "
        f"{sec['sensitivity']:.2f} s, {sec['passes']} forward passes)"
    )
    out.print(f"written {html_path} and {json_path}")
