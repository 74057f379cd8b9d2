"""Checkpoints: safetensors for tensors, JSON for everything else, one atomic, hashed unit.

A run directory (``attnkit train --out``) holds its checkpoint as one generation directory
(``attnkit.train.manifest``: written whole, switched to in one rename, every file's SHA-256 in
its ``manifest.json``)::

    checkpoint-000007/
        manifest.json              format, generation, size and SHA-256 of the files below
        config.json                what to rebuild: task, model config, training config, data seed
        model.safetensors          the weights to use (the best epoch on validation)
        trainer_state.safetensors  for --resume: current weights, optimizer moments, RNG state
        trainer_state.json         for --resume: epoch, step, best score, history, optimizer groups
        vocab.json                 (text, scratch) the word list the ids refer to
    checkpoint -> checkpoint-000007, config.json -> checkpoint/config.json, ...   (links)
    metrics.json, attention.json, words.html, ...   results, written by the task after testing

Nothing is unpickled: tensors load through safetensors, the rest is JSON, so a checkpoint from
anywhere is safe to open; every file is checked against its SHA-256 before it is parsed.
Problems (no checkpoint, a damaged or changed file, a missing entry, weights that do not fit the
model) raise ``ValueError``/``FileNotFoundError`` with one line that names the file and what was
expected.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnkit._io import atomic_write_bytes, atomic_write_text
from attnkit.train.manifest import FORMAT, Checkpoint, commit, find_checkpoint, open_checkpoint

__all__ = [
    "CONFIG_FILE",
    "FORMAT",
    "MODEL_FILE",
    "STATE_JSON",
    "STATE_TENSORS",
    "TRAINED_FILES",
    "has_trained",
    "json_bytes",
    "json_from_bytes",
    "load_json",
    "load_model_weights",
    "load_tensors",
    "read_config",
    "require_keys",
    "save_json",
    "save_tensors",
    "start_run",
    "tensors_bytes",
    "tensors_from_bytes",
]

CONFIG_FILE = "config.json"
MODEL_FILE = "model.safetensors"
STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"


def tensors_bytes(tensors: Mapping[str, Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """``tensors`` as safetensors bytes (contiguous CPU copies)."""
    from safetensors.torch import save  # lazy: the `train` extra

    flat = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    return save(flat, metadata=metadata)


def tensors_from_bytes(data: bytes, source: str | Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Tensors and metadata of safetensors bytes; a one-line ``ValueError`` naming ``source``."""
    from safetensors.torch import load

    try:
        # The format: an 8-byte little-endian header length, a JSON header, then the data.
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
        metadata = header.get("__metadata__") or {}
        tensors = load(data)
    except Exception as exc:  # struct, JSON and safetensors each raise their own types
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(
            f"checkpoint file {str(source)!r} is corrupt or not safetensors ({msg})"
        ) from None
    return tensors, dict(metadata)


def save_tensors(
    path: str | Path, tensors: Mapping[str, Tensor], metadata: dict[str, str] | None = None
) -> Path:
    """Write ``tensors`` as one safetensors file, atomically."""
    return atomic_write_bytes(path, tensors_bytes(tensors, metadata))


def load_tensors(path: str | Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Tensors and metadata of one safetensors file (no hash: see ``Checkpoint.read_bytes``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {str(path)!r} does not exist")
    return tensors_from_bytes(path.read_bytes(), path)


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")


def json_from_bytes(data: bytes, source: str | Path) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"checkpoint file {str(source)!r} is not valid JSON ({exc})") from None


def save_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, json_bytes(obj).decode("utf-8"))


