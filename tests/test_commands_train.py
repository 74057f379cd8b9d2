"""`attnkit train` end to end on a tiny Iris run (tests/train_runs.py): the files it writes, a
resume of a finished run, and a resume with nothing (or not enough) to resume from."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from attnkit.cli import main
from attnkit.registry import use
from attnkit.train.checkpoint import has_trained
from attnkit.train.manifest import commit, open_checkpoint
from killing import KILLED, run_killed_at
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


# The runs below are compared bit for bit, so they pin one backend: auto may choose another
# as it learns the machine, and another backend rounds differently.


def _train(*argv: str) -> int:
    with use("math"):
        return main(["train", "iris", "--seed", "1", *argv, *TINY])


def _weights(run: Path) -> bytes:
    return open_checkpoint(run).read_bytes("model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    assert _train("--out", str(out)) == 0
    return out


def test_resume_with_nothing_saved_points_at_a_plain_run_which_works(
    uninterrupted, tmp_path, capsys
):
    empty = tmp_path / "empty"
    empty.mkdir()  # a folder, but no run in it (a missing folder: the bad-input test below)
    assert _train("--out", str(empty), "--resume") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "holds no checkpoint yet, so nothing to continue: run without --resume" in err
    assert _train("--out", str(empty)) == 0
    assert _weights(empty) == _weights(uninterrupted)


def test_a_run_stopped_before_its_first_epoch_resumes_from_the_start_or_is_replaced(
    uninterrupted, tmp_path, capsys
):
    """Its checkpoint holds only config.json: --resume trains it from the first epoch, and a
    plain run replaces it without --overwrite; both give the uninterrupted run's weights."""
    config = open_checkpoint(uninterrupted).read_bytes("config.json")
    started = tmp_path / "started"  # as a run killed before its first epoch was saved leaves it
    commit(started, {"config.json": config})
    again = tmp_path / "again"
    shutil.copytree(started, again, symlinks=True)
    capsys.readouterr()
    assert _train("--out", str(started), "--resume") == 0
    assert "training it from the first epoch" in capsys.readouterr().out
    assert _weights(started) == _weights(uninterrupted)
    assert _train("--out", str(again)) == 0
    assert _weights(again) == _weights(uninterrupted)
    # Other settings for a run that saved no epoch: --resume refuses and says a plain run
    # replaces it, which it does.
    commit(again, {"config.json": config}, carry_over=False)
    assert _train("--out", str(again), "--lr", "0.01", "--resume") == 2
    err = capsys.readouterr().err.strip()
    assert "different settings" in err and "without --resume, this run replaces it" in err
    assert _train("--out", str(again), "--lr", "0.01") == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="kills a forked run")
def test_a_run_killed_before_its_first_epoch_is_saved_is_never_stuck(
    uninterrupted, tmp_path, capsys
):
    """Killed at write steps 1, 2, 3, 5, 8, ... (a Fibonacci walk) until its first epoch is
    saved: in every state it leaves (no folder, an empty one, a checkpoint written half, one
    holding only its settings), a plain run works without --overwrite and --resume either
    trains from the first epoch or says to run without --resume; both give the uninterrupted
    run's weights."""
    seen, step, following = set(), 1, 2
    while True:
        out = tmp_path / f"killed-{step}"
        assert run_killed_at(step, lambda out=out: _train("--out", str(out))) == KILLED
        if out.is_dir() and has_trained(out):
            break
        state = None if not out.is_dir() else tuple(sorted(p.name for p in out.iterdir()))
        if state not in seen:
            seen.add(state)
            resumed = tmp_path / f"resumed-{step}"
            if out.is_dir():
                shutil.copytree(out, resumed, symlinks=True)
            capsys.readouterr()
            code = _train("--out", str(resumed), "--resume")
            err = capsys.readouterr().err
            assert code == 0 or "run without --resume" in err, (step, state, err)
            assert _train("--out", str(out)) == 0, (step, state, capsys.readouterr().err)
            assert _weights(out) == _weights(uninterrupted)
            if code == 0:
                assert _weights(resumed) == _weights(uninterrupted)
        step, following = following, step + following
    assert len(seen) >= 3, seen  # no folder, a folder without a checkpoint, settings only


