"""The CO2 forecaster's data and baselines: the vendored series and its filled weeks, windows
split by the calendar, the baselines exact on series they describe, and the model's shapes."""

from __future__ import annotations

import math

import torch

from attnkit.tasks.forecast import (
    CONTEXT,
    HORIZON,
    YEAR,
    ForecastConfig,
    SeriesForecaster,
    co2_windows,
    linear_seasonal,
    load_co2,
    seasonal_naive,
)


def test_the_series_is_complete_after_interpolation() -> None:
    dates, y, filled = load_co2()
    assert len(dates) == len(y) == 2284 and filled == 59
    assert dates[0] == 19580329 and dates[-1] == 20011229
    assert not torch.isnan(y).any()
    assert float(y.min()) > 310 and float(y.max()) < 375


def test_a_filled_week_lies_on_the_line_between_its_neighbours() -> None:
    from importlib import resources

    text = resources.files("attnkit").joinpath("data/co2_weekly.csv").read_text("utf-8")
    raw = [line.split(",")[1] for line in text.splitlines()[1:]]
    _, y, _ = load_co2()
    k = next(n for n, v in enumerate(raw) if not v.strip() and raw[n - 1] and raw[n + 1])
    assert math.isclose(float(y[k]), (float(raw[k - 1]) + float(raw[k + 1])) / 2, rel_tol=1e-12)


def test_windows_are_split_by_the_calendar_and_relative_to_their_level() -> None:
    train, val, test, levels = co2_windows()
    assert train["past"].shape[1] == CONTEXT and train["labels"].shape[1] == HORIZON
    assert (len(val["labels"]), len(test["labels"])) == (158, 158)
    assert len(train["labels"]) > 1500
    assert torch.allclose(test["past"][:, -52:].mean(1), torch.zeros(158), atol=1e-4)
    assert levels.shape == (158, 1) and float(levels.min()) > 360  # 1997-2000 levels


def test_baselines_are_exact_on_the_series_they_describe() -> None:
    t = torch.arange(CONTEXT + HORIZON, dtype=torch.float64)
    series = (
        0.03 * t + 2 * torch.sin(2 * math.pi * t / YEAR) + 0.5 * torch.cos(4 * math.pi * t / YEAR)
    )
    guess = linear_seasonal(series[None, :CONTEXT])
    assert torch.allclose(guess[0], series[CONTEXT:], atol=1e-9)
    periodic = torch.sin(2 * math.pi * t / 52)
    assert torch.allclose(
        seasonal_naive(periodic[None, :CONTEXT])[0], periodic[CONTEXT:], atol=1e-9
    )


def test_the_model_forecasts_52_weeks_and_attends_over_the_past() -> None:
    torch.manual_seed(0)
    model = SeriesForecaster(ForecastConfig(embed_dim=8, num_heads=2, num_layers=1)).eval()
    past = torch.randn(3, CONTEXT)
    y, w = model(past, return_attention=True)
    assert y.shape == (3, HORIZON) and w.shape == (3, 2, HORIZON, CONTEXT)
    assert torch.allclose(w.sum(-1), torch.ones(3, 2, HORIZON), atol=1e-5)