def load_json(path: str | Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {str(path)!r} does not exist")
    return json_from_bytes(path.read_bytes(), path)


def require_keys(obj: Any, keys: Mapping[str, type | tuple[type, ...]], source: str | Path) -> dict:
    """``obj`` as a dict holding every key of ``keys`` with a value of its type, or a
    ``ValueError`` naming ``source`` and what is missing or wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"{str(source)!r}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in keys if k not in obj]
    if missing:
        raise ValueError(f"{str(source)!r} lacks {', '.join(repr(k) for k in missing)}")
    for key, kind in keys.items():
        value = obj[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _types(kind)):
            names = " or ".join(t.__name__ for t in _types(kind))
            raise ValueError(
                f"{str(source)!r}: {key!r} must be {names}, got {type(value).__name__}"
            )
    return obj


def _types(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _check_format(config: Any, source: Path) -> dict[str, Any]:
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        got = config.get("format") if isinstance(config, dict) else type(config).__name__
        raise ValueError(
            f"{str(source)!r} is not an attnkit checkpoint config of this version (format "
            f"{got!r}, expected {FORMAT!r}); a run from an older version must be trained again"
        )
    return config


def read_config(directory: str | Path) -> dict[str, Any]:
    """The run's ``config.json`` (SHA-256 checked), with its format tag checked.

    A directory without a checkpoint is read from a plain ``config.json`` (its format tag then
    tells an older run apart); its weights, if any, still fail to load without a manifest.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(directory)!r} does not exist")
    ckpt = find_checkpoint(directory)
    if ckpt is None:
        return _check_format(load_json(directory / CONFIG_FILE), directory / CONFIG_FILE)
    ckpt.require(CONFIG_FILE, "rebuilding the model")
    source = ckpt.path(CONFIG_FILE)
    return _check_format(json_from_bytes(ckpt.read_bytes(CONFIG_FILE), source), source)


def check_weights_fit(model: nn.Module, tensors: Mapping[str, Tensor], source: str | Path) -> None:
    """Every name and shape of ``tensors`` must match ``model``'s state dict, else a ValueError."""
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
            f"weights in {str(source)!r} do not match the model built from its config: "
            + "; ".join(parts)
        )


def load_model_weights(model: nn.Module, source: str | Path | Checkpoint) -> nn.Module:
    """Load safetensors weights into ``model`` strictly: every name and shape must match.

    ``source`` is a checkpoint (its ``model.safetensors``, SHA-256 checked) or one file.
    """
    if isinstance(source, Checkpoint):
        source.require(MODEL_FILE, "loading the model")
        path = source.path(MODEL_FILE)
        tensors, _ = tensors_from_bytes(source.read_bytes(MODEL_FILE), path)
    else:
        path = Path(source)
        tensors, _ = load_tensors(path)
    check_weights_fit(model, tensors, path)
    with torch.no_grad():
        model.load_state_dict(tensors, strict=True)
    return model


TRAINED_FILES = (STATE_JSON, STATE_TENSORS, MODEL_FILE)


def has_trained(run_dir: str | Path) -> bool:
    """Whether ``run_dir``'s checkpoint holds anything trained (a trainer state or weights).

    A run stopped before its first epoch was saved has none: its checkpoint holds only its
    settings, or it has no checkpoint yet. Resuming it is training from the first epoch, which
    gives exactly the uninterrupted run (every random draw is seeded from the settings).
    """
    ckpt = find_checkpoint(run_dir)
    return ckpt is not None and any(name in ckpt for name in TRAINED_FILES)


def start_run(
    out: Path | None,
    run_config: dict[str, Any],
    *,
    resume: bool,
    writer: bool,
    files: Mapping[str, bytes] | None = None,
) -> None:
    """Begin a run in ``out``: a fresh checkpoint holding ``run_config`` (and ``files``), or, on
    ``resume``, a check that the saved run has the same settings and files.

    A fresh run replaces whatever checkpoint ``out`` held, as a whole. Every process of a
    data-parallel run reads; only the ``writer`` (rank 0) writes.
    """
    if out is None:
        return
    files = dict(files or {})
    if resume:
        ckpt = open_checkpoint(out)  # names what is missing: the directory, or its checkpoint
        if read_config(out) != run_config:
            untrained = (
                ""
                if has_trained(out)
                else " (no epoch of it was saved: without --resume, this run replaces it)"
            )
            raise ValueError(
                f"{out}: --resume with different settings than the saved run{untrained}"
            )
        for name, data in files.items():
            ckpt.require(name, "--resume")
            if ckpt.read_bytes(name) != data:
                raise ValueError(
                    f"{str(ckpt.path(name))!r}: --resume, but this run's {name} differs"
                )
        return
    if writer:
        commit(out, {CONFIG_FILE: json_bytes(run_config), **files}, carry_over=False)
