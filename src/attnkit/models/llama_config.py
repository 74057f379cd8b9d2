"""Configuration of a Llama-family decoder (``attnkit.models.llama``).

The field values come from a checkpoint: a GGUF file's ``llama.*`` metadata or a Hugging Face
``config.json`` (``LlamaConfig.from_gguf_metadata``, ``LlamaConfig.from_hf``). The bundled
SmolLM2-135M-Instruct has 30 layers, width 576, 9 query heads and 3 key/value heads (head width
64), a SwiGLU feed-forward of width 1536, RMSNorm eps 1e-5, RoPE base 100,000, 49,152 tokens and
tied input/output embeddings: 134,515,008 parameters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["LlamaConfig"]


@dataclass(frozen=True)
class LlamaConfig:
    """Shapes and constants of a Llama decoder (Touvron et al. 2023, "LLaMA", section 2.2).

    Pre-norm blocks with RMSNorm, rotary positions (RoPE, base ``rope_base``) on queries and keys,
    grouped-query attention (``num_kv_heads`` key/value heads shared by ``num_heads`` query
    heads, Ainslie et al. 2023) without biases, and a SwiGLU feed-forward of width ``ffn_dim``.
    ``tie_embeddings``: the output projection is the token embedding (Press & Wolf 2017).
    ``bos_id``/``eos_id``/``pad_id`` are the special token ids of the checkpoint's tokenizer
    (``None``: it has none); ``max_len`` is the context length it was trained for (longer
    inputs run, but the model has not seen such positions).
    """

    vocab_size: int
    embed_dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_dim: int
    rope_base: float = 10000.0
    eps: float = 1e-5
    max_len: int = 2048
    tie_embeddings: bool = True
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads"):
            _check_positive(name, getattr(self, name))
        _check_positive("ffn_dim", self.ffn_dim)
        _check_positive("max_len", self.max_len)
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"embed_dim ({self.embed_dim}) must be divisible by num_heads ({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head width, got {self.head_dim}")
        for name in ("rope_base", "eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        for name in ("bos_id", "eos_id", "pad_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value} is outside the vocabulary ({self.vocab_size})")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @classmethod
    def from_gguf_metadata(
        cls, meta: Mapping[str, Any], *, tie_embeddings: bool = True
    ) -> LlamaConfig:
        """From a GGUF file's metadata (llama.cpp's key names, architecture ``llama``).

        The metadata does not say whether embeddings are tied; the file does by having no
        ``output.weight`` tensor, so the reader passes ``tie_embeddings``.
        """

        def need(key: str) -> Any:
            if key not in meta:
                raise ValueError(f"GGUF metadata lacks {key!r}, which a Llama model needs")
            return meta[key]

        def whole(key: str, default: Any = None) -> int:
            return _whole(
                "GGUF metadata", key, need(key) if default is None else meta.get(key, default)
            )

        embed_dim = whole("llama.embedding_length")
        num_heads = whole("llama.attention.head_count")
        _check_positive("llama.attention.head_count", num_heads)
        rope_dims = meta.get("llama.rope.dimension_count")
        if (
            rope_dims is not None
            and _whole("GGUF metadata", "llama.rope.dimension_count", rope_dims)
            != embed_dim // num_heads
        ):
            raise ValueError(
                f"partial rotary embeddings (llama.rope.dimension_count={rope_dims} of head "
                f"width {embed_dim // num_heads}) are not supported"
            )
        scaling = meta.get("llama.rope.scaling.type", "none")
        if scaling != "none":
            raise ValueError(f"RoPE scaling {scaling!r} (llama.rope.scaling.type) is not supported")
        vocab = meta.get("llama.vocab_size") or len(need("tokenizer.ggml.tokens"))
        return cls(
            vocab_size=_whole("GGUF metadata", "llama.vocab_size", vocab),
            embed_dim=embed_dim,
            num_layers=whole("llama.block_count"),
            num_heads=num_heads,
            num_kv_heads=whole("llama.attention.head_count_kv", num_heads),
            ffn_dim=whole("llama.feed_forward_length"),
            rope_base=_real(
                "GGUF metadata", "llama.rope.freq_base", meta.get("llama.rope.freq_base", 10000.0)
            ),
            eps=_real(
                "GGUF metadata",
                "llama.attention.layer_norm_rms_epsilon",
                need("llama.attention.layer_norm_rms_epsilon"),
            ),
            max_len=whole("llama.context_length", 2048),
            tie_embeddings=tie_embeddings,
            bos_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
            eos_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
            pad_id=_opt_int(meta.get("tokenizer.ggml.padding_token_id")),
        )

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> LlamaConfig:
        """From a Hugging Face ``config.json`` of ``model_type`` ``"llama"``."""
        if not isinstance(config, Mapping):
            raise ValueError(f"config.json must hold a JSON object, got {type(config).__name__}")

        def whole(key: str, default: Any = None) -> int:
            if default is None and key not in config:
                raise ValueError(f"config.json lacks {key!r}, which a Llama model needs")
            value = config.get(key)
            return _whole("config.json", key, default if value is None else value)

        model_type = config.get("model_type")
        if model_type != "llama":
            raise ValueError(f"expected a Llama config (model_type 'llama'), got {model_type!r}")
        unsupported = [
            key
            for key in ("attention_bias", "mlp_bias")
            if config.get(key)  # biases in the projections: not in the Llama recipe
        ]
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            unsupported.append(f"rope scaling {rope!r}")
        if config.get("hidden_act", "silu") != "silu":
            unsupported.append(f"hidden_act={config['hidden_act']!r}")
        embed_dim, num_heads = whole("hidden_size"), whole("num_attention_heads")
        _check_positive("num_attention_heads", num_heads)
        head_dim = config.get("head_dim")
        if head_dim is not None and head_dim != embed_dim // num_heads:
            unsupported.append(f"head_dim={head_dim}")
        if unsupported:
            raise ValueError(f"unsupported Llama config options: {', '.join(unsupported)}")
        rope_base = config.get("rope_theta") or rope.get("rope_theta") or 10000.0
        return cls(
            vocab_size=whole("vocab_size"),
            embed_dim=embed_dim,
            num_layers=whole("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=whole("num_key_value_heads", num_heads),
            ffn_dim=whole("intermediate_size"),
            rope_base=_real("config.json", "rope_theta", rope_base),
            eps=_real("config.json", "rms_norm_eps", config.get("rms_norm_eps", 1e-6)),
            max_len=whole("max_position_embeddings", 2048),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            bos_id=_opt_int(config.get("bos_token_id")),
            eos_id=_opt_int(_first(config.get("eos_token_id"))),
            pad_id=_opt_int(config.get("pad_token_id")),
        )


def _whole(source: str, key: str, value: Any) -> int:
    """``value`` of ``key`` as an int: an int (numpy's too) or a whole float; never a bool, a
    string or a fraction."""
    if isinstance(value, bool):
        ok = False
    elif isinstance(value, float):
        ok = math.isfinite(value) and value.is_integer()
    else:
        ok = hasattr(type(value), "__index__")
    if not ok:
        raise ValueError(f"{source}: {key} must be a whole number, got {value!r}")
    return int(value)


def _real(source: str, key: str, value: Any) -> float:
    if isinstance(value, (bool, str, bytes)) or not hasattr(type(value), "__float__"):
        raise ValueError(f"{source}: {key} must be a number, got {value!r}")
    return float(value)


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _first(value: Any) -> Any:
    """Hugging Face allows a list of end-of-sequence ids; the first is the model's own."""
    return value[0] if isinstance(value, (list, tuple)) and value else value
