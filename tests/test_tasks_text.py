"""The text worked example end to end on a tiny budget (200 snippets, one epoch, d_model 16)."""

from __future__ import annotations

import json

import pytest
import torch

from attnkit.tasks.registry import evaluate_checkpoint
from attnkit.tasks.text import TextRun, train_text
from attnkit.train import TrainConfig

pytestmark = pytest.mark.slow


def test_scratch_run_writes_metrics_words_and_reloads(tmp_path):
    torch.set_num_threads(1)
    run = TextRun(
        variant="scratch", seed=0, limit_train=200, baseline=False,
        model={"d_model": 16, "num_heads": 2, "num_layers": 1},
        train=TrainConfig(epochs=1, batch_size=50, patience=0),
    )  # fmt: skip
    m = train_text(run, out=tmp_path, progress=False)
    assert m["n_train"] == 200 and m["params"] > 0 and 0 <= m["test_accuracy"] <= 1
    words = json.loads((tmp_path / "words.json").read_text())
    assert len(words) == 6  # three reviews of each class
    assert {w["label"] for w in words} == {"fresh", "rotten"}
    for w in words:
        assert len(w["tokens"]) == len(w["weights"]) > 0
        assert abs(sum(w["weights"]) - 1) < 1e-3  # pooling weights over the real words
    html = (tmp_path / "words.html").read_text()
    assert "attnkit-highlight" in html and words[0]["tokens"][0] in html
    again = evaluate_checkpoint(tmp_path)
    assert again["test_accuracy"] == m["test_accuracy"]
    assert again["val_accuracy"] == pytest.approx(m["val_accuracy"], abs=1e-4)


def test_run_names_a_known_variant() -> None:
    with pytest.raises(ValueError, match="variant must be 'scratch' or 'pretrained'"):
        TextRun(variant="large")


@pytest.mark.parametrize("limit", [1, 3, 0, True, 2.5])
def test_a_training_set_of_one_class_or_no_snippet_is_refused_before_the_run_folder(
    tmp_path, limit
) -> None:
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"limit_train"):
        train_text(TextRun(limit_train=limit, baseline=False), out=out, progress=False)
    assert not out.exists()
