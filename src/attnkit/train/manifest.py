"""A checkpoint as one atomic unit: a generation directory, a manifest of SHA-256s, one rename.

A run directory holds its checkpoint like this::

    checkpoint-000007/                  one generation: every file of one checkpoint
        manifest.json                   written last: format, generation, size and SHA-256 of
        config.json                     each file beside it
        model.safetensors
        trainer_state.safetensors
        trainer_state.json
    checkpoint -> checkpoint-000007     links for people and other tools (see below)
    model.safetensors -> checkpoint/model.safetensors
    ...

**The current checkpoint is the highest-numbered generation whose ``manifest.json`` exists.**
``commit(run_dir, files)`` writes a new generation directory beside the current one (files of the
current generation that ``files`` does not replace are carried over as hard links), writes the
new manifest last, into its final name with one ``os.replace``: that rename makes the new
checkpoint current. A process killed at any moment before it leaves the previous checkpoint
current and complete; killed after it, the new one. Older generations are deleted only after
the switch (manifest first, so a half-deleted generation is never taken for a checkpoint), and a
generation left without a manifest by a killed writer is ignored, then deleted by the next
commit.

After the switch ``commit`` points the ``checkpoint`` link at the new generation (one more
rename) and makes sure every file has a top-level link through it, so ``run/model.safetensors``
keeps working for people and scripts. attnkit itself never reads through these links: they can
lag one commit behind when a writer is killed between the two renames (they then show the
previous checkpoint, complete), and they are skipped on file systems without symbolic links.

``open_checkpoint(run_dir)`` reads the manifest; ``Checkpoint.read_bytes(name)`` returns a file's
bytes only after checking them against the manifest's size and SHA-256, so a flipped byte is a
``ValueError`` naming the file, never a silently different model. A copy of a run made by a tool
that follows links has regular files in place of the links; such a file must equal the
checkpoint's own copy, or reading it fails too (an edited copy is never silently ignored).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnkit._io import atomic_write_bytes

__all__ = [
    "FORMAT",
    "LINK",
    "MANIFEST",
    "Checkpoint",
    "commit",
    "find_checkpoint",
    "foreign_entries",
    "open_checkpoint",
]

FORMAT = "attnkit-checkpoint/2"
MANIFEST = "manifest.json"
LINK = "checkpoint"
_GENERATION = re.compile(r"checkpoint-(\d{6,})")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _generation_name(number: int) -> str:
    return f"checkpoint-{number:06d}"


def _generations(run_dir: Path) -> Iterator[tuple[int, Path]]:
    """Every ``checkpoint-NNNNNN`` directory of ``run_dir``, complete or not."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in run_dir.iterdir():
            match = _GENERATION.fullmatch(entry.name)
            if match and entry.is_dir() and not entry.is_symlink():
                yield int(match.group(1)), entry


@dataclass(frozen=True)
class Checkpoint:
    """One complete generation: where it is and what its manifest promises.

    Attributes:
        run_dir: the run directory holding the generation.
        directory: the generation directory (``run_dir/checkpoint-NNNNNN``).
        generation: its number.
        files: ``{name: {"sha256": hex digest, "bytes": size}}`` from ``manifest.json``.
    """

    run_dir: Path
    directory: Path
    generation: int
    files: Mapping[str, Mapping[str, Any]]

    def __contains__(self, name: object) -> bool:
        return name in self.files

    def path(self, name: str) -> Path:
        """Where file ``name`` of this checkpoint is (no check; ``read_bytes`` checks)."""
        return self.directory / name

    def require(self, name: str, why: str) -> None:
        """A ``ValueError`` naming the file when the checkpoint lacks ``name``; ``why`` says
        what needs it (``"--resume"``), and the message lists what the checkpoint holds."""
        if name not in self.files:
            raise ValueError(
                f"checkpoint {str(self.directory)!r} has no {name} ({why} needs it; it holds "
                f"{', '.join(sorted(self.files)) or 'no files'})"
            )

    def read_bytes(self, name: str) -> bytes:
        """The bytes of file ``name``, checked against the manifest's size and SHA-256."""
        self.require(name, "reading it")
        path = self.path(name)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ValueError(
                f"checkpoint file {str(path)!r} is missing (its manifest lists it); the "
                "checkpoint is damaged: restore it or train again"
            ) from None
        self._check(path, data, self.files[name])
        shadow = self.run_dir / name
        if shadow.is_file() and not shadow.is_symlink():  # a copy that followed the links
            copy = shadow.read_bytes()
            if copy != data:
                raise ValueError(
                    f"{str(shadow)!r} differs from the checkpoint's own {name} ({str(path)!r}, "
                    "SHA-256 checked); attnkit reads only the checkpoint's: replace one with "
                    "the other, or train again"
                )
        return data

    def verify(self) -> None:
        """Read and check every file (before heavy work, so a damaged file fails first)."""
        for name in self.files:
            self.read_bytes(name)

    @staticmethod
    def _check(path: Path, data: bytes, entry: Mapping[str, Any]) -> None:
        if len(data) != entry["bytes"]:
            raise ValueError(
                f"checkpoint file {str(path)!r} is damaged: {len(data)} bytes, its manifest "
                f"records {entry['bytes']}; restore it or train again"
            )
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry["sha256"]:
            raise ValueError(
                f"checkpoint file {str(path)!r} is damaged: its SHA-256 is {digest[:16]}..., "
                f"its manifest records {entry['sha256'][:16]}...; restore it or train again"
            )