# ---------------------------------------------------------------- bad input: before any work


def _code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as stop:  # argparse's usage errors
        return int(stop.code)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ("iris --layers 0", "--layers: '0' is not a whole number of at least 1"),
        ("iris --d-model 0", "--d-model: '0' is not a whole number of at least 1"),
        ("iris --heads -1", "--heads: '-1' is not"),
        ("iris --threads -2", "--threads: '-2' is not a whole number from 1 to 1024"),
        ("iris --threads 0", "--threads: '0' is not"),
        ("iris --seed -1", "--seed: '-1' is not a whole number from 0 to 2**63 - 1"),
        ("iris --epochs 0", "--epochs: '0' is not"),
        ("iris --batch-size 0", "--batch-size: '0' is not"),
        ("iris --lr 0", "--lr: '0' is not a number above 0 and at most 3.4e38"),
        ("iris --lr nan", "--lr: 'nan' is not a number above 0 and at most 3.4e38"),
        ("iris --lr inf", "--lr: 'inf' is not a number above 0 and at most 3.4e38"),
        ("iris --threads 2147483648", "--threads: '2147483648' is not a whole number from 1 to"),
        ("iris --heads 3", "--heads 3 must divide the embedding width --d-model 64"),
        ("iris --d-model 16 --heads 3", "--heads 3 must divide the embedding width --d-model 16"),
        ("text --d-model 30", "--heads 4 must divide the embedding width --d-model 30"),
        ("iris --d-model 1000000 --heads 1", "--d-model 1000000, --layers 2: the model's"),
        ("text --layers 1000000000", "--layers 1000000000: the model's 49,152,000,000,"),
        ("iris --patience -1", "--patience: '-1' is not"),
        ("iris --layers two", "--layers: 'two' is not"),
        ("text --limit-train -5", "--limit-train: '-5' is not a whole number of at least 1"),
        ("text --max-len 0", "--max-len: '0' is not a whole number of at least 1"),
        ("text --limit-train 1", "limit_train=1 keeps 1 training snippet(s), all of class"),
        ("iris --max-len 32", "--max-len: only the text task reads this; iris does not"),
        ("iris --limit-train 10", "--limit-train: only the text task reads this"),
        ("iris --freeze-layers 2", "--freeze-layers: only the text task reads this"),
        ("iris --max-len 8 --limit-train 9", "--max-len, --limit-train: only the text task"),
        ("iris --variant pretrained", "--variant pretrained is for the text task"),
        ("text --freeze-layers 2", "--freeze-layers is for --variant pretrained"),
        ("text --variant pretrained --layers 2", "--d-model/--heads/--layers are for the scratch"),
        ("text --variant pretrained --max-len 1", "reads 2 to 512 tokens per snippet"),
        ("text --variant pretrained --max-len 513", "reads 2 to 512 tokens per snippet"),
        ("text --variant pretrained --freeze-layers 7", "the pretrained model has 6 layers"),
        ("iris --resume --overwrite", "--resume continues the saved run and --overwrite"),
        ("iris --resume", "--resume: there is no run at 'runs/iris-seed0' to continue"),
        ("iris --out a_file", "--out 'a_file' is a file; give a directory for the run"),
        ("iris --out a_file/run", "'a_file' is a file, not a directory"),
        ("nonsense", "invalid choice: 'nonsense'"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_creates_nothing(
    tmp_path, monkeypatch, capsys, argv, words
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("not a run")
    assert _code(["train", *argv.split()]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("attnkit train: error: ") and words in err, err
    assert captured.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_a_second_run_into_an_existing_one_needs_overwrite(run_dir, tmp_path, capsys):
    again = copy_run(run_dir, tmp_path)
    before = sorted(p.name for p in again.iterdir())
    assert main(["train", "iris", "--seed", "1", "--out", str(again), *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "already holds a run" in err and "--overwrite" in err
    assert sorted(p.name for p in again.iterdir()) == before
    assert main(["train", "iris", "--seed", "2", "--out", str(again), "--overwrite", *TINY]) == 0
    assert json.loads((again / "metrics.json").read_text())["seed"] == 2
