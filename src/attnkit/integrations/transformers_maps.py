"""The attention maps of any Hugging Face model, in the shape ``attnkit.viz`` draws.

``load(path)`` opens a model directory (``config.json``, weights, tokenizer files) offline;
``attention_maps(model, tokenizer, texts)`` runs the model on each text and returns its tokens
and weights ``(l, h, i, i)``: layers ``l``, heads ``h``, query and key tokens ``i``. Models on
transformers' attention interface compute them on attnkit (``register()``, weights from the
reference math); others fall back to transformers' eager attention, which every model has.
An encoder-decoder model (T5) shows its encoder's self-attention.

viz itself stays free of model code: ``attnkit.viz.AttentionExplorer(maps.attention,
maps.tokens)`` or ``attnkit show "text" --model DIR`` draw the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnkit.integrations.transformers import _transformers, register

__all__ = ["AttentionMaps", "attention_maps", "load"]


@dataclass(frozen=True)
class AttentionMaps:
    """One text's attention: ``attention[l, h, q, k]`` is how much token ``q`` attends to
    token ``k`` in head ``h`` of layer ``l`` (float32, CPU); ``tokens`` has ``i`` entries."""

    tokens: list[str]
    attention: Tensor  # (l, h, i, i)
    implementation: str  # "attnkit", or "eager" for models off the attention interface
    special: frozenset[str]  # the tokenizer's special tokens ([CLS], <s>, ...)


def load(path: str | Path, *, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a Hugging Face model directory, in evaluation mode.

    The directory must hold ``config.json``; nothing is downloaded (``local_files_only``).
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a Hugging Face model directory: it has no config.json"
        )
    transformers = _transformers()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = transformers.AutoModel.from_pretrained(
        str(path), local_files_only=True, dtype=dtype, attn_implementation="eager"
    )
    return model.eval(), tokenizer


def attention_maps(model: Any, tokenizer: Any, texts: Sequence[str]) -> list[AttentionMaps]:
    """Run ``model`` on each text alone (no padding) and return its tokens and weights.

    ``model`` is a transformers model (a base model or one with a head); ``tokenizer`` its
    tokenizer. The model's attention implementation is restored afterwards.
    """
    if isinstance(texts, str):
        raise TypeError("texts must be a sequence of strings; wrap a single text in a list")
    encoder = model.get_encoder() if model.config.is_encoder_decoder else model
    before = model.config._attn_implementation
    implementation = register() if type(model).is_backend_compatible() else "eager"
    model.set_attn_implementation(implementation)
    try:
        return [_one(encoder, tokenizer, text, implementation) for text in texts]
    finally:
        model.set_attn_implementation(before)


def _one(model: Any, tokenizer: Any, text: str, implementation: str) -> AttentionMaps:
    batch = tokenizer([text], return_tensors="pt")
    ids = batch["input_ids"].to(model.device)  # (1, i)
    with torch.no_grad():
        output = model(input_ids=ids, output_attentions=True)
    layers = getattr(output, "attentions", None)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} returned no attention weights for output_attentions=True"
        )
    attention = torch.stack([a[0] for a in layers]).float().cpu()  # (l, h, i, i)
    tokens = tokenizer.convert_ids_to_tokens(ids[0].tolist())
    special = frozenset(getattr(tokenizer, "all_special_tokens", ()))
    return AttentionMaps(list(tokens), attention, implementation, special)
