"""The worked examples by name: evaluate any checkpoint directory, print results as a table.

A checkpoint's ``config.json`` names its task (``"iris"``, ``"text"``, ``"vit"``,
``"translate"`` or ``"forecast"``); ``TASKS`` maps that
name to the function that re-tests such a checkpoint, ``(directory, config) -> metrics``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attnkit.tasks.forecast import evaluate_forecast
from attnkit.tasks.iris import evaluate_iris
from attnkit.tasks.text import evaluate_text
from attnkit.tasks.translate import evaluate_translate
from attnkit.tasks.vit import evaluate_vit
from attnkit.train.checkpoint import read_config, save_json
from attnkit.train.manifest import open_checkpoint

__all__ = ["TASKS", "evaluate_checkpoint", "format_table"]

TASKS: dict[str, Callable[[Path, dict[str, Any]], dict[str, Any]]] = {
    "iris": evaluate_iris,
    "text": evaluate_text,
    "vit": evaluate_vit,
    "translate": evaluate_translate,
    "forecast": evaluate_forecast,
}


def evaluate_checkpoint(directory: str | Path, *, write: bool = True) -> dict[str, Any]:
    """Rebuild the model a checkpoint describes, load its weights, re-test it on its split.

    The split is rebuilt from the seed in ``config.json`` (splits are deterministic), so the
    accuracies must equal those of the training run. Every checkpoint file is checked against
    its SHA-256 first: a changed byte is a ``ValueError`` naming the file. ``write`` saves them as
    ``evaluation.json`` beside the checkpoint.
    """
    directory = Path(directory)
    config = read_config(directory)
    started = time.perf_counter()
    task = config.get("task")
    if task not in TASKS:
        known = " or ".join(TASKS)
        raise ValueError(f"{directory / 'config.json'}: unknown task {task!r} ({known})")
    open_checkpoint(directory).verify()  # every file against its SHA-256, before the heavy work
    metrics = TASKS[task](directory, config)
    metrics.update(
        task=task,
        variant=config.get("variant"),
        seed=config.get("seed"),
        seconds=round(time.perf_counter() - started, 2),
    )
    if write:
        save_json(directory / "evaluation.json", metrics)
    return metrics


def format_table(rows: list[list[Any]], header: list[str]) -> str:
    """A plain aligned text table (also valid Markdown)."""
    cells = [[str(c) for c in header], *[[_fmt(c) for c in row] for row in rows]]
    widths = [max(len(r[k]) for r in cells) for k in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if value <= 1 else f"{value:.1f}"
    return "-" if value is None else str(value)
