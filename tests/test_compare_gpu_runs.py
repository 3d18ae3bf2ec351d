"""benchmarks.compare_gpu_runs matches two bench_gpu_calibration runs row by row."""

from __future__ import annotations

import json

from benchmarks.compare_gpu_runs import main


def _run(path, rows):
    path.write_text(json.dumps({"device": "test GPU", "rows": rows}))
    return str(path)


def test_rows_are_matched_by_model_and_method_and_the_change_is_the_ratios(tmp_path, capsys):
    row = {"model": "m", "method": "max", "ratio": "2.00x", "observe ratio": "1.50x", "target": "<= 1.15x"}
    before = _run(tmp_path / "a.json", [row, {**row, "method": "mse", "ratio": "4.00x"}])
    after = _run(
        tmp_path / "b.json",
        [{**row, "ratio": "1.50x", "result": "MISSED", "graph replays": 7}, {**row, "method": "entropy"}],
    )
    got = {r["method"]: r for r in main([before, after])}
    assert got["max"]["change"] == "-25%" and got["max"]["ratio"] == "2.0 -> 1.5"
    assert got["max"]["graph replays"] == 7 and got["max"]["after"] == "MISSED"
    assert got["mse"]["change"] == "-" and got["mse"]["ratio"] == "4.0 -> -"  # in the first run only
    assert got["entropy"]["ratio"] == "- -> 2.0"  # in the second only
    assert "test GPU" in capsys.readouterr().out
