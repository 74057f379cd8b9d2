"""Attention variants of recent models, as small pieces ``MultiHeadAttention`` composes.

Shape vocabulary: ``b`` batch, ``h`` query heads, ``i`` positions, ``d`` head width, ``e = h d``.

``AttentionVariants`` groups the options (a frozen config, so the module's constructor stays
small); each piece is written once and cited where it is implemented:

* ``softcap``: the scores become ``softcap * tanh(scores / softcap)`` (Gemma 2);
* ``sinks``: one learned logit per head in every row's softmax denominator (gpt-oss);
* ``qk_norm``: RMSNorm or LayerNorm of each head's queries and keys, before RoPE (``QKNorm``);
* ``gate``: a sigmoid gate from the layer input on each head's output (``OutputGate``).

The first two are arguments of ``attnkit.scaled_dot_product_attention``, so every backend that
serves them (reference, tiled) computes them inside the attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from attnkit.norms import RMSNorm

__all__ = ["AttentionVariants", "OutputGate", "QKNorm"]


@dataclass(frozen=True)
class AttentionVariants:
    """Options of ``MultiHeadAttention`` beyond the classic formula (all off by default).

    Args:
        softcap: cap the scores at ``+-softcap`` smoothly (Gemma Team 2024, Gemma 2, sec. 2).
        sinks: learn one sink logit per head (initialised to 0) that joins each row's softmax
            denominator without a value (OpenAI 2025, gpt-oss; Xiao et al. 2023).
        qk_norm: ``"rms"`` or ``"layer"``: normalise each head's queries and keys over ``d``
            before RoPE (Henry et al. 2020, "Query-Key Normalization for Transformers"; as in
            OLMo 2, Qwen3 and Gemma 3).
        gate: ``"head"`` (one gate per head) or ``"element"`` (one per output channel): scale
            each head's output by ``sigmoid(x W_g)`` of the layer input ``x`` (Qiu et al. 2025,
            "Gated Attention for Large Language Models").
    """

    softcap: float | None = None
    sinks: bool = False
    qk_norm: Literal["rms", "layer"] | None = None
    gate: Literal["head", "element"] | None = None

    def __post_init__(self) -> None:
        if self.softcap is not None and not (
            isinstance(self.softcap, (int, float))
            and not isinstance(self.softcap, bool)
            and math.isfinite(self.softcap)
            and self.softcap > 0
        ):
            raise ValueError(f"softcap must be a positive finite number, got {self.softcap!r}")
        if not isinstance(self.sinks, bool):
            raise TypeError(f"sinks must be a bool, got {type(self.sinks).__name__}")
        if self.qk_norm not in (None, "rms", "layer"):
            raise ValueError(f"qk_norm must be None, 'rms' or 'layer', got {self.qk_norm!r}")
        if self.gate not in (None, "head", "element"):
            raise ValueError(f"gate must be None, 'head' or 'element', got {self.gate!r}")


class QKNorm(nn.Module):
    """Normalise queries or keys ``(b, h, i, d)`` over ``d``, one learned scale per channel
    shared by all heads (Henry et al. 2020; Qwen3 and Gemma 3 share it across heads)."""

    def __init__(self, head_dim: int, kind: Literal["rms", "layer"], eps: float = 1e-6) -> None:
        super().__init__()
        self.norm: nn.Module
        if kind == "rms":
            self.norm = RMSNorm(head_dim, eps=eps)
        else:
            self.norm = nn.LayerNorm(head_dim, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x)


class OutputGate(nn.Module):
    """``out * sigmoid(x W_g + b_g)``: a gate from the layer input ``x (b, i, e)`` on the
    attention output ``out (b, h, i, d)``, per head (``(b, i, h)``) or per channel
    (``(b, i, h * d)``) (Qiu et al. 2025, eq. 5: the gate after the attention, before the
    output projection, which they found best). ``W_g`` starts at 0 and ``b_g`` at 0, so every
    gate starts at 1/2."""

    def __init__(self, embed_dim: int, num_heads: int, kind: Literal["head", "element"]) -> None:
        super().__init__()
        self.num_heads, self.kind = num_heads, kind
        self.proj = nn.Linear(embed_dim, num_heads if kind == "head" else embed_dim)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, out: Tensor, x: Tensor) -> Tensor:
        b, h, i, _ = out.shape
        gate = torch.sigmoid(self.proj(x))  # (b, i, h) or (b, i, h * d)
        gate = gate.view(b, i, h, -1).transpose(1, 2)  # (b, h, i, 1 or d)
        return out * gate.to(out.dtype)
