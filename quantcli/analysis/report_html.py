"""The ``analyze`` report as one self-contained HTML page: inline SVG plots, no scripts, no dependency.

* the sensitivity ranking: per quantizer a bar of ``1 - cosine`` (log scale) with only that quantizer on;
* per quantizer, the histogram of ``|x|`` (log counts) with the calibrated amax and the amax each method would
  choose marked, next to its statistics.

:func:`render` is a pure function of :meth:`quantcli.analysis.analyze.AnalysisReport.to_dict`'s dictionary.
"""

from __future__ import annotations

import html
import math

from calibrators.methods import AMAX_METHODS

#: one plot colour per amax method, in :data:`calibrators.methods.AMAX_METHODS` order
METHOD_COLORS = dict(zip(AMAX_METHODS, ("#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e"), strict=True))
CHOSEN_COLOR = "#d62728"
_LOSS_FLOOR = 1e-7  # 1 - cosine below this is drawn as the floor (float rounding)


def _f(v, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        return f"{v:.{digits}g}"
    return html.escape(str(v))


def _loss(cos) -> float:
    return 1.0 if cos is None else max(_LOSS_FLOOR, 1.0 - cos)


def ranking_svg(rows: list[dict], width: int = 900) -> str:
    """Horizontal bars, worst first: ``1 - cosine`` with only that quantizer enabled, on a log axis."""
    bar_h, gap, label_w, top = 16, 4, 430, 28
    plot_w = width - label_w - 150
    lo, hi = math.log10(_LOSS_FLOOR), 0.0
    h = top + len(rows) * (bar_h + gap) + 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" font-family="sans-serif" '
        'font-size="11" role="img" aria-label="sensitivity ranking">',
        f'<text x="{label_w}" y="14" font-size="12">1 - cosine vs float, only this quantizer enabled '
        "(log scale; longer is worse)</text>",
    ]
    for k in range(int(lo), int(hi) + 1):
        x = label_w + (k - lo) / (hi - lo) * plot_w
        parts.append(f'<line x1="{x:.1f}" y1="{top - 6}" x2="{x:.1f}" y2="{h - 24}" stroke="#ddd"/>')
        parts.append(f'<text x="{x:.1f}" y="{h - 10}" text-anchor="middle" fill="#555">1e{k}</text>')
    for i, r in enumerate(rows):
        y = top + i * (bar_h + gap)
        oe = r["only_enabled"]
        w = (math.log10(_loss(oe["cosine"])) - lo) / (hi - lo) * plot_w
        name = html.escape(r["quantizer"])
        parts.append(
            f'<text x="{label_w - 6}" y="{y + 12}" text-anchor="end"><title>{name}</title>'
            f"{i + 1}. {html.escape(_short(r['quantizer'], 64))}</text>"
        )
        parts.append(
            f'<rect x="{label_w}" y="{y}" width="{max(w, 1):.1f}" height="{bar_h}" '
            f'fill="{CHOSEN_COLOR}" '
            f'fill-opacity="0.75"><title>{name}: cosine {_f(oe["cosine"], 7)}, SNR '
            f"{_f(oe['snr_db'])} dB"
            "</title></rect>"
        )
        parts.append(
            f'<text x="{label_w + max(w, 1) + 4:.1f}" y="{y + 12}" fill="#333">cos '
            f"{_f(oe['cosine'], 6)}, "
            f"{_f(oe['snr_db'], 3)} dB</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _short(name: str, n: int) -> str:
    return name if len(name) <= n else "…" + name[-(n - 1) :]


def histogram_svg(row: dict, width: int = 520, height: int = 170) -> str:
    """Bars of the histogram of ``|x|`` (log counts) with the calibrated amax (solid) and each method's amax
    (dashed) as vertical lines."""
    counts = row["histogram"]["counts"]
    top = row["histogram"]["top"] or 1.0
    left, bottom, pw, ph = 8, 18, width - 16, height - 40
    peak = max((math.log10(c + 1) for c in counts), default=1.0) or 1.0
    bw = pw / max(len(counts), 1)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" '
        f'font-size="10" role="img" aria-label="histogram of {html.escape(row["quantizer"])}">',
        f'<rect x="{left}" y="{bottom - 10}" width="{pw}" height="{ph + 10}" fill="#fafafa" stroke="#ccc"/>',
    ]
    base = bottom + ph
    for i, c in enumerate(counts):
        if c <= 0:
            continue
        bh = math.log10(c + 1) / peak * ph
        parts.append(
            f'<rect x="{left + i * bw:.2f}" y="{base - bh:.2f}" width="{max(bw - 0.3, 0.5):.2f}" '
            f'height="{bh:.2f}" fill="#888"/>'
        )

    def vline(v, color, dash, label, idx):
        if v is None or not math.isfinite(v):
            return
        x = left + min(v / top, 1.0) * pw
        d = ' stroke-dasharray="4,3"' if dash else ""
        parts.append(
            f'<line x1="{x:.1f}" y1="{bottom - 10}" x2="{x:.1f}" y2="{base}" stroke="{color}" '
            f'stroke-width="{1.2 if dash else 2}"{d}><title>{label} = {_f(v, 6)}</title></line>'
        )
        parts.append(
            f'<text x="{left + 4 + idx * 100}" y="{height - 6}" fill="{color}">{label} {_f(v, 4)}</text>'
        )

    vline(row.get("amax"), CHOSEN_COLOR, False, "amax", 0)
    for j, (m, v) in enumerate((row.get("method_amax") or {}).items(), 1):
        vline(v, METHOD_COLORS.get(m, "#000"), True, m, j)
    parts.append(
        f'<text x="{left + pw}" y="{bottom - 12}" text-anchor="end" fill="#555">|x| up to '
        f"{_f(top, 4)}"
        "</text></svg>"
    )
    return "".join(parts)


