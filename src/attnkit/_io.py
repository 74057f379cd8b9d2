"""Atomic file writes: a file is either its old self or completely new, never half written.

Permissions follow ``open()``: a new file gets ``0o666`` minus the process umask (the kernel
applies it, as for any ``open(path, "w")``), and a file that already exists keeps its permission
bits (``open()`` on an existing file truncates it in place and so keeps its mode).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = [
    "atomic_open",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_writable",
    "is_utf8",
]


def is_utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8: a lone surrogate (a JSON escape such as ``\\ud800``,
    or bytes of a command-line argument that are not UTF-8) does not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_writable(path: str | os.PathLike[str]) -> Path:
    """Fail early (before heavy work) when ``path`` cannot be written; returns it as a Path."""
    if not str(path):
        raise ValueError("the output path is empty")
    path = Path(path)
    try:
        is_dir = path.is_dir()
    except OSError as exc:  # a name too long for the file system, say
        raise ValueError(f"output path {str(path)!r}: {exc.strerror}") from None
    if is_dir:
        raise IsADirectoryError(f"output path {str(path)!r} is a directory, expected a file path")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.exists():
        raise FileNotFoundError(f"output directory {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise NotADirectoryError(f"output directory {str(parent)!r} is a file, not a directory")
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"output directory {str(parent)!r} is not writable")
    return path


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "w", **kwargs: object) -> Iterator[IO]:
    """Open a temporary file beside ``path``; on success it replaces ``path`` in one rename.

    If the block raises (or the process dies), ``path`` is untouched and the temporary file is
    removed (or left as ``.<name>.*.tmp``, never under the real name). The file's permissions are
    those ``open(path, mode)`` would give (see the module docstring). An error in creating the
    temporary file or in renaming it names ``path``: the temporary name means nothing to a user.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open supports modes 'w' and 'wb', got {mode!r}")
    path = check_writable(path)
    try:
        fd, tmp = _create_temporary(path)
    except OSError as exc:
        raise _about(path, exc) from None
    try:
        with os.fdopen(fd, mode, **kwargs) as handle:  # type: ignore[call-overload]
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.replace(tmp, path)
        except OSError as exc:
            raise _about(path, exc) from None
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _about(path: Path, exc: OSError) -> OSError:
    """``exc`` told about ``path`` instead of the temporary file (same errno, same subclass)."""
    return OSError(exc.errno, exc.strerror or str(exc), str(path))


def _create_temporary(path: Path) -> tuple[int, str]:
    """A new, empty ``.<name>.<random>.tmp`` beside ``path``, with ``open()``'s permissions.

    ``tempfile.mkstemp`` would create it ``0o600`` whatever the umask; ``os.open`` with
    ``0o666`` lets the kernel apply the umask, exactly as ``open()`` does for a new file.
    """
    try:
        keep = stat.S_IMODE(os.stat(path).st_mode)  # an existing file keeps its mode
    except FileNotFoundError:
        keep = None
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    while True:
        # A name the file system takes (at most 255 bytes) must not fail for its temporary one,
        # 19 characters longer: the temporary one keeps at most 200 of its characters.
        tmp = str(path.parent / f".{path.name[:200]}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:  # pragma: no cover - 48 random bits already taken
            continue
        break
    if keep is not None:
        try:
            os.chmod(tmp, keep)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
    return fd, tmp


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    with atomic_open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
    return Path(path)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    with atomic_open(path, "wb") as handle:
        handle.write(data)
    return Path(path)
