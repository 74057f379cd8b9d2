"""A small, reusable training loop: seeded, deterministic, resumable.

``fit`` trains any classifier ``model(**inputs) -> logits (b, classes)`` on a dataset given as a
dict of tensors with a ``"labels"`` entry (every tensor has the examples on dim 0):

- AdamW (Loshchilov & Hutter 2019, decoupled weight decay) with a linear warm-up followed by a
  cosine (Loshchilov & Hutter 2017, SGDR, without restarts) or linear decay, set per step;
- early stopping: the best epoch on validation (lowest loss, or highest accuracy with ties broken
  by loss) is kept, and training stops after ``patience`` epochs without a better one;
- a tqdm progress bar with the running loss and accuracy (off when stderr is not a terminal);
- a checkpoint after every epoch (``FitOptions.out_dir``): the best weights as
  ``model.safetensors``, and everything needed to continue (current weights, optimizer moments,
  the global RNG state, step, epoch, history, best score) as ``trainer_state.safetensors`` +
  ``trainer_state.json``; the three are committed as one unit (``attnkit.train.manifest``), so a
  run killed at any moment resumes from the previous epoch or from the new one, never a mix.

Why a resumed run equals an uninterrupted one: the shuffling order of epoch ``e`` is a pure
function of ``(seed, e)``, the learning rate a pure function of the step, dropout draws from the
global RNG whose state is saved at the epoch boundary, and safetensors stores the floats exactly.
Resuming from the end of epoch ``k`` therefore replays epochs ``k+1...`` bit for bit on the same
machine and thread count.

What is learned is the ``objective`` seam of ``FitOptions``: ``classification`` by default
(cross-entropy; logits ``(b, classes)`` against labels ``(b,)``, or a sequence of them,
``(b, classes, t)`` against ``(b, t)``, where a label of ``-100`` is padding and neither counts
in the loss nor in the accuracy, as in ``F.cross_entropy``), or ``regression`` (mean absolute
error; its "accuracy" is 0, so such a run monitors ``val_loss``).

Two frozen dataclasses describe a call: ``TrainConfig`` is the recipe (saved with the checkpoint;
a resumed run must use the same one), ``FitOptions`` says how this call runs: where it writes,
whether it resumes or shows progress, and the seams for data-parallel training (``torchrun``):
``make_optimizer`` builds the optimizer (for example around a ``DistributedDataParallel`` model),
``sampler(n, epoch) -> indices`` gives each rank its shard of the epoch's order, and
``is_writer=False`` on every rank but 0. Every rank evaluates the full validation set with
identical weights, so all ranks reach the same early-stopping decision without communication.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.train.checkpoint import (
    MODEL_FILE,
    STATE_JSON,
    STATE_TENSORS,
    has_trained,
    json_bytes,
    json_from_bytes,
    require_keys,
    tensors_bytes,
    tensors_from_bytes,
)
from attnkit.train.manifest import commit, open_checkpoint

__all__ = [
    "Dataset",
    "FitOptions",
    "FitResult",
    "Objective",
    "TrainConfig",
    "classification",
    "evaluate",
    "fit",
    "lr_at",
    "predict",
    "regression",
    "shuffled_order",
    "trim_padding",
]

Dataset = dict[str, Tensor]  # {"labels": (n,), other model inputs: (n, ...)}
SCHEDULES = ("cosine", "linear", "constant")
# (outputs, labels) -> (mean loss, correct predictions, predictions counted)
Objective = Callable[[Tensor, Tensor], tuple[Tensor, int, int]]
IGNORE = -100  # a padding label (F.cross_entropy's ignore_index)


def classification(logits: Tensor, labels: Tensor) -> tuple[Tensor, int, int]:
    """Cross-entropy and correct predictions: ``(b, c)`` vs ``(b,)`` or ``(b, c, t)`` vs ``(b, t)``.

    In the sequence case every position is one prediction, and labels ``IGNORE`` (-100) are
    padding: they count neither in the loss nor in the accuracy.
    """
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE)
    counted = labels != IGNORE
    correct = int(((logits.argmax(dim=1) == labels) & counted).sum())
    return loss, correct, int(counted.sum())


def regression(outputs: Tensor, targets: Tensor) -> tuple[Tensor, int, int]:
    """Mean absolute error of ``outputs`` against ``targets`` (same shape); nothing is "correct"
    (accuracy 0), so monitor ``val_loss``. MAE, not squared error: it is the figure reported."""
    if outputs.shape != targets.shape:
        raise ValueError(
            f"regression: outputs {tuple(outputs.shape)} and targets {tuple(targets.shape)} "
            "must have one shape"
        )
    return (outputs - targets).abs().mean(), 0, targets.numel()


@dataclass(frozen=True)
class TrainConfig:
    """How to train. ``patience=0`` never stops early; ``grad_clip=0`` does not clip."""

    epochs: int = 100
    batch_size: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_frac: float = 0.05  # share of all steps spent warming up linearly from 0
    schedule: str = "cosine"  # after warm-up: "cosine" | "linear" (to 0) | "constant"
    patience: int = 20
    grad_clip: float = 1.0
    seed: int = 0
    monitor: str = "val_loss"  # what picks the best epoch: "val_loss" or "val_accuracy"

    def __post_init__(self) -> None:
        if self.monitor not in ("val_loss", "val_accuracy"):
            raise ValueError(f"monitor must be 'val_loss' or 'val_accuracy', got {self.monitor!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        for name in ("epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup_frac < 1:
            raise ValueError(f"warmup_frac must be in [0, 1), got {self.warmup_frac}")
        for name in ("lr", "weight_decay", "grad_clip"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        if self.lr <= 0 or self.patience < 0 or self.grad_clip < 0:
            raise ValueError(
                f"need lr > 0, patience >= 0, grad_clip >= 0; got lr={self.lr}, "
                f"patience={self.patience}, grad_clip={self.grad_clip}"
            )


@dataclass
class FitResult:
    best_epoch: int  # 1-based epoch whose weights the model holds now ("epochs to convergence")
    epochs_run: int
    stopped_early: bool
    seconds: float  # training time, summed over an interrupted run and its resumptions
    history: list[dict[str, float]] = field(default_factory=list)


def lr_at(step: int, total: int, config: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based) out of ``total``."""
    warmup = int(config.warmup_frac * total)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    if config.schedule == "constant":
        return config.lr
    progress = (step - warmup) / max(1, total - warmup)  # 0 -> 1 over the decay phase
    if config.schedule == "linear":
        return config.lr * (1.0 - progress)
    return config.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def shuffled_order(seed: int) -> Callable[[int, int], Tensor]:
    """The default sampler: a fresh permutation per epoch, a pure function of (seed, epoch)."""

    def order(n: int, epoch: int) -> Tensor:
        gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
        return torch.randperm(n, generator=gen)

    return order


