"""Configuration of a Llama-family decoder (``attnkit.models.llama``).

The field values come from a checkpoint: a GGUF file's ``llama.*`` metadata or a Hugging Face
``config.json`` (``LlamaConfig.from_gguf_metadata``, ``LlamaConfig.from_hf``). The bundled
SmolLM2-135M-Instruct has 30 layers, width 576, 9 query heads and 3 key/value heads (head width
64), a SwiGLU feed-forward of width 1536, RMSNorm eps 1e-5, RoPE base 100,000, 49,152 tokens and
tied input/output embeddings: 134,515,008 parameters.
"""

from __future__ import annotations

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

        embed_dim = int(need("llama.embedding_length"))
        num_heads = int(need("llama.attention.head_count"))
        rope_dims = meta.get("llama.rope.dimension_count")
        if rope_dims is not None and int(rope_dims) != embed_dim // num_heads:
            raise ValueError(
                f"partial rotary embeddings (llama.rope.dimension_count={rope_dims} of head "
                f"width {embed_dim // num_heads}) are not supported"
            )
        scaling = meta.get("llama.rope.scaling.type", "none")
        if scaling != "none":
            raise ValueError(f"RoPE scaling {scaling!r} (llama.rope.scaling.type) is not supported")
        vocab = meta.get("llama.vocab_size") or len(need("tokenizer.ggml.tokens"))
        return cls(
            vocab_size=int(vocab),
            embed_dim=embed_dim,
            num_layers=int(need("llama.block_count")),
            num_heads=num_heads,
            num_kv_heads=int(meta.get("llama.attention.head_count_kv", num_heads)),
            ffn_dim=int(need("llama.feed_forward_length")),
            rope_base=float(meta.get("llama.rope.freq_base", 10000.0)),
            eps=float(need("llama.attention.layer_norm_rms_epsilon")),
            max_len=int(meta.get("llama.context_length", 2048)),
            tie_embeddings=tie_embeddings,
            bos_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
            eos_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
            pad_id=_opt_int(meta.get("tokenizer.ggml.padding_token_id")),
        )

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> LlamaConfig:
        """From a Hugging Face ``config.json`` of ``model_type`` ``"llama"``."""
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
        head_dim = config.get("head_dim")
        if (
            head_dim is not None
            and head_dim != config["hidden_size"] // config["num_attention_heads"]
        ):
            unsupported.append(f"head_dim={head_dim}")
        if unsupported:
            raise ValueError(f"unsupported Llama config options: {', '.join(unsupported)}")
        num_heads = int(config["num_attention_heads"])
        return cls(
            vocab_size=int(config["vocab_size"]),
            embed_dim=int(config["hidden_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            ffn_dim=int(config["intermediate_size"]),
            rope_base=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            eps=float(config.get("rms_norm_eps", 1e-6)),
            max_len=int(config.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            bos_id=_opt_int(config.get("bos_token_id")),
            eos_id=_opt_int(_first(config.get("eos_token_id"))),
            pad_id=_opt_int(config.get("pad_token_id")),
        )


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _first(value: Any) -> Any:
    """Hugging Face allows a list of end-of-sequence ids; the first is the model's own."""
    return value[0] if isinstance(value, (list, tuple)) and value else value
