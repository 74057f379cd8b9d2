"""BERT (Devlin et al. 2019) assembled from attnkit's blocks, loading Hugging Face checkpoints.

Shape vocabulary: ``b`` batch, ``i`` query positions, ``j`` key positions (``i == j`` here: BERT
attends within one text), ``e`` hidden size, ``h`` heads, ``L`` layers.

The architecture, in attnkit's parts::

    x = LayerNorm(word[ids] + position[0..i-1] + token_type[types])      # BertEmbeddings
    repeat L times: x, w = TransformerBlock(x, mask=padding)               # post-norm, exact GELU
    pooled = tanh(W x[:, 0] + b)                                           # BertPooler

Each layer is an ``attnkit.TransformerBlock`` with ``norm_first=False`` (BERT is post-norm:
``x = LN(x + attn(x)); x = LN(x + ffn(x))``), the activation and layer-norm epsilon of the config.
Hugging Face's separate ``query``/``key``/``value`` matrices are stacked into the block's fused
``attn.in_proj`` when loading (see ``from_hf_state_dict``), so self-attention is one matmul.

Entry point for users: ``attnkit.models.load_pretrained()`` (``bert_pretrained.py``), which builds
this model from a checkpoint directory and adds the tokenizer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit.blocks import TransformerBlock
from attnkit.models.bert_config import BertConfig
from attnkit.models.bert_loading import (
    check_config_matches_weights,
    hf_parameter_names,
    hf_state_dict_to_attnkit,
    load_bert_weights,
)
from attnkit.registry import use

__all__ = [
    "BertConfig",
    "BertEmbeddings",
    "BertModel",
    "BertOutput",
    "BertPooler",
]


class BertEmbeddings(nn.Module):
    """Sum of learned token, position and token-type (segment) embeddings, then LayerNorm."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        e = config.hidden_size
        self.word = nn.Embedding(config.vocab_size, e, padding_idx=config.pad_token_id)
        self.position = nn.Embedding(config.max_position_embeddings, e)
        self.token_type = nn.Embedding(config.type_vocab_size, e)
        self.norm = nn.LayerNorm(e, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # (i,)
        x = self.word(input_ids) + self.token_type(token_type_ids)  # (b, i, e)
        x = x + self.position(positions)  # (i, e) broadcast over b
        return self.dropout(self.norm(x))


class BertPooler(nn.Module):
    """``tanh(W h_[CLS] + b)``: BERT's sentence vector for next-sentence prediction."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))  # (b, e)


@dataclass(frozen=True)
class BertOutput:
    """``hidden_states (b, i, e)`` last layer; ``attentions (L, b, h, i, j)`` or None (padding
    query rows and key columns are zero); ``pooled (b, e)`` or None (no pooler)."""

    hidden_states: Tensor
    attentions: Tensor | None
    pooled: Tensor | None


class BertModel(nn.Module):
    """The BERT encoder. ``forward(input_ids, attention_mask, token_type_ids)`` -> ``BertOutput``.

    Args:
        config: the model's ``BertConfig``.
        pooler: build the pooler (checkpoints saved without one load with ``pooler=False``).
        backend: attention backend of every layer (``"auto"``: the fused kernel when it can
            serve the call, the math when weights are wanted).
    """

    # Where each BERT sub-layer lives inside an attnkit TransformerBlock (names HF -> attnkit).
    HF_NAMES: ClassVar[dict[str, str]] = {
        "attn": "attn",  # MultiHeadAttention: in_proj (fused q, k, v) and out_proj
        "attn_out": "attn.out_proj",
        "norm1": "attn_norm",
        "ff_in": "ffn.up",
        "ff_out": "ffn.down",
        "norm2": "ffn_norm",
    }

    def __init__(self, config: BertConfig, *, pooler: bool = True, backend: str = "auto") -> None:
        super().__init__()
        if not isinstance(config, BertConfig):
            raise TypeError(f"config must be a BertConfig, got {type(config).__name__}")
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(
            TransformerBlock(
                config.hidden_size,
                config.num_attention_heads,
                config.intermediate_size,
                dropout=config.hidden_dropout_prob,
                activation=config.activation,
                norm_first=False,  # BERT is post-norm
                eps=config.layer_norm_eps,
                backend=backend,
            )
            for _ in range(config.num_hidden_layers)
        )
        self.pooler = BertPooler(config) if pooler else None

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        need_weights: bool = False,
        backend: str | None = None,
    ) -> BertOutput:
        """Encode a padded batch.

        Args:
            input_ids: ``(b, i)`` token ids.
            attention_mask: ``(b, i)``, ``True``/1 on real tokens, ``False``/0 on padding (Hugging
                Face's meaning); ``None`` means every position is real.
            token_type_ids: ``(b, i)`` segment ids; ``None`` means all zeros.
            need_weights: also return every layer's attention probabilities.
            backend: run every layer's attention on this backend for this call (see
                ``attnkit.backends.use``); ``None`` keeps the layers' own.
        """
        c = self.config
        if not isinstance(input_ids, Tensor) or input_ids.ndim != 2:
            raise ValueError(f"input_ids must be a (b, i) tensor, got {_shape(input_ids)}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
        i = input_ids.shape[1]
        if not 0 < i <= c.max_position_embeddings:
            raise ValueError(
                f"input_ids has {i} positions; this model takes 1 to "
                f"{c.max_position_embeddings} (max_position_embeddings)"
            )
        for name, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
            if t is not None and (not isinstance(t, Tensor) or t.shape != input_ids.shape):
                raise ValueError(
                    f"{name} must have the shape of input_ids {tuple(input_ids.shape)}, "
                    f"got {_shape(t)}"
                )
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)

        # One padding mask for all layers: (b, 1, 1, j), True = may attend. When nothing is
        # padded there is no mask at all, so the fused kernel runs its unmasked path.
        mask = None
        real = None
        if attention_mask is not None:
            real = attention_mask.bool()  # (b, j)
            if not bool(real.all()):
                mask = real[:, None, None, :]  # (b, 1, 1, j)

        x = self.embeddings(input_ids, token_type_ids)  # (b, i, e)
        weights: list[Tensor] = []
        with contextlib.nullcontext() if backend is None else use(backend):
            for layer in self.layers:
                x, w = layer(x, mask=mask, need_weights=need_weights)
                if w is not None:
                    weights.append(w)  # (b, h, i, j)
        attentions = None
        if need_weights:
            attentions = torch.stack(weights)  # (L, b, h, i, j)
            if mask is not None:
                # Padding columns are already zero; zero the padding query rows too.
                attentions = attentions * real[None, :, None, :, None].to(attentions.dtype)
        pooled = self.pooler(x) if self.pooler is not None else None
        return BertOutput(hidden_states=x, attentions=attentions, pooled=pooled)

    @classmethod
    def from_hf_state_dict(
        cls,
        config: BertConfig,
        state: dict[str, Tensor],
        *,
        source: str = "state dict",
        strict: bool = True,
        backend: str = "auto",
    ) -> BertModel:
        """A model holding the weights of a Hugging Face BERT state dict (names translated).

        Names may carry a ``bert.`` prefix. A checkpoint without pooler tensors gives a model
        without a pooler. Problems are reported by tensor name; see ``load_bert_weights``.
        """
        shapes = {name: tuple(t.shape) for name, t in state.items()}
        check_config_matches_weights(config, shapes, source=source)  # before any allocation
        translated, unexpected, origin = hf_state_dict_to_attnkit(state, cls.HF_NAMES, _pack_qkv)
        has_pooler = any(k.startswith("pooler.") for k in translated)
        model = cls(config, pooler=has_pooler, backend=backend)
        # Missing tensors are named as the checkpoint would spell them.
        expected = hf_parameter_names(config.num_hidden_layers, pooler=has_pooler)
        dummy = {name: torch.empty(0) for name in expected}
        origin = {**hf_state_dict_to_attnkit(dummy, cls.HF_NAMES, _pack_qkv)[2], **origin}
        first = next(iter(translated.values()), None)
        if first is not None and first.is_floating_point():
            model = model.to(first.dtype)
        load_bert_weights(
            model, translated, source=source, strict=strict, unexpected=unexpected, origin=origin
        )
        return model.eval()


def _pack_qkv(query: Tensor, key: Tensor, value: Tensor) -> dict[str, Tensor]:
    """HF's three ``(e, e)`` projections -> the fused ``in_proj`` ``(3e, e)``, rows [q; k; v]."""
    return {"in_proj": torch.cat([query, key, value], dim=0)}  # (3e, e) or (3e,)


def _shape(t: object) -> str:
    return str(tuple(t.shape)) if isinstance(t, Tensor) else type(t).__name__
