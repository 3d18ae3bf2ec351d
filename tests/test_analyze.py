"""``quantcli analyze``: sensitivity ranking, statistics, the HTML report, and its errors."""

import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch

from tests.helpers import assert_clean_error, cli

PLANTED = "layers.1.intermediate.input_quantizer"


@pytest.fixture(scope="module")
def planted(calibrated, tmp_path_factory):
    """text_encoder with one activation quantizer's amax forced 10x too small, analysed once."""
    root = tmp_path_factory.mktemp("analyze")
    ck = torch.load(calibrated("text_encoder"), weights_only=True)
    bad = ck["quantizers"][PLANTED]["amax"] / 10
    ck["quantizers"][PLANTED]["amax"] = bad
    ck["state_dict"][f"{PLANTED}.amax"] = bad
    path = root / "bad.calib.pt"
    torch.save(ck, path)
    out = root / "report"
    r = cli("analyze", path, "--out", out, "--num-samples", "32", "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout), out, ck


def test_planted_bad_quantizer_ranks_first(planted):
    rep, _, ck = planted
    rows = rep["quantizers"]
    assert rows[0]["quantizer"] == PLANTED and rows[0]["rank"] == 1
    # clearly separated from the rest, not first by a rounding accident
    assert rows[0]["only_enabled"]["snr_db"] < rows[1]["only_enabled"]["snr_db"] - 10
    # every enabled quantizer is ranked, once, each with its only-off counterpart
    assert sorted(r["quantizer"] for r in rows) == sorted(
        n for n, q in ck["quantizers"].items() if q["enabled"]
    )
    assert all(r["only_disabled"] is not None for r in rows)
    # switching the planted one off recovers more than switching off any other
    best_off = max(rows, key=lambda r: r["only_disabled"]["snr_db"])
    assert best_off["quantizer"] == PLANTED
    assert rep["sensitivity_samples"] == 32 and rep["num_samples"] == 600


def test_statistics_match_an_independent_pass(planted):
    """max |x|, the signed range and the outlier ratio of one activation, from a forward hook on the float
    model."""
    from sample_models import text_encoder

    rep, _, _ = planted
    row = next(r for r in rep["quantizers"] if r["quantizer"] == PLANTED)
    model = text_encoder.build()
    seen = []
    model.layers[1].intermediate.register_forward_pre_hook(
        lambda m, a: seen.append(a[0].detach().reshape(-1))
    )
    with torch.inference_mode():
        for b in text_encoder.evaluation_batches():
            model(**b)
    x = torch.cat(seen).numpy().astype(np.float64)
    assert row["min"] == pytest.approx(x.min(), rel=1e-6) and row["max"] == pytest.approx(x.max(), rel=1e-6)
    absmax = np.abs(x).max()
    assert row["method_amax"]["max"] == pytest.approx(absmax, rel=1e-6)
    # p99.99 from the histogram: within one bin (top / 2048) of numpy's exact percentile
    p = np.percentile(np.abs(x), 99.99)
    top = row["histogram"]["top"]
    assert abs(row["p99_99"] - p) <= top / 2048 + 1e-9
    assert row["outlier_ratio"] == pytest.approx(absmax / row["p99_99"])
    # amax this quantizer stores is the planted one; methods differ from it
    assert row["amax"] < row["method_amax"]["percentile"] / 5
    assert sum(row["histogram"]["counts"]) == x.size


def test_html_report_has_the_plots(planted):
    rep, out, _ = planted
    page = (out / "report.html").read_text()
    assert (
        page.startswith("<!DOCTYPE html>")
        and "<script" not in page
        and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    )
    svgs = [ET.fromstring("<svg" + c[: c.index("</svg>") + 6]) for c in page.split("<svg")[1:]]
    ns = "{http://www.w3.org/2000/svg}"
    ranking, hists = svgs[0], svgs[1:]
    n = len(rep["quantizers"])
    assert len(ranking.findall(f"{ns}rect")) == n  # one bar per quantizer
    assert len(hists) == n
    # each histogram marks the calibrated amax; activation histograms also the four methods' amax
    planted_svg = next(s for s in hists if PLANTED in s.get("aria-label"))
    titles = [t.text for t in planted_svg.iter(f"{ns}title")]
    for label in ("amax", "max", "percentile", "mse", "entropy"):
        assert any(t.startswith(f"{label} = ") for t in titles), (label, titles)
    assert json.loads((out / "analysis.json").read_text())["quantizers"][0]["quantizer"] == PLANTED


def test_errors_are_one_line_exit_2(tmp_path, calibrated):
    assert_clean_error(cli("analyze", tmp_path / "missing.calib.pt"), "does not exist")
    bad = tmp_path / "not.calib.pt"
    bad.write_text("hello")
    assert_clean_error(cli("analyze", bad), "not a quantcli calibrated checkpoint")
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert_clean_error(cli("analyze", calibrated("digits_cnn"), "--out", afile), "is a file")
    assert_clean_error(
        cli("analyze", calibrated("digits_cnn"), "--out", tmp_path / "no" / "dir"), "does not exist"
    )
    assert_clean_error(cli("analyze", calibrated("digits_cnn"), "--num-samples", "0"), "--num-samples")
    assert not (tmp_path / "no").exists()


def test_an_asymmetric_quantizer_reports_its_range(planted):
    """A signed activation on the uint8 grid with a zero point (the int8 preset's on onnxruntime) was
    described by its amax alone: the amin its grid starts at appeared nowhere."""
    rep, _, ck = planted
    rows = {r["quantizer"]: r for r in rep["quantizers"]}
    asym = [n for n, r in rows.items() if r["asymmetric"]]
    assert asym, "text_encoder has signed activations on the asymmetric grid"
    for name in asym:
        want = float(ck["state_dict"][f"{name}.amin"].min())
        assert rows[name]["amin"] == pytest.approx(want) and rows[name]["amin"] < 0
    assert all(r["amin"] is None for r in rows.values() if not r["asymmetric"])
