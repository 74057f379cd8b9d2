"""Encoder and decoder stacks: embeddings, positions, ``TransformerBlock``s and a final norm.

Shape vocabulary: ``b`` batch, ``i`` positions of the sequence being processed, ``j`` key
positions (the memory's length in cross-attention), ``e`` embed_dim, ``h`` heads, ``V`` vocabulary.

Parameter names are stable (other code loads weights into them): ``embed`` (token embedding,
when ``vocab_size`` is set), ``pos`` (absolute positions, if any), ``blocks``, ``norm`` (final
norm, pre-norm stacks only). The decoder's output projection is tied to ``embed``.

Initialisation: token embeddings are ``N(0, 1/e)`` and multiplied by ``sqrt(e)`` in the forward
(Vaswani et al. 2017, section 3.4), so token vectors have unit variance, the scale of the
sinusoidal table; the blocks initialise themselves (``attnkit.blocks``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from attnkit.attention import KVCache
from attnkit.blocks import TransformerBlock
from attnkit.masks import MaskFn
from attnkit.positional import (
    LearnedPositionalEmbedding,
    RelativePositionAttention,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    alibi_fn,
)
from attnkit.variants import AttentionVariants, Registers, ValueResidual

__all__ = ["TransformerConfig", "TransformerDecoder", "TransformerEncoder"]

POSITIONAL = ("sinusoidal", "learned", "rope", "alibi", "relative", "none")


@dataclass(frozen=True)
class TransformerConfig:
    """Configuration of a ``TransformerEncoder`` or ``TransformerDecoder``.

    ``vocab_size=None`` (encoder only) means the inputs are already vectors ``(b, i, e)`` (for
    example tabular features turned into tokens); otherwise they are token ids ``(b, i)``.
    ``positional`` is one of ``"sinusoidal"``, ``"learned"`` (needs ``max_len``), ``"rope"``,
    ``"alibi"``, ``"relative"`` (Shaw et al. 2018: every block's self-attention is a
    ``RelativePositionAttention`` with distances clipped at ``max_distance``) or ``"none"``.
    ``ffn_dim=None`` means ``4 * embed_dim``.
    ``gradient_checkpointing`` recomputes each block in the backward pass instead of storing its
    activations (training only; ``torch.utils.checkpoint`` with ``use_reentrant=False``).
    ``cross_attention`` gives decoder blocks a cross-attention over an encoder's memory.
    ``variants`` (``attnkit.variants.AttentionVariants``: soft-capping, sinks, qk-norm, output
    gates, differential attention, value residuals) applies to every block's self-attention,
    with ``layer`` set to the block's depth (1-based); not with ``positional="relative"``. With
    ``differential`` and ``"rope"`` the rotation has half the head width (each half of a head is
    rotated on its own, see ``DifferentialAttention``), so the head width must divide by 4.
    ``registers`` (encoder only) prepends that many learned tokens to the sequence and drops
    them from the output (Darcet et al. 2023, ``attnkit.variants.Registers``).
    """

    embed_dim: int
    num_heads: int
    num_layers: int
    vocab_size: int | None = None
    ffn_dim: int | None = None
    num_kv_heads: int | None = None
    max_len: int = 512
    positional: str = "sinusoidal"
    activation: str = "gelu"
    norm_first: bool = True
    dropout: float = 0.0
    eps: float = 1e-5
    cross_attention: bool = False
    gradient_checkpointing: bool = False
    backend: str = "auto"
    max_distance: int = 16
    variants: AttentionVariants | None = None
    registers: int = 0

    def __post_init__(self) -> None:
        for name in ("embed_dim", "num_heads", "num_layers", "max_len", "max_distance"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.embed_dim % self.num_heads != 0:
            raise ValueError(
                f"embed_dim ({self.embed_dim}) must be divisible by num_heads ({self.num_heads})"
            )
        if self.positional not in POSITIONAL:
            raise ValueError(f"positional must be one of {POSITIONAL}, got {self.positional!r}")
        if self.vocab_size is not None and (
            not isinstance(self.vocab_size, int) or self.vocab_size <= 0
        ):
            raise ValueError(f"vocab_size must be a positive int or None, got {self.vocab_size!r}")
        if not isinstance(self.registers, int) or isinstance(self.registers, bool):
            raise ValueError(f"registers must be an int >= 0, got {self.registers!r}")
        if self.registers < 0:
            raise ValueError(f"registers must be an int >= 0, got {self.registers!r}")
        eps = self.eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
            raise ValueError(f"eps must be a positive finite number, got {eps!r}")
        if self.variants is not None and not isinstance(self.variants, AttentionVariants):
            raise TypeError(f"variants must be an AttentionVariants or None, got {self.variants!r}")
        head_dim = self.embed_dim // self.num_heads
        if self.variants is not None and self.variants.differential:
            # two halves per head, and with RoPE each half is rotated on its own
            multiple = 4 if self.positional == "rope" else 2
            if head_dim % multiple:
                raise ValueError(
                    f"differential attention with positional={self.positional!r} needs a head "
                    f"width (embed_dim // num_heads = {head_dim}) that divides by {multiple}"
                )
        if self.variants is not None and self.positional == "relative":
            raise ValueError(
                "variants are not available with positional='relative' (its attention computes "
                "relative keys and values itself); use 'rope' or 'alibi'"
            )

    @property
    def hidden_dim(self) -> int:
        return 4 * self.embed_dim if self.ffn_dim is None else self.ffn_dim


class _Stack(nn.Module):
    """Shared parts of the encoder and decoder: embeddings, positions, blocks, final norm."""

    def __init__(self, config: TransformerConfig, *, causal: bool) -> None:
        super().__init__()
        c = config
        self.config = c
        self.causal = causal
        self.embed = nn.Embedding(c.vocab_size, c.embed_dim) if c.vocab_size else None
        self.pos: nn.Module | None = None
        if c.positional == "sinusoidal":
            self.pos = SinusoidalPositionalEncoding(c.embed_dim)
        elif c.positional == "learned":
            self.pos = LearnedPositionalEmbedding(c.max_len, c.embed_dim)
        head_dim = c.embed_dim // c.num_heads
        differential = c.variants is not None and c.variants.differential
        rope_dim = head_dim // 2 if differential else head_dim  # one rotation per half-head
        self.rope = RotaryEmbedding(rope_dim) if c.positional == "rope" else None
        self.dropout = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(
                c.embed_dim,
                c.num_heads,
                c.hidden_dim,
                num_kv_heads=c.num_kv_heads,
                dropout=c.dropout,
                activation=c.activation,
                norm_first=c.norm_first,
                cross_attention=c.cross_attention and causal,
                eps=c.eps,
                backend=c.backend,
                variants=None if c.variants is None else dataclasses.replace(c.variants, layer=n),
            )
            for n in range(1, c.num_layers + 1)
        )
        if c.positional == "relative":
            for block in self.blocks:
                block.attn = RelativePositionAttention(
                    c.embed_dim,
                    c.num_heads,
                    max_distance=c.max_distance,
                    num_kv_heads=c.num_kv_heads,
                    dropout=c.dropout,
                )
        # A post-norm block already ends in a norm; a pre-norm stack needs one at the end.
        self.norm = nn.LayerNorm(c.embed_dim, eps=c.eps) if c.norm_first else None
        if self.embed is not None:
            nn.init.normal_(self.embed.weight, std=c.embed_dim**-0.5)

    def _embed(self, x: Tensor, offset: int) -> Tensor:
        c = self.config
        if self.embed is not None:
            if x.dtype not in (torch.int64, torch.int32) or x.ndim != 2:
                raise ValueError(
                    f"inputs must be token ids (b, i) of an integer dtype (vocab_size="
                    f"{c.vocab_size}), got dtype {x.dtype} and shape {tuple(x.shape)}"
                )
            if x.numel() and not (int(x.min()) >= 0 and int(x.max()) < c.vocab_size):
                raise ValueError(
                    f"token ids must lie in 0..{c.vocab_size - 1} (vocab_size), got "
                    f"{int(x.min())}..{int(x.max())}"
                )
            x = self.embed(x) * math.sqrt(c.embed_dim)  # (b, i, e)
        elif x.ndim != 3 or x.shape[-1] != c.embed_dim or not x.is_floating_point():
            raise ValueError(
                f"inputs must be float vectors (b, i, embed_dim={c.embed_dim}) when vocab_size "
                f"is None, got dtype {x.dtype} and shape {tuple(x.shape)}"
            )
        if self.pos is not None:
            x = self.pos(x, offset)
        return self.dropout(x)

    def _run_blocks(
        self,
        x: Tensor,
        *,
        mask: Tensor | MaskFn | None,
        is_causal: bool,
        need_weights: bool,
        memory: Tensor | None = None,
        memory_mask: Tensor | MaskFn | None = None,
        caches: list[KVCache] | None = None,
        cross_caches: list[KVCache] | None = None,
    ) -> tuple[Tensor, list[Tensor] | None]:
        c = self.config
        offset = caches[0].length if caches else 0
        bias = None
        if c.positional == "alibi":
            # bottom-right: query 0 sits at key position offset (= j - i)
            bias = alibi_fn(c.num_heads, offset)
        weights: list[Tensor] = []
        # Zhou et al. 2024: layer 1's values reach every later layer of this forward
        carrier = None
        if c.variants is not None and c.variants.value_residual is not None:
            carrier = ValueResidual()
        use_checkpoint = c.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for n, block in enumerate(self.blocks):
            kwargs = dict(
                mask=mask,
                is_causal=is_causal,
                memory=memory,
                memory_mask=memory_mask,
                need_weights=need_weights,
                bias=bias,
                rope=self.rope,
                cache=None if caches is None else caches[n],
                cross_cache=None if cross_caches is None else cross_caches[n],
                value_residual=carrier,
            )
            if use_checkpoint and caches is None:
                x, w = checkpoint(block, x, use_reentrant=False, **kwargs)
            else:
                x, w = block(x, **kwargs)
            if w is not None:
                weights.append(w)
        if self.norm is not None:
            x = self.norm(x)
        return x, (weights if need_weights else None)


class TransformerEncoder(_Stack):
    """Token embedding, positional encoding, ``num_layers`` blocks and a final norm.

    ``forward(x, mask=None, *, is_causal=False, need_weights=False)`` takes token ids ``(b, i)``
    (or vectors ``(b, i, e)`` when ``vocab_size`` is None) and a bool mask broadcastable to
    ``(b, h, i, i)`` (``attnkit.masks.padding_mask(lengths)``), and returns
    ``(hidden (b, i, e), per-layer weights [(b, h, i, i)] * num_layers or None)``.

    With ``config.registers = r`` the blocks see ``r`` learned tokens before the sequence
    (``registers``, an ``attnkit.variants.Registers``): the mask is extended to them
    (``Registers.extend_mask``), ``hidden`` drops them, and the weights keep them, so each map
    is ``(b, h, r + i, r + i)`` with the registers first. With ``is_causal`` every token sees
    every register.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config, causal=False)
        c = config
        self.registers = Registers(c.registers, c.embed_dim) if c.registers else None

    def forward(
        self,
        x: Tensor,
        mask: Tensor | MaskFn | None = None,
        *,
        is_causal: bool = False,
        need_weights: bool = False,
    ) -> tuple[Tensor, list[Tensor] | None]:
        x = self._embed(x, 0)  # (b, i, e)
        if self.registers is None:
            return self._run_blocks(x, mask=mask, is_causal=is_causal, need_weights=need_weights)
        b, n, _ = x.shape
        mask = self.registers.extend_mask(mask, n, b, self.config.num_heads, x.device)
        x = self.registers.prepend(x)  # (b, r + i, e)
        x, weights = self._run_blocks(x, mask=mask, is_causal=is_causal, need_weights=need_weights)
        return self.registers.drop(x), weights  # (b, i, e)


