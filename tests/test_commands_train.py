"""`attnkit train` end to end on a tiny Iris run (tests/train_runs.py): the files it writes, a
resume of a finished run, and a resume with nothing (or not enough) to resume from."""

from __future__ import annotations

import json
import os

import pytest

from attnkit.cli import main
from attnkit.train.manifest import commit, open_checkpoint
from train_runs import TINY, copy_run
from train_runs import run_dir as run_dir

pytestmark = pytest.mark.slow  # trains a (tiny) model and draws its attention PNG


def test_train_writes_checkpoint_metrics_and_attention(run_dir, capsys):
    names = {p.name for p in run_dir.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "metrics.json",
        "attention.json",
        "trainer_state.json",
        "trainer_state.safetensors",
    } <= names
    ckpt = open_checkpoint(run_dir)  # the checkpoint is one generation, with every SHA-256
    assert sorted(ckpt.files) == [
        "config.json",
        "model.safetensors",
        "trainer_state.json",
        "trainer_state.safetensors",
    ]
    ckpt.verify()
    assert os.readlink(run_dir / "model.safetensors") == "checkpoint/model.safetensors"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    for key in ("test_accuracy", "val_accuracy", "train_accuracy", "params", "epochs", "seconds"):
        assert key in metrics
    assert metrics["epochs_run"] == 3 and metrics["d_model"] == 16
    maps = json.loads((run_dir / "attention.json").read_text())["maps"]
    assert len(maps) == 1 and len(maps[0]) == 2 and len(maps[0][0]) == 5  # layer, head, 5x5
    assert all(abs(sum(row) - 1) < 1e-5 for row in maps[0][0])


def test_resume_of_a_finished_run_changes_nothing(run_dir, tmp_path):
    again = copy_run(run_dir, tmp_path)
    before = (again / "model.safetensors").read_bytes()
    assert main(["train", "iris", "--seed", "1", "--out", str(again), "--resume", *TINY]) == 0
    assert (again / "model.safetensors").read_bytes() == before
    with pytest.raises(SystemExit):
        main(["train", "nonsense"])


def test_resume_without_a_trainer_state_is_one_line_exit_2(run_dir, tmp_path, capsys):
    empty = tmp_path / "empty"
    assert main(["train", "iris", "--seed", "1", "--out", str(empty), "--resume", *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds no checkpoint" in err and len(err.splitlines()) == 1
    started = copy_run(run_dir, tmp_path)  # as if killed before its first epoch was saved
    config = open_checkpoint(started).read_bytes("config.json")
    commit(started, {"config.json": config}, carry_over=False)
    assert main(["train", "iris", "--seed", "1", "--out", str(started), "--resume", *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no trainer_state.json (--resume needs it" in err and len(err.splitlines()) == 1
