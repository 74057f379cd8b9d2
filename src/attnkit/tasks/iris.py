"""The Iris worked example: train, test, and look at what the attention heads do.

``train_iris(IrisRun(seed=...), out=...)`` builds the tabular attention classifier
(``attnkit.models.classifiers``), trains it with ``attnkit.train.fit`` on a stratified 60/20/20
split (standardised with training statistics), and writes into ``out``: the checkpoint,
``metrics.json``, ``attention.json`` (the mean feature-to-feature attention map of every head on
the test set, and what each head attends to) and ``attention.png`` (``attnkit.viz.plot_grid``)
when matplotlib is installed.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnkit.models.classifiers import TabularAttentionClassifier, TabularConfig
from attnkit.tasks.runs import accuracies, load_trained, run_facts, seeded, start_task
from attnkit.train.data import IRIS_FEATURES, load_iris_splits
from attnkit.train.loop import TrainConfig
from attnkit.viz.heatmap import plot_grid, save_figure

__all__ = [
    "IRIS_TRAIN",
    "IrisRun",
    "build_iris",
    "describe_heads",
    "evaluate_iris",
    "iris_attention",
    "iris_datasets",
    "summarize_heads",
    "train_iris",
]

# Chosen by comparing recipes over 60 seeds (benchmarks/iris_recipes.py, its section in
# docs/benchmarks.md): 200 epochs with patience 50 beat 100 / 30 by about 0.5 points, on seeds
# 0-29 and again on fresh seeds 30-59, together with TabularConfig.feature_bias_init = 3.
IRIS_TRAIN = TrainConfig(
    epochs=200, batch_size=16, lr=1e-3, weight_decay=0.05, patience=50, monitor="val_accuracy"
)
FRACTIONS = (0.6, 0.2, 0.2)
TOKENS = ("CLS", *IRIS_FEATURES)
SHORT_TOKENS = ("CLS", "sep.L", "sep.W", "pet.L", "pet.W")  # picture labels, TOKENS' order
SEPAL, PETAL = (1, 2), (3, 4)  # token positions (0 is CLS)


@dataclass(frozen=True)
class IrisRun:
    """What one Iris run trains: the seed (split, initial weights, order), model and recipe.

    ``train.seed`` is replaced by ``seed``, so one number seeds the whole run.
    """

    seed: int = 0
    model: TabularConfig = field(default_factory=TabularConfig)
    train: TrainConfig = IRIS_TRAIN


def build_iris(config: TabularConfig, seed: int) -> TabularAttentionClassifier:
    return seeded(TabularAttentionClassifier, config, seed)


def iris_datasets(
    seed: int, fractions: tuple[float, float, float] = FRACTIONS
) -> tuple[dict, dict, dict]:
    """The seeded train / validation / test splits as ``fit``'s datasets (features, labels)."""
    d = load_iris_splits(seed, fractions)
    return (
        {"features": d.x_train, "labels": d.y_train},
        {"features": d.x_val, "labels": d.y_val},
        {"features": d.x_test, "labels": d.y_test},
    )


@torch.no_grad()
def iris_attention(model: TabularAttentionClassifier, features: torch.Tensor) -> torch.Tensor:
    """Mean attention over ``features``' rows: ``(layers, heads, 5, 5)``, token order ``TOKENS``."""
    model.eval()
    _, maps = model(features, return_attention=True)
    return torch.stack([m.mean(dim=0) for m in maps])  # (layers, h, t, t)


def describe_heads(maps: torch.Tensor) -> list[str]:
    """One honest sentence per head: where CLS looks and how much feature tokens look at petals."""
    lines = []
    for layer in range(maps.shape[0]):
        for head in range(maps.shape[1]):
            m = maps[layer, head]  # (t, t)
            cls_row = m[0]
            top = int(cls_row[1:].argmax()) + 1
            petal_from_feats = m[1:, list(PETAL)].sum(-1).mean().item()
            sepal_from_feats = m[1:, list(SEPAL)].sum(-1).mean().item()
            cls_petal = cls_row[list(PETAL)].sum().item()
            kind = (
                "petal-focused"
                if petal_from_feats > 0.6
                else "sepal-focused"
                if sepal_from_feats > 0.6
                else "CLS-focused"
                if m[1:, 0].mean().item() > 0.5
                else "mixed"
            )
            lines.append(
                f"layer {layer + 1} head {head + 1}: {kind}; feature tokens put "
                f"{petal_from_feats:.0%} on petal and {sepal_from_feats:.0%} on sepal tokens; "
                f"CLS puts {cls_petal:.0%} on petals, most on {TOKENS[top]} ({cls_row[top]:.0%})"
            )
    return lines


