"""The training loop: schedule, learning on Iris, resume == uninterrupted (also after a kill at
every write step of a checkpoint), seams, checks, and resume errors that name the file."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

from attnkit.models.classifiers import TabularAttentionClassifier, TabularConfig
from attnkit.registry import use
from attnkit.train import FitOptions, TrainConfig, evaluate, fit, lr_at
from attnkit.train import loop as loop_module
from attnkit.train.checkpoint import json_bytes, json_from_bytes
from attnkit.train.data import load_iris_splits
from attnkit.train.manifest import commit, open_checkpoint
from killing import KILLED, run_killed_at

SMALL = TabularConfig(d_model=16, num_heads=2, num_layers=1, dropout=0.1)
QUIET = FitOptions(progress=False)


@pytest.fixture(scope="module")
def iris():
    d = load_iris_splits(seed=0)
    return (
        {"features": d.x_train, "labels": d.y_train},
        {"features": d.x_val, "labels": d.y_val},
        {"features": d.x_test, "labels": d.y_test},
    )


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic and fast for tiny tensors
    yield
    torch.set_num_threads(before)


def _model(seed: int = 0, config: TabularConfig = SMALL) -> TabularAttentionClassifier:
    torch.manual_seed(seed)
    return TabularAttentionClassifier(config)


def test_lr_schedule_warmup_then_decay():
    c = TrainConfig(lr=1.0, warmup_frac=0.1, schedule="cosine")
    assert [lr_at(s, 100, c) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert lr_at(9, 100, c) == pytest.approx(1.0)
    assert lr_at(10, 100, c) == pytest.approx(1.0)
    assert lr_at(55, 100, c) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    lin = TrainConfig(lr=2.0, warmup_frac=0.0, schedule="linear")
    assert lr_at(25, 100, lin) == pytest.approx(1.5)
    assert lr_at(0, 100, TrainConfig(lr=3.0, warmup_frac=0, schedule="constant")) == 3.0


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="schedule"):
        TrainConfig(schedule="step")
    with pytest.raises(ValueError, match="monitor"):
        TrainConfig(monitor="train_loss")
    with pytest.raises(ValueError, match="epochs"):
        TrainConfig(epochs=0)
    for name in ("lr", "weight_decay", "grad_clip"):
        for value in (float("inf"), float("nan")):
            with pytest.raises(ValueError, match=rf"{name} must be a finite number, got {value}"):
                TrainConfig(**{name: value})


@pytest.mark.slow
def test_a_few_epochs_on_iris_beat_chance_clearly(iris):
    train, val, test = iris
    model = _model()
    _, before = evaluate(model, test)
    result = fit(model, train, val, TrainConfig(epochs=12, lr=5e-3, patience=0), QUIET)
    _, after = evaluate(model, test)
    assert after >= 0.8 > before + 0.2  # chance is 1/3
    assert result.epochs_run == 12 and len(result.history) == 12


def test_model_holds_the_best_validation_epoch(iris):
    train, val, _ = iris
    model = _model(1)
    result = fit(model, train, val, TrainConfig(epochs=10, lr=5e-3, patience=0), QUIET)
    losses = [h["val_loss"] for h in result.history]
    assert result.best_epoch == 1 + losses.index(min(losses))
    assert evaluate(model, val)[0] == pytest.approx(min(losses), rel=1e-6)


def test_early_stopping_stops_after_patience(iris):
    train, val, _ = iris
    # Train on shifted labels: every epoch makes the (true-label) validation loss worse.
    wrong = {"features": train["features"], "labels": (train["labels"] + 1) % 3}
    config = TrainConfig(epochs=40, lr=1e-2, patience=2, schedule="constant", warmup_frac=0)
    result = fit(_model(2), wrong, val, config, QUIET)
    assert result.stopped_early
    assert result.epochs_run == result.best_epoch + 2 < 40


def test_resume_equals_uninterrupted(iris, tmp_path):
    train, val, _ = iris
    config = TrainConfig(epochs=6, lr=3e-3, patience=0, seed=7)
    full = _model(5)
    full_result = fit(full, train, val, config, FitOptions(tmp_path / "full", progress=False))
    part = _model(5)
    fit(part, train, val, config, FitOptions(tmp_path / "cut", progress=False, stop_after=3))
    assert (tmp_path / "cut" / "trainer_state.json").exists()
    torch.manual_seed(1234)  # the resumed process starts from an unrelated RNG state
    resumed = _model(99)  # and from other weights: everything must come from the checkpoint
    resume = FitOptions(tmp_path / "cut", resume=True, progress=False)
    res = fit(resumed, train, val, config, resume)
    assert res.epochs_run == 6
    assert [h["val_loss"] for h in res.history] == [h["val_loss"] for h in full_result.history]
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # A different configuration cannot continue this run.
    with pytest.raises(ValueError, match="different training configuration"):
        fit(_model(5), train, val, TrainConfig(epochs=7, patience=0, seed=7), resume)


def test_a_checkpoint_of_settings_only_resumes_from_the_first_epoch(iris, tmp_path):
    """A run stopped before its first epoch was saved holds only its settings: resuming it
    trains from the first epoch, which is the uninterrupted run exactly (same seeds, same
    starting weights, one backend pinned so both runs round alike)."""
    train, val, _ = iris
    config = TrainConfig(epochs=3, lr=3e-3, patience=0, seed=7)
    with use("math"):
        full = _model(5)
        full_result = fit(full, train, val, config, QUIET)
        commit(tmp_path / "started", {"config.json": b"{}"})
        torch.manual_seed(1234)  # the resumed process starts from an unrelated RNG state
        resumed = _model(5)
        options = FitOptions(tmp_path / "started", resume=True, progress=False)
        result = fit(resumed, train, val, config, options)
    assert result.epochs_run == 3 and result.history == full_result.history
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert "trainer_state.json" in open_checkpoint(tmp_path / "started")


def test_sampler_and_writer_seams(iris, tmp_path):
    train, val, _ = iris
    calls = []

    def first_half(n: int, epoch: int) -> torch.Tensor:  # a "rank" that sees half the data
        calls.append(epoch)
        return torch.arange(n // 2)

    config = TrainConfig(epochs=2, batch_size=15, patience=0)
    options = FitOptions(tmp_path / "r1", progress=False, sampler=first_half, is_writer=False)
    fit(_model(), train, val, config, options)
    assert not (tmp_path / "r1").exists()  # only the writer rank writes
    assert calls.count(0) >= 1 and calls.count(1) == 1


def test_bad_datasets_are_rejected(iris):
    train, val, _ = iris
    with pytest.raises(ValueError, match="'labels'"):
        fit(_model(), {"features": train["features"]}, val, TrainConfig(epochs=1))
    bad = {"features": train["features"][:5], "labels": train["labels"]}
    with pytest.raises(ValueError, match="rows like 'labels'"):
        fit(_model(), bad, val, TrainConfig(epochs=1))


def test_parameter_groups_can_scale_the_schedule(iris):
    train, val, _ = iris
    model = _model(3)
    frozen_by_scale = model.head.weight.detach().clone()

    def make(m, config):
        rest = [p for n, p in m.named_parameters() if n != "head.weight"]
        groups = [{"params": rest}, {"params": [m.head.weight], "lr_scale": 0.0}]
        return torch.optim.AdamW(groups, lr=config.lr, weight_decay=0.0)

    options = FitOptions(progress=False, make_optimizer=make)
    fit(model, train, val, TrainConfig(epochs=1, patience=0), options)
    assert torch.equal(model.head.weight, frozen_by_scale)  # lr 0 * schedule: untouched
    assert not torch.equal(model.feature_weight, _model(3).feature_weight)  # the rest learned


def _contents(run_dir) -> dict[str, bytes]:
    ckpt = open_checkpoint(run_dir)
    return {name: ckpt.read_bytes(name) for name in ckpt.files}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="kills a forked writer")
def test_a_kill_at_every_write_step_of_a_checkpoint_still_resumes_exactly(
    iris, tmp_path, monkeypatch
):
    train, val, _ = iris
    config = TrainConfig(epochs=3, lr=3e-3, patience=0, seed=7)
    full = _model(5)
    full_result = fit(full, train, val, config, QUIET)  # the uninterrupted run: the oracle
    start = tmp_path / "epoch1"
    fit(_model(5), train, val, config, FitOptions(start, progress=False, stop_after=1))
    # What epoch 2's checkpoint commits, recorded from a real resumed run.
    recorded = []
    real_commit = loop_module.commit

    def record(out, files, **kwargs):
        recorded.append((files, kwargs))
        return real_commit(out, files, **kwargs)

    monkeypatch.setattr(loop_module, "commit", record)
    epoch2 = tmp_path / "epoch2"
    shutil.copytree(start, epoch2, symlinks=True)
    fit(
        _model(5), train, val, config, FitOptions(epoch2, resume=True, progress=False, stop_after=2)
    )
    monkeypatch.undo()
    [(files, kwargs)] = recorded
    before, after = _contents(start), _contents(epoch2)
    assert before != after
    step, outcomes = 0, set()
    while True:
        step += 1
        run = tmp_path / f"killed-{step}"
        shutil.copytree(start, run, symlinks=True)
        code = run_killed_at(step, lambda run=run: commit(run, files, **kwargs))
        assert code in (KILLED, 0), f"step {step}: the writer failed (exit {code})"
        contents = _contents(run)
        assert contents in (before, after), f"killed at step {step}: a mix of two checkpoints"
        outcomes.add(contents == after)
        torch.manual_seed(1234)  # the resumed process starts from an unrelated RNG state
        resumed = _model(99)
        result = fit(resumed, train, val, config, FitOptions(run, resume=True, progress=False))
        assert [h["val_loss"] for h in result.history] == [
            h["val_loss"] for h in full_result.history
        ], f"killed at step {step}"
        for (name, a), b in zip(
            full.state_dict().items(), resumed.state_dict().values(), strict=True
        ):
            assert torch.equal(a, b), (step, name)
        if code == 0:
            break
    assert outcomes == {False, True} and step > 10


def test_resume_names_what_is_missing_or_damaged(iris, tmp_path):
    train, val, _ = iris
    config = TrainConfig(epochs=2, patience=0)

    def resume(out, **kwargs):
        return fit(
            _model(), train, val, config, FitOptions(out, resume=True, progress=False, **kwargs)
        )

    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):  # never a silent restart
        resume(tmp_path / "empty")
    commit(tmp_path / "half", {"config.json": b"{}", "trainer_state.json": b"{}"})
    with pytest.raises(ValueError, match=r"has no trainer_state\.safetensors \(--resume needs"):
        resume(tmp_path / "half")
    run = tmp_path / "run"
    fit(_model(), train, val, config, FitOptions(run, progress=False, stop_after=1))
    ckpt = open_checkpoint(run)
    state = json_from_bytes(ckpt.read_bytes("trainer_state.json"), "state")
    for key in ("param_groups", "epoch"):
        damaged = {k: v for k, v in state.items() if k != key}
        commit(run, {"trainer_state.json": json_bytes(damaged)})  # consistent SHA-256, no key
        with pytest.raises(ValueError, match=rf"trainer_state\.json' lacks '{key}'"):
            resume(run)
    commit(run, {"trainer_state.json": json_bytes({**state, "param_groups": [{"lr": 1}]})})
    with pytest.raises(ValueError, match=r"optimizer state does not fit this optimizer"):
        resume(run)
    commit(run, {"trainer_state.json": json_bytes(state)})
    path = open_checkpoint(run).path("trainer_state.safetensors")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # inside the last tensor: safetensors alone would load it
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"trainer_state\.safetensors' is damaged"):
        resume(run)


def test_sequence_classification_ignores_padding_labels() -> None:
    """Logits (b, c, t) against labels (b, t): -100 counts neither in the loss nor the accuracy."""
    from attnkit.train.loop import classification

    logits = torch.tensor([[[2.0, 0.0, 2.0], [0.0, 2.0, 0.0]]])  # (b=1, c=2, t=3)
    labels = torch.tensor([[0, 0, -100]])  # position 2 is padding
    loss, correct, counted = classification(logits, labels)
    assert (correct, counted) == (1, 2)  # position 0 right, position 1 wrong
    expected = (math.log(1 + math.exp(-2)) + math.log(1 + math.exp(2))) / 2
    assert math.isclose(loss.item(), expected, rel_tol=1e-6)
    _, flat_correct, flat_counted = classification(logits[:, :, 0], labels[:, 0])
    assert (flat_correct, flat_counted) == (1, 1)  # (b, c) against (b,): as before


def test_regression_is_mean_absolute_error_and_refuses_shape_mismatch() -> None:
    from attnkit.train.loop import regression

    loss, correct, counted = regression(torch.tensor([[1.0, 3.0]]), torch.tensor([[2.0, 1.0]]))
    assert loss.item() == 1.5 and correct == 0 and counted == 2
    with pytest.raises(ValueError, match=r"outputs \(1, 2\) and targets \(2,\) must have one"):
        regression(torch.zeros(1, 2), torch.zeros(2))
