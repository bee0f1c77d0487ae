"""core.atomic_files: a failed write leaves the previous file; results get the usual mode."""

import os

import pytest

from core import atomic_files


def test_text_written_atomically_with_the_umask_mode(tmp_path, monkeypatch):
    out = tmp_path / "reports" / "report.md"  # the directory is created
    atomic_files.write_text_atomically(out, "old\n")
    assert out.read_text() == "old\n"
    mask = os.umask(0o022)
    os.umask(mask)
    assert atomic_files._umask() == mask
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask  # not mkstemp's private 0600

    def fail(*_):
        raise OSError("disk full")
    monkeypatch.setattr(atomic_files.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        atomic_files.write_text_atomically(out, "new\n")
    assert out.read_text() == "old\n" and [p.name for p in out.parent.iterdir()] == ["report.md"]


def test_failed_writer_leaves_nothing(tmp_path):
    out = tmp_path / "data.bin"
    out.write_bytes(b"before")

    def write(stream):
        stream.write(b"partial")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        atomic_files.write_atomically(str(out), write)
    assert out.read_bytes() == b"before" and [p.name for p in tmp_path.iterdir()] == ["data.bin"]
