"""`attnkit train` and `attnkit evaluate` end to end on a tiny Iris run; checkpoint errors."""

from __future__ import annotations

import json

import pytest

from attnkit.cli import main

pytestmark = pytest.mark.slow  # trains a (tiny) model and draws its attention PNG

TINY = ["--epochs", "3", "--d-model", "16", "--heads", "2", "--layers", "1", "--quiet"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("iris")
    assert main(["train", "iris", "--seed", "1", "--out", str(out), *TINY]) == 0
    return out


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
    metrics = json.loads((run_dir / "metrics.json").read_text())
    for key in ("test_accuracy", "val_accuracy", "train_accuracy", "params", "epochs", "seconds"):
        assert key in metrics
    assert metrics["epochs_run"] == 3 and metrics["d_model"] == 16
    maps = json.loads((run_dir / "attention.json").read_text())["maps"]
    assert len(maps) == 1 and len(maps[0]) == 2 and len(maps[0][0]) == 5  # layer, head, 5x5
    assert all(abs(sum(row) - 1) < 1e-5 for row in maps[0][0])


def test_evaluate_reproduces_the_training_metrics(run_dir, capsys):
    assert main(["evaluate", str(run_dir)]) == 0
    printed = capsys.readouterr().out
    metrics = json.loads((run_dir / "metrics.json").read_text())
    again = json.loads((run_dir / "evaluation.json").read_text())
    for key in ("train_accuracy", "val_accuracy", "test_accuracy", "params"):
        assert again[key] == metrics[key]
    assert f"{metrics['test_accuracy']:.4f}" in printed


def _copy(run_dir, tmp_path):
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(run_dir, target)
    return target


def test_corrupt_checkpoint_is_one_line_exit_2(run_dir, tmp_path, capsys):
    bad = _copy(run_dir, tmp_path)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert main(["evaluate", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "corrupt" in err and "model.safetensors" in err and len(err.splitlines()) == 1


def test_mismatched_checkpoint_is_one_line_exit_2(run_dir, tmp_path, capsys):
    bad = _copy(run_dir, tmp_path)
    config = json.loads((bad / "config.json").read_text())
    config["model"]["d_model"] = 32  # the weights were trained with 16
    (bad / "config.json").write_text(json.dumps(config))
    assert main(["evaluate", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "do not match the model" in err and len(err.splitlines()) == 1
    assert main(["evaluate", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_resume_of_a_finished_run_changes_nothing(run_dir, tmp_path):
    again = _copy(run_dir, tmp_path)
    before = (again / "model.safetensors").read_bytes()
    assert main(["train", "iris", "--seed", "1", "--out", str(again), "--resume", *TINY]) == 0
    assert (again / "model.safetensors").read_bytes() == before
    with pytest.raises(SystemExit):
        main(["train", "nonsense"])
