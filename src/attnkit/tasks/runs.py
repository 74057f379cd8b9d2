"""What every worked example does around its own model: start a run, train it, report, re-load.

A task (``iris``, ``text``, ``vit``, ``translate``, ``forecast``) owns its data, its model and
its pictures; the scaffolding around them is the same for all and lives here, written once:

- ``start_task``: a run's settings as ``config.json`` (``format``, ``task``, ``variant``,
  ``seed``, the task's own keys, ``model``, ``train``), a fresh checkpoint in ``out`` or, on
  ``resume``, the check that the saved run has the same settings; only rank 0 of a ``torchrun``
  job writes. It returns a ``TaskRun`` that trains (``TaskRun.fit``, data parallel through
  ``attnkit.tasks.parallel``) and writes files (``TaskRun.save``) for the run.
- ``seeded``: a model built right after ``torch.manual_seed(seed)``, so the initial weights are
  part of the seeded run.
- ``run_facts``: the figures every ``metrics.json`` reports about the training itself.
- ``accuracies``: ``{split}_accuracy`` of a classifier on its splits.
- ``load_trained``: the model a checkpoint's ``config.json`` describes, with its saved weights,
  for ``attnkit evaluate``; a ``model`` entry that does not fit the task's config class is a
  ``ValueError`` naming the file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, is_dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from attnkit.distributed.ddp import DistEnv, current_env
from attnkit.tasks.parallel import fit_on_ranks
from attnkit.train.checkpoint import (
    CONFIG_FILE,
    FORMAT,
    load_model_weights,
    require_keys,
    save_json,
    start_run,
)
from attnkit.train.loop import FitOptions, FitResult, TrainConfig, evaluate
from attnkit.train.manifest import open_checkpoint

__all__ = ["TaskRun", "accuracies", "load_trained", "run_facts", "seeded", "start_task"]

M = TypeVar("M", bound=nn.Module)


@dataclass(frozen=True)
class TaskRun:
    """A started run: where it writes (``out``, ``None``: nowhere), the process group it is part
    of, and the recipe with the run's seed in it."""

    out: Path | None
    env: DistEnv
    train: TrainConfig
    resume: bool
    progress: bool | None

    @property
    def writes(self) -> bool:
        """``True`` on the process that writes the run's files (rank 0) when there is an ``out``."""
        return self.out is not None and self.env.is_main

    @property
    def fit_settings(self) -> dict[str, Any]:
        """The ``FitOptions`` every run sets: its checkpoint, ``resume`` and ``progress``."""
        return {"out_dir": self.out, "resume": self.resume, "progress": self.progress}

    def fit(
        self,
        model: nn.Module,
        train: Any,
        val: Any,
        options: FitOptions | None = None,
        **settings: Any,
    ) -> FitResult:
        """``attnkit.train.fit`` on this run's recipe and checkpoint. ``options`` defaults to
        ``FitOptions(**fit_settings, **settings)``; ``settings`` are the task's own
        (``make_optimizer``, ``objective``)."""
        if options is None:
            options = FitOptions(**self.fit_settings, **settings)
        # Data parallel (a no-op on one process): attnkit.tasks.parallel.
        return fit_on_ranks(model, train, val, self.train, self.env, options)

    def save(self, name: str, value: Any) -> None:
        """``value`` as JSON in ``out / name``; call it only when ``writes``."""
        assert self.out is not None
        save_json(self.out / name, value)


def start_task(
    task: str,
    run: Any,
    *,
    out: str | Path | None,
    resume: bool,
    progress: bool | None,
    variant: str = "scratch",
    model: Any = None,
    train: TrainConfig | None = None,
    extra: Mapping[str, Any] | None = None,
    files: Mapping[str, bytes] | None = None,
) -> TaskRun:
    """Begin ``run`` (a task's run dataclass: ``seed``, ``model``, ``train``) of ``task`` in
    ``out``. ``config.json`` holds the settings: ``model`` (default ``run.model``; a dataclass
    or a mapping), ``train`` (default ``run.train``) with ``run.seed`` in it, so one number
    seeds the run, and ``extra``, the task's own keys; ``files`` are saved beside it."""
    model = run.model if model is None else model
    train = replace(run.train if train is None else train, seed=run.seed)
    out = Path(out) if out is not None else None
    run_config = {
        "format": FORMAT,
        "task": task,
        "variant": variant,
        "seed": run.seed,
        **(extra or {}),
        "model": asdict(model) if is_dataclass(model) else dict(model),
        "train": asdict(train),
    }
    env = current_env()  # several processes under torchrun: only rank 0 writes
    start_run(out, run_config, resume=resume, writer=env.is_main, files=files)
    return TaskRun(out=out, env=env, train=train, resume=resume, progress=progress)


def seeded(build: Callable[[Any], M], config: Any, seed: int) -> M:
    """``build(config)`` right after ``torch.manual_seed(seed)``: the initial weights are part
    of the seeded run."""
    torch.manual_seed(seed)
    return build(config)


def run_facts(
    model: nn.Module, result: FitResult, *, digits: int = 2, stopped_early: bool = False
) -> dict[str, Any]:
    """What ``metrics.json`` says about the training: weights, the kept epoch, epochs run (and,
    with ``stopped_early``, whether early stopping ended it), seconds, torch threads."""
    facts: dict[str, Any] = {
        "params": sum(p.numel() for p in model.parameters()),
        "epochs": result.best_epoch,
        "epochs_run": result.epochs_run,
    }
    if stopped_early:
        facts["stopped_early"] = result.stopped_early
    facts.update(seconds=round(result.seconds, digits), threads=torch.get_num_threads())
    return facts


def accuracies(
    model: nn.Module, splits: Mapping[str, Any], batch_size: int = 256
) -> dict[str, float]:
    """``{name}_accuracy`` of ``model`` on each named split (eval mode, 4 decimals)."""
    return {
        f"{name}_accuracy": round(evaluate(model, data, batch_size=batch_size)[1], 4)
        for name, data in splits.items()
    }


def load_trained(
    directory: str | Path,
    config: Mapping[str, Any],
    config_class: type,
    build: Callable[[Any], M],
    keys: Mapping[str, type | tuple[type, ...]] | None = None,
) -> M:
    """``build(config_class(**config["model"]))`` with the weights saved in ``directory``.

    ``keys``: what else the task reads from ``config.json`` (name -> type), checked first, as
    ``model`` is; a setting ``config_class`` does not know, or lacks, is a ``ValueError``.
    """
    source = Path(directory) / CONFIG_FILE
    require_keys(config, {"model": dict, **(keys or {})}, source)
    try:
        model_config = config_class(**config["model"])
    except TypeError as exc:  # an unknown or missing setting
        raise ValueError(
            f"{str(source)!r}: 'model' does not fit {config_class.__name__} ({exc})"
        ) from None
    model = build(model_config)
    load_model_weights(model, open_checkpoint(directory))
    return model
