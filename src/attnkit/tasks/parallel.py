"""``attnkit.train.fit`` on one process or on every rank of a ``torchrun`` job (data parallel).

``fit`` has seams for this (``FitOptions.make_optimizer``, ``sampler``, ``is_writer``) and
``attnkit.distributed.ddp`` has the helpers; this module joins the two, so that neither the
training library nor the distributed helpers import each other.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from attnkit.distributed.ddp import DistEnv, rank_share, unwrap_model, wrap_model
from attnkit.train.loop import FitOptions, FitResult, TrainConfig, fit, shuffled_order

__all__ = ["fit_on_ranks", "prepare_fit"]


def prepare_fit(
    model: nn.Module, config: TrainConfig, env: DistEnv, options: FitOptions | None = None
) -> tuple[nn.Module, TrainConfig, FitOptions]:
    """Adapt a run of ``attnkit.train.fit`` to data parallelism, through fit's seams.

    ``config.batch_size`` stays the *global* batch: each of the ``W`` ranks takes
    ``batch_size / W`` examples per step, so a run under ``torchrun`` makes the same optimizer
    steps, with the same learning-rate schedule, as one process. The epoch order is fit's own
    seeded shuffle (or ``options.sampler``), cut by ``rank_share``: rank ``r`` takes positions
    ``r, r + W, ...``, so at every step the ranks' batches together are exactly the
    single-process batch.

    ``options.make_optimizer`` is handed the plain model, not the DDP wrapper, so it can address
    submodules and parameter names as usual (the parameters are the same objects).

    Returns ``(model, config, options)``: the DDP-wrapped model, the config with the per-rank
    batch size, and the options with the rank's sampler, ``is_writer`` (rank 0 only) and the
    optimizer seam. On a world of one the model and config come back unchanged.
    """
    options = replace(options or FitOptions(), is_writer=env.is_main)
    if not env.distributed:
        return model, config, options
    if config.batch_size % env.world_size:
        raise ValueError(
            f"--batch-size is the global batch and must be divisible by the number of "
            f"processes: {config.batch_size} is not divisible by {env.world_size}"
        )
    base = options.sampler or shuffled_order(config.seed)
    build = options.make_optimizer

    def shard(n: int, epoch: int) -> Tensor:
        return rank_share(base(n, epoch), env)  # this rank's share of the single-process order

    def make_optimizer(m: nn.Module, c: TrainConfig) -> torch.optim.Optimizer:
        return build(unwrap_model(m), c)

    per_rank = replace(config, batch_size=config.batch_size // env.world_size)
    seams = replace(options, sampler=shard, make_optimizer=make_optimizer)
    return wrap_model(model, env), per_rank, seams


def fit_on_ranks(
    model: nn.Module,
    train: Any,
    val: Any,
    config: TrainConfig,
    env: DistEnv,
    options: FitOptions | None = None,
) -> FitResult:
    """``attnkit.train.fit`` through ``prepare_fit``: one process, or every rank under torchrun.

    Only rank 0 shows progress and writes checkpoints; ``model`` holds the kept weights after.
    """
    fit_model, fit_config, fit_options = prepare_fit(model, config, env, options)
    if not env.is_main:
        fit_options = replace(fit_options, progress=False)
    return fit(fit_model, train, val, fit_config, fit_options)
