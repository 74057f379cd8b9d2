"""One checkpoint, one atomic unit (train/manifest.py): a writer killed at every single file-system
step leaves the previous or the new checkpoint, whole; every changed byte of every file is an
error that names the file; files and directories get the umask's permissions.

Oracles: the bytes committed, read back; the checkpoint before and after the commit; a forked
writer killed (``os._exit``) before each of its write calls (tests/killing.py)."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from attnkit.train.manifest import (
    LINK,
    MANIFEST,
    commit,
    find_checkpoint,
    foreign_entries,
    open_checkpoint,
)
from killing import KILLED, run_killed_at

OLD = {"config.json": b'{"run": 1}\n', "model.safetensors": b"old weights " * 50}
NEW = {"model.safetensors": b"new weights " * 60, "trainer_state.json": b'{"epoch": 2}\n'}


def _contents(run_dir: Path) -> dict[str, bytes]:
    """Every file of the current checkpoint, each read through its SHA-256 check."""
    ckpt = open_checkpoint(run_dir)
    return {name: ckpt.read_bytes(name) for name in ckpt.files}


def test_commit_round_trips_carries_over_and_links(tmp_path: Path) -> None:
    first = commit(tmp_path, OLD)
    assert first.generation == 1 and _contents(tmp_path) == OLD
    second = commit(tmp_path, NEW)
    assert second.generation == 2
    assert _contents(tmp_path) == {**OLD, **NEW}  # config.json carried over
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint")) == [
        LINK,
        "checkpoint-000002",
    ]  # the old generation is gone
    manifest = json.loads((second.directory / MANIFEST).read_text())
    assert manifest["files"]["trainer_state.json"]["bytes"] == len(NEW["trainer_state.json"])
    # The links: the familiar top-level paths show the current checkpoint.
    assert os.readlink(tmp_path / LINK) == "checkpoint-000002"
    assert (tmp_path / "model.safetensors").read_bytes() == NEW["model.safetensors"]
    assert (tmp_path / "config.json").read_bytes() == OLD["config.json"]
    # A fresh start replaces the whole checkpoint: nothing of the old one is carried over.
    commit(tmp_path, {"config.json": b"{}"}, carry_over=False)
    assert _contents(tmp_path) == {"config.json": b"{}"}
    assert not (tmp_path / "model.safetensors").exists()  # its link went with it


@pytest.mark.skipif(not hasattr(os, "fork"), reason="kills a forked writer")
def test_a_kill_at_every_write_step_leaves_the_previous_or_the_new_checkpoint(
    tmp_path: Path,
) -> None:
    start = tmp_path / "start"
    commit(start, OLD)
    commit(start, {"trainer_state.json": b'{"epoch": 1}\n'})  # a second generation to carry
    previous = _contents(start)
    new = {**previous, **NEW}
    seen = {"previous": 0, "new": 0}
    step = 0
    while True:
        step += 1
        run_dir = tmp_path / f"kill-{step}"
        shutil.copytree(start, run_dir, symlinks=True)
        code = run_killed_at(step, lambda d=run_dir: commit(d, NEW))
        assert code in (KILLED, 0), f"step {step}: the writer failed (exit {code})"
        contents = _contents(run_dir)  # never "no checkpoint", never a damaged file
        assert contents in (previous, new), f"killed at step {step}: a mix of two checkpoints"
        seen["previous" if contents == previous else "new"] += 1
        # A later commit (the next epoch) works from whatever the kill left behind.
        commit(run_dir, {"trainer_state.json": b'{"epoch": 3}\n'})
        assert _contents(run_dir) == {**contents, "trainer_state.json": b'{"epoch": 3}\n'}
        generations = [p for p in run_dir.iterdir() if p.name.startswith("checkpoint-")]
        assert len(generations) == 1  # leftovers of the killed writer are cleaned up
        if code == 0:
            break
    assert step > 10 and seen["previous"] > 3 and seen["new"] > 3, (step, seen)


@pytest.mark.parametrize("name", [*OLD, MANIFEST])
@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])  # first, middle and last byte
def test_a_flipped_byte_in_any_file_is_an_error_naming_it(
    tmp_path: Path, name: str, where: float
) -> None:
    ckpt = commit(tmp_path, OLD)
    path = ckpt.directory / name
    data = bytearray(path.read_bytes())
    data[round(where * (len(data) - 1))] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="damaged") as info:
        open_checkpoint(tmp_path).verify()
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    # Written through its top-level link, the change is caught the same way.
    if name != MANIFEST:
        commit(tmp_path, OLD)
        with open(tmp_path / name, "r+b") as handle:
            handle.seek(3)
            handle.write(b"?")
        with pytest.raises(ValueError, match=rf"{name}' is damaged: its SHA-256"):
            open_checkpoint(tmp_path).read_bytes(name)


def test_a_missing_file_or_entry_names_what_is_missing(tmp_path: Path) -> None:
    ckpt = commit(tmp_path, OLD)
    with pytest.raises(ValueError, match=r"has no trainer_state\.json \(--resume needs it; it "
                       r"holds config\.json, model\.safetensors\)"):  # fmt: skip
        ckpt.require("trainer_state.json", "--resume")
    os.unlink(ckpt.directory / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.safetensors' is missing \(its manifest lists"):
        ckpt.read_bytes("model.safetensors")


def test_foreign_entries_are_what_the_checkpoint_layout_does_not_explain(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert foreign_entries(run) == []  # missing: nothing foreign
    commit(run, {"config.json": b"{}", "model.safetensors": b"w"})
    (run / "checkpoint-000009").mkdir()  # a generation a killed writer left without a manifest
    (run / ".config.json.3f2a.tmp").write_bytes(b"")  # an unfinished atomic write
    (run / ".model.safetensors.link.tmp").symlink_to("checkpoint/model.safetensors")
    assert foreign_entries(run) == []
    (run / "notes.txt").write_text("mine")
    (run / "elsewhere").symlink_to("/tmp")  # a link, but not through the checkpoint
    (run / "checkpoint-12").mkdir()  # too few digits for a generation
    assert foreign_entries(run) == ["checkpoint-12", "elsewhere", "notes.txt"]


def test_no_checkpoint_and_the_older_layout_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_checkpoint(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"holds no checkpoint"):
        open_checkpoint(tmp_path)
    assert find_checkpoint(tmp_path) is None
    (tmp_path / "trainer_state.json").write_text("{}")  # files as attnkit wrote them before
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(ValueError, match=r"older layout .* cannot be verified\); train it again"):
        open_checkpoint(tmp_path)


def test_a_copy_that_followed_the_links_is_checked_too(tmp_path: Path) -> None:
    commit(tmp_path / "run", OLD)
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "run", copy)  # links become regular files
    assert not (copy / "model.safetensors").is_symlink()
    assert _contents(copy) == OLD
    (copy / "model.safetensors").write_bytes(b"edited by hand")
    with pytest.raises(ValueError, match=r"differs from the checkpoint's own model\.safetensors"):
        open_checkpoint(copy).read_bytes("model.safetensors")
    commit(copy, NEW)  # committing into such a copy works, and restores the links
    assert (copy / LINK).is_symlink() and _contents(copy) == {**OLD, **NEW}


@pytest.mark.parametrize(
    "name", ["", "../x", "a/b", ".hidden", MANIFEST, LINK, "checkpoint-000001"]
)
def test_file_names_must_be_plain(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="plain, visible file name"):
        commit(tmp_path, {name: b"x"})


@pytest.mark.skipif(os.name == "nt", reason="POSIX permission bits")
@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_files_and_directories_get_the_umask_permissions(tmp_path: Path, mask: int) -> None:
    saved = os.umask(mask)
    try:
        ckpt = commit(tmp_path / "run", OLD)
    finally:
        os.umask(saved)
    assert stat.S_IMODE(os.stat(ckpt.directory).st_mode) == 0o777 & ~mask
    for name in [*OLD, MANIFEST]:
        assert stat.S_IMODE(os.stat(ckpt.directory / name).st_mode) == 0o666 & ~mask, name
