"""The worked examples' shared scaffolding: a run's config.json, training into its checkpoint and
loading it back (weights equal), seeded construction, the reported facts, accuracies against
hand-counted ones, and a checkpoint whose settings do not fit named."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from attnkit.tasks.runs import accuracies, load_trained, run_facts, seeded, start_task
from attnkit.train.checkpoint import FORMAT
from attnkit.train.loop import FitResult, TrainConfig


@dataclass(frozen=True)
class TinyConfig:
    width: int = 3


class Tiny(nn.Module):
    """``features (b, width)`` -> logits ``(b, 2)``."""

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.linear = nn.Linear(config.width, 2)

    def forward(self, features: Tensor) -> Tensor:
        return self.linear(features)


@dataclass(frozen=True)
class TinyRun:
    seed: int = 0
    model: TinyConfig = field(default_factory=TinyConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def _data(n: int, seed: int) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=gen)
    return {"features": x, "labels": (x[:, 0] > 0).long()}


def test_a_run_writes_its_settings_trains_and_loads_back(tmp_path: Path) -> None:
    run = TinyRun(seed=7, train=TrainConfig(epochs=2, batch_size=5, patience=0, seed=99))
    task = start_task(
        "tiny", run, out=tmp_path / "run", resume=False, progress=False, extra={"n_train": 13}
    )
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert set(config) == {"format", "task", "variant", "seed", "n_train", "model", "train"}
    assert config["format"] == FORMAT and config["model"] == {"width": 3}
    assert (config["task"], config["variant"], config["n_train"]) == ("tiny", "scratch", 13)
    assert config["train"]["seed"] == 7 == task.train.seed  # one number seeds the run
    assert task.writes
    model = seeded(Tiny, TinyConfig(), 7)
    result = task.fit(model, _data(13, 0), _data(7, 1))
    assert result.epochs_run == 2
    again = load_trained(tmp_path / "run", config, TinyConfig, Tiny, keys={"n_train": int})
    for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_resume_with_other_settings_is_refused(tmp_path: Path) -> None:
    start_task("tiny", TinyRun(seed=0), out=tmp_path, resume=False, progress=False)
    with pytest.raises(ValueError, match="--resume with different settings"):
        start_task("tiny", TinyRun(seed=1), out=tmp_path, resume=True, progress=False)


def test_without_out_nothing_is_written(tmp_path: Path) -> None:
    task = start_task("tiny", TinyRun(), out=None, resume=False, progress=False, model={"width": 3})
    assert task.out is None and not task.writes


def test_seeded_builds_the_same_weights_for_the_same_seed() -> None:
    a, b, c = (seeded(Tiny, TinyConfig(width=5), s) for s in (3, 3, 4))
    assert torch.equal(a.linear.weight, b.linear.weight)
    assert not torch.equal(a.linear.weight, c.linear.weight)


def test_run_facts_report_the_fit_result() -> None:
    model = Tiny(TinyConfig(width=4))  # 4 * 2 + 2 weights
    result = FitResult(best_epoch=3, epochs_run=5, stopped_early=True, seconds=1.23456)
    assert run_facts(model, result) == {
        "params": 10,
        "epochs": 3,
        "epochs_run": 5,
        "seconds": 1.23,
        "threads": torch.get_num_threads(),
    }
    facts = run_facts(model, result, digits=1, stopped_early=True)
    assert list(facts) == ["params", "epochs", "epochs_run", "stopped_early", "seconds", "threads"]
    assert facts["seconds"] == 1.2 and facts["stopped_early"] is True


def test_accuracies_equal_the_hand_counted_share() -> None:
    model = Tiny(TinyConfig())
    with torch.no_grad():  # predicts class 1 exactly when feature 0 is positive
        model.linear.weight.copy_(torch.tensor([[-1.0, 0, 0], [1.0, 0, 0]]))
        model.linear.bias.zero_()
    x = torch.tensor([[1.0, 0, 0], [-1.0, 0, 0], [2.0, 0, 0]])
    right = {"features": x, "labels": torch.tensor([1, 0, 1])}
    two_of_three = {"features": x, "labels": torch.tensor([1, 1, 1])}
    got = accuracies(model, {"train": right, "test": two_of_three}, batch_size=2)
    assert got == {"train_accuracy": 1.0, "test_accuracy": 0.6667}


def test_a_checkpoint_that_does_not_fit_is_named(tmp_path: Path) -> None:
    config = {"model": {"width": 3, "depth": 2}, "seed": 0}
    with pytest.raises(ValueError, match=r"config.json'?: 'model' does not fit TinyConfig"):
        load_trained(tmp_path, config, TinyConfig, Tiny)
    with pytest.raises(ValueError, match="lacks 'seed'"):
        load_trained(tmp_path, {"model": {}}, TinyConfig, Tiny, keys={"seed": int})
