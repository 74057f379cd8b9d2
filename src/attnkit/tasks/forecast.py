"""The time-series worked example: forecasting a year of Mauna Loa CO2 with attention over time.

``train_forecast(ForecastRun(seed=...), out=...)`` reads the weekly series shipped with attnkit
(``attnkit/data/co2_weekly.csv``, public domain, see ``attnkit/data/NOTICE``; its 59 missing
weeks are filled by linear interpolation between their neighbours) and learns to forecast the
next ``HORIZON = 52`` weeks from the last ``CONTEXT = 156`` (three years).

Every window is expressed relative to its own level (the mean of its last 52 weeks), so the model
learns shapes (the yearly cycle, the growth over a year), not levels it has never seen. The model
is attnkit's encoder-decoder without token embeddings: an encoder reads one token per past week
(its value, projected, plus the sinusoidal position), and 52 learned queries, one per week ahead,
cross-attend to it and each read out one value. Which past weeks a forecast week attends to is
then a picture: a model that learned the season looks about a year back.

The windows are split by time: forecasts whose 52 weeks fall in 1998-2001 (the held-out years,
``TEST_FROM``) are the test set, 1994-1997 validation, everything before training. On the test
windows the model's mean absolute error over the 52 weeks ahead (``mae``, ppm) is printed beside
two baselines computed on the same windows from the same three years of context:

- seasonal naive: each week ahead repeats the same week a year earlier;
- linear trend plus seasonal: least squares of a line and three yearly harmonics (periods
  52.18, 26.09 and 17.39 weeks) on the context, extrapolated.

It writes into ``out``: the checkpoint, ``metrics.json`` and ``forecast.png`` (the forecast
against the truth for the first test window, with the baselines, and the cross-attention of every
week ahead over the past weeks, averaged over layers and heads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnkit.attention import MultiHeadAttention
from attnkit.blocks import FeedForward
from attnkit.positional import sinusoidal_table
from attnkit.stacks import TransformerConfig, TransformerEncoder
from attnkit.tasks.runs import load_trained, run_facts, seeded, start_task
from attnkit.train.loop import TrainConfig, predict, regression
from attnkit.viz.heatmap import save_figure

__all__ = [
    "CONTEXT",
    "FORECAST_TRAIN",
    "HORIZON",
    "ForecastConfig",
    "ForecastRun",
    "SeriesForecaster",
    "co2_windows",
    "evaluate_forecast",
    "linear_seasonal",
    "load_co2",
    "seasonal_naive",
    "train_forecast",
]

CONTEXT, HORIZON = 156, 52
YEAR = 365.25 / 7  # weeks in a year
TEST_FROM, VAL_FROM = 19980101, 19940101  # the first date a window's forecast may cover
SCALE = 3.0  # ppm: window values are divided by this inside the model (about their spread)
FORECAST_TRAIN = TrainConfig(
    epochs=15, batch_size=64, lr=1e-3, weight_decay=0.01, warmup_frac=0.05, patience=0
)


def load_co2() -> tuple[list[int], Tensor, int]:
    """``(dates as yyyymmdd, values (2284,) float64 ppm, weeks filled)``; missing weeks are
    linearly interpolated between the nearest observed weeks before and after."""
    text = resources.files("attnkit").joinpath("data/co2_weekly.csv").read_text("utf-8")
    dates, values = [], []
    for line in text.splitlines()[1:]:
        date, value = line.split(",")
        dates.append(int(date))
        values.append(float(value) if value.strip() else math.nan)
    y = torch.tensor(values, dtype=torch.float64)
    missing = torch.isnan(y)
    known = (~missing).nonzero().flatten()
    for k in missing.nonzero().flatten().tolist():
        after = int(known[known > k][0])  # the series starts and ends with observed weeks
        before = int(known[known < k][-1])
        y[k] = y[before] + (y[after] - y[before]) * (k - before) / (after - before)
    return dates, y, int(missing.sum())


def co2_windows() -> tuple[dict, dict, dict, Tensor]:
    """Train / validation / test windows as ``fit``'s datasets, relative to each window's level:
    ``past (n, CONTEXT)``, ``labels (n, HORIZON)`` (ppm minus level); and the test levels."""
    dates, y, _ = load_co2()
    parts: tuple[list[int], list[int], list[int]] = ([], [], [])
    for origin in range(CONTEXT, len(y) - HORIZON + 1):  # forecast weeks origin .. origin+51
        first, last = dates[origin], dates[origin + HORIZON - 1]
        if first >= TEST_FROM:
            parts[2].append(origin)
        elif first >= VAL_FROM and last < TEST_FROM:
            parts[1].append(origin)
        elif last < VAL_FROM:
            parts[0].append(origin)
    sets = []
    levels = torch.empty(0)
    for origins in parts:
        idx = torch.tensor(origins)
        past = y[idx[:, None] + torch.arange(-CONTEXT, 0)]  # (n, CONTEXT)
        future = y[idx[:, None] + torch.arange(HORIZON)]  # (n, HORIZON)
        levels = past[:, -52:].mean(dim=1, keepdim=True)  # (n, 1)
        sets.append({"past": (past - levels).float(), "labels": (future - levels).float()})
    return sets[0], sets[1], sets[2], levels.float()


def seasonal_naive(past: Tensor) -> Tensor:
    """``(n, CONTEXT)`` -> ``(n, HORIZON)``: each week ahead repeats the week 52 weeks before."""
    return past[:, -52:][:, :HORIZON]


def linear_seasonal(past: Tensor, harmonics: int = 3) -> Tensor:
    """Least squares of ``a + b t + sum_k (c_k sin + d_k cos)(2 pi k t / YEAR)`` on each context
    window, extrapolated ``HORIZON`` weeks: ``(n, CONTEXT)`` -> ``(n, HORIZON)``."""

    def design(t: Tensor) -> Tensor:  # (T,) -> (T, 2 + 2 harmonics)
        cols = [torch.ones_like(t), t / CONTEXT]
        for k in range(1, harmonics + 1):
            cols += [torch.sin(2 * math.pi * k * t / YEAR), torch.cos(2 * math.pi * k * t / YEAR)]
        return torch.stack(cols, dim=1)

    t = torch.arange(CONTEXT + HORIZON, dtype=torch.float64)
    x_past, x_future = design(t[:CONTEXT]), design(t[CONTEXT:])
    coef = torch.linalg.lstsq(x_past, past.double().T).solution  # (p, n)
    return (x_future @ coef).T.to(past.dtype)  # (n, HORIZON)


@dataclass(frozen=True)
class ForecastConfig:
    embed_dim: int = 32
    num_heads: int = 4
    num_layers: int = 2
    dropout: float = 0.0


@dataclass(frozen=True)
class ForecastRun:
    """One run: the seed (weights, order; the split is the calendar's), model and recipe."""

    seed: int = 0
    model: ForecastConfig = field(default_factory=ForecastConfig)
    train: TrainConfig = FORECAST_TRAIN


class SeriesForecaster(nn.Module):
    """``past (b, CONTEXT)`` (ppm relative to the level) -> ``(b, HORIZON)`` weeks ahead.

    An encoder over the past weeks, then one cross-attention from ``HORIZON`` learned queries
    (one per week ahead, with the sinusoidal position of that week continuing the past's) to the
    encoded weeks, a feed-forward layer and a linear read-out per query."""

    def __init__(self, config: ForecastConfig) -> None:
        super().__init__()
        c = self.config = config
        self.value_in = nn.Linear(1, c.embed_dim)
        self.encoder = TransformerEncoder(
            TransformerConfig(
                embed_dim=c.embed_dim,
                num_heads=c.num_heads,
                num_layers=c.num_layers,
                positional="sinusoidal",
                max_len=CONTEXT + HORIZON,
                dropout=c.dropout,
                norm_first=True,
            )
        )
        self.queries = nn.Parameter(torch.randn(HORIZON, c.embed_dim) * 0.02)
        future = sinusoidal_table(HORIZON, c.embed_dim, offset=CONTEXT).float()
        self.register_buffer("future_pos", future, persistent=False)  # (HORIZON, e)
        self.cross = MultiHeadAttention(c.embed_dim, c.num_heads, dropout=c.dropout)
        self.norm = nn.LayerNorm(c.embed_dim)
        self.ffn = FeedForward(c.embed_dim, 4 * c.embed_dim, activation="gelu")
        self.out = nn.Linear(c.embed_dim, 1)

    def forward(
        self, past: Tensor, *, return_attention: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        tokens = self.value_in((past / SCALE)[..., None])  # (b, CONTEXT, e)
        memory, _ = self.encoder(tokens)  # (b, CONTEXT, e)
        q = (self.queries + self.future_pos).expand(past.shape[0], -1, -1)  # (b, HORIZON, e)
        h, weights = self.cross(q, memory, need_weights=return_attention)  # (b, HORIZON, e)
        h = q + h
        h = h + self.ffn(self.norm(h))
        y = self.out(h).squeeze(-1) * SCALE  # (b, HORIZON), ppm relative to the level
        return (y, weights) if return_attention else y


def build_forecaster(config: ForecastConfig, seed: int) -> SeriesForecaster:
    return seeded(SeriesForecaster, config, seed)


def _mae(pred: Tensor, truth: Tensor) -> dict[str, float]:
    err = (pred - truth).abs()  # (n, HORIZON)
    return {"mae": round(float(err.mean()), 4), "mae_week_52": round(float(err[:, -1].mean()), 4)}


def _metrics(model: SeriesForecaster, train: dict, val: dict, test: dict) -> dict[str, Any]:
    model.eval()
    pred = predict(model, test)
    return {
        **_mae(pred, test["labels"]),
        "val_mae": _mae(predict(model, val), val["labels"])["mae"],
        "train_mae": _mae(predict(model, train), train["labels"])["mae"],
        "baseline": {
            "seasonal_naive": _mae(seasonal_naive(test["past"]), test["labels"]),
            "linear_trend_seasonal": _mae(linear_seasonal(test["past"]), test["labels"]),
        },
    }


def plot_forecast(model: SeriesForecaster, test: dict, level: float, path: Path) -> bool:
    """``forecast.png``: the first test window's forecast, truth and baselines; and where each
    week ahead looked in the past (cross-attention, mean over heads)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    model.eval()
    past = test["past"][:1]
    with torch.no_grad():
        pred, weights = model(past, return_attention=True)  # (1, HORIZON), (1, h, HORIZON, C)
    weeks_past = torch.arange(-CONTEXT, 0)
    weeks_ahead = torch.arange(HORIZON)
    fig = Figure(figsize=(11, 7.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, height_ratios=[1, 1.1])
    top.plot(weeks_past, past[0] + level, color="gray", label="past (context)")
    top.plot(weeks_ahead, test["labels"][0] + level, color="black", label="truth")
    top.plot(weeks_ahead, pred[0] + level, color="tab:red", label="attention model")
    top.plot(weeks_ahead, seasonal_naive(past)[0] + level, ":", label="seasonal naive")
    top.plot(weeks_ahead, linear_seasonal(past)[0] + level, "--", label="linear trend + seasonal")
    top.set_xlabel("weeks from the forecast origin")
    top.set_ylabel("CO2 (ppm)")
    top.legend(fontsize=8)
    top.set_title("Mauna Loa CO2: the first held-out window")
    image = bottom.imshow(
        weights[0].mean(0).numpy(),
        aspect="auto",
        cmap="Blues",
        extent=(-CONTEXT - 0.5, -0.5, HORIZON - 0.5, -0.5),
    )
    bottom.set_xlabel("past week (weeks before the origin)")
    bottom.set_ylabel("week ahead")
    bottom.set_title("Which past weeks each week ahead attends to (mean over heads)")
    fig.colorbar(image, ax=bottom, label="attention weight")
    save_figure(fig, path, dpi=90)
    return True


def yearly_lag_share(model: SeriesForecaster, past: Tensor) -> float:
    """The share of cross-attention on past weeks a whole number of years (±4 weeks) before the
    week being forecast: 1 year back, 2, 3 (mean over windows, heads and weeks ahead). Weeks
    at such lags make up 27/156 = 17 % of the context, so more than that is the season."""
    model.eval()
    with torch.no_grad():
        _, w = model(past, return_attention=True)  # (b, h, HORIZON, CONTEXT)
    ahead = torch.arange(HORIZON)[:, None]
    before = torch.arange(-CONTEXT, 0)[None, :]
    lag = ahead - before  # (HORIZON, CONTEXT): weeks between the two
    off = (lag - torch.round(lag / YEAR) * YEAR).abs()
    yearly = off <= 4
    return round(float((w * yearly).sum(-1).mean()), 4)


def train_forecast(
    run: ForecastRun | None = None,
    *,
    out: str | Path | None = None,
    resume: bool = False,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Train the forecaster on the windows before 1994, test on 1998-2001; returns the metrics."""
    run = run or ForecastRun()
    seed, model_config = run.seed, run.model
    if run.train.monitor != "val_loss":
        raise ValueError("forecast is a regression: monitor must be 'val_loss'")
    task = start_task("forecast", run, out=out, resume=resume, progress=progress)
    train, val, test, levels = co2_windows()
    model = build_forecaster(model_config, seed)
    result = task.fit(model, train, val, objective=regression)
    metrics = _metrics(model, train, val, test)
    _, _, filled = load_co2()
    metrics.update(
        task="forecast",
        variant="scratch",
        seed=seed,
        **run_facts(model, result),
        n_train=len(train["labels"]),
        n_val=len(val["labels"]),
        n_test=len(test["labels"]),
        weeks_interpolated=filled,
        context_weeks=CONTEXT,
        horizon_weeks=HORIZON,
        yearly_attention=yearly_lag_share(model, test["past"]),
        yearly_attention_uniform=round(27 / CONTEXT, 4),
    )
    if task.writes:
        assert task.out is not None
        png = task.out / "forecast.png"
        metrics["forecast_png"] = plot_forecast(model, test, float(levels[0]), png)
        task.save("metrics.json", metrics)
    return metrics


def evaluate_forecast(directory: Path, config: dict[str, Any]) -> dict[str, Any]:
    """MAE of the checkpoint in ``directory`` on the held-out years, beside the baselines."""
    model = load_trained(directory, config, ForecastConfig, SeriesForecaster)
    train, val, test, _ = co2_windows()
    return {
        **_metrics(model, train, val, test),
        "params": sum(p.numel() for p in model.parameters()),
    }
