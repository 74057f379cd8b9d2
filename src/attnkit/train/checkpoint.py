"""Checkpoints: safetensors for tensors, JSON for everything else, every file written atomically.

A checkpoint is a directory::

    config.json                    what to rebuild: task, model config, training config, data seed
    model.safetensors              the weights to use (the best epoch on validation)
    trainer_state.safetensors      for --resume: current weights, optimizer moments, RNG states
    trainer_state.json             for --resume: epoch, step, best score, history, optimizer groups
    metrics.json                   results (written by the task after testing)

Nothing is unpickled: tensors load through safetensors, the rest is JSON, so a checkpoint from
anywhere is safe to open. Problems (missing file, corrupt bytes, weights that do not fit the
model) raise ``ValueError``/``FileNotFoundError`` with one line that names the file and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnkit._io import atomic_write_bytes, atomic_write_text

__all__ = [
    "CONFIG_FILE",
    "FORMAT",
    "MODEL_FILE",
    "load_json",
    "load_model_weights",
    "load_tensors",
    "read_config",
    "save_json",
    "save_tensors",
]

FORMAT = "attnkit-checkpoint/1"
CONFIG_FILE = "config.json"
MODEL_FILE = "model.safetensors"


def save_tensors(
    path: str | Path, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None
) -> Path:
    """Write ``tensors`` as safetensors, atomically (as contiguous CPU copies)."""
    from safetensors.torch import save  # lazy: the `train` extra

    flat = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    return atomic_write_bytes(path, save(flat, metadata=metadata))


def load_tensors(path: str | Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Tensors and metadata of a safetensors file; a clear ``ValueError`` if it is corrupt."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118
    except Exception as exc:  # safetensors raises its own error types for bad headers/bytes
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(
            f"checkpoint file {str(path)!r} is corrupt or not safetensors ({msg})"
        ) from None
    return tensors, metadata


def save_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def load_json(path: str | Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {str(path)!r} does not exist")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"checkpoint file {str(path)!r} is not valid JSON ({exc})") from None


def read_config(directory: str | Path) -> dict[str, Any]:
    """The checkpoint's ``config.json``, checked for the format tag."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(directory)!r} does not exist")
    config = load_json(directory / CONFIG_FILE)
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        got = config.get("format") if isinstance(config, dict) else type(config).__name__
        raise ValueError(
            f"{str(directory / CONFIG_FILE)!r} is not an attnkit checkpoint config "
            f"(format {got!r}, expected {FORMAT!r})"
        )
    return config


def load_model_weights(model: nn.Module, path: str | Path) -> nn.Module:
    """Load safetensors weights into ``model`` strictly: every name and shape must match."""
    tensors, _ = load_tensors(path)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [
        f"{k} {tuple(tensors[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in expected
        if k in tensors and tensors[k].shape != expected[k].shape
    ]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} (e.g. {unexpected[0]})")
        if wrong:
            parts.append(f"{len(wrong)} with the wrong shape (e.g. {wrong[0]})")
        raise ValueError(
            f"weights in {str(path)!r} do not match the model built from its config: "
            + "; ".join(parts)
        )
    with torch.no_grad():
        model.load_state_dict(tensors, strict=True)
    return model


def start_run(out: Path | None, run_config: dict[str, Any], *, resume: bool, writer: bool) -> None:
    """Check a resumed run's saved settings against ``run_config``, then (writer only) save them.

    Every process of a data-parallel run reads; only the ``writer`` (rank 0) writes.
    """
    if out is None:
        return
    if resume and (out / CONFIG_FILE).exists() and read_config(out) != run_config:
        raise ValueError(f"{out}: --resume with different settings than the saved run")
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        save_json(out / CONFIG_FILE, run_config)
