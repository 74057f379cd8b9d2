"""`attnkit evaluate` on a tiny Iris run (tests/train_runs.py): it reproduces the metrics that
training wrote, and a corrupt, changed, incomplete, mismatched, missing or older checkpoint is
one line and exit 2."""

from __future__ import annotations

import json
import shutil

import pytest

from attnkit.cli import main
from attnkit.train.checkpoint import json_bytes
from attnkit.train.manifest import MANIFEST, commit, open_checkpoint
from train_runs import copy_run
from train_runs import run_dir as run_dir

pytestmark = pytest.mark.slow  # trains a (tiny) model first


def test_evaluate_reproduces_the_training_metrics(run_dir, tmp_path, capsys):
    out = tmp_path / "evaluation.json"
    before = sorted(p.name for p in run_dir.iterdir())
    assert main(["evaluate", str(run_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in run_dir.iterdir()) == before  # the run is only read
    metrics = json.loads((run_dir / "metrics.json").read_text())
    again = json.loads(out.read_text())
    for key in ("train_accuracy", "val_accuracy", "test_accuracy", "params"):
        assert again[key] == metrics[key]
    assert f"{metrics['test_accuracy']:.4f}" in printed and f"wrote {out}" in printed


def test_evaluate_a_read_only_run_prints_and_writes_nothing(run_dir, tmp_path, capsys):
    frozen = copy_run(run_dir, tmp_path)
    for path in [frozen, *frozen.rglob("*")]:
        if path.is_dir() and not path.is_symlink():
            path.chmod(0o555)
    try:
        assert main(["evaluate", str(frozen)]) == 0
    finally:
        for path in [frozen, *frozen.rglob("*")]:
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
    assert "test acc" in capsys.readouterr().out
    assert not (frozen / "evaluation.json").exists()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--out", "metrics.txt"], "give a .json file"),
        (["--out", "missing/e.json"], "does not exist"),
        (["--threads", "0"], "--threads: '0' is not"),
    ],
)
def test_bad_evaluate_options_are_one_line_and_write_nothing(
    run_dir, tmp_path, monkeypatch, capsys, args, words
):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["evaluate", str(run_dir), *args])
    except SystemExit as stop:
        code = stop.code
    assert code == 2
    err = _one_line(capsys)
    assert words in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_corrupt_checkpoint_is_one_line_exit_2(run_dir, tmp_path, capsys):
    bad = copy_run(run_dir, tmp_path)
    path = open_checkpoint(bad).path("model.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert main(["evaluate", str(bad)]) == 2
    err = _one_line(capsys)
    assert "damaged" in err and str(path) in err


@pytest.mark.parametrize(
    "name",
    [
        "config.json",
        "model.safetensors",
        "trainer_state.json",
        "trainer_state.safetensors",
        MANIFEST,
    ],
)
def test_a_flipped_byte_in_any_checkpoint_file_is_named_never_a_silent_result(
    run_dir, tmp_path, capsys, name
):
    bad = copy_run(run_dir, tmp_path)
    path = open_checkpoint(bad).directory / name
    data = bytearray(path.read_bytes())
    for k in range(len(data) // 2, len(data) // 2 + 4):  # flip four bytes in the middle
        data[k] ^= 0xFF
    path.write_bytes(bytes(data))
    assert main(["evaluate", str(bad)]) == 2
    err = _one_line(capsys)
    assert str(path) in err and "damaged" in err


def test_a_config_without_its_model_is_one_line_exit_2(run_dir, tmp_path, capsys):
    bad = copy_run(run_dir, tmp_path)
    config = json.loads(open_checkpoint(bad).read_bytes("config.json"))
    del config["model"]
    commit(bad, {"config.json": json_bytes(config)})  # a consistent SHA-256: only the key is gone
    assert main(["evaluate", str(bad)]) == 2
    err = _one_line(capsys)
    assert "config.json' lacks 'model'" in err


def test_a_run_from_before_manifests_is_one_line_exit_2(run_dir, tmp_path, capsys):
    old = copy_run(run_dir, tmp_path)  # the links became plain files: the old layout, plus ...
    for path in old.iterdir():
        if path.name.startswith("checkpoint"):
            shutil.rmtree(path)  # ... the checkpoint directories, which it did not have
    config = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({**config, "format": "attnkit-checkpoint/1"}))
    assert main(["evaluate", str(old)]) == 2
    err = _one_line(capsys)
    assert "attnkit-checkpoint/1" in err and "trained again" in err


def test_mismatched_checkpoint_is_one_line_exit_2(run_dir, tmp_path, capsys):
    bad = copy_run(run_dir, tmp_path)
    config = json.loads(open_checkpoint(bad).read_bytes("config.json"))
    config["model"]["d_model"] = 32  # the weights were trained with 16
    commit(bad, {"config.json": json_bytes(config)})
    assert main(["evaluate", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "do not match the model" in err and len(err.splitlines()) == 1
    assert main(["evaluate", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
