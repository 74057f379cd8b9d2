"""The Iris worked example: head descriptions on hand-made maps, a tiny run end to end."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import matplotlib.image as mpimg
import pytest
import torch

from attnkit.models.classifiers import TabularConfig
from attnkit.tasks.iris import (
    IRIS_TRAIN,
    IrisRun,
    build_iris,
    describe_heads,
    evaluate_iris,
    iris_attention,
    iris_datasets,
    summarize_heads,
    train_iris,
)
from attnkit.train.checkpoint import read_config

pytest.importorskip("sklearn", reason="the `train` extra (scikit-learn) is not installed")

TINY = TabularConfig(d_model=16, num_heads=2, num_layers=1)


def _maps() -> torch.Tensor:
    """One layer, two heads over (CLS, sepal L, sepal W, petal L, petal W): head 0 looks only at
    the petal tokens, head 1 only at the sepal tokens (half on each of the pair)."""
    maps = torch.zeros(1, 2, 5, 5)
    maps[0, 0, :, 3:] = 0.5
    maps[0, 1, :, 1:3] = 0.5
    return maps


def test_describe_heads_by_hand() -> None:
    lines = describe_heads(_maps())
    assert lines[0].startswith("layer 1 head 1: petal-focused; feature tokens put 100% on petal")
    assert "CLS puts 100% on petals" in lines[0]
    assert lines[1].startswith("layer 1 head 2: sepal-focused; feature tokens put 0% on petal")
    assert summarize_heads(_maps()) == "every head is focused: 1 on petals, 1 on sepals."


def test_summary_of_mixed_heads_says_so() -> None:
    uniform = torch.full((2, 4, 5, 5), 0.2)  # every token looks at every token alike
    summary = summarize_heads(uniform)
    assert summary.startswith("0 of 8 heads are petal-focused and 0 sepal-focused")
    assert "do not split cleanly" in summary


def test_datasets_and_attention_maps() -> None:
    train, val, test = iris_datasets(seed=0)
    assert [len(d["labels"]) for d in (train, val, test)] == [90, 30, 30]
    model = build_iris(TINY, seed=0)
    maps = iris_attention(model, test["features"])
    assert maps.shape == (1, 2, 5, 5)  # (layers, heads, tokens, tokens), CLS first
    torch.testing.assert_close(maps.sum(-1), torch.ones(1, 2, 5))  # mean of softmax rows


def test_run_defaults_and_seed() -> None:
    run = IrisRun()
    assert run.seed == 0 and run.model == TabularConfig() and run.train == IRIS_TRAIN


@pytest.mark.slow
def test_tiny_run_writes_checkpoint_report_and_picture(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = IrisRun(seed=2, model=TINY, train=replace(IRIS_TRAIN, epochs=2, seed=99))
        m = train_iris(run, out=tmp_path, progress=False)
    finally:
        torch.set_num_threads(threads)
    config = read_config(tmp_path)
    assert config["seed"] == 2 and config["train"]["seed"] == 2  # one seed for the whole run
    assert m["epochs_run"] == 2 and m["attention_png"] is True
    saved = json.loads((tmp_path / "attention.json").read_text())
    assert saved["heads"] == m["heads"] and len(saved["maps"][0]) == 2
    image = mpimg.imread(tmp_path / "attention.png")
    assert image.shape[:2] == (round((2.6 + 0.4) * 110), round(2 * 2.6 * 110))  # 1 x 2 panels
    again = evaluate_iris(tmp_path, config)
    for key in ("train_accuracy", "val_accuracy", "test_accuracy", "params"):
        assert again[key] == m[key]
