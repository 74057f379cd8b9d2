"""Atomic file writes (_io.py): the path holds either its old content or the complete new one,
never a partial file, and no temporary file is left behind (except, when the writer is killed,
a hidden ``.<name>.*.tmp`` beside it, never under the real name).

Oracles: the bytes written, read back; the directory listing before and after; a writer process
killed in the middle of its write; for permissions, what ``open()`` gives under the same umask."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from attnkit import _io
from attnkit._io import atomic_open, atomic_write_bytes, atomic_write_text, check_writable

TEMPORARY = re.compile(r"\.out\.txt\..+\.tmp")  # how a temporary beside out.txt is named


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_text_round_trips_as_utf8_and_replaces_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "out.txt"
    path.write_text("old content, longer than the new one", encoding="utf-8")
    text = "naïve ✓ 注意\nsecond line\n"
    assert atomic_write_text(path, text) == path
    assert path.read_bytes() == text.encode("utf-8")
    assert _names(tmp_path) == ["out.txt"]


def test_bytes_round_trip_every_byte_value(tmp_path: Path) -> None:
    data = bytes(range(256)) * 3
    written = atomic_write_bytes(str(tmp_path / "out.bin"), data)  # a str path works too
    assert written == tmp_path / "out.bin"
    assert written.read_bytes() == data
    assert _names(tmp_path) == ["out.bin"]


def test_while_writing_the_path_still_holds_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "out.txt"
    path.write_text("old", encoding="utf-8")
    with atomic_open(path, "w", encoding="utf-8") as handle:
        handle.write("new, first half;")
        handle.flush()
        assert path.read_text(encoding="utf-8") == "old"  # a reader now sees the old file
        others = [name for name in _names(tmp_path) if name != "out.txt"]
        assert len(others) == 1 and TEMPORARY.fullmatch(others[0]), others
        # Beside the target (same file system), so the final os.replace is one atomic rename.
        assert (tmp_path / others[0]).read_text(encoding="utf-8") == "new, first half;"
        handle.write(" second half")
    assert path.read_text(encoding="utf-8") == "new, first half; second half"
    assert _names(tmp_path) == ["out.txt"]


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
@pytest.mark.parametrize("old", ["old", None])
def test_an_error_in_the_block_keeps_the_old_file_and_removes_the_temporary(
    tmp_path: Path, error: type[BaseException], old: str | None
) -> None:
    path = tmp_path / "out.txt"
    if old is not None:
        path.write_text(old, encoding="utf-8")
    with pytest.raises(error), atomic_open(path, "wb") as handle:
        handle.write(b"half of the new")
        raise error("stop in the middle of the write")
    if old is None:
        assert _names(tmp_path) == []  # no file appeared under the real name
    else:
        assert path.read_text(encoding="utf-8") == old
        assert _names(tmp_path) == ["out.txt"]


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_a_failed_flush_to_disk_or_rename_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    path = tmp_path / "out.txt"
    path.write_text("old", encoding="utf-8")

    def disk_full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_io.os, step, disk_full)
    with pytest.raises(OSError, match="No space"):
        atomic_write_text(path, "new")
    monkeypatch.undo()
    assert path.read_text(encoding="utf-8") == "old"
    assert _names(tmp_path) == ["out.txt"]


@pytest.mark.parametrize("step", ["open", "replace"])
def test_an_error_names_the_file_not_its_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    path = tmp_path / "out.txt"
    real = getattr(os, step)

    def refused(*args: object, **kwargs: object) -> object:
        if not any(TEMPORARY.search(str(a)) for a in args):
            return real(*args, **kwargs)
        raise PermissionError(13, "Permission denied", str(args[0]))  # as the OS words it

    monkeypatch.setattr(_io.os, step, refused)
    with pytest.raises(PermissionError) as caught:
        atomic_write_text(path, "new")
    monkeypatch.undo()
    assert str(caught.value) == f"[Errno 13] Permission denied: {str(path)!r}"
    assert ".tmp" not in str(caught.value) and caught.value.__cause__ is None
    assert _names(tmp_path) == []


def test_a_name_the_file_system_takes_is_written_though_its_temporary_is_longer(
    tmp_path: Path,
) -> None:
    path = tmp_path / ("a" * 250 + ".txt")  # 254 bytes: allowed; ".<name>.<12 hex>.tmp" is not
    assert atomic_write_text(path, "x").read_text(encoding="utf-8") == "x"
    assert _names(tmp_path) == [path.name]


def test_a_killed_writer_leaves_the_old_file_and_only_a_hidden_temporary(tmp_path: Path) -> None:
    path = tmp_path / "out.txt"
    path.write_text("old", encoding="utf-8")
    writer = (
        "import os, sys\n"
        "from attnkit._io import atomic_open\n"
        "with atomic_open(sys.argv[1], 'w') as handle:\n"
        "    handle.write('half of the new')\n"
        "    handle.flush()\n"
        "    os._exit(3)  # dies here: no exception handler, no cleanup runs\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", writer, str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 3, proc.stderr
    assert path.read_text(encoding="utf-8") == "old"
    others = [name for name in _names(tmp_path) if name != "out.txt"]
    assert len(others) == 1 and TEMPORARY.fullmatch(others[0]), others
    assert (tmp_path / others[0]).read_text(encoding="utf-8") == "half of the new"


@pytest.mark.parametrize("mode", ["a", "r", "w+", "r+b", "x"])
def test_only_the_write_modes_are_accepted(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "out.txt"
    path.write_text("old", encoding="utf-8")
    with (
        pytest.raises(ValueError, match=r"supports modes 'w' and 'wb', got '" + re.escape(mode)),
        atomic_open(path, mode),
    ):
        pass
    assert path.read_text(encoding="utf-8") == "old"
    assert _names(tmp_path) == ["out.txt"]


def test_check_writable_returns_the_path_or_names_the_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert check_writable(str(tmp_path / "out.txt")) == tmp_path / "out.txt"
    monkeypatch.chdir(tmp_path)
    assert check_writable("out.txt") == Path("out.txt")  # a bare name: the current directory
    with pytest.raises(IsADirectoryError, match=re.escape(f"{str(tmp_path)!r} is a directory")):
        check_writable(tmp_path)
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match=re.escape(f"{str(missing)!r} does not exist")):
        check_writable(missing / "out.txt")
    monkeypatch.setattr(_io.os, "access", lambda path, mode: False)  # as for a read-only dir
    with pytest.raises(PermissionError, match=re.escape(f"{str(tmp_path)!r} is not writable")):
        check_writable(tmp_path / "out.txt")
    monkeypatch.undo()
    assert _names(tmp_path) == []  # checking wrote nothing


def test_a_write_into_a_missing_directory_fails_before_creating_anything(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        atomic_write_bytes(tmp_path / "missing" / "out.bin", b"data")
    with pytest.raises(IsADirectoryError):
        atomic_write_text(tmp_path, "data")
    assert _names(tmp_path) == []


@pytest.fixture
def umask():
    """``os.umask`` for one test; the process umask is restored after it."""
    saved = os.umask(0o022)
    yield os.umask
    os.umask(saved)


@pytest.mark.skipif(os.name == "nt", reason="POSIX permission bits")
@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_a_new_file_gets_the_permissions_open_gives(tmp_path: Path, umask, mask: int) -> None:
    umask(mask)
    with open(tmp_path / "by_open.txt", "w") as handle:  # the oracle: what open() does
        handle.write("x")
    atomic_write_text(tmp_path / "new.txt", "x")
    atomic_write_bytes(tmp_path / "new.bin", b"x")
    expected = 0o666 & ~mask
    assert _mode(tmp_path / "by_open.txt") == expected
    assert _mode(tmp_path / "new.txt") == expected
    assert _mode(tmp_path / "new.bin") == expected


@pytest.mark.skipif(os.name == "nt", reason="POSIX permission bits")
@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
@pytest.mark.parametrize("mode", [0o640, 0o600, 0o664])
def test_an_overwritten_file_keeps_its_mode_as_with_open(
    tmp_path: Path, umask, mask: int, mode: int
) -> None:
    umask(mask)
    for name in ("by_open.txt", "atomic.txt"):
        (tmp_path / name).write_text("old", encoding="utf-8")
        os.chmod(tmp_path / name, mode)
    with open(tmp_path / "by_open.txt", "w") as handle:  # the oracle: open() on an existing file
        handle.write("new")
    atomic_write_text(tmp_path / "atomic.txt", "new")
    assert _mode(tmp_path / "by_open.txt") == mode
    assert _mode(tmp_path / "atomic.txt") == mode
    assert (tmp_path / "atomic.txt").read_text(encoding="utf-8") == "new"


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)
