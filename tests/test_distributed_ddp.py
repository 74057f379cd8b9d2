"""Data-parallel training on 2 CPU processes equals one process with the same global batch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from attnkit.distributed import ddp
from distributed_harness import free_port, run_workers

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


def _forbid_writes(rank: int) -> None:
    """Make every file write of attnkit fail on this rank (only rank 0 may write)."""
    import attnkit._io
    import attnkit.train.checkpoint

    def refuse(path: object, *args: object) -> None:
        raise AssertionError(f"rank {rank} tried to write {path}")

    for module in (attnkit._io, attnkit.train.checkpoint):
        module.atomic_write_bytes = refuse  # type: ignore[assignment]
        module.atomic_write_text = refuse  # type: ignore[assignment]


def _iris_fit(out: Path | None, env: ddp.DistEnv, **fit_kwargs: object) -> dict[str, torch.Tensor]:
    """The Iris classifier trained by attnkit.train.fit, in float64 with dropout off, so that
    runs differ only by floating-point summation order."""
    from attnkit.models.classifiers import TabularConfig
    from attnkit.train import TrainConfig, fit
    from attnkit.train.data import load_iris_splits
    from attnkit.train.iris import build_iris

    d = load_iris_splits(0)
    train = {"features": d.x_train.double(), "labels": d.y_train}  # 90 flowers: 45 per rank
    val = {"features": d.x_val.double(), "labels": d.y_val}
    model = build_iris(TabularConfig(dropout=0.0), seed=0).double()
    config = TrainConfig(epochs=3, batch_size=16, lr=2e-3, patience=0, seed=0)
    fit_model, fit_config, seams = ddp.prepare_fit(model, config, env)
    fit(fit_model, train, val, fit_config, out_dir=out, progress=False, **seams, **fit_kwargs)
    from attnkit.train.checkpoint import load_tensors

    if out is not None:  # the last epoch's weights, as checkpointed (fit returns the best ones)
        return {
            k: v
            for k, v in load_tensors(out / "trainer_state.safetensors")[0].items()
            if k.startswith("model.")
        }
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_worker(rank: int, world: int, tmp: str, port: int) -> None:
    tmp_path = Path(tmp)
    # 0. The helpers in a plain loop.
    plain_diff, losses = _plain_ddp(rank, world)
    env = ddp.current_env()
    if rank > 0:
        _forbid_writes(rank)
    # 1. attnkit.train.fit through its seams: 2 processes vs 1, and an interrupted + resumed run.
    two = _iris_fit(tmp_path / "two", env)
    dist.barrier()  # rank 0 has finished writing
    one = _iris_fit(None, ddp.DistEnv()) if rank == 0 else None
    _iris_fit(tmp_path / "resumed", env, stop_after=2)
    dist.barrier()
    resumed = _iris_fit(tmp_path / "resumed", env, resume=True)
    dist.barrier()
    if rank == 0:
        assert one is not None
        diff = max((two[f"model.{k}"] - v).abs().max().item() for k, v in one.items())
        assert diff < 1e-10, f"2 processes vs 1: parameters differ by {diff}"
        assert all(torch.equal(resumed[k], two[k]) for k in two), "resumed run differs"
        Path(tmp, "fit.json").write_text(
            json.dumps({"plain_param_diff": plain_diff, "losses": losses, "iris_param_diff": diff})
        )

    # 2. The CLI exactly as torchrun starts it: a fresh group from RANK/WORLD_SIZE/LOCAL_RANK.
    dist.destroy_process_group()
    from attnkit.cli import main

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_PORT=str(port))  # fmt: skip
    out = tmp_path / "cli"
    assert main(["train", "iris", "--epochs", "2", "--out", str(out), "--quiet"]) == 0
    assert not dist.is_initialized()  # the command tore its group down
    assert main(["train", "iris", "--epochs", "2", "--out", str(out), "--quiet", "--resume"]) == 0


@pytest.mark.distributed
@pytest.mark.slow
def test_data_parallel_training_equals_one_process_resumes_and_runs_the_cli(
    tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    run_workers(_train_worker, 2, str(tmp_path), free_port())
    result = json.loads((tmp_path / "fit.json").read_text())
    assert result["plain_param_diff"] < 1e-12 and result["iris_param_diff"] < 1e-10
    assert len(result["losses"]) == EPOCHS * N_EXAMPLES // GLOBAL_BATCH
    files = {p.name for p in (tmp_path / "cli").iterdir()}
    assert {"model.safetensors", "trainer_state.json", "metrics.json", "config.json"} <= files
    metrics = json.loads((tmp_path / "cli" / "metrics.json").read_text())
    assert metrics["epochs_run"] == 2 and metrics["test_accuracy"] > 0.5
    assert capfd.readouterr().out.count("checkpoint and metrics.json in") == 2  # rank 0, twice


def test_prepare_fit_global_batch_must_divide() -> None:
    from attnkit.train import TrainConfig

    two_ranks = ddp.DistEnv(rank=1, world_size=2)  # checked before any process group is used
    with pytest.raises(ValueError, match=r"--batch-size .* 15 is not divisible by 2"):
        ddp.prepare_fit(nn.Linear(2, 2), TrainConfig(batch_size=15), two_ranks)
    alone = ddp.DistEnv()
    model = nn.Linear(2, 2)
    same, config, seams = ddp.prepare_fit(model, TrainConfig(batch_size=15), alone)
    assert same is model and config.batch_size == 15 and seams == {"is_writer": True}
