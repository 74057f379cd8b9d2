"""Positional information: absolute encodings, rotary embeddings, ALiBi, relative attention.

Shape vocabulary: ``b`` batch, ``h`` heads, ``i`` query positions, ``j`` key positions,
``d`` head width, ``e`` embed_dim, ``n`` positions of a sequence.

How each scheme composes with ``attnkit.MultiHeadAttention``:

* ``SinusoidalPositionalEncoding`` / ``LearnedPositionalEmbedding``: added to the token
  embeddings ``(b, n, e)`` before the first block; ``offset`` shifts positions for a KV cache.
* ``RotaryEmbedding``: a q/k transform, passed as ``rope=`` to the attention.
* ``alibi_bias`` (tensor) / ``alibi_fn`` (bias function): passed as ``bias=``.
* ``RelativePositionAttention`` (Shaw et al. 2018): its own module, since the value term changes
  the weighted sum itself (see its docstring).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit._numerics import compute_dtype, poison
from attnkit.attention import MultiHeadAttention
from attnkit.functional import make_call, scaled_dot_product_attention
from attnkit.masks import BiasFn, MaskFn, causal_offset, declare, materialize

__all__ = [
    "LearnedPositionalEmbedding",
    "RelativePositionAttention",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "alibi_bias",
    "alibi_fn",
    "alibi_slopes",
    "sinusoidal_table",
]


def _check_offset(offset: int) -> None:
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ValueError(f"offset must be a non-negative int, got {offset!r}")


def _check_base(base: object) -> None:
    if (
        isinstance(base, bool)
        or not isinstance(base, (int, float))
        or not (math.isfinite(base) and base > 0)
    ):
        raise ValueError(f"base must be a positive finite number, got {base!r}")


def _check_dim(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def sinusoidal_table(n: int, embed_dim: int, *, offset: int = 0, base: float = 10000.0) -> Tensor:
    """The table of Vaswani et al. 2017, section 3.5, in float64, shape ``(n, e)``.

    ``PE[p, 2k] = sin(p / base^(2k/e))`` and ``PE[p, 2k+1] = cos(p / base^(2k/e))`` for positions
    ``p = offset .. offset + n - 1``. An odd ``embed_dim`` drops the last cosine column.
    """
    _check_offset(offset)
    _check_base(base)
    p = torch.arange(offset, offset + n, dtype=torch.float64).unsqueeze(1)  # (n, 1)
    k2 = torch.arange(0, embed_dim, 2, dtype=torch.float64)  # (ceil(e/2),)
    angle = p / base ** (k2 / embed_dim)  # (n, ceil(e/2))
    table = torch.empty(n, embed_dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : embed_dim // 2])
    return table


class SinusoidalPositionalEncoding(nn.Module):
    """Adds the fixed sinusoidal table to ``(b, n, e)`` inputs; no parameters, no length limit.

    The table is computed on the fly in float64 and cast to the input's dtype, so there is no
    buffer to save and no maximum length.
    """

    def __init__(self, embed_dim: int, *, base: float = 10000.0) -> None:
        super().__init__()
        _check_dim("embed_dim", embed_dim)
        _check_base(base)
        self.embed_dim = embed_dim
        self.base = base

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        if x.ndim != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"x must have shape (b, n, embed_dim={self.embed_dim}), got {tuple(x.shape)}"
            )
        table = sinusoidal_table(x.shape[1], self.embed_dim, offset=offset, base=self.base)
        return x + table.to(dtype=x.dtype, device=x.device)  # (b, n, e) + (n, e)


class LearnedPositionalEmbedding(nn.Module):
    """A trained vector per absolute position (as in BERT and GPT-2), added to ``(b, n, e)``.

    Initialised ``N(0, 0.02)`` (BERT's choice), small next to unit-variance token embeddings.
    """

    def __init__(self, max_len: int, embed_dim: int) -> None:
        super().__init__()
        _check_dim("max_len", max_len)
        _check_dim("embed_dim", embed_dim)
        self.max_len = max_len
        self.embed_dim = embed_dim
        self.weight = nn.Parameter(torch.empty(max_len, embed_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        if x.ndim != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"x must have shape (b, n, embed_dim={self.embed_dim}), got {tuple(x.shape)}"
            )
        _check_offset(offset)
        n = x.shape[1]
        if offset + n > self.max_len:
            raise ValueError(
                f"positions {offset}..{offset + n - 1} exceed max_len={self.max_len} of the "
                "learned positional embedding"
            )
        return x + self.weight[offset : offset + n]  # (b, n, e) + (n, e)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, RoPE (Su et al. 2021, "RoFormer", section 3.4).

    Each pair of features ``(x[k], x[k + d/2])`` of a query or key at position ``p`` is rotated by
    the angle ``p * base^(-2k/d)`` (the "half" pairing of GPT-NeoX and Llama). A rotation is
    orthogonal, and ``R(p)^T R(q) = R(q - p)``, so ``rotate(q, p) . rotate(k, s)`` depends only on
    ``s - p``: attention scores see relative positions although each vector is rotated by its
    absolute one. Pass the module as ``MultiHeadAttention(..., rope=rope)``; with a KV cache the
    attention passes ``offset = cache.length``.

    Angles are computed in float64 and the rotation in the input's dtype (float32 at least).
    """

    def __init__(self, head_dim: int, *, base: float = 10000.0) -> None:
        super().__init__()
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int for RoPE, got {head_dim!r}")
        _check_base(base)
        self.head_dim = head_dim
        self.base = base

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}"

    def cos_sin(
        self, n: int, offset: int = 0, *, device: torch.device | str | None = None
    ) -> tuple[Tensor, Tensor]:
        """``cos`` and ``sin`` of the angles for positions ``offset ..``, each ``(n, d)``."""
        _check_offset(offset)
        return self.cos_sin_at(torch.arange(offset, offset + n), device=device)

    def cos_sin_at(
        self, positions: Tensor, *, device: torch.device | str | None = None
    ) -> tuple[Tensor, Tensor]:
        """``cos`` and ``sin`` ``(..., n, d)`` for integer positions of any shape ``(..., n)``.

        Rows of a left-padded batch start at different positions: pass them as ``(b, 1, n)``
        and rotate ``(b, h, n, d)`` with ``apply``.
        """
        half = self.head_dim // 2
        inv_freq = self.base ** (-torch.arange(half, dtype=torch.float64) / half)  # (d/2,)
        p = positions.to(device="cpu", dtype=torch.float64).unsqueeze(-1)  # (..., n, 1)
        angle = p * inv_freq  # (..., n, d/2)
        angle = torch.cat([angle, angle], dim=-1)  # (..., n, d): pair k with k + d/2
        return angle.cos().to(device), angle.sin().to(device)

    @staticmethod
    def apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate ``x (..., n, d)`` by angles given as ``cos``/``sin`` broadcastable to it."""
        dtype = compute_dtype(x.dtype)
        xf = x.to(dtype)
        x1, x2 = xf.chunk(2, dim=-1)  # (..., n, d/2) each
        rotated_half = torch.cat([-x2, x1], dim=-1)  # (..., n, d)
        return (xf * cos.to(dtype) + rotated_half * sin.to(dtype)).to(x.dtype)

    def rotate(self, x: Tensor, offset: int = 0) -> Tensor:
        """Rotate ``x`` of shape ``(..., n, d)`` at positions ``offset .. offset + n - 1``."""
        if x.shape[-1] != self.head_dim:
            raise ValueError(
                f"RoPE was built for head_dim={self.head_dim}, got x of shape {tuple(x.shape)}"
            )
        cos, sin = self.cos_sin(x.shape[-2], offset, device=x.device)
        return self.apply(x, cos, sin)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        return self.rotate(x, offset)


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi head slopes (Press et al. 2022, "Train Short, Test Long", section 3), float64 ``(h,)``.

    For ``h`` a power of two the slopes are the geometric sequence that starts at ``2^(-8/h)``
    with that same ratio: ``2^(-8/h), 2^(-16/h), ..., 2^(-8)``. Otherwise, as in the paper's code,
    take the slopes of the closest smaller power of two ``m`` and add every other slope of ``2m``.
    """
    if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads <= 0:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (k + 1) for k in range(n)]

    m = 1 << (num_heads.bit_length() - 1)  # largest power of two <= num_heads
    slopes = power_of_two(m)
    if m < num_heads:
        slopes += power_of_two(2 * m)[0::2][: num_heads - m]
    return torch.tensor(slopes, dtype=torch.float64)


