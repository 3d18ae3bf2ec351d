"""Option groups are declared once and build their object by keyword; every default the CLI shows is the
library's (quantcli.defaults)."""

from __future__ import annotations

import inspect
from typing import Annotated, Optional

import pytest
import typer
from typer.testing import CliRunner

from quantcli import defaults
from quantcli.cli.options import PREPROCESSING, THRESHOLDS, OptionGroup


def _app_with(group: OptionGroup, seen: dict) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    @group.add
    def cmd(
        first: Annotated[str, typer.Argument()],
        before: Annotated[int, typer.Option("--before")] = 1,
        grouped=None,
        after: Annotated[int, typer.Option("--after")] = 2,
    ) -> None:
        seen.update(first=first, before=before, grouped=grouped, after=after)

    @app.command()
    def other() -> None:  # a second command, so that ``cmd`` keeps its name
        pass

    return app


PAIR = OptionGroup(
    "grouped",
    {
        "low": (Annotated[int, typer.Option("--low")], 0),
        "high": (Annotated[Optional[int], typer.Option("--high")], None),
    },
    lambda low, high: (low, high),
)


def test_a_group_puts_its_options_where_its_parameter_stands_and_builds_by_keyword():
    seen: dict = {}
    app = _app_with(PAIR, seen)
    r = CliRunner().invoke(app, ["cmd", "x", "--high", "7", "--after", "5"])
    assert r.exit_code == 0, r.output
    assert seen == {"first": "x", "before": 1, "grouped": (0, 7), "after": 5}
    names = list(inspect.signature(PAIR.add(lambda first, grouped=None, after=2: None)).parameters)
    assert names == ["first", "low", "high", "after"]
    help_text = CliRunner().invoke(app, ["cmd", "--help"]).output
    assert (
        help_text.index("--before")
        < help_text.index("--low")
        < help_text.index("--high")
        < help_text.index("--after")
    )


def test_a_group_needs_its_parameter():
    with pytest.raises(TypeError, match="no parameter 'grouped'"):
        PAIR.add(lambda first: None)


def test_preprocessing_builds_data_options_by_keyword():
    from quantcli.inputs.data import DataOptions

    built = PREPROCESSING.build(tokenizer=None, max_length=64, image_size="32x48", mean="0.5", std="0.25")
    assert built == DataOptions(max_length=64, image_size="32x48", mean="0.5", std="0.25")


def test_thresholds_validate_and_leave_out_what_was_not_given():
    given = dict(max_abs_diff=None, max_rms_ratio=2.0, max_deploy_ratio=None, min_cosine=0.99, min_snr=None)
    assert THRESHOLDS.build(**given) == {"max_rms_ratio": 2.0, "min_cosine": 0.99}
    from quantcli.errors import QuantCliError

    with pytest.raises(QuantCliError, match="--max-deploy-ratio must be a number >= 0, got -1"):
        THRESHOLDS.build(**{**given, "max_deploy_ratio": -1.0})


def test_the_defaults_shown_are_the_librarys():
    from quantcli.calibration.calibrate import calibrate
    from quantcli.calibration.job import CalibrationRequest
    from quantcli.cli.application import app
    from quantcli.verify.verdict import MAX_RMS_RATIO

    request = CalibrationRequest(model="m")
    assert (request.percentile, request.num_bins, request.config, request.method, request.placement) == (
        defaults.PERCENTILE,
        defaults.NUM_BINS,
        defaults.CONFIG,
        defaults.METHOD,
        defaults.PLACEMENT,
    )
    params = inspect.signature(calibrate).parameters
    assert (
        params["percentile"].default == defaults.PERCENTILE
        and params["num_bins"].default == defaults.NUM_BINS
    )
    assert MAX_RMS_RATIO == defaults.MAX_RMS_RATIO
    runner = CliRunner()
    calibrate_help = " ".join(runner.invoke(app, ["calibrate", "--help"]).output.split())
    assert (
        f"[default: {defaults.PERCENTILE}]" in calibrate_help
        and f"[default: {defaults.NUM_BINS}]" in calibrate_help
    )
    verify_help = " ".join(runner.invoke(app, ["verify", "--help"]).output.split())
    assert f"[default: {defaults.MAX_RMS_RATIO}]" in verify_help
    analyze_help = " ".join(runner.invoke(app, ["analyze", "--help"]).output.split())
    assert f"[default: {defaults.SENSITIVITY_SAMPLES}]" in analyze_help


def test_the_packages_app_is_the_typer_app_whatever_was_imported_first():
    # a submodule named like the package's lazy attribute would replace it once imported (the import system
    # sets the package's attribute to the submodule): `from quantcli.cli import app` then gave a module
    import subprocess
    import sys

    code = (
        "import quantcli.cli.entry, quantcli.cli.application, typer\n"
        "from quantcli.cli import app, main\n"
        "assert isinstance(app, typer.Typer), type(app)\n"
        "assert callable(main) and not isinstance(main, type(typer)), type(main)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
