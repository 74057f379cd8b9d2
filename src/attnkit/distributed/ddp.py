"""Data-parallel training helpers: DistributedDataParallel under torchrun, in a few functions.

Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training". Every
rank holds a full copy of the model and sees a different slice of each global batch
(``DistributedSampler``); DDP averages the gradients across ranks during ``backward``, so every
rank takes the same optimizer step. With equal slices, the average of the ranks' mean losses is
the mean loss of the global batch, so ``W`` ranks with a batch of ``B / W`` each train exactly
like one process with a batch of ``B`` (up to floating-point summation order).

``torchrun --nproc_per_node=W ...`` starts ``W`` copies of the program and tells each one who it
is through environment variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``). ``setup()`` reads them; without them the program runs as a world of one and
nothing here does anything, so the same training code serves both cases::

    env = setup()                              # init_process_group when launched by torchrun
    model = wrap_model(model, env)             # DDP when world_size > 1
    sampler = make_sampler(dataset, env, shuffle=True, seed=0)
    ...
    if env.is_main:                            # only rank 0 writes checkpoints, logs, metrics
        save(...)
    teardown(env)

These helpers know nothing of ``attnkit.train``: ``attnkit.tasks.parallel`` runs its ``fit`` on
several ranks with them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = [
    "DistEnv",
    "all_reduce_mean",
    "barrier",
    "current_env",
    "launched_by_torchrun",
    "make_sampler",
    "rank_share",
    "setup",
    "teardown",
    "unwrap_model",
    "wrap_model",
]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class DistEnv:
    """Who this process is in the job. A plain run is ``DistEnv(rank=0, world_size=1, ...)``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None  # "gloo" or "nccl" when a process group is in use
    initialized_here: bool = False  # setup() created the group, so teardown() destroys it

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes files and prints."""
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """``cuda:LOCAL_RANK`` under NCCL, else the CPU."""
        if self.backend == "nccl":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")


def launched_by_torchrun() -> bool:
    """True when torchrun (or any launcher setting RANK/WORLD_SIZE/LOCAL_RANK) started us."""
    return all(name in os.environ for name in _TORCHRUN_VARS)


def _env_int(name: str) -> int:
    raw = os.environ[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def setup(backend: str | None = None, timeout_s: float = 300.0) -> DistEnv:
    """Join the process group torchrun describes; a world of one when not launched by torchrun.

    ``backend`` defaults to NCCL when CUDA is available, else gloo (CPU). If a group is already
    initialised (a test harness, a notebook), it is used as is.
    """
    if dist.is_available() and dist.is_initialized():
        return DistEnv(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            backend=str(dist.get_backend()),
        )
    if not launched_by_torchrun():
        return DistEnv()
    rank, world_size, local_rank = (_env_int(name) for name in _TORCHRUN_VARS)
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} must lie in [0, WORLD_SIZE={world_size})")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return DistEnv(rank, world_size, local_rank, backend, initialized_here=True)


def current_env() -> DistEnv:
    """The job this process belongs to, from the initialised default group; never initialises."""
    if dist.is_available() and dist.is_initialized():
        return setup()
    return DistEnv()


def teardown(env: DistEnv) -> None:
    """Destroy the process group if ``setup`` created it."""
    if env.initialized_here and dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: nn.Module, env: DistEnv) -> nn.Module:
    """``DistributedDataParallel(model)`` when there are several ranks, else ``model`` itself.

    DDP broadcasts rank 0's parameters and buffers at construction, so every rank starts from
    the same weights even if they were initialised differently.
    """
    if not env.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel

    if env.device.type == "cuda":
        model = model.to(env.device)
        return DistributedDataParallel(model, device_ids=[env.local_rank])
    return DistributedDataParallel(model)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module inside a DDP wrapper (what checkpoints should store)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def make_sampler(
    dataset: torch.utils.data.Dataset,
    env: DistEnv,
    *,
    shuffle: bool,
    seed: int = 0,
    drop_last: bool = False,
) -> torch.utils.data.Sampler | None:
    """A ``DistributedSampler`` giving this rank every ``W``-th example, or ``None`` alone.

    With ``shuffle`` all ranks draw the same permutation (``seed + epoch``: call
    ``sampler.set_epoch(epoch)`` every epoch) and rank ``r`` takes positions ``r, r + W, ...``
    of it, so the ranks' batches at one step together form one global batch. Without
    ``drop_last`` the sampler repeats a few examples so every rank gets the same count.
    """
    if not env.distributed:
        return None
    from torch.utils.data import DistributedSampler

    return DistributedSampler(
        dataset,
        num_replicas=env.world_size,
        rank=env.rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )


def all_reduce_mean(value: float, env: DistEnv) -> float:
    """The mean of ``value`` over all ranks (a metric such as a loss); ``value`` alone."""
    if not env.distributed:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.item() / env.world_size


def barrier(env: DistEnv) -> None:
    """Wait for every rank (e.g. before others read a file rank 0 just wrote)."""
    if env.distributed:
        dist.barrier()


def rank_share(order: Tensor, env: DistEnv) -> Tensor:
    """This rank's share of an epoch's order of examples: positions ``r, r + W, ...`` of ``order``.

    The cut ``DistributedSampler(shuffle=False)`` makes: when ``W`` does not divide
    ``len(order)`` the first few examples are repeated, so every rank gets the same count (DDP
    needs every rank to make the same number of steps). A world of one gets ``order`` itself.
    With equal batch sizes, the ranks' batches at one step together are the single-process batch.
    """
    if not env.distributed:
        return order
    from torch.utils.data import DistributedSampler

    mine = DistributedSampler(
        range(len(order)), num_replicas=env.world_size, rank=env.rank, shuffle=False
    )
    return order[torch.tensor(list(mine), dtype=torch.long)]  # positions r, r + W, ...
