"""Transformer building blocks: the feed-forward network and one transformer block.

The stacks built from them (``TransformerConfig``, ``TransformerEncoder``,
``TransformerDecoder``) live in ``attnkit.stacks``.

Shape vocabulary: ``b`` batch, ``i`` positions of the sequence being processed, ``j`` key
positions (the memory's length in cross-attention), ``e`` embed_dim, ``h`` heads.

Parameter names are stable (other code loads weights into them):

* ``FeedForward``: ``up`` (e -> hidden), ``gate`` (SwiGLU only), ``down`` (hidden -> e).
* ``TransformerBlock``: ``attn``, ``attn_norm``, ``cross_attn`` / ``cross_norm`` (decoder blocks
  only), ``ffn``, ``ffn_norm``.

Initialisation (deliberate, documented once here):

* attention projections: Xavier-uniform, zero biases (see ``attnkit.attention``);
* feed-forward ``up``, ``gate``, ``down``: torch's ``nn.Linear`` default, uniform in
  ``±1/sqrt(fan_in)`` (Kaiming-uniform with ``a = sqrt(5)``), as in ``nn.TransformerEncoderLayer``,
  so a fresh block and an imported one start alike; biases zero;
* layer norms: weight 1, bias 0, so every block starts as a well-scaled residual update.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.attention import KVCache, MultiHeadAttention, QKTransform
from attnkit.masks import BiasFn, MaskFn
from attnkit.variants import AttentionVariants, ValueResidual

__all__ = ["FeedForward", "TransformerBlock"]

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact (erf) GELU, as torch's "gelu" and BERT
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's approximation
}


class FeedForward(nn.Module):
    """Position-wise feed-forward network (Vaswani et al. 2017, section 3.3).

    ``relu``/``gelu``/``gelu_tanh``: ``down(dropout(act(up(x))))``.
    ``swiglu`` (Shazeer 2020, "GLU Variants Improve Transformer"):
    ``down(dropout(silu(gate(x)) * up(x)))``.
    """

    def __init__(
        self,
        embed_dim: int,
        hidden_dim: int,
        *,
        activation: str = "relu",
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if activation not in (*ACTIVATIONS, "swiglu"):
            raise ValueError(
                f"activation must be one of {[*ACTIVATIONS, 'swiglu']}, got {activation!r}"
            )
        if not isinstance(hidden_dim, int) or hidden_dim <= 0:
            raise ValueError(f"hidden_dim must be a positive int, got {hidden_dim!r}")
        self.activation = activation
        self.up = nn.Linear(embed_dim, hidden_dim, bias=bias)
        self.gate = nn.Linear(embed_dim, hidden_dim, bias=bias) if activation == "swiglu" else None
        self.down = nn.Linear(hidden_dim, embed_dim, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.up, self.gate, self.down):
            if lin is None:
                continue
            lin.reset_parameters()  # torch's Linear default: U(±1/sqrt(fan_in))
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate is not None:
            hidden = F.silu(self.gate(x)) * self.up(x)  # (b, i, hidden)
        else:
            hidden = ACTIVATIONS[self.activation](self.up(x))
        return self.down(self.dropout(hidden))


class TransformerBlock(nn.Module):
    """One transformer layer: self-attention, optional cross-attention, feed-forward.

    Post-norm (``norm_first=False``, as in the original paper)::

        x = attn_norm(x + dropout(self_attn(x)))
        x = cross_norm(x + dropout(cross_attn(x, memory)))      # decoder blocks only
        x = ffn_norm(x + dropout(ffn(x)))

    Pre-norm (``norm_first=True``, Xiong et al. 2020; trains without warm-up)::

        x = x + dropout(self_attn(attn_norm(x)))
        x = x + dropout(cross_attn(cross_norm(x), memory))
        x = x + dropout(ffn(ffn_norm(x)))

    ``dropout`` is used for attention weights, inside the feed-forward and on each residual
    branch, as in ``nn.TransformerEncoderLayer``. ``variants`` configures the self-attention
    (``attnkit.variants.AttentionVariants``).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        ffn_dim: int,
        *,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        activation: str = "relu",
        norm_first: bool = False,
        cross_attention: bool = False,
        eps: float = 1e-5,
        backend: str = "auto",
        variants: AttentionVariants | None = None,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.attn = MultiHeadAttention(
            embed_dim,
            num_heads,
            num_kv_heads=num_kv_heads,
            dropout=dropout,
            backend=backend,
            variants=variants,
        )
        self.attn_norm = nn.LayerNorm(embed_dim, eps=eps)
        self.cross_attn: MultiHeadAttention | None = None
        self.cross_norm: nn.LayerNorm | None = None
        if cross_attention:
            self.cross_attn = MultiHeadAttention(
                embed_dim, num_heads, num_kv_heads=num_kv_heads, dropout=dropout, backend=backend
            )
            self.cross_norm = nn.LayerNorm(embed_dim, eps=eps)
        self.ffn = FeedForward(embed_dim, ffn_dim, activation=activation, dropout=dropout)
        self.ffn_norm = nn.LayerNorm(embed_dim, eps=eps)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | MaskFn | None = None,
        is_causal: bool = False,
        memory: Tensor | None = None,
        memory_mask: Tensor | MaskFn | None = None,
        need_weights: bool = False,
        bias: Tensor | BiasFn | None = None,
        rope: QKTransform | None = None,
        cache: KVCache | None = None,
        cross_cache: KVCache | None = None,
        value_residual: ValueResidual | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """``x (b, i, e)`` -> ``(x (b, i, e), self-attention weights (b, h, i, j) or None)``.

        ``mask``, ``is_causal``, ``bias``, ``rope`` and ``cache`` go to the self-attention (see
        ``MultiHeadAttention.forward``); ``memory (b, j, e)``, ``memory_mask`` (broadcastable
        to ``(b, h, i, j)``, e.g. the encoder's padding mask) and ``cross_cache`` (the memory's
        projected keys/values, kept between decoding steps) to the cross-attention.
        ``value_residual`` carries the first layer's values to the self-attention of later
        layers (``AttentionVariants.value_residual``; the stacks make one per forward).
        """
        if self.cross_attn is None and memory is not None:
            raise ValueError("memory was given but this block has no cross-attention")
        if self.cross_attn is not None and memory is None:
            raise ValueError("this block has cross-attention: pass memory (b, j, embed_dim)")
        # x is checked before a norm reads it (a norm's own error does not name x).
        self.attn._check_inputs(x, x, x, names=("x", "x", "x"))
        kwargs = dict(mask=mask, is_causal=is_causal, need_weights=need_weights, bias=bias)
        if value_residual is not None:
            kwargs["value_residual"] = value_residual
        if self.norm_first:
            h, weights = self.attn(self.attn_norm(x), **kwargs, rope=rope, cache=cache)
            x = x + self.dropout(h)
            if self.cross_attn is not None:
                assert self.cross_norm is not None
                h, _ = self.cross_attn(
                    self.cross_norm(x), memory, mask=memory_mask, cache=cross_cache
                )
                x = x + self.dropout(h)
            x = x + self.dropout(self.ffn(self.ffn_norm(x)))
        else:
            h, weights = self.attn(x, **kwargs, rope=rope, cache=cache)
            x = self.attn_norm(x + self.dropout(h))
            if self.cross_attn is not None:
                assert self.cross_norm is not None
                h, _ = self.cross_attn(x, memory, mask=memory_mask, cache=cross_cache)
                x = self.cross_norm(x + self.dropout(h))
            x = self.ffn_norm(x + self.dropout(self.ffn(x)))
        return x, weights

    @classmethod
    def from_torch(
        cls,
        layer: nn.TransformerEncoderLayer | nn.TransformerDecoderLayer,
        *,
        backend: str = "auto",
    ) -> TransformerBlock:
        """A block holding a copy of a torch layer's weights (same dtype and device).

        ``nn.TransformerEncoderLayer`` gives a self-attention block; ``nn.TransformerDecoderLayer``
        a block with cross-attention (its ``multihead_attn``; ``norm1, norm2, norm3`` become
        ``attn_norm, cross_norm, ffn_norm``). Supports ``norm_first`` either way and relu/gelu
        activations. The result is batch-first whatever the layer's ``batch_first``.
        """
        decoder = isinstance(layer, nn.TransformerDecoderLayer)
        if not (decoder or isinstance(layer, nn.TransformerEncoderLayer)):
            raise TypeError(
                "expected nn.TransformerEncoderLayer or nn.TransformerDecoderLayer, got "
                f"{type(layer).__name__}"
            )
        act = layer.activation
        if act is F.relu or isinstance(act, nn.ReLU):
            activation = "relu"
        elif act is F.gelu or (isinstance(act, nn.GELU) and act.approximate == "none"):
            activation = "gelu"
        elif isinstance(act, nn.GELU) and act.approximate == "tanh":
            activation = "gelu_tanh"
        else:
            raise ValueError(f"unsupported activation {act!r}: relu and gelu are")
        if layer.linear1.bias is None or layer.norm1.bias is None:
            raise ValueError("layers built with bias=False are not supported")
        sa = layer.self_attn
        weight = layer.linear1.weight
        block = cls(
            sa.embed_dim,
            sa.num_heads,
            layer.linear1.out_features,
            dropout=layer.dropout.p,
            activation=activation,
            norm_first=layer.norm_first,
            cross_attention=decoder,
            eps=layer.norm1.eps,
            backend=backend,
        ).to(dtype=weight.dtype, device=weight.device)
        block.attn = MultiHeadAttention.from_torch(sa, backend=backend)
        with torch.no_grad():
            block.ffn.up.load_state_dict(layer.linear1.state_dict())
            block.ffn.down.load_state_dict(layer.linear2.state_dict())
            block.attn_norm.load_state_dict(layer.norm1.state_dict())
            if decoder:
                assert block.cross_norm is not None
                block.cross_attn = MultiHeadAttention.from_torch(
                    layer.multihead_attn, backend=backend
                )
                block.cross_norm.load_state_dict(layer.norm2.state_dict())
                block.ffn_norm.load_state_dict(layer.norm3.state_dict())
            else:
                block.ffn_norm.load_state_dict(layer.norm2.state_dict())
        return block