def alibi_fn(num_heads: int, offset: int = 0) -> BiasFn:
    """ALiBi as a bias function ``fn(b, h, i, j) = -slope[h] * |i + offset - j|``.

    ``offset`` is the position of query 0 among the keys: ``j - i`` (bottom-right, what a KV
    cache needs: the new queries are the last positions). No ``(i, j)`` tensor is built: it is
    declared ``relative`` (``masks.Structure``), so the tiled backend evaluates it once per
    call on the ``n_i + n_j - 1`` offsets and reads each tile as a view of them. In causal
    attention only ``j <= i + offset`` is ever used, which is the paper's ``-m (i - j)``; the
    absolute value extends it symmetrically to bidirectional encoders.
    """
    slopes = alibi_slopes(num_heads)
    cache: dict[torch.device, Tensor] = {}

    def alibi(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        s = cache.get(h.device)
        if s is None:
            s = cache[h.device] = slopes.to(torch.float32).to(h.device)
        if h.numel() and int(h.max()) >= num_heads:
            raise ValueError(
                f"alibi_fn was made for num_heads={num_heads} (one slope each), but attention "
                f"asks for head {int(h.max())}: make it with the query's number of heads"
            )
        distance = (i + offset - j).abs().to(torch.float32)
        return -s[h] * distance

    return declare(alibi, relative=True)  # depends on h and j - i only


def alibi_bias(
    num_heads: int,
    n_queries: int,
    n_keys: int | None = None,
    *,
    offset: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """ALiBi as a dense bias tensor ``(1, h, i, j)``: the same values as ``alibi_fn``.

    ``offset`` defaults to ``n_keys - n_queries`` (bottom-right alignment).
    """
    n_keys = n_queries if n_keys is None else n_keys
    offset = causal_offset(n_queries, n_keys) if offset is None else offset
    slopes = alibi_slopes(num_heads).to(device=device, dtype=dtype)
    i = torch.arange(n_queries, device=device).view(-1, 1)  # (i, 1)
    j = torch.arange(n_keys, device=device).view(1, -1)  # (1, j)
    distance = (i + offset - j).abs().to(dtype)  # (i, j)
    return (-slopes.view(-1, 1, 1) * distance).unsqueeze(0)  # (1, h, i, j)


class RelativePositionAttention(MultiHeadAttention):
    """Self-attention with relative position representations (Shaw et al. 2018, section 3).

    Each clipped distance ``r = clip(j - i, -max_distance, max_distance)`` between a query and a
    key has two learned vectors of width ``d``, shared by all heads (section 3.1):
    ``a^K_r`` enters the scores and ``a^V_r`` the weighted sum (equations 3 and 4)::

        e_ij = q_i . (k_j + a^K_ij) / sqrt(d)        z_i = sum_j alpha_ij (v_j + a^V_ij)

    How it is computed, and why not in one call: the key term is a score bias,
    ``q_i . a^K_ij / sqrt(d)``, so it goes through ``scaled_dot_product_attention`` as ``bias=``
    (the reference math then does scale, mask, softmax and fully-masked rows). The value term
    changes the weighted sum itself (``a^V_ij`` depends on both ``i`` and ``j``), which no fused
    kernel computes, so the module asks the math for the weights ``alpha`` and forms both sums
    here: ``alpha @ V`` and, by summing ``alpha`` into its ``2 * max_distance + 1`` distance
    buckets, ``buckets @ a^V``. Dropout is applied to ``alpha`` once, before both sums.

    Positions: query ``t`` sits at key position ``t + (j - i)`` (bottom-right, as ``is_causal``
    and the KV cache), so token-by-token decoding with a cache matches the full forward.

    Parameters: those of ``MultiHeadAttention`` plus ``rel_key`` and ``rel_value``, each
    ``(2 * max_distance + 1, d)``, row ``r + max_distance`` for distance ``r``, initialised
    ``N(0, 1/d)`` so the key term starts on the scale of ``q . k``. A ``bias=`` given to
    ``forward`` is added to the relative key term.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        max_distance: int,
        num_kv_heads: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
    ) -> None:
        if not isinstance(max_distance, int) or isinstance(max_distance, bool) or max_distance < 0:
            raise ValueError(f"max_distance must be a non-negative int, got {max_distance!r}")
        super().__init__(
            embed_dim,
            num_heads,
            num_kv_heads=num_kv_heads,
            bias=bias,
            dropout=dropout,
            backend="math",
        )
        self.max_distance = max_distance
        self.rel_key = nn.Parameter(torch.empty(2 * max_distance + 1, self.head_dim))
        self.rel_value = nn.Parameter(torch.empty(2 * max_distance + 1, self.head_dim))
        self._reset_relative()

    def _reset_relative(self) -> None:
        nn.init.normal_(self.rel_key, std=self.head_dim**-0.5)
        nn.init.normal_(self.rel_value, std=self.head_dim**-0.5)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", max_distance={self.max_distance}"

    def relative_index(
        self, n_queries: int, n_keys: int, device: torch.device | str | None = None
    ) -> Tensor:
        """Bucket ``clip(j - i) + max_distance`` of every query/key pair, ``(i, j)`` int64."""
        offset = causal_offset(n_queries, n_keys)  # query t sits at key position t + offset
        i = torch.arange(n_queries, device=device).view(-1, 1) + offset  # (i, 1)
        j = torch.arange(n_keys, device=device).view(1, -1)  # (1, j)
        k = self.max_distance
        return (j - i).clamp(-k, k) + k  # (i, j)

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | MaskFn | None,
        is_causal: bool,
        need_weights: bool,
        bias: Tensor | BiasFn | None,
    ) -> tuple[Tensor, Tensor | None]:
        b, h, i, d = q.shape
        h_kv, j = k.shape[1], k.shape[2]
        compute = compute_dtype(q.dtype)
        idx = self.relative_index(i, j, q.device).expand(b, h, i, j)  # (b, h, i, j)
        rel_scores = q.to(compute) @ self.rel_key.to(compute).T  # (b, h, i, 2k+1)
        key_term = rel_scores.gather(-1, idx) / math.sqrt(d)  # (b, h, i, j)
        if bias is not None:
            if callable(bias):
                bias = materialize(bias, (b, h, i, j), device=q.device)
            key_term = key_term + bias
        _, weights = scaled_dot_product_attention(
            q, k, v, mask, bias=key_term, is_causal=is_causal, return_weights=True
        )
        weights = weights.to(compute)  # (b, h, i, j), rows sum to 1 (0 when fully masked)
        dropped = F.dropout(weights, self.dropout, self.training)
        grouped = dropped.unflatten(1, (h_kv, h // h_kv))  # (b, h_kv, g, i, j)
        values = v.to(compute).unsqueeze(2)  # (b, h_kv, 1, j, d)
        bad = ~torch.isfinite(values)
        if bool(bad.any()):
            # As the reference math: a non-finite value is read as 0 and makes NaN only the
            # rows that see its key (0 * nan would reach the rows that cannot).
            visible = make_call(q, k, v, mask, is_causal=is_causal).dense_mask()
            hidden = torch.isneginf(key_term)
            if bool(hidden.any()):
                visible = ~hidden if visible is None else visible & ~hidden
            if visible is not None:
                visible = visible.expand(b, h, i, j).unflatten(1, (h_kv, h // h_kv))
            out = poison(grouped @ values.masked_fill(bad, 0.0), visible, bad).flatten(1, 2)
        else:
            out = (grouped @ values).flatten(1, 2)  # (b, h, i, d)
        buckets = dropped.new_zeros(b, h, i, 2 * self.max_distance + 1)
        buckets.scatter_add_(-1, idx, dropped)  # (b, h, i, 2k+1): weight per clipped distance
        out = out + buckets @ self.rel_value.to(compute)  # (b, h, i, d)
        return out.to(q.dtype), (weights.to(q.dtype) if need_weights else None)