def render(report: dict) -> str:
    """The whole page."""
    rows = report["quantizers"]
    ov = report["overall"]
    sec = report.get("seconds", {})
    head = (
        f"<p>{report['num_samples']} samples; sensitivity on the first {report['sensitivity_samples']}. "
        f"All quantizers enabled: cosine {_f(ov['cosine'], 6)}, SNR {_f(ov['snr_db'], 4)} dB. "
        f"Time: statistics {_f(sec.get('statistics'), 3)} s, sensitivity "
        f"{_f(sec.get('sensitivity'), 3)} s "
        f"({sec.get('passes', '-')} forward passes).</p>"
    )
    table = [
        "<table><tr><th>rank</th><th>quantizer</th><th>format</th><th>cos only on</th><th>SNR only "
        "on</th>"
        "<th>cos only off</th><th>range</th><th>outlier ratio</th><th>amax</th>"
        + "".join(f"<th>{m}</th>" for m in AMAX_METHODS)
        + "</tr>"
    ]
    for r in rows:
        ma = r.get("method_amax") or {}
        od = r.get("only_disabled") or {}
        table.append(
            f"<tr><td>{r['rank']}</td><td><a href='#q{r['rank']}'>{html.escape(r['quantizer'])}</a></td>"
            f"<td>{html.escape(r['format'])}{' per-channel' if r['per_channel'] else ''}</td>"
            f"<td>{_f(r['only_enabled']['cosine'], 6)}</td><td>{_f(r['only_enabled']['snr_db'], 4)}</td>"
            f"<td>{_f(od.get('cosine'), 6)}</td><td>[{_f(r['min'])}, {_f(r['max'])}]</td>"
            f"<td>{_f(r['outlier_ratio'], 3)}</td><td>{_f(r['amax'])}</td>"
            + "".join(f"<td>{_f(ma.get(m))}</td>" for m in AMAX_METHODS)
            + "</tr>"
        )
    table.append("</table>")
    cards = []
    for r in rows:
        cards.append(
            f"<div class='card' id='q{r['rank']}'><h3>{r['rank']}. {html.escape(r['quantizer'])}</h3>"
            f"{histogram_svg(r)}<p>range [{_f(r['min'])}, {_f(r['max'])}], p99.99 |x| {_f(r['p99_99'])}, "
            f"outlier ratio {_f(r['outlier_ratio'], 3)}; only this on: cosine "
            f"{_f(r['only_enabled']['cosine'], 6)}"
            f"</p></div>"
        )
    style = (
        "body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ddd;padding:2px 6px;text-align:right}td:nth-child(2){text-align:left}"
        ".card{display:inline-block;vertical-align:top;margin:6px;padding:4px 8px;border:1px solid #eee}"
        ".card h3{font-size:12px;margin:2px 0}.card p{font-size:11px;margin:2px 0;max-width:520px}"
    )
    title = f"quantcli analyze {html.escape(report['checkpoint'])}"
    return (
        f"<!DOCTYPE html><html><head><meta "
        f"charset='utf-8'><title>{title}</title><style>{style}</style></head>"
        f"<body><h1>{title}</h1>{head}<h2>Sensitivity ranking (worst first)</h2>{ranking_svg(rows)}"
        f"<h2>Statistics</h2>{''.join(table)}<h2>Histograms of |x| with amax marked</h2>"
        f"<p>solid red: the calibrated amax; dashed: the amax of "
        + ", ".join(f"<span style='color:{c}'>{m}</span>" for m, c in METHOD_COLORS.items())
        + f"</p>{''.join(cards)}</body></html>\n"
    )
