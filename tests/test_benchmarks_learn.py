"""The course benchmark reads each task's metrics.json as the tasks write it (the baseline's
figure on the model's own metric) and judges the issue's targets: mean accuracy and beating the
baseline for vit, the worst seed for translate, every seed below both baselines for forecast."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "learn.py"
spec = importlib.util.spec_from_file_location("bench_learn", SCRIPT)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def _row(task: str, value: float, baseline: dict) -> dict:
    return {"task": task, "seed": 0, "wall": 1.0,
            "metrics": {bench.METRIC[task]: value, "baseline": baseline}}  # fmt: skip


VIT_BASE = {"model": "logistic regression on pixels", "test_accuracy": 0.9694, "C": 1.0}
FORECAST_BASE = {"seasonal_naive": {"mae": 1.7, "mae_week_52": 1.9},
                 "linear_trend_seasonal": {"mae": 0.95, "mae_week_52": 1.1}}  # fmt: skip


def test_baselines_are_read_on_the_tasks_own_metric() -> None:
    assert bench.baselines("vit", {"baseline": VIT_BASE}) == {
        "logistic regression on pixels": 0.9694
    }
    translate = {"model": "the most common training date", "exact_match": 0.001}
    assert bench.baselines("translate", {"baseline": translate}) == {
        "the most common training date": 0.001
    }
    assert bench.baselines("forecast", {"baseline": FORECAST_BASE}) == {
        "seasonal_naive": 1.7,
        "linear_trend_seasonal": 0.95,
    }


def test_verdicts_follow_the_targets() -> None:
    vit = [_row("vit", a, VIT_BASE) for a in (0.9733, 0.9666, 0.9800)]
    assert bench.verdict("vit", vit).endswith("met")  # mean 97.33 %, above 96.94 %
    low = [_row("vit", a, VIT_BASE) for a in (0.97, 0.96, 0.97)]
    assert bench.verdict("vit", low).endswith("MISSED")  # mean 96.67 %
    assert bench.verdict("translate", [_row("translate", 0.995, {})]).endswith("met")
    assert bench.verdict("translate", [_row("translate", 0.989, {})]).endswith("MISSED")
    assert bench.verdict("forecast", [_row("forecast", 0.69, FORECAST_BASE)]).endswith("met")
    assert bench.verdict("forecast", [_row("forecast", 0.96, FORECAST_BASE)]).endswith("MISSED")


def test_the_table_names_every_run_and_verdict() -> None:
    rows = [_row("vit", 0.98, VIT_BASE), _row("forecast", 0.69, FORECAST_BASE)]
    md = bench.render(rows, "python benchmarks/learn.py", 1, 60.0)
    assert md.count("| vit | 0 |") == 1 and md.count("| forecast | 0 |") == 1
    assert "- vit: test_accuracy mean 0.98" in md and "- forecast: mae mean 0.69" in md
