"""quantcli.files: the one atomic write and destination check every output file goes through."""

import os
from pathlib import Path

import pytest

from quantcli.errors import ExportError, QuantCliError
from quantcli.files import atomic_write, staging_directory, writable_directory


def test_atomic_write_replaces_the_file_whole(tmp_path):
    out = tmp_path / "report.json"
    out.write_text("old")
    atomic_write(out, lambda tmp: Path(tmp).write_text("new"))
    assert out.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_atomic_write_failure_leaves_no_file(tmp_path):
    out = tmp_path / "report.json"

    def half_then_fail(tmp):
        with open(tmp, "w") as f:
            f.write("half")
        raise KeyboardInterrupt  # an interrupt too: BaseException

    with pytest.raises(KeyboardInterrupt):
        atomic_write(out, half_then_fail)
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_failure_keeps_the_old_file(tmp_path):
    out = tmp_path / "a.calib.pt"
    out.write_text("old")
    with pytest.raises(ValueError):
        atomic_write(out, lambda tmp: (_ for _ in ()).throw(ValueError("boom")))
    assert out.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.calib.pt"]


def test_destination_errors_name_the_problem_in_the_callers_kind(tmp_path):
    with pytest.raises(ExportError, match=r"cannot write .*: directory .*missing does not exist"):
        writable_directory(tmp_path / "missing" / "o.onnx", ExportError)
    with pytest.raises(QuantCliError, match="it is a directory; give a file name"):
        atomic_write(tmp_path, lambda tmp: None)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if not os.access(ro, os.W_OK):  # root can write anywhere
            with pytest.raises(QuantCliError, match="is not writable"):
                atomic_write(ro / "x.json", lambda tmp: None)
            assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o700)


def test_bare_file_name_is_written_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert str(writable_directory("o.onnx")) == "."


def test_staging_directory_is_removed_with_its_contents(tmp_path):
    with pytest.raises(RuntimeError):
        with staging_directory(tmp_path, prefix=".quantcli-export-") as work:
            assert work.parent == tmp_path and work.name.startswith(".quantcli-export-")
            (work / "raw.onnx").write_bytes(b"partial")
            raise RuntimeError("exporter failed")
    assert list(tmp_path.iterdir()) == []


def test_a_directory_that_takes_no_file_is_a_one_line_refusal(tmp_path, monkeypatch):
    """A directory that passes the writability check and refuses a new file (/proc; a full inode table):
    ended in 'FileNotFoundError: ...' with traceback advice, on the bad-input path."""
    import tempfile

    def refuse(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with pytest.raises(ExportError, match=r"^cannot write .*x\.onnx: .* takes no new file \(No such file"):
        atomic_write(tmp_path / "x.onnx", lambda tmp: None, ExportError)
    with pytest.raises(QuantCliError, match=r"^cannot write in .*: it takes no new file"):
        with staging_directory(tmp_path):
            pass
    assert list(tmp_path.iterdir()) == []
