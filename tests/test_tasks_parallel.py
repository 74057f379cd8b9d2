"""``attnkit.train.fit`` on 2 CPU processes through ``attnkit.tasks.parallel`` equals one
process with the same global batch, resumes exactly, and ``attnkit train`` runs under torchrun."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from attnkit.distributed import ddp
from attnkit.tasks.parallel import prepare_fit
from attnkit.train import FitOptions, TrainConfig
from distributed_harness import free_port, run_workers


def _forbid_writes(rank: int) -> None:
    """Make every file write of attnkit fail on this rank (only rank 0 may write)."""
    import attnkit._io
    import attnkit.train.checkpoint

    def refuse(path: object, *args: object) -> None:
        raise AssertionError(f"rank {rank} tried to write {path}")

    for module in (attnkit._io, attnkit.train.checkpoint):
        module.atomic_write_bytes = refuse  # type: ignore[assignment]
        module.atomic_write_text = refuse  # type: ignore[assignment]


def _iris_fit(out: Path | None, env: ddp.DistEnv, **options: object) -> dict[str, torch.Tensor]:
    """The Iris classifier trained by attnkit.train.fit, in float64 with dropout off, so that
    runs differ only by floating-point summation order."""
    from attnkit.models.classifiers import TabularConfig
    from attnkit.tasks.iris import build_iris
    from attnkit.train import fit
    from attnkit.train.data import load_iris_splits

    d = load_iris_splits(0)
    train = {"features": d.x_train.double(), "labels": d.y_train}  # 90 flowers: 45 per rank
    val = {"features": d.x_val.double(), "labels": d.y_val}
    model = build_iris(TabularConfig(dropout=0.0), seed=0).double()
    config = TrainConfig(epochs=3, batch_size=16, lr=2e-3, patience=0, seed=0)
    fit_model, fit_config, seams = prepare_fit(model, config, env)
    fit(fit_model, train, val, fit_config, replace(seams, out_dir=out, progress=False, **options))
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
        Path(tmp, "fit.json").write_text(json.dumps({"iris_param_diff": diff}))

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
def test_fit_on_two_processes_equals_one_resumes_and_runs_the_cli(
    tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    run_workers(_train_worker, 2, str(tmp_path), free_port())
    result = json.loads((tmp_path / "fit.json").read_text())
    assert result["iris_param_diff"] < 1e-10
    files = {p.name for p in (tmp_path / "cli").iterdir()}
    assert {"model.safetensors", "trainer_state.json", "metrics.json", "config.json"} <= files
    metrics = json.loads((tmp_path / "cli" / "metrics.json").read_text())
    assert metrics["epochs_run"] == 2 and metrics["test_accuracy"] > 0.5
    assert capfd.readouterr().out.count("checkpoint and metrics.json in") == 2  # rank 0, twice


def test_prepare_fit_global_batch_must_divide() -> None:
    two_ranks = ddp.DistEnv(rank=1, world_size=2)  # checked before any process group is used
    with pytest.raises(ValueError, match=r"--batch-size .* 15 is not divisible by 2"):
        prepare_fit(nn.Linear(2, 2), TrainConfig(batch_size=15), two_ranks)
    alone = ddp.DistEnv()
    model = nn.Linear(2, 2)
    same, config, seams = prepare_fit(model, TrainConfig(batch_size=15), alone)
    assert same is model and config.batch_size == 15 and seams == FitOptions(is_writer=True)
