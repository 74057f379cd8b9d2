"""``BertConfig``: the hyper-parameters of a BERT encoder, read from a Hugging Face ``config.json``.

Only the fields that change the computation are kept; training-only fields (dropout rates,
initializer range) are read where they matter at inference (nowhere: dropout is off in eval) and
ignored otherwise. A config of another architecture is rejected with a message that says what was
found, before any weights are read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["SUPPORTED_ACTIVATIONS", "BertConfig"]

# Hugging Face's names for the feed-forward activation -> what BERT computes with them.
# "gelu" is the exact erf form (Hendrycks & Gimpel 2016), which BERT was trained with.
SUPPORTED_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}


@dataclass(frozen=True)
class BertConfig:
    """Shape and numerics of a BERT encoder (Devlin et al. 2019).

    Defaults are those of all-MiniLM-L6-v2, the model ``load_pretrained()`` bundles.
    """

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"BertConfig.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"BertConfig.hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if not isinstance(self.layer_norm_eps, float | int) or not self.layer_norm_eps > 0:
            raise ValueError(
                f"BertConfig.layer_norm_eps must be a positive number, got {self.layer_norm_eps!r}"
            )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"BertConfig.hidden_act {self.hidden_act!r} is not supported; expected one of "
                f"{sorted(SUPPORTED_ACTIVATIONS)}"
            )
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            value = getattr(self, name)
            if not isinstance(value, float | int) or not 0.0 <= value < 1.0:
                raise ValueError(f"BertConfig.{name} must be in [0, 1), got {value!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def activation(self) -> str:
        """The activation in attnkit's words: ``gelu`` (exact erf), ``gelu_tanh``, ``relu``..."""
        return SUPPORTED_ACTIVATIONS[self.hidden_act]

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config") -> BertConfig:
        """Build from a Hugging Face ``config.json`` dict; other architectures are refused."""
        if not isinstance(raw, dict):
            raise ValueError(f"{source} must hold a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type != "bert":
            raise ValueError(
                f"{source} describes model_type {model_type!r}, but attnkit.models.bert loads "
                "only model_type 'bert'"
            )
        architectures = raw.get("architectures") or []
        if not isinstance(architectures, list):
            raise ValueError(f"{source}: 'architectures' must be a list, got {architectures!r}")
        foreign = [a for a in architectures if not str(a).startswith("Bert")]
        if foreign:
            raise ValueError(
                f"{source} lists architectures {architectures}, but attnkit.models.bert loads "
                "only BERT encoders (BertModel, BertForMaskedLM, ...)"
            )
        position_type = raw.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(
                f"{source} uses position_embedding_type {position_type!r}; only 'absolute' "
                "(learned) position embeddings are supported"
            )
        if raw.get("is_decoder") or raw.get("add_cross_attention"):
            raise ValueError(f"{source} describes a BERT decoder; only encoders are supported")
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in names and v is not None}
        missing = [
            n
            for n in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "intermediate_size",
            )
            if n not in kwargs
        ]
        if missing:
            raise ValueError(f"{source} lacks required fields {missing}")
        try:
            return cls(**kwargs)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> BertConfig:
        """Read a ``config.json`` file (or the ``config.json`` inside a model directory)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"config file {str(path)!r} does not exist")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"config file {str(path)!r} is not valid JSON: {err}") from None
        return cls.from_dict(raw, source=f"config file {str(path)!r}")
