"""`attnkit evaluate` on a tiny Iris run (tests/train_runs.py): it reproduces the metrics that
training wrote, and a corrupt, mismatched or missing checkpoint is one line and exit 2."""

from __future__ import annotations

import json

import pytest

from attnkit.cli import main
from train_runs import copy_run
from train_runs import run_dir as run_dir

pytestmark = pytest.mark.slow  # trains a (tiny) model first


def test_evaluate_reproduces_the_training_metrics(run_dir, capsys):
    assert main(["evaluate", str(run_dir)]) == 0
    printed = capsys.readouterr().out
    metrics = json.loads((run_dir / "metrics.json").read_text())
    again = json.loads((run_dir / "evaluation.json").read_text())
    for key in ("train_accuracy", "val_accuracy", "test_accuracy", "params"):
        assert again[key] == metrics[key]
    assert f"{metrics['test_accuracy']:.4f}" in printed


def test_corrupt_checkpoint_is_one_line_exit_2(run_dir, tmp_path, capsys):
    bad = copy_run(run_dir, tmp_path)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert main(["evaluate", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "corrupt" in err and "model.safetensors" in err and len(err.splitlines()) == 1


def test_mismatched_checkpoint_is_one_line_exit_2(run_dir, tmp_path, capsys):
    bad = copy_run(run_dir, tmp_path)
    config = json.loads((bad / "config.json").read_text())
    config["model"]["d_model"] = 32  # the weights were trained with 16
    (bad / "config.json").write_text(json.dumps(config))
    assert main(["evaluate", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "do not match the model" in err and len(err.splitlines()) == 1
    assert main(["evaluate", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
