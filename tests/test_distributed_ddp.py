"""The data-parallel helpers: a DDP loop on 2 CPU processes equals one process with the same
global batch; a world of one is a no-op; rank_share cuts an epoch's order as DistributedSampler
does."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from attnkit.distributed import ddp
from distributed_harness import run_workers

GLOBAL_BATCH, EPOCHS, N_EXAMPLES, SEED = 8, 2, 32, 3


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N_EXAMPLES, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (N_EXAMPLES,), generator=gen)
    return x, y


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _train_single() -> nn.Module:
    """The oracle: one process, batches of GLOBAL_BATCH in DistributedSampler's shuffled order
    (``torch.randperm`` seeded with ``seed + epoch``, as its documentation states)."""
    x, y = _data()
    model = _model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(EPOCHS):
        order = torch.randperm(N_EXAMPLES, generator=torch.Generator().manual_seed(SEED + epoch))
        for start in range(0, N_EXAMPLES, GLOBAL_BATCH):
            batch = order[start : start + GLOBAL_BATCH]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            opt.step()
    return model


def _plain_ddp(rank: int, world: int) -> tuple[float, list[float]]:
    """A hand-written DDP loop (SGD with momentum) against the single-process oracle."""
    env = ddp.setup()  # the harness already initialised the group: setup() adopts it
    assert env.rank == rank and env.world_size == world
    assert env.distributed and env.is_main == (rank == 0)
    x, y = _data()
    dataset = torch.utils.data.TensorDataset(x, y)
    # Each rank initialises differently on purpose: DDP must broadcast rank 0's weights.
    model = ddp.wrap_model(_model(seed=rank), env)
    sampler = ddp.make_sampler(dataset, env, shuffle=True, seed=SEED)
    loader = torch.utils.data.DataLoader(dataset, batch_size=GLOBAL_BATCH // world, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            losses.append(ddp.all_reduce_mean(loss.item(), env))
    trained = ddp.unwrap_model(model)
    assert not isinstance(trained, nn.parallel.DistributedDataParallel)
    reference = _train_single()
    diff = max(
        (p - r).abs().max().item()
        for p, r in zip(trained.parameters(), reference.parameters(), strict=True)
    )
    assert diff < 1e-12, f"rank {rank}: DDP parameters differ from one process by {diff}"
    # all_reduce_mean is the mean over ranks.
    assert ddp.all_reduce_mean(float(rank), env) == pytest.approx((world - 1) / 2)
    return diff, losses


def test_setup_without_torchrun_is_a_world_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not ddp.launched_by_torchrun()
    env = ddp.setup()
    assert env == ddp.DistEnv() and env.is_main and not env.distributed
    model = nn.Linear(2, 2)
    assert ddp.wrap_model(model, env) is model
    assert (
        ddp.make_sampler(torch.utils.data.TensorDataset(torch.zeros(4)), env, shuffle=True) is None
    )
    assert ddp.all_reduce_mean(2.5, env) == 2.5
    assert env.device == torch.device("cpu")
    ddp.teardown(env)
    assert not dist.is_initialized()


def test_setup_rejects_bad_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="RANK=2"):
        ddp.setup()
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError, match="RANK"):
        ddp.setup()
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="backend"):
        ddp.setup(backend="mpi")


def _plain_worker(rank: int, world: int, tmp: str) -> None:
    plain_diff, losses = _plain_ddp(rank, world)
    if rank == 0:
        Path(tmp, "plain.json").write_text(
            json.dumps({"plain_param_diff": plain_diff, "losses": losses})
        )
    gc.collect()  # the DDP wrapper (and its reducer's hold on the group) goes first
    dist.barrier()  # both ranks are done before either tears the group down


@pytest.mark.distributed
@pytest.mark.slow
def test_data_parallel_loop_equals_one_process(tmp_path: Path) -> None:
    run_workers(_plain_worker, 2, str(tmp_path))
    result = json.loads((tmp_path / "plain.json").read_text())
    assert result["plain_param_diff"] < 1e-12
    assert len(result["losses"]) == EPOCHS * N_EXAMPLES // GLOBAL_BATCH


def test_rank_share_is_every_world_size_th_position_padded_like_distributed_sampler() -> None:
    order = torch.tensor([4, 2, 0, 3, 1])
    assert torch.equal(ddp.rank_share(order, ddp.DistEnv()), order)  # a world of one: all of it
    first = ddp.rank_share(order, ddp.DistEnv(rank=0, world_size=2))
    second = ddp.rank_share(order, ddp.DistEnv(rank=1, world_size=2))
    assert first.tolist() == [4, 0, 1]  # positions 0, 2, 4
    assert second.tolist() == [2, 3, 4]  # positions 1, 3, then position 0 again: equal counts