def find_checkpoint(run_dir: str | os.PathLike[str]) -> Checkpoint | None:
    """The current checkpoint of ``run_dir``, or ``None`` when it has none.

    A damaged manifest is a ``ValueError`` naming it (never "no checkpoint").
    """
    run_dir = Path(run_dir)
    complete = [(n, d) for n, d in _generations(run_dir) if (d / MANIFEST).is_file()]
    if not complete:
        return None
    number, directory = max(complete)
    return _read_manifest(run_dir, directory, number)


def foreign_entries(run_dir: str | os.PathLike[str]) -> list[str]:
    """The entries of ``run_dir`` that are not part of a checkpoint's layout: not a generation
    directory (complete or left without a manifest by a killed writer), not the ``checkpoint``
    link or a top-level link through it, not a temporary file of an unfinished write. Empty for
    a missing directory."""
    run_dir = Path(run_dir)
    foreign = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in sorted(run_dir.iterdir()):
            name = entry.name
            if name.startswith(".") and name.endswith(".tmp"):
                continue  # an unfinished atomic write (a file or a link)
            if entry.is_symlink():
                if name == LINK or os.readlink(entry) == f"{LINK}/{name}":
                    continue
            elif _GENERATION.fullmatch(name) and entry.is_dir():
                continue
            foreign.append(name)
    return foreign