def trim_padding(batch: Dataset) -> Dataset:
    """Drop trailing columns that are padding in every row (needs an ``attention_mask``)."""
    mask = batch.get("attention_mask")
    if mask is None or mask.dim() != 2:
        return batch
    length = int(mask.any(dim=0).nonzero().max()) + 1 if mask.any() else 1
    width = mask.shape[1]
    return {
        k: v[:, :length] if v.dim() == 2 and v.shape[1] == width else v for k, v in batch.items()
    }


def _take(data: Dataset, idx: Tensor) -> Dataset:
    return trim_padding({k: v[idx] for k, v in data.items()})


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DistributedDataParallel keeps the model in .module


def _check_dataset(data: Dataset, name: str) -> int:
    if not isinstance(data, dict) or "labels" not in data:
        raise ValueError(f"{name} must be a dict of tensors with a 'labels' entry")
    n = len(data["labels"])
    bad = {k: tuple(v.shape) for k, v in data.items() if len(v) != n}
    if bad:
        raise ValueError(f"{name}: every tensor needs {n} rows like 'labels', got {bad}")
    if n == 0:
        raise ValueError(f"{name} is empty")
    return n


@torch.no_grad()
def predict(model: nn.Module, data: Dataset, batch_size: int = 256) -> Tensor:
    """Logits ``(n, classes)`` in eval mode (no dropout)."""
    was_training = model.training
    model.eval()
    n = _check_dataset(data, "data")
    out = []
    for start in range(0, n, batch_size):
        batch = _take(data, torch.arange(start, min(n, start + batch_size)))
        batch.pop("labels")
        out.append(model(**batch).float())
    model.train(was_training)
    return torch.cat(out)