def summarize_heads(maps: torch.Tensor) -> str:
    """Do heads specialise in sepal or petal measurements? What the numbers say, in a sentence."""
    petal = maps[:, :, 1:, list(PETAL)].sum(-1).mean(-1)  # (layers, h): feature rows -> petals
    sepal = maps[:, :, 1:, list(SEPAL)].sum(-1).mean(-1)
    cls_petal = maps[:, :, 0, list(PETAL)].sum(-1)  # (layers, h)
    n_petal = int((petal > 0.6).sum())
    n_sepal = int((sepal > 0.6).sum())
    return (
        f"{n_petal} of {petal.numel()} heads are petal-focused and {n_sepal} sepal-focused "
        f"(> 60 % of the feature tokens' attention on that pair); the CLS token puts "
        f"{cls_petal.min():.0%}-{cls_petal.max():.0%} of its attention on the petal "
        f"measurements (the two that separate the species best; mean over heads "
        f"{cls_petal.mean():.0%}). So heads do not split cleanly into sepal and petal experts."
        if n_petal + n_sepal < petal.numel()
        else f"every head is focused: {n_petal} on petals, {n_sepal} on sepals."
    )


def _plot(maps: torch.Tensor, path: Path) -> bool:
    """``attention.png``: every head's mean map, annotated; ``False`` without matplotlib."""
    try:
        fig = plot_grid(
            maps,
            SHORT_TOKENS,
            title="Iris: mean attention on the test set (rows attend to columns)",
            count_from=1,  # as describe_heads counts
            cmap="viridis",
        )
    except ImportError:
        return False
    save_figure(fig, path, dpi=110)
    return True


def train_iris(
    run: IrisRun | None = None,
    *,
    out: str | Path | None = None,
    resume: bool = False,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Train and test the Iris classifier; returns (and writes to ``out``) the metrics.

    ``run`` defaults to ``IrisRun()``; ``resume`` continues the run saved in ``out``;
    ``progress`` shows a bar (``None``: when stderr is a terminal).

    Tensors here are tiny (16 x 5 tokens x 64), so run it with ``torch.set_num_threads(1)``: extra
    threads only add synchronisation (20x slower on a busy 2-core machine); the CLI does this.
    """
    run = run or IrisRun()
    seed, model_config = run.seed, run.model
    task = start_task("iris", run, out=out, resume=resume, progress=progress)
    train, val, test = iris_datasets(seed)
    model = build_iris(model_config, seed)
    started = time.perf_counter()
    result = task.fit(model, train, val)
    wall = time.perf_counter() - started
    metrics = _metrics(model, train, val, test)
    maps = iris_attention(model, test["features"])
    metrics.update(
        task="iris",
        variant="scratch",
        seed=seed,
        **run_facts(model, result, stopped_early=True),
        wall_seconds=round(wall, 2),
        heads=describe_heads(maps),
        heads_summary=summarize_heads(maps),
        **{
            k: v
            for k, v in asdict(model_config).items()
            if k in ("d_model", "num_heads", "num_layers")
        },
    )
    if task.writes:
        task.save("metrics.json", metrics)
        task.save(
            "attention.json",
            {
                "tokens": list(TOKENS),
                "maps": maps.tolist(),
                "heads": metrics["heads"],
                "summary": metrics["heads_summary"],
                "what": "mean attention weights on the test set, [layer][head][query][key]",
            },
        )
        assert task.out is not None
        metrics["attention_png"] = _plot(maps, task.out / "attention.png")
    return metrics


def _metrics(model: torch.nn.Module, train: dict, val: dict, test: dict) -> dict[str, float]:
    return accuracies(model, {"train": train, "val": val, "test": test})


def evaluate_iris(directory: Path, config: dict[str, Any]) -> dict[str, Any]:
    """Accuracies of the checkpoint in ``directory`` on the split its ``config.json`` seeds."""
    model = load_trained(
        directory, config, TabularConfig, TabularAttentionClassifier, keys={"seed": int}
    )
    train, val, test = iris_datasets(config["seed"])
    return {
        **_metrics(model, train, val, test),
        "params": sum(p.numel() for p in model.parameters()),
    }