class TransformerDecoder(_Stack):
    """Causal decoder: embeddings, blocks with causal self-attention (and cross-attention over an
    encoder's ``memory`` when ``config.cross_attention``), final norm, and logits through the
    token embedding (weights tied, Press & Wolf 2017). ``vocab_size`` is required.

    ``forward(ids, memory=None, *, mask=None, memory_mask=None, need_weights=False, caches=None,
    cross_caches=None)`` returns ``(logits (b, i, V), per-layer self-attention weights or None)``.
    ``caches`` is one ``KVCache`` per layer (``new_caches()``); positions then continue at
    ``caches[0].length``. ``cross_caches`` (also from ``new_caches()``) keep each layer's projected
    memory between steps, so the memory is projected once per generation, not once per token.
    """

    def __init__(self, config: TransformerConfig) -> None:
        if config.vocab_size is None:
            raise ValueError("TransformerDecoder needs config.vocab_size (it predicts tokens)")
        if config.registers:
            raise ValueError(
                f"registers are for encoders; a TransformerDecoder was given registers="
                f"{config.registers} (set it to 0)"
            )
        super().__init__(config, causal=True)

    def new_caches(self, max_len: int | None = None) -> list[KVCache]:
        """One empty ``KVCache`` per layer."""
        return [KVCache(max_len) for _ in self.blocks]

    def forward(
        self,
        ids: Tensor,
        memory: Tensor | None = None,
        *,
        mask: Tensor | MaskFn | None = None,
        memory_mask: Tensor | MaskFn | None = None,
        need_weights: bool = False,
        caches: list[KVCache] | None = None,
        cross_caches: list[KVCache] | None = None,
    ) -> tuple[Tensor, list[Tensor] | None]:
        for name, given in (("caches", caches), ("cross_caches", cross_caches)):
            if given is not None and len(given) != len(self.blocks):
                raise ValueError(
                    f"{name} must hold one KVCache per layer ({len(self.blocks)}), got {len(given)}"
                )
        offset = caches[0].length if caches else 0
        x = self._embed(ids, offset)
        x, weights = self._run_blocks(
            x,
            mask=mask,
            is_causal=True,
            need_weights=need_weights,
            memory=memory,
            memory_mask=memory_mask,
            caches=caches,
            cross_caches=cross_caches,
        )
        assert self.embed is not None
        return x @ self.embed.weight.T, weights  # (b, i, V)

    @torch.no_grad()
    def generate(
        self,
        ids: Tensor,
        max_new_tokens: int,
        memory: Tensor | None = None,
        *,
        memory_mask: Tensor | MaskFn | None = None,
        eos_id: int | None = None,
    ) -> Tensor:
        """Greedy decoding with a KV cache: ``ids (b, i)`` -> ``(b, i + max_new_tokens)``.

        The prompt is processed in one call, then one token per step (each step attends over the
        cache; the memory is projected once, on the first step). Prompts must share a length (no
        left padding). After ``eos_id`` a sequence keeps emitting ``eos_id``.
        """
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"ids must be a non-empty (b, i) prompt, got {tuple(ids.shape)}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        total = ids.shape[1] + max_new_tokens
        if self.config.positional == "learned" and total > self.config.max_len:
            raise ValueError(f"prompt + max_new_tokens = {total} exceeds max_len")
        caches = self.new_caches(total)
        cross_caches = self.new_caches() if self.config.cross_attention else None
        out = ids
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        step_input = ids
        for _ in range(max_new_tokens):
            logits, _ = self(
                step_input,
                memory,
                memory_mask=memory_mask,
                caches=caches,
                cross_caches=cross_caches,
            )
            nxt = logits[:, -1].argmax(dim=-1)  # (b,)
            if eos_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
                done = done | (nxt == eos_id)
            step_input = nxt.unsqueeze(1)  # (b, 1)
            out = torch.cat([out, step_input], dim=1)
        return out
