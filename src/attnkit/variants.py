"""Attention variants of recent models, as small pieces ``MultiHeadAttention`` composes.

Shape vocabulary: ``b`` batch, ``h`` query heads, ``i`` positions, ``d`` head width, ``e = h d``.

``AttentionVariants`` groups the options (a frozen config, so the module's constructor stays
small); each piece is written once and cited where it is implemented:

* ``softcap``: the scores become ``softcap * tanh(scores / softcap)`` (Gemma 2);
* ``sinks``: one learned logit per head in every row's softmax denominator (gpt-oss);
* ``qk_norm``: RMSNorm or LayerNorm of each head's queries and keys, before RoPE (``QKNorm``);
* ``gate``: a sigmoid gate from the layer input on each head's output (``OutputGate``);
* ``differential``: the difference of two softmax maps, each head normalised
  (``DifferentialAttention``);
* ``value_residual``: later layers mix the first layer's values into theirs (``ValueMix``, with
  ``ValueResidual`` carrying the first layer's values through a stack).

``Registers`` (learned tokens prepended to an encoder's sequence) is an option of the stacks
(``TransformerConfig.registers``), not of one attention layer.

Softcap and sinks are arguments of ``attnkit.scaled_dot_product_attention``, so every backend
that serves them (reference, tiled) computes them inside the attention; differential attention
is two calls of it, so it runs on whichever backend the module uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from attnkit.masks import MaskFn, checked_mask, materialize, pad_to_rank
from attnkit.norms import RMSNorm

__all__ = [
    "AttentionVariants",
    "DifferentialAttention",
    "OutputGate",
    "QKNorm",
    "Registers",
    "ValueMix",
    "ValueResidual",
    "lambda_init",
]


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
        differential: split each head's queries and keys into two halves, attend with each and
            subtract the second map, scaled by a learned ``lambda``, from the first; normalise
            each head's output (Ye et al. 2024, "Differential Transformer"). Needs an even head
            width; each half is rotated by a RoPE of half the head width.
        value_residual: ``"fixed"`` or ``"learned"``: layer ``n > 1`` attends over
            ``lambda_1 v_n + lambda_2 v_1``, ``v_1`` the first layer's values (Zhou et al. 2024,
            "Value Residual Learning", ResFormer), with ``lambda_1 = lambda_2 = 1/2`` fixed (the
            paper's ResFormer) or learned from there.
        layer: the layer's depth ``l`` (1-based). Differential attention's ``lambda_init`` and
            the value residual (layer 1 gives its values, later layers take them) read it; the
            stacks set it for each block.
    """

    softcap: float | None = None
    sinks: bool = False
    qk_norm: Literal["rms", "layer"] | None = None
    gate: Literal["head", "element"] | None = None
    differential: bool = False
    value_residual: Literal["fixed", "learned"] | None = None
    layer: int = 1

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
        if not isinstance(self.differential, bool):
            raise TypeError(f"differential must be a bool, got {type(self.differential).__name__}")
        if self.value_residual not in (None, "fixed", "learned"):
            raise ValueError(
                f"value_residual must be None, 'fixed' or 'learned', got {self.value_residual!r}"
            )
        if not isinstance(self.layer, int) or isinstance(self.layer, bool) or self.layer < 1:
            raise ValueError(f"layer must be a positive int (1-based depth), got {self.layer!r}")


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


def lambda_init(layer: int) -> float:
    """Differential attention's ``lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1))`` for layer ``l``
    (1-based), Ye et al. 2024, section 2.1."""
    return 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))


Attend = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor | None]]
"""``attend(q, k, v) -> (out, weights or None)``: one call of the attention a module uses."""


