"""The task registry: a checkpoint's task picks its evaluator; the table the CLI prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnkit.tasks.forecast import evaluate_forecast
from attnkit.tasks.iris import evaluate_iris
from attnkit.tasks.registry import TASKS, evaluate_checkpoint, format_table
from attnkit.tasks.text import evaluate_text
from attnkit.tasks.translate import evaluate_translate
from attnkit.tasks.vit import evaluate_vit
from attnkit.train.checkpoint import FORMAT


def test_every_task_has_its_evaluator() -> None:
    assert dict(TASKS) == {
        "iris": evaluate_iris,
        "text": evaluate_text,
        "vit": evaluate_vit,
        "translate": evaluate_translate,
        "forecast": evaluate_forecast,
    }


def test_unknown_task_names_the_known_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"format": FORMAT, "task": "poetry"}))
    known = r"\(iris or text or vit or translate or forecast\)"
    with pytest.raises(ValueError, match=rf"unknown task 'poetry' {known}"):
        evaluate_checkpoint(tmp_path)
    assert not (tmp_path / "evaluation.json").exists()


def test_format_table_aligns_and_formats() -> None:
    table = format_table(
        [["iris", 0.96666, 100867, None], ["text", 0.5, 12.34, "x"]], ["a", "b", "c", "d"]
    )
    assert table.splitlines() == [
        "| a    | b      | c      | d |",
        "|------|--------|--------|---|",
        "| iris | 0.9667 | 100867 | - |",
        "| text | 0.5000 | 12.3   | x |",
    ]