def evaluate(
    model: nn.Module,
    data: Dataset,
    batch_size: int = 256,
    objective: Objective = classification,
) -> tuple[float, float]:
    """Mean loss and accuracy of ``model`` on ``data`` (``objective``: see the module's text)."""
    logits = predict(model, data, batch_size)
    loss, correct, counted = objective(logits, data["labels"])
    return loss.item(), correct / max(1, counted)


def default_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; biases, norms and embeddings-like 1-D parameters get no weight decay."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.999))


def _save_state(
    out: Path,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    state: dict,
    best_weights: dict[str, Tensor] | None,
) -> None:
    """Commit the epoch as one checkpoint: the resumable state and, when the epoch improved,
    ``best_weights`` (else the previous checkpoint's ``model.safetensors`` is carried over)."""
    sd = opt.state_dict()
    tensors = {f"model.{k}": v for k, v in _unwrap(model).state_dict().items()}
    tensors["rng.torch"] = torch.get_rng_state()
    for pid, st in sd["state"].items():
        for name, value in st.items():
            if not torch.is_tensor(value):
                raise TypeError(f"optimizer state {name!r} is not a tensor; cannot checkpoint it")
            tensors[f"optimizer.{pid}.{name}"] = value
    files = {
        STATE_TENSORS: tensors_bytes(tensors, metadata={"epoch": str(state["epoch"])}),
        STATE_JSON: json_bytes({**state, "param_groups": sd["param_groups"]}),
    }
    if best_weights is not None:
        files[MODEL_FILE] = tensors_bytes(best_weights)
    commit(out, files)  # carries over the run's other files (config.json, vocab.json)


# What trainer_state.json must hold, and of which JSON type.
_STATE_KEYS: dict[str, type | tuple[type, ...]] = {
    "epoch": int,
    "step": int,
    "best_score": (list, type(None)),
    "best_epoch": int,
    "bad_epochs": int,
    "stopped_early": bool,
    "seconds": (int, float),
    "history": list,
    "config": dict,
    "param_groups": list,
}


