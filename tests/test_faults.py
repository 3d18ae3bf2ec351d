"""The fault campaign of issue 24: outputs that are inputs, interrupts and kills during writes, full disks,
damaged checkpoints, --json on failures, the error path with the installed typer.

Interrupts are sent to a subprocess at a point it reports (a marker file its patched writer creates), never
after a fixed sleep."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from quantcli import files
from quantcli.errors import QuantCliError
from tests.helpers import assert_clean_error, cli, cli_subprocess

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------- outputs = inputs


def _digits_data(path: Path) -> Path:
    np.save(path, np.random.default_rng(0).random((16, 1, 8, 8), dtype=np.float32))
    return path


def _unchanged(path: Path, before: bytes) -> None:
    assert path.read_bytes() == before, f"{path} was overwritten"


def test_calibrate_refuses_an_out_that_is_an_input(tmp_path):
    data = _digits_data(tmp_path / "x.npy")
    before = data.read_bytes()
    assert_clean_error(cli("calibrate", "digits_cnn", "--data", data, "--out", data), "--out", "--data")
    _unchanged(data, before)
    link = tmp_path / "link.calib.pt"
    link.symlink_to(data)
    assert_clean_error(cli("calibrate", "digits_cnn", "--data", data, "--out", link), "--data")
    _unchanged(data, before)
    fac = tmp_path / "fac.py"
    fac.write_text("from sample_models.digits_cnn import build\n")
    src = fac.read_bytes()
    assert_clean_error(cli("calibrate", f"{fac}:build", "--data", data, "--out", fac), "the model")
    _unchanged(fac, src)
    w = tmp_path / "w.pt"
    from sample_models.digits_cnn import build

    torch.save(build().state_dict(), w)
    wb = w.read_bytes()
    assert_clean_error(
        cli("calibrate", "digits_cnn", "--weights", w, "--data", data, "--out", w), "--weights"
    )
    _unchanged(w, wb)


def test_export_and_verify_refuse_outputs_that_are_inputs(calibrated, exported, tmp_path):
    ck = tmp_path / "c.calib.pt"
    ck.write_bytes(calibrated("digits_cnn").read_bytes())
    g = tmp_path / "g.onnx"
    g.write_bytes(exported("digits_cnn").read_bytes())
    cb, gb = ck.read_bytes(), g.read_bytes()
    assert_clean_error(cli("export", ck, "--onnx", ck), "--onnx", "checkpoint")
    for report in (g, ck):
        assert_clean_error(cli("verify", g, "--reference", ck, "--report", report), "--report")
    link = tmp_path / "r.json"
    link.symlink_to(g)
    assert_clean_error(cli("verify", g, "--reference", ck, "--report", link), "--report", "the graph")
    _unchanged(ck, cb)
    _unchanged(g, gb)


def test_analyze_refuses_a_report_file_that_is_an_input(calibrated, tmp_path):
    ck = tmp_path / "c.calib.pt"
    ck.write_bytes(calibrated("digits_cnn").read_bytes())
    before = ck.read_bytes()
    out = tmp_path / "a"
    out.mkdir()
    (out / "analysis.json").symlink_to(ck)
    assert_clean_error(cli("analyze", ck, "--out", out), "--out", "checkpoint")
    _unchanged(ck, before)


# ----------------------------------------------------------------------- analyze: check first, all or nothing


def test_analyze_checks_its_folder_before_the_analysis(calibrated, tmp_path, monkeypatch):
    import quantcli.analysis.analyze

    def never(*a, **k):
        raise AssertionError("the analysis ran before the output folder was checked")

    monkeypatch.setattr(quantcli.analysis.analyze, "analyze", never)
    taken = tmp_path / "taken"
    (taken / "report.html").mkdir(parents=True)  # a file name the report cannot take
    assert_clean_error(cli("analyze", calibrated("digits_cnn"), "--out", taken), "report.html", "directory")
    assert_clean_error(
        cli("analyze", calibrated("digits_cnn"), "--out", tmp_path / "no" / "a"), "does not exist"
    )
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user who can write anywhere")
        assert_clean_error(cli("analyze", calibrated("digits_cnn"), "--out", ro / "a"), "not writable")
    finally:
        ro.chmod(0o755)


def _full_disk_after(monkeypatch, name: str):
    real = Path.write_text

    def write_text(self, text, *a, **k):
        if self.name == name:
            with open(self, "w") as f:
                f.write(text[: len(text) // 2])
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, text, *a, **k)

    monkeypatch.setattr(Path, "write_text", write_text)


def test_analyze_on_a_full_disk_writes_nothing(calibrated, tmp_path, monkeypatch):
    _full_disk_after(monkeypatch, "report.html")
    out = tmp_path / "a"
    assert_clean_error(
        cli("analyze", calibrated("digits_cnn"), "--out", out, "--num-samples", "8"),
        "no space left on device",
    )
    assert not out.exists()
    assert os.listdir(tmp_path) == []
    out.mkdir()
    (out / "analysis.json").write_text("old")
    assert_clean_error(
        cli("analyze", calibrated("digits_cnn"), "--out", out, "--num-samples", "8"),
        "no space left on device",
    )
    assert os.listdir(out) == ["analysis.json"] and (out / "analysis.json").read_text() == "old"


def test_write_together_is_all_or_nothing(tmp_path, monkeypatch):
    files.write_together(tmp_path / "f", {"a.txt": "1", "b.txt": "2"})
    assert sorted(os.listdir(tmp_path / "f")) == ["a.txt", "b.txt"] and os.listdir(tmp_path) == ["f"]
    _full_disk_after(monkeypatch, "b.txt")
    with pytest.raises(QuantCliError, match="no space left on device"):
        files.write_together(tmp_path / "f", {"a.txt": "new", "b.txt": "new"})
    assert (tmp_path / "f" / "a.txt").read_text() == "1" and sorted(os.listdir(tmp_path / "f")) == [
        "a.txt",
        "b.txt",
    ]


# --------------------------------------------------------------------------------------------- full disks


@pytest.mark.parametrize(
    "failure",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError(
            "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file data/0: "
            "file write failed"
        ),
    ],
)
def test_a_full_disk_is_named(tmp_path, failure):
    out = tmp_path / "c.calib.pt"
    out.write_text("old")

    def fill(tmp):
        Path(tmp).write_text("part")
        raise failure

    with pytest.raises(QuantCliError, match="no space left on device") as e:
        files.atomic_write(out, fill)
    assert "\n" not in str(e.value) and str(out) in str(e.value)
    assert out.read_text() == "old" and os.listdir(tmp_path) == ["c.calib.pt"]


def test_full_disk_through_the_cli(tmp_path, monkeypatch):
    def full(obj, f, *a, **k):
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file data/0: "
            "file write failed"
        )

    monkeypatch.setattr(torch, "save", full)
    r = cli("calibrate", "digits_cnn", "--out", tmp_path / "d.calib.pt", "--num-samples", "16", "--json")
    assert r.exit_code == 2
    assert "no space left on device" in r.stderr and r.stderr.count("\n") == 1
    assert json.loads(r.stdout)["exit_code"] == 2
    assert os.listdir(tmp_path) == []


def test_help_to_a_full_device_is_one_line():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "quantcli", "--help"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0
    assert "no space left on device" in r.stderr


def test_destinations_that_are_not_regular_files_are_refused(tmp_path):
    """Renaming over a device or a FIFO would replace it (as root, ``--report /dev/null`` would replace the
    system's /dev/null): a FIFO stands in for a device here, so the test harms nothing when the check is
    missing."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(QuantCliError, match="not a regular file"):
        files.atomic_write(fifo, lambda tmp: Path(tmp).write_text("x"))
    assert fifo.is_fifo()


# ---------------------------------------------------------------------------------------- damaged checkpoints


def _first_quantizer_emptied(d):
    d["quantizers"][next(iter(d["quantizers"]))] = {}


MALFORMED = {
    "no model": lambda d: d.pop("model"),  # was KeyError: 'model'
    "no state_dict": lambda d: d.pop("state_dict"),
    "model not a dict": lambda d: d.__setitem__("model", 3),
    "no example": lambda d: d["inputs"].pop("example"),
    "format_version text": lambda d: d.__setitem__("format_version", "x"),
    "quantizer entry empty": _first_quantizer_emptied,  # was KeyError: 'enabled' / 'descriptor'
    "rules not a list": lambda d: d["quant_config"].__setitem__("rules", 5),  # was TypeError
}


@pytest.mark.parametrize("edit", sorted(MALFORMED))
def test_malformed_checkpoints_are_named(calibrated, tmp_path, edit):
    data = torch.load(calibrated("digits_cnn"), weights_only=True)
    MALFORMED[edit](data)
    ck = tmp_path / "c.calib.pt"
    torch.save(data, ck)
    for args in (("export", ck, "--onnx", tmp_path / "m.onnx"), ("analyze", ck)) + (
        () if edit == "rules not a list" else (("inspect", ck),)
    ):  # inspect does not build the config
        assert_clean_error(cli(*args), str(ck), "damaged")


# --------------------------------------------------------------------------------------------- --json errors


@pytest.mark.parametrize(
    "args",
    [
        ("calibrate", "--json"),  # usage error: missing MODEL
        ("calibrate", "digits_cnn", "--bogus", "--json"),
        ("inspect", "missing.calib.pt", "--json"),
        ("export", "missing.calib.pt", "--onnx", "m.onnx", "--json"),
        ("verify", "missing.onnx", "--reference", "missing.calib.pt", "--json"),
        ("analyze", "missing.calib.pt", "--json"),
    ],
)
def test_json_errors_are_json_on_stdout(args, tmp_path):
    r = cli_subprocess(*args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    d = json.loads(r.stdout)
    assert d["exit_code"] == 2 and d["error"] and d["error"] in r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.strip().count("\n") == 0


def test_json_error_on_nan_data(tmp_path):
    x = tmp_path / "x.npy"
    a = np.random.default_rng(0).random((8, 1, 8, 8), dtype=np.float32)
    a[0, 0, 0, 0] = np.nan
    np.save(x, a)
    r = cli("calibrate", "digits_cnn", "--data", x, "--out", tmp_path / "c.calib.pt", "--json")
    assert r.exit_code == 2
    d = json.loads(r.stdout)
    assert d["exit_code"] == 2 and d["error"] in r.stderr


# ------------------------------------------------------------------------------------- the error path in main


def test_unexpected_errors_reaching_main_are_one_line(monkeypatch, capsys):
    """main() with the installed typer: an exception outside any command's guard (here: printing --help) is
    one line and exit 2, not an AttributeError about click's exceptions."""
    from quantcli.cli import entry

    def broken_help(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sys, "argv", ["quantcli", "--help"])
    monkeypatch.setattr(entry, "app", broken_help)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as e:
            entry.main()
    finally:  # main() installs its own; this process keeps pytest's
        for s, h in handlers.items():
            signal.signal(s, h)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no space left on device" in err


def test_a_closed_pipe_is_quiet(monkeypatch, capfd):
    """``quantcli inspect x --json | head -1``: the reader closed the pipe; no error line, exit 141
    (SIGPIPE)."""
    from quantcli.cli import entry

    def closed(*a, **k):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(sys, "argv", ["quantcli", "inspect", "x.calib.pt", "--json"])
    monkeypatch.setattr(entry, "app", closed)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as e:
            entry.main()
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert e.value.code == 141
    assert capfd.readouterr().err == ""


def test_debug_shows_the_real_traceback_then_exit_2():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "quantcli", "--help"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            env={**os.environ, "QUANTCLI_DEBUG": "1"},
        )
    assert r.returncode == 2, r.stderr
    assert "OSError: [Errno 28]" in r.stderr and "AttributeError" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: no space left on device")


# the lower bound in pyproject.toml, typer>=0.12 (whose code is the typer-slim distribution)
OLD_TYPER = "0.12.0"


def test_error_path_with_the_oldest_allowed_typer(tmp_path):
    """The same error path with typer 0.12 (which uses the click package, not a vendored copy)."""
    target = tmp_path / "old"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(target),
            f"typer-slim=={OLD_TYPER}",
            "click==8.1.7",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode != 0:
        pytest.skip(f"typer {OLD_TYPER} cannot be installed here: {r.stderr.strip()[-200:]}")
    env = {"PYTHONPATH": os.pathsep.join([str(target), str(REPO)])}
    probe = cli_subprocess("--version", env=env)
    check = subprocess.run(
        [sys.executable, "-c", "import typer; print(typer.__version__)"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    assert check.stdout.strip() == OLD_TYPER and probe.returncode == 0, probe.stderr
    r = cli_subprocess("calibrate", "--bogus", "--json", env=env)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and json.loads(r.stdout)["exit_code"] == 2
    r = cli_subprocess("inspect", tmp_path / "missing.calib.pt", env=env)
    assert_clean_error(r, "does not exist")
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "quantcli", "--help"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            env={**os.environ, **env},
        )
    assert r.returncode == 2 and "no space left on device" in r.stderr and "Traceback" not in r.stderr
    with open("/dev/full", "w") as full:  # QUANTCLI_DEBUG: the real traceback, then the one line, exit 2
        r = subprocess.run(
            [sys.executable, "-m", "quantcli", "--help"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            env={**os.environ, **env, "QUANTCLI_DEBUG": "1"},
        )
    assert r.returncode == 2 and "OSError: [Errno 28]" in r.stderr and "AttributeError" not in r.stderr, (
        r.stderr
    )
    assert r.stderr.strip().splitlines()[-1].startswith("error: no space left on device")


# --------------------------------------------------------------------------------------------- signals


# Runs quantcli's main with ``torch.save`` (or ``onnx.save_model``) patched: the real write, then a marker
# file, then a wait, so the test signals the process while the temporary file or folder exists.
PAUSED_WRITER = textwrap.dedent("""
    import os, sys, time
    mark, module, attr = sys.argv[1:4]
    mod = __import__(module)
    real = getattr(mod, attr)

    def paused(obj, f, *a, **k):
        real(obj, f, *a, **k)
        with open(mark + ".part", "w") as m:  # renamed whole, so the test never reads it half-written
            m.write(str(f))
        os.replace(mark + ".part", mark)
        while True:
            time.sleep(0.05)

    setattr(mod, attr, paused)
    sys.argv = ["quantcli", *sys.argv[4:]]
    from quantcli.cli import main
    main()
""")


def _start_paused(tmp_path, module, attr, *args):
    mark = tmp_path / "paused.marker"
    script = tmp_path / "paused.py"
    script.write_text(PAUSED_WRITER)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(mark), module, attr, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    deadline = time.monotonic() + 300
    while not mark.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the writer never reached its pause"
        time.sleep(0.05)
    return proc, mark


def _leftovers(folder: Path) -> list[str]:
    return sorted(p for p in os.listdir(folder) if p.startswith(".") and p != ".paused.marker")


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_during_checkpoint_write_cleans_up(tmp_path, sig, code):
    out = tmp_path / "x.calib.pt"
    out.write_bytes(b"previous")
    proc, mark = _start_paused(
        tmp_path, "torch", "save", "calibrate", "digits_cnn", "--out", out, "--num-samples", "16"
    )
    assert Path(mark.read_text()).name.startswith(".x.calib.pt.")  # the temporary file exists now
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert err.strip() == f"error: {'terminated' if code == 143 else 'interrupted'}"
    assert _leftovers(tmp_path) == [] and out.read_bytes() == b"previous"


SWALLOWED = textwrap.dedent("""
    import signal, sys
    import torch
    from quantcli.cli import entry
    real = torch.save

    def save(obj, f, *a, **k):
        try:  # SIGTERM's handler runs inside a callback that ignores its exception (a weakref's)
            entry._on_signal(signal.SIGTERM, None)
        except KeyboardInterrupt:
            pass
        real(obj, f, *a, **k)

    torch.save = save
    sys.argv = ["quantcli", *sys.argv[1:]]
    entry.main()
""")


SIGNAL_AFTER_JSON = textwrap.dedent("""
    import signal, sys
    from quantcli.cli import entry

    class Stdout:  # Ctrl-C as soon as the JSON document is on stdout (a CI job cancelled as it finished)
        def __init__(self, real):
            self.real = real

        def write(self, text):
            n = self.real.write(text)
            if text.endswith("}\\n"):
                entry._on_signal(signal.SIGINT, None)
            return n

        def __getattr__(self, name):
            return getattr(self.real, name)

    sys.stdout = Stdout(sys.stdout)
    sys.argv = ["quantcli", *sys.argv[1:]]
    entry.main()
""")


def _run_script(tmp_path, name: str, text: str, *args: str) -> subprocess.CompletedProcess:
    """``text`` written to ``tmp_path/name`` and run with ``args`` (quantcli's arguments), in ``tmp_path``."""
    script = tmp_path / name
    script.write_text(text)
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )


def test_a_signal_after_the_json_document_leaves_one_document_and_the_commands_exit(tmp_path):
    """Ctrl-C landing just after ``calibrate --json`` printed its summary: stdout held the summary and then
    ``{"error": "interrupted", ...}`` (json.loads: "Extra data"), and the exit was 130 with the checkpoint
    written."""
    out = tmp_path / "x.calib.pt"
    args = ("calibrate", "digits_cnn", "--out", str(out), "--num-samples", "16", "--json")
    r = _run_script(tmp_path, "late.py", SIGNAL_AFTER_JSON, *args)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["out"] == str(out) and out.exists()
    assert r.stderr == ""


def test_a_swallowed_sigterm_still_writes_nothing_and_exits_143(tmp_path):
    """The handler's KeyboardInterrupt, raised inside a callback (an import lock's weakref), was ignored by
    Python: calibrate went on, wrote its checkpoint and exited 0."""
    out = tmp_path / "x.calib.pt"
    out.write_bytes(b"previous")
    args = ("calibrate", "digits_cnn", "--out", str(out), "--num-samples", "16")
    r = _run_script(tmp_path, "swallowed.py", SWALLOWED, *args)
    assert r.returncode == 143, r.stderr
    assert r.stderr.strip() == "error: terminated"
    assert _leftovers(tmp_path) == [] and out.read_bytes() == b"previous"


def test_sigterm_during_export_removes_the_staging_folder(calibrated, tmp_path):
    out = tmp_path / "m.onnx"
    proc, mark = _start_paused(
        tmp_path, "onnx", "save_model", "export", calibrated("digits_cnn"), "--onnx", out
    )
    assert any(p.startswith(".quantcli-export-") for p in os.listdir(tmp_path))
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert _leftovers(tmp_path) == [] and not out.exists()


def test_leftovers_of_a_killed_writer_are_removed_by_the_next_run(tmp_path):
    out = tmp_path / "x.calib.pt"
    proc, _ = _start_paused(
        tmp_path, "torch", "save", "calibrate", "digits_cnn", "--out", out, "--num-samples", "16"
    )
    proc.send_signal(signal.SIGKILL)  # no handler runs
    proc.communicate(timeout=120)
    left = _leftovers(tmp_path)
    assert len(left) == 1 and left[0].startswith(".x.calib.pt.")
    host = left[0].split(".")[-2].rsplit("-", 2)[0]
    live = tmp_path / f".x.calib.pt.{host}-{os.getppid()}-abc.tmp"  # a writer that still runs: kept
    other = tmp_path / ".x.calib.pt.otherhost-1-abc.tmp"  # another host's (shared file system): kept
    for f in (live, other):
        f.write_text("in progress")
    r = cli("calibrate", "digits_cnn", "--out", out, "--num-samples", "16")
    assert r.exit_code == 0, r.output
    assert _leftovers(tmp_path) == sorted([live.name, other.name])


# Runs quantcli's main with an import of torch that, like numpy's, turns an interrupt into an ImportError
INTERRUPTED_IMPORT = textwrap.dedent("""
    import importlib.abc, importlib.machinery, sys, time
    mark = sys.argv[1]

    class Slow(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            return importlib.machinery.ModuleSpec(name, self) if name == "torch" else None
        def create_module(self, spec):
            return None
        def exec_module(self, module):
            open(mark, "w").write("importing")
            try:
                while True:
                    time.sleep(0.05)
            except BaseException:
                raise ImportError("initialization failed")

    sys.meta_path.insert(0, Slow())
    sys.argv = ["quantcli", *sys.argv[2:]]
    from quantcli.cli import main
    main()
""")


def test_ctrl_c_inside_a_lazy_import_is_exit_130(tmp_path):
    mark = tmp_path / "import.marker"
    script = tmp_path / "slow_import.py"
    script.write_text(INTERRUPTED_IMPORT)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(mark), "calibrate", "digits_cnn", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    deadline = time.monotonic() + 120
    while not mark.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip() == "error: interrupted"
    assert json.loads(out)["exit_code"] == 130


# -------------------------------------------------------------------------------------- stderr stays one line


def test_runtime_errors_stay_off_stderr(calibrated, exported, tmp_path):
    """A graph onnxruntime loads but cannot run: its own coloured [E:onnxruntime:...] lines stay off stderr.
    The failure is verify's verdict (graph.runs fails, exit 1, the node named in the report), said once, by
    quantcli."""
    import onnx

    m = onnx.load(exported("digits_cnn"))
    conv = next(n for n in m.graph.node if n.op_type == "Conv")
    conv.input[1] = conv.input[0]  # the input as the weight: the kernel shape no longer fits
    onnx.save(m, tmp_path / "bad.onnx")
    r = cli_subprocess("verify", tmp_path / "bad.onnx", "--reference", calibrated("digits_cnn"), "--json")
    assert r.returncode == 1, r.stderr
    # onnxruntime logs "[E:onnxruntime:...] Non-zero status code ..." at its default level
    assert r.stderr == ""
    failed = {c["name"]: c["detail"] for c in json.loads(r.stdout)["checks"] if not c["passed"]}
    assert conv.name in failed["graph.runs"]


def test_complex_data_is_refused_in_one_line(calibrated, exported, tmp_path):
    x = tmp_path / "c.npy"
    np.save(x, (np.ones((8, 1, 8, 8)) + 1j).astype(np.complex64))
    r = cli_subprocess("verify", exported("digits_cnn"), "--reference", calibrated("digits_cnn"), "--data", x)
    assert_clean_error(r, "complex")


def test_library_warnings_do_not_reach_stderr(calibrated, tmp_path):
    script = tmp_path / "noisy.py"
    script.write_text(
        textwrap.dedent("""
        import sys, warnings
        import quantcli.analysis.inspect
        real = quantcli.analysis.inspect.inspect_checkpoint

        def noisy(*a, **k):
            warnings.warn("something a library says", UserWarning, stacklevel=1)
            return real(*a, **k)

        quantcli.analysis.inspect.inspect_checkpoint = noisy
        sys.argv = ["quantcli", *sys.argv[1:]]
        from quantcli.cli import main
        main()
    """)
    )
    r = subprocess.run(
        [sys.executable, str(script), "inspect", str(calibrated("digits_cnn"))],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""


# --------------------------------------------------------------------------------------------- image defaults


def _gray_images(folder: Path, n: int = 6) -> np.ndarray:
    from PIL import Image

    folder.mkdir()
    pixels = np.random.default_rng(0).integers(0, 256, (n, 8, 8), dtype=np.uint8)
    for i, p in enumerate(pixels):
        Image.fromarray(p, mode="L").save(folder / f"{i}.png")
    return pixels


def test_one_channel_model_reads_an_image_folder_without_mean_and_std(tmp_path):
    pytest.importorskip("PIL")
    pixels = _gray_images(tmp_path / "imgs")
    ck = tmp_path / "d.calib.pt"
    r = cli("calibrate", "digits_cnn", "--data", tmp_path / "imgs", "--image-size", "8", "--out", ck)
    assert r.exit_code == 0, r.output
    data = torch.load(ck, weights_only=True)
    prep = data["preprocessing"]
    # ImageNet's mean and std as luma, by hand: 0.299 R + 0.587 G + 0.114 B of each
    mean = 0.299 * 0.485 + 0.587 * 0.456 + 0.114 * 0.406
    std = 0.299 * 0.229 + 0.587 * 0.224 + 0.114 * 0.225
    assert prep["mean"] == pytest.approx([mean], abs=1e-4) and prep["std"] == pytest.approx([std], abs=1e-4)
    x = data["inputs"]["example"]["x"].numpy()
    want = (pixels[: len(x)].astype(np.float32) / 255 - prep["mean"][0]) / prep["std"][0]
    np.testing.assert_allclose(x[:, 0], want, rtol=1e-5, atol=1e-5)


def test_analyze_takes_mean_and_std(tmp_path, monkeypatch):
    pytest.importorskip("PIL")
    _gray_images(tmp_path / "imgs")
    ck = tmp_path / "d.calib.pt"
    r = cli("calibrate", "digits_cnn", "--data", tmp_path / "imgs", "--image-size", "8", "--out", ck)
    assert r.exit_code == 0, r.output
    import quantcli.analysis.analyze

    seen = {}
    real = quantcli.analysis.analyze.analyze

    def spy(ckpt, batches, **k):
        seen["x"] = batches[0]["x"]
        return real(ckpt, batches, **k)

    monkeypatch.setattr(quantcli.analysis.analyze, "analyze", spy)
    r = cli(
        "analyze",
        ck,
        "--data",
        tmp_path / "imgs",
        "--mean",
        "0.5",
        "--std",
        "0.25",
        "--out",
        tmp_path / "a",
        "--num-samples",
        "4",
    )
    assert r.exit_code == 0, r.output
    from PIL import Image

    first = np.asarray(Image.open(tmp_path / "imgs" / "0.png"), np.float32) / 255
    np.testing.assert_allclose(seen["x"][0, 0].numpy(), (first - 0.5) / 0.25, rtol=1e-5, atol=1e-5)


def test_a_pipe_closed_before_the_table_exits_141_not_1(calibrated):
    """The real path: `quantcli inspect x | true` (the reader gone before rich prints the table). rich's
    own handler exited 1, which a CI script reads as FAIL; quantcli's console exits 141 as the entry point
    does."""
    import subprocess

    p = subprocess.Popen(
        [sys.executable, "-m", "quantcli", "inspect", str(calibrated())],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    p.stdout.close()  # before the process has imported anything: its first write meets a closed pipe
    _, err = p.communicate(timeout=300)
    assert p.returncode == 141, err
    assert b"Traceback" not in err


def test_a_full_disk_while_exporting_is_not_blamed_on_the_exporter(calibrated, tmp_path, monkeypatch):
    """torch.onnx.export writing into a full disk: the full-disk error, not "try --exporter dynamo"."""

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch.onnx, "export", full)
    r = cli("export", calibrated(), "--onnx", tmp_path / "m.onnx")
    assert r.exit_code == 2, r.output
    assert "no space left on device" in r.stderr.lower() and "--exporter" not in r.stderr
    assert not (tmp_path / "m.onnx").exists()