class DifferentialAttention(nn.Module):
    """Differential attention (Ye et al. 2024, "Differential Transformer", ICLR 2025, eq. 1-3).

    Each head's queries and keys ``(b, h, n, d)`` are split into halves ``q = [q1; q2]``,
    ``k = [k1; k2]`` of width ``d/2``; the values keep their width ``d``::

        out  = (softmax(q1 k1^T / sqrt(d/2)) - lambda softmax(q2 k2^T / sqrt(d/2))) v
        head = (1 - lambda_init) RMSNorm(out)

    Because ``out`` is linear in the maps, it is computed as two ordinary attention calls,
    ``attend(q1, k1, v) - lambda attend(q2, k2, v)``, so every backend (the tiled one included)
    serves it and no map is stored. ``lambda`` is one scalar per layer, re-parameterised as
    ``exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`` with four learned vectors of width
    ``d/2`` initialised ``N(0, 0.1^2)``, as in the authors' code. RMSNorm has a learned scale
    (weight 1 at the start).

    RoPE: each half is a head of its own (the authors' code reshapes ``q`` to ``2h`` heads of
    width ``d/2`` before rotating), so a RoPE of width ``d/2`` rotates each half separately
    (``per_half``). A RoPE of width ``d`` would pair channel ``k`` of ``q1`` with channel ``k``
    of ``q2`` (the "half" pairing) and mix the two maps.
    """

    def __init__(self, head_dim: int, layer: int) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"differential attention needs an even head width, got {head_dim}")
        half = head_dim // 2
        self.lambda_init = lambda_init(layer)
        self.lambda_q1 = nn.Parameter(torch.zeros(half))
        self.lambda_k1 = nn.Parameter(torch.zeros(half))
        self.lambda_q2 = nn.Parameter(torch.zeros(half))
        self.lambda_k2 = nn.Parameter(torch.zeros(half))
        self.norm = RMSNorm(head_dim, eps=1e-5)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            nn.init.normal_(p, mean=0.0, std=0.1)
        self.norm.reset_parameters()

    def extra_repr(self) -> str:
        return f"lambda_init={self.lambda_init:.4f}"

    def lam(self) -> Tensor:
        """``lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`` (Ye et al. 2024, eq. 2)."""
        first = torch.exp(torch.dot(self.lambda_q1, self.lambda_k1))
        second = torch.exp(torch.dot(self.lambda_q2, self.lambda_k2))
        return first - second + self.lambda_init

    @staticmethod
    def per_half(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        """Apply ``fn`` to each half of every head of ``x (b, h, n, d)`` as a head of width
        ``d/2`` (RoPE, qk-norm), and put the halves back."""
        b, h, n, d = x.shape
        halves = x.unflatten(-1, (2, d // 2)).transpose(2, 3)  # (b, h, 2, n, d/2)
        out = fn(halves.reshape(b, 2 * h, n, d // 2))  # (b, 2h, n, d/2)
        return out.view(b, h, 2, n, d // 2).transpose(2, 3).reshape(b, h, n, d)  # (b, h, n, d)

    def forward(
        self, attend: Attend, q: Tensor, k: Tensor, v: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        """``q (b, h, i, d)``, ``k, v (b, h_kv, j, d)`` -> ``(heads (b, h, i, d), the
        differential map (b, h, i, j) or None)``."""
        q1, q2 = q.chunk(2, dim=-1)  # (b, h, i, d/2) each
        k1, k2 = k.chunk(2, dim=-1)  # (b, h_kv, j, d/2) each
        out1, weights1 = attend(q1, k1, v)  # (b, h, i, d)
        out2, weights2 = attend(q2, k2, v)
        lam = self.lam().to(out1.dtype)
        out = out1 - lam * out2  # Ye et al. eq. 1: (softmax1 - lambda softmax2) v
        heads = self.norm(out) * (1.0 - self.lambda_init)  # eq. 3: (1 - lambda_init) LN(head)
        weights = None
        if weights1 is not None and weights2 is not None:
            weights = weights1 - lam * weights2  # (b, h, i, j), rows sum to 1 - lambda
        return heads, weights


class ValueResidual:
    """Carries the first layer's values ``v_1 (b, h_kv, j, d)`` to the later layers of one
    forward pass (Zhou et al. 2024): layer 1 stores them in ``first``, later layers read them.
    A stack makes one per forward; it holds nothing between calls."""

    def __init__(self) -> None:
        self.first: Tensor | None = None


class ValueMix(nn.Module):
    """``lambda_1 v_n + lambda_2 v_1`` (Zhou et al. 2024, "Value Residual Learning", sec. 3:
    ResFormer attends over ``A_n (lambda_1 V_n + lambda_2 V_1)``), ``lambda_1 = lambda_2 = 1/2``
    as in the paper's ResFormer; ``learned=True`` makes both learnable from there."""

    def __init__(self, learned: bool) -> None:
        super().__init__()
        lambdas = torch.full((2,), 0.5)
        self.lambdas: Tensor
        if learned:
            self.lambdas = nn.Parameter(lambdas)
        else:
            self.register_buffer("lambdas", lambdas, persistent=False)

    def extra_repr(self) -> str:
        return f"learned={isinstance(self.lambdas, nn.Parameter)}"

    def forward(self, v: Tensor, first: Tensor) -> Tensor:
        if first.shape != v.shape:
            raise ValueError(
                f"the first layer's values {tuple(first.shape)} do not match this layer's "
                f"{tuple(v.shape)} (b, h_kv, j, d): value residuals need equal shapes"
            )
        lambdas = self.lambdas.to(v.dtype)
        return lambdas[0] * v + lambdas[1] * first.to(v.dtype)


class Registers(nn.Module):
    """``count`` learned tokens prepended to an encoder's sequence and dropped from its output
    (Darcet et al. 2023, "Vision Transformers Need Registers"): the model may park global
    computation there instead of in some tokens' positions, which otherwise show up as
    high-norm outliers in the attention maps. Initialised ``N(0, 1e-6^2)``, as DINOv2's
    ``register_tokens``; they get no absolute position (the tokens keep theirs).
    """

    def __init__(self, count: int, embed_dim: int) -> None:
        super().__init__()
        self.count = count
        self.tokens = nn.Parameter(torch.zeros(count, embed_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.tokens, std=1e-6)

    def extra_repr(self) -> str:
        return f"count={self.count}"

    def prepend(self, x: Tensor) -> Tensor:
        """``x (b, n, e)`` -> ``(b, r + n, e)``, the registers first."""
        tokens = self.tokens.to(x.dtype).expand(x.shape[0], -1, -1)  # (b, r, e)
        return torch.cat([tokens, x], dim=1)

    def drop(self, x: Tensor) -> Tensor:
        """``(b, r + n, e)`` -> ``(b, n, e)``."""
        return x[:, self.count :]

    def extend_mask(
        self,
        mask: Tensor | MaskFn | None,
        n: int,
        batch: int,
        heads: int,
        device: torch.device | str | None = None,
    ) -> Tensor | None:
        """A mask over ``n`` tokens -> the same mask over ``r + n`` positions, registers first.

        Every query may attend to every register; a register's row may attend to the registers
        and to every token some query may attend to (with a padding mask: the real tokens), so
        padding never reaches the registers, nor through them the real tokens. A mask function
        is evaluated on the ``(b, h, n, n)`` grid first.
        """
        if mask is None:
            return None
        if callable(mask):
            grid = (batch, heads, n, n)
            mask = checked_mask(materialize(mask, grid, device), grid)
        shape = (1,) * (4 - mask.ndim) + tuple(mask.shape)
        if mask.dtype != torch.bool or mask.ndim > 4 or not {shape[-2], shape[-1]} <= {1, n}:
            raise ValueError(
                f"mask must be bool, broadcastable to (b, h, i, j) with i = j = {n} tokens, "
                f"got dtype {mask.dtype}, shape {tuple(mask.shape)}"
            )
        mask = pad_to_rank(mask, 4)
        b, h, i, _ = mask.shape
        mask = mask.expand(b, h, i, n)  # (b, h, i, n)
        r = self.count
        to_registers = torch.ones(b, h, i, r, dtype=torch.bool, device=mask.device)
        mask = torch.cat([to_registers, mask], dim=-1)  # (b, h, i, r + n)
        if i != 1:  # rows per query: the registers' rows see what any query sees
            seen = mask.any(dim=-2, keepdim=True).expand(b, h, r, r + n)  # (b, h, r, r + n)
            mask = torch.cat([seen, mask], dim=-2)  # (b, h, r + n, r + n)
        return mask