def _load_state(
    out: Path, model: nn.Module, opt: torch.optim.Optimizer, config: TrainConfig
) -> tuple[dict, dict[str, Tensor] | None] | None:
    """The saved state (checked against ``config`` before anything is loaded), loaded into
    ``model``, ``opt`` and the global RNG; returns it with the best weights (``None``: none yet).
    ``None`` when the checkpoint holds nothing trained (``has_trained``): the run starts from
    the first epoch, as it would have without the interruption.
    """
    ckpt = open_checkpoint(out)
    if not has_trained(out):
        return None
    ckpt.require(STATE_JSON, "--resume")
    ckpt.require(STATE_TENSORS, "--resume")
    json_path, tensors_path = ckpt.path(STATE_JSON), ckpt.path(STATE_TENSORS)
    state = require_keys(
        json_from_bytes(ckpt.read_bytes(STATE_JSON), json_path), _STATE_KEYS, json_path
    )
    if state["config"] != asdict(config):
        raise ValueError(
            f"{out}: --resume with a different training configuration "
            f"(saved {state['config']}, now {asdict(config)})"
        )
    tensors, meta = tensors_from_bytes(ckpt.read_bytes(STATE_TENSORS), tensors_path)
    if meta.get("epoch") != str(state["epoch"]):
        raise ValueError(
            f"{str(tensors_path)!r} (epoch {meta.get('epoch')}) and {STATE_JSON} "
            f"(epoch {state['epoch']}) disagree; the checkpoint is damaged, train again"
        )
    if "rng.torch" not in tensors:
        raise ValueError(f"{str(tensors_path)!r} lacks 'rng.torch' (the saved RNG state)")
    weights = {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}
    try:
        _unwrap(model).load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise ValueError(
            f"{str(tensors_path)!r}: saved weights do not fit this model ({first})"
        ) from None
    opt_state: dict[int, dict[str, Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, pid, name = key.split(".", 2)
            if not pid.isdigit():
                raise ValueError(f"{str(tensors_path)!r}: bad optimizer tensor name {key!r}")
            opt_state.setdefault(int(pid), {})[name] = value
    try:
        opt.load_state_dict({"state": opt_state, "param_groups": state.pop("param_groups")})
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(
            f"{str(json_path)!r}: the saved optimizer state does not fit this optimizer "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    torch.set_rng_state(tensors["rng.torch"])
    best = None
    if state["best_epoch"] > 0:
        ckpt.require(MODEL_FILE, "--resume")
        best, _ = tensors_from_bytes(ckpt.read_bytes(MODEL_FILE), ckpt.path(MODEL_FILE))
    return state, best


@dataclass(frozen=True)
class FitOptions:
    """How one call of ``fit`` runs; the recipe itself is the ``TrainConfig``.

    Attributes:
        out_dir: checkpoint directory, written after every epoch when ``is_writer``; ``None``
            writes nothing.
        resume: continue from ``out_dir``'s checkpoint. One that holds nothing trained yet
            (only the run's settings: stopped before its first epoch was saved) starts from the
            first epoch, which is exactly the uninterrupted run; one that holds part of a
            trainer state is a ``ValueError`` naming what is missing, and no checkpoint at all
            a ``FileNotFoundError`` (never a silent fresh start).
        progress: show a progress bar; ``None`` means "if stderr is a terminal".
        stop_after: stop (as if interrupted) after this many epochs in total, for tests and demos
            of ``resume``; ``None`` runs them all. The schedule still spans ``config.epochs``.
        make_optimizer: seam ``(model, config) -> optimizer`` (default: AdamW, no decay on 1-D
            parameters).
        sampler: seam ``(n, epoch) -> indices``, the epoch's order; ``None`` is a seeded shuffle
            (``shuffled_order(config.seed)``).
        is_writer: ``False`` on every data-parallel rank but 0: it trains but writes nothing.
        objective: ``(outputs, labels) -> (loss, correct, counted)``: ``classification``
            (the default) or ``regression``.
    """

    out_dir: str | Path | None = None
    resume: bool = False
    progress: bool | None = None
    stop_after: int | None = None
    make_optimizer: Callable[[nn.Module, TrainConfig], torch.optim.Optimizer] = default_optimizer
    sampler: Callable[[int, int], Tensor] | None = None
    is_writer: bool = True
    objective: Objective = classification


def fit(
    model: nn.Module,
    train: Dataset,
    val: Dataset,
    config: TrainConfig,
    options: FitOptions | None = None,
) -> FitResult:
    """Train ``model`` in place; on return it holds the weights of the best validation epoch.

    ``config`` is the recipe; ``options`` (default ``FitOptions()``: no checkpoint, a progress bar
    on a terminal) says where the run writes, whether it resumes, and its seams.
    """
    options = options or FitOptions()
    n = _check_dataset(train, "train")
    _check_dataset(val, "val")
    out = Path(options.out_dir) if options.out_dir is not None else None
    is_writer = options.is_writer
    if out is not None and is_writer:
        out.mkdir(parents=True, exist_ok=True)
    sampler = options.sampler or shuffled_order(config.seed)
    torch.manual_seed(config.seed)  # the stream dropout draws from
    opt = options.make_optimizer(model, config)
    steps_per_epoch = math.ceil(len(sampler(n, 0)) / config.batch_size)
    total_steps = config.epochs * steps_per_epoch

    state: dict[str, Any] = {
        "epoch": 0,
        "step": 0,
        "best_score": None,
        "best_epoch": 0,
        "bad_epochs": 0,
        "stopped_early": False,
        "seconds": 0.0,
        "history": [],
        "config": asdict(config),
    }
    best_weights = {k: v.detach().clone() for k, v in _unwrap(model).state_dict().items()}
    loaded = _load_state(out, model, opt, config) if options.resume and out is not None else None
    if loaded is not None:
        state, best = loaded
        if best is not None:
            best_weights = best

    from tqdm.auto import tqdm  # lazy: the `train` extra

    show = sys.stderr.isatty() if options.progress is None else options.progress
    bar = tqdm(total=total_steps, initial=state["step"], disable=not show, unit="step", leave=False)
    stop_after = options.stop_after
    last_epoch = config.epochs if stop_after is None else min(config.epochs, stop_after)
    while state["epoch"] < last_epoch and not state["stopped_early"]:
        epoch = state["epoch"]
        started = time.perf_counter()
        model.train()
        loss_sum, correct, seen = 0.0, 0, 0
        order = sampler(n, epoch)
        for start in range(0, len(order), config.batch_size):
            batch = _take(train, order[start : start + config.batch_size])
            labels = batch.pop("labels")
            for group in opt.param_groups:  # a group may scale the schedule ("lr_scale")
                group["lr"] = lr_at(state["step"], total_steps, config) * group.get("lr_scale", 1.0)
            logits = model(**batch)
            loss, right, counted = options.objective(logits, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if config.grad_clip > 0:
                nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            opt.step()
            state["step"] += 1
            loss_sum += loss.item() * counted
            correct += right
            seen += counted
            bar.update(1)
            bar.set_postfix(
                epoch=epoch + 1, loss=f"{loss_sum / seen:.3f}", acc=f"{correct / seen:.3f}"
            )
        val_loss, val_acc = evaluate(model, val, objective=options.objective)
        # Higher is better; the other number breaks ties.
        score = [-val_loss, val_acc] if config.monitor == "val_loss" else [val_acc, -val_loss]
        improved = state["best_score"] is None or score > state["best_score"]
        if improved:
            state.update(best_score=score, best_epoch=epoch + 1, bad_epochs=0)
            best_weights = {k: v.detach().clone() for k, v in _unwrap(model).state_dict().items()}
        else:
            state["bad_epochs"] += 1
        state["history"].append(
            {
                "epoch": epoch + 1,
                "train_loss": loss_sum / seen,
                "train_accuracy": correct / seen,
                "val_loss": val_loss,
                "val_accuracy": val_acc,
                "lr": opt.param_groups[0]["lr"],
            }
        )
        state["epoch"] = epoch + 1
        state["stopped_early"] = bool(config.patience and state["bad_epochs"] >= config.patience)
        state["seconds"] += time.perf_counter() - started
        bar.set_postfix(epoch=epoch + 1, loss=f"{loss_sum / seen:.3f}", val_acc=f"{val_acc:.3f}")
        if out is not None and is_writer:
            _save_state(out, model, opt, state, best_weights if improved else None)
    bar.close()
    _unwrap(model).load_state_dict(best_weights)
    return FitResult(
        best_epoch=state["best_epoch"],
        epochs_run=state["epoch"],
        stopped_early=state["stopped_early"],
        seconds=state["seconds"],
        history=state["history"],
    )