def open_checkpoint(run_dir: str | os.PathLike[str]) -> Checkpoint:
    """The current checkpoint of ``run_dir``; a clear error when there is none.

    ``FileNotFoundError`` when the directory or its checkpoint does not exist; ``ValueError``
    for a run written in the layout before manifests (top-level files without hashes, which
    cannot be verified) and for a damaged manifest.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(run_dir)!r} does not exist")
    found = find_checkpoint(run_dir)
    if found is not None:
        return found
    old = [n for n in ("trainer_state.json", "model.safetensors") if (run_dir / n).is_file()]
    if old:
        raise ValueError(
            f"{str(run_dir / old[0])!r} belongs to a checkpoint in an older layout (no "
            f"checkpoint-NNNNNN/{MANIFEST} with SHA-256s, so it cannot be verified); train it "
            "again"
        )
    raise FileNotFoundError(
        f"{str(run_dir)!r} holds no checkpoint (no checkpoint-NNNNNN/{MANIFEST})"
    )


def _read_manifest(run_dir: Path, directory: Path, number: int) -> Checkpoint:
    path = directory / MANIFEST
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"checkpoint manifest {str(path)!r} is damaged: not valid JSON ({exc})"
        ) from None

    def bad(what: str) -> ValueError:
        return ValueError(f"checkpoint manifest {str(path)!r} is damaged: {what}")

    if not isinstance(raw, dict):
        raise bad(f"expected a JSON object, got {type(raw).__name__}")
    if raw.get("format") != FORMAT:
        raise bad(f"format {raw.get('format')!r}, expected {FORMAT!r}")
    if raw.get("generation") != number:
        raise bad(f"generation {raw.get('generation')!r}, but it lies in {directory.name!r}")
    files = raw.get("files")
    if not isinstance(files, dict):
        raise bad("no 'files' object")
    for name, entry in files.items():
        if not _is_plain_name(name):
            raise bad(f"file name {name!r} is not a plain file name")
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("sha256"), str)
            or not _SHA256.fullmatch(entry["sha256"])
            or not isinstance(entry.get("bytes"), int)
            or entry["bytes"] < 0
        ):
            raise bad(
                f"entry of {name!r} needs 'sha256' (64 hex digits) and 'bytes', got {entry!r}"
            )
    return Checkpoint(run_dir=run_dir, directory=directory, generation=number, files=files)


def _is_plain_name(name: object) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..", MANIFEST, LINK)
        and not name.startswith(".")
        and "/" not in name
        and "\\" not in name
        and not _GENERATION.fullmatch(name)
    )


def commit(
    run_dir: str | os.PathLike[str], files: Mapping[str, bytes], *, carry_over: bool = True
) -> Checkpoint:
    """Make ``files`` (name -> bytes) the run's new checkpoint, in one rename; returns it.

    ``carry_over=True`` keeps the current checkpoint's other files (the run's settings stay
    beside each epoch's weights); ``False`` starts from nothing (a fresh run replaces an old
    one as a whole). Files and directories get the permissions ``open()`` and ``mkdir()`` give.
    """
    run_dir = Path(run_dir)
    for name in files:
        if not _is_plain_name(name):
            raise ValueError(f"checkpoint file name {name!r} must be a plain, visible file name")
    run_dir.mkdir(parents=True, exist_ok=True)
    previous = find_checkpoint(run_dir) if carry_over else None
    number = max((n for n, _ in _generations(run_dir)), default=0) + 1
    directory = run_dir / _generation_name(number)
    directory.mkdir()
    entries: dict[str, dict[str, Any]] = {}
    for name, data in files.items():
        atomic_write_bytes(directory / name, data)
        entries[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    if previous is not None:
        for name, entry in previous.files.items():
            if name not in entries:
                _carry(previous.path(name), directory / name)
                entries[name] = dict(entry)
    _fsync_directory(directory)
    manifest = {"format": FORMAT, "generation": number, "files": dict(sorted(entries.items()))}
    # The commit point: the manifest appears under its name in one os.replace.
    atomic_write_bytes(directory / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    _fsync_directory(directory)
    _fsync_directory(run_dir)
    _update_links(run_dir, directory.name, entries)
    for other, path in _generations(run_dir):
        if other != number:
            _remove_generation(path)
    return Checkpoint(run_dir=run_dir, directory=directory, generation=number, files=entries)


def _carry(source: Path, target: Path) -> None:
    """``target`` becomes ``source``'s content: a hard link, or a copy where links fail."""
    try:
        os.link(source, target)
    except FileNotFoundError:
        raise ValueError(
            f"checkpoint file {str(source)!r} is missing (its manifest lists it); the "
            "checkpoint is damaged: restore it or train again"
        ) from None
    except OSError:  # a file system without hard links
        atomic_write_bytes(target, source.read_bytes())


def _fsync_directory(directory: Path) -> None:
    """Make renames inside ``directory`` durable (POSIX); a no-op where directories can't open."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _replace_with_link(path: Path, target: str) -> None:
    """``path`` becomes a symbolic link to ``target``, in one rename."""
    tmp = path.parent / f".{path.name}.link.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(target, tmp)
    if path.is_dir() and not path.is_symlink():  # a copy of a run that followed the links
        shutil.rmtree(path)
    os.replace(tmp, path)


def _update_links(run_dir: Path, generation: str, entries: Mapping[str, Any]) -> None:
    """Point ``checkpoint`` at ``generation`` and give each file a top-level link through it.

    Best effort: the checkpoint is already committed, so a file system without symbolic links
    (or any other failure here) leaves the links as they were, and attnkit never reads them.
    """
    with contextlib.suppress(OSError, NotImplementedError):
        _replace_with_link(run_dir / LINK, generation)
        for name in entries:
            view, target = run_dir / name, f"{LINK}/{name}"
            if not (view.is_symlink() and os.readlink(view) == target):
                _replace_with_link(view, target)
        for view in run_dir.iterdir():
            if (
                view.name not in entries
                and view.is_symlink()
                and os.readlink(view) == f"{LINK}/{view.name}"
            ):
                view.unlink()  # a file the new checkpoint no longer has


def _remove_generation(path: Path) -> None:
    """Delete an old generation, its manifest first (so it never looks complete half-deleted)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path / MANIFEST)
    shutil.rmtree(path, ignore_errors=True)
