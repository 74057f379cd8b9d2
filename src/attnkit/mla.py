"""Multi-head latent attention, MLA (DeepSeek-V2, arXiv:2405.04434, section 2.1), as DeepSeek-V3
and Kimi K2 use it.

Shape vocabulary (used in every comment below):

    b  batch    i  query positions    j  key positions    e  embed_dim    h  heads
    d_c  the KV latent (kv_rank)    d_q  the query latent (q_rank)
    d_n  the per-head query/key width without RoPE (nope_dim)    d_r  the RoPE width (rope_dim)
    d_v  the per-head value width

A KV cache of ordinary attention holds ``2 h d`` numbers per token and layer. MLA stores one
small latent instead, and rebuilds per-head keys and values from it (paper equations 9-11)::

    c_kv  = RMSNorm(W_DKV x)                        (b, j, d_c)     the cached latent
    k_n   = W_UK c_kv,  v = W_UV c_kv              (b, h, j, d_n), (b, h, j, d_v)

RoPE cannot ride on ``k_n`` (it would sit between ``W_UK`` and the query and block the
absorption below), so position goes to a separate *decoupled* key shared by all heads, which is
cached too (equations 14-19)::

    k_r   = RoPE(W_KR x)                            (b, j, d_r)     cached beside c_kv
    q     = W_UQ RMSNorm(W_DQ x)  (or W_Q x)        (b, h, i, d_n + d_r), its last d_r rotated
    score = (q_n . k_n + q_r . k_r) * scale,        scale = (d_n + d_r) ** -0.5

The cache thus holds ``d_c + d_r`` numbers per token and layer (DeepSeek-V2: ``4.5 d_h`` against
``2 h d_h`` for full K/V; ``LatentCache.nbytes``).

Two forms give the same output:

* **expanded** (prefill and training): rebuild ``k`` and ``v`` for every head and run
  ``attnkit.scaled_dot_product_attention`` (any backend: ``"auto"``, ``"tiled"``, ``"fused"``).
* **absorbed** (decoding; section 2.1.2, "we can absorb W_UK into W_UQ, and W_UV into W_O"):
  ``q_n . (W_UK c_kv) = (W_UK^T q_n) . c_kv``, so each head's query is mapped into the latent
  space once and attends over the cached latents directly, as multi-query attention with
  keys ``[c_kv; k_r]`` ``(b, 1, j, d_c + d_r)`` and values ``c_kv``; ``W_UV`` is applied to the
  ``(b, h, i, d_c)`` result before ``W_O``. No per-head key or value is built for the cache.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import attnkit.backends  # noqa: F401  (registers the backends a module's `backend=` names)
from attnkit.functional import check_mask, scaled_dot_product_attention
from attnkit.masks import MaskFn, causal_mask, pad_to_rank
from attnkit.norms import RMSNorm
from attnkit.positional import RotaryEmbedding

__all__ = ["LatentCache", "MultiHeadLatentAttention"]


class LatentCache:
    """The MLA cache of one layer: the latent ``c_kv`` and the rotated decoupled key ``k_r`` of
    every position, stored side by side as ``[c_kv; k_r]`` ``(b, j, d_c + d_r)`` (the absorbed
    form's keys, so decoding reads them without a copy), not per-head keys and values.

    ``length`` is also the position of the next token (the RoPE offset). With ``is_causal=True``
    the mask is aligned bottom-right, as with ``attnkit.KVCache``, so decoding token by token
    equals one causal forward. With ``max_len`` the storage is allocated once and filled in
    place; without it each append concatenates.
    """

    def __init__(self, max_len: int | None = None) -> None:
        if max_len is not None and (not isinstance(max_len, int) or max_len <= 0):
            raise ValueError(f"max_len must be a positive int or None, got {max_len!r}")
        self.max_len = max_len
        self.length = 0
        self.kv_rank = 0  # d_c, from the first append
        self._kv: Tensor | None = None  # (b, j or max_len, d_c + d_r)

    @property
    def keys(self) -> Tensor | None:
        """``[c_kv; k_r]`` of the cached positions, ``(b, j, d_c + d_r)``."""
        return None if self._kv is None else self._kv[:, : self.length]

    @property
    def latent(self) -> Tensor | None:
        """``c_kv (b, j, d_c)``."""
        return None if self._kv is None else self._kv[:, : self.length, : self.kv_rank]

    @property
    def rope_key(self) -> Tensor | None:
        """``k_r (b, j, d_r)``, rotated."""
        return None if self._kv is None else self._kv[:, : self.length, self.kv_rank :]

    def __len__(self) -> int:
        return self.length

    def reset(self) -> None:
        self._kv, self.length = None, 0

    def nbytes(self) -> int:
        """Bytes of the cached positions: ``(d_c + d_r) * b * j * element_size``."""
        kv = self.keys
        return 0 if kv is None else kv.numel() * kv.element_size()

    def append(self, kv: Tensor, kv_rank: int) -> Tensor:
        """Append ``[c_kv; k_r]`` ``(b, n, d_c + d_r)`` with ``d_c = kv_rank``; return all."""
        if not isinstance(kv, Tensor) or kv.ndim != 3:
            got = tuple(kv.shape) if isinstance(kv, Tensor) else type(kv).__name__
            raise TypeError(f"LatentCache.append takes kv (b, n, d_c + d_r), got {got}")
        n = kv.shape[1]
        if self._kv is not None:
            want = (self._kv.shape[0], self._kv.shape[2], self.kv_rank)
            if (kv.shape[0], kv.shape[2], kv_rank) != want:
                raise ValueError(
                    f"cache holds latents (b, d_c + d_r, d_c) = {want} but this call gives "
                    f"{(kv.shape[0], kv.shape[2], kv_rank)}: the cache comes from another "
                    "layer, model or batch (call reset())"
                )
        self.kv_rank = kv_rank
        if self.max_len is not None:
            if self.length + n > self.max_len:
                raise ValueError(
                    f"LatentCache is full: {self.length} cached + {n} new > max_len={self.max_len}"
                )
            if self._kv is None:
                self._kv = kv.new_empty(kv.shape[0], self.max_len, kv.shape[2])
            self._kv[:, self.length : self.length + n] = kv
        elif self._kv is None:
            self._kv = kv
        else:
            self._kv = torch.cat([self._kv[:, : self.length], kv], dim=1)  # (b, j + n, .)
        self.length += n
        keys = self.keys
        assert keys is not None
        return keys


def _check_positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention over ``(b, i, e)`` (see the module docstring for the math).

    Args:
        embed_dim: ``e``.
        num_heads: ``h``.
        kv_rank: ``d_c``, the width of the cached latent (DeepSeek-V3: 512).
        nope_dim: ``d_n``, the per-head query/key width that carries no position (V3: 128).
        rope_dim: ``d_r``, the decoupled RoPE key's width, even (V3: 64).
        v_dim: ``d_v``, the per-head value width (V3: 128).
        q_rank: ``d_q``, the query latent (V3: 1536); ``None`` projects queries directly.
        rope_base: RoPE's base (``attnkit.RotaryEmbedding``, the "half" pairing).
        scale: multiplies the scores; ``None`` means ``(d_n + d_r) ** -0.5``.
        bias: biases on the down projections and the output projection (DeepSeek:
            ``attention_bias``); the up projections never have one.
        backend: the attention backend of both forms (``"auto"``, ``"tiled"``, ``"fused"``, ...).

    Parameters: ``q_down`` (``W_DQ``) and ``q_norm`` and ``q_up`` (``W_UQ``) with ``q_rank``,
    else ``q_proj``; ``kv_down`` (``[W_DKV; W_KR]``, ``e -> d_c + d_r``), ``kv_norm``, ``kv_up``
    (``[W_UK; W_UV]`` per head, ``d_c -> h (d_n + d_v)``), ``out_proj`` (``W_O``).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kv_rank: int,
        nope_dim: int,
        rope_dim: int,
        v_dim: int,
        q_rank: int | None = None,
        rope_base: float = 10000.0,
        scale: float | None = None,
        bias: bool = False,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        e = _check_positive("embed_dim", embed_dim)
        h = _check_positive("num_heads", num_heads)
        self.kv_rank = _check_positive("kv_rank", kv_rank)
        self.nope_dim = _check_positive("nope_dim", nope_dim)
        self.rope_dim = _check_positive("rope_dim", rope_dim)
        self.v_dim = _check_positive("v_dim", v_dim)
        if rope_dim % 2:
            raise ValueError(f"rope_dim must be even (RoPE rotates pairs), got {rope_dim}")
        self.q_rank = None if q_rank is None else _check_positive("q_rank", q_rank)
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a string, got {type(backend).__name__}")
        self.embed_dim, self.num_heads, self.backend = e, h, backend
        self.qk_dim = nope_dim + rope_dim
        self.scale = self.qk_dim**-0.5 if scale is None else float(scale)
        self.q_proj: nn.Linear | None = None
        self.q_down: nn.Linear | None = None
        self.q_norm: RMSNorm | None = None
        self.q_up: nn.Linear | None = None
        if q_rank is None:
            self.q_proj = nn.Linear(e, h * self.qk_dim, bias=False)
        else:
            self.q_down = nn.Linear(e, q_rank, bias=bias)
            self.q_norm = RMSNorm(q_rank)
            self.q_up = nn.Linear(q_rank, h * self.qk_dim, bias=False)
        self.kv_down = nn.Linear(e, kv_rank + rope_dim, bias=bias)
        self.kv_norm = RMSNorm(kv_rank)
        self.kv_up = nn.Linear(kv_rank, h * (nope_dim + v_dim), bias=False)
        self.out_proj = nn.Linear(h * v_dim, e, bias=bias)
        self.rope = RotaryEmbedding(rope_dim, base=rope_base)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, kv_rank={self.kv_rank}, "
            f"q_rank={self.q_rank}, nope_dim={self.nope_dim}, rope_dim={self.rope_dim}, "
            f"v_dim={self.v_dim}, backend={self.backend!r}"
        )

    def cache_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """What one token costs in this layer's cache: ``(d_c + d_r)`` numbers (the paper's
        ``(d_c + d_h^R) l`` per token over ``l`` layers)."""
        return (self.kv_rank + self.rope_dim) * torch.empty(0, dtype=dtype).element_size()

    # -- the pieces ---------------------------------------------------------------------------

    def query_latent(self, x: Tensor) -> Tensor | None:
        """``c_q = RMSNorm(W_DQ x)`` ``(b, i, d_q)`` (DeepSeek-V3.2's indexer reads it too);
        ``None`` without a query latent."""
        if self.q_down is None or self.q_norm is None:
            return None
        return self.q_norm(self.q_down(x))

    def queries(self, x: Tensor, offset: int, c_q: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(q_n (b, h, i, d_n), q_r (b, h, i, d_r))``, ``q_r`` rotated at ``offset ..``."""
        b, i, _ = x.shape
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_up is not None
            q = self.q_up(self.query_latent(x) if c_q is None else c_q)
        q = q.view(b, i, self.num_heads, self.qk_dim).transpose(1, 2)  # (b, h, i, d_n + d_r)
        q_n, q_r = q.split([self.nope_dim, self.rope_dim], dim=-1)
        return q_n, self.rope.rotate(q_r, offset)

    def latents(self, x: Tensor, offset: int) -> Tensor:
        """``[c_kv; k_r]`` ``(b, j, d_c + d_r)`` of new tokens at positions ``offset ..``: what
        the cache stores."""
        c_kv, k_r = self.kv_down(x).split([self.kv_rank, self.rope_dim], dim=-1)
        return torch.cat([self.kv_norm(c_kv), self.rope.rotate(k_r, offset)], dim=-1)

    def up_weights(self) -> tuple[Tensor, Tensor]:
        """``W_UK (h, d_n, d_c)`` and ``W_UV (h, d_v, d_c)``, the rows of ``kv_up`` per head."""
        # (h, d_n + d_v, d_c): each head's key rows, then its value rows
        w = self.kv_up.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_rank)
        w_uk, w_uv = w.split([self.nope_dim, self.v_dim], dim=1)
        return w_uk, w_uv

    def expand(self, c_kv: Tensor, k_r: Tensor) -> tuple[Tensor, Tensor]:
        """Per-head keys ``(b, h, j, d_n + d_r)`` and values ``(b, h, j, d_v)`` from latents."""
        b, j, _ = c_kv.shape
        kv = self.kv_up(c_kv).view(b, j, self.num_heads, self.nope_dim + self.v_dim)
        k_n, v = kv.transpose(1, 2).split([self.nope_dim, self.v_dim], dim=-1)  # (b, h, j, .)
        k_r = k_r[:, None].expand(b, self.num_heads, j, self.rope_dim)  # one key for all heads
        return torch.cat([k_n, k_r], dim=-1), v

    def absorb_query(self, q_n: Tensor, q_r: Tensor) -> Tensor:
        """``[W_UK^T q_n; q_r]`` ``(b, h, i, d_c + d_r)``: a query that scores latents."""
        w_uk, _ = self.up_weights()
        q_c = torch.einsum("bhin,hnc->bhic", q_n, w_uk)  # (b, h, i, d_c)
        return torch.cat([q_c, q_r], dim=-1)

    def absorb_output(self, o_c: Tensor) -> Tensor:
        """``W_UV`` on each head's latent output ``(b, h, i, d_c)`` -> ``(b, i, h d_v)``."""
        _, w_uv = self.up_weights()
        o = torch.einsum("bhic,hvc->bihv", o_c, w_uv)  # (b, i, h, d_v)
        return o.flatten(2)

    # -- forward -------------------------------------------------------------------------------

    def forward(
        self,
        x: Tensor,
        *,
        is_causal: bool = True,
        cache: LatentCache | None = None,
        mask: Tensor | MaskFn | None = None,
        need_weights: bool = False,
        absorb: bool | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Self-attention over ``x (b, i, e)``; ``(out (b, i, e), weights (b, h, i, j) or None)``.

        Args:
            x: ``(b, i, e)``, the new tokens, at positions ``cache.length ..`` (``0 ..`` without
                a cache): RoPE rotates queries and the decoupled key by these positions.
            is_causal: causal, aligned bottom-right (see ``LatentCache``).
            cache: a ``LatentCache``; the new latents are appended and attention runs over all.
            mask: bool, ``True`` = may attend, broadcastable to ``(b, h, i, j)``.
            need_weights: also return the weights (runs the ``"math"`` backend under "auto").
            absorb: the absorbed form (True) or the expanded one (False); ``None``: absorbed when
                a cache holds more positions than this call adds (decoding), else expanded.
        """
        if not isinstance(x, Tensor) or x.ndim != 3 or x.shape[-1] != self.embed_dim:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (b, i, embed_dim={self.embed_dim}), got {shape}")
        if cache is not None and not isinstance(cache, LatentCache):
            raise TypeError(f"cache must be a LatentCache, got {type(cache).__name__}")
        offset = 0 if cache is None else cache.length
        kv = self.latents(x, offset)  # (b, i, d_c + d_r)
        if cache is not None:
            kv = cache.append(kv, self.kv_rank)  # (b, j, d_c + d_r)
        q_n, q_r = self.queries(x, offset)
        if absorb is None:
            absorb = cache is not None and offset > x.shape[1]
        out, weights = self.attend(
            q_n, q_r, kv, mask=mask, is_causal=is_causal, need_weights=need_weights,
            absorb=absorb,
        )  # fmt: skip
        return self.out_proj(out), weights

    def attend(
        self,
        q_n: Tensor,
        q_r: Tensor,
        kv: Tensor,
        *,
        mask: Tensor | MaskFn | None,
        is_causal: bool,
        need_weights: bool,
        absorb: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention of ``q_n, q_r (b, h, i, .)`` over the latents ``kv = [c_kv; k_r]``
        ``(b, j, d_c + d_r)``; ``(o (b, i, h d_v), weights or None)`` before ``out_proj``."""
        b, h, i, _ = q_n.shape
        c_kv, k_r = kv.split([self.kv_rank, self.rope_dim], dim=-1)  # views
        if absorb and not callable(mask):
            return self._attend_absorbed(q_n, q_r, kv, mask, is_causal, need_weights)
        if absorb:  # a mask function sees (b, h, i, j): keep the head axis
            q = self.absorb_query(q_n, q_r)  # (b, h, i, d_c + d_r)
            k, v = kv[:, None], c_kv[:, None]  # (b, 1, j, d_c + d_r), (b, 1, j, d_c): one head
        else:
            q = torch.cat([q_n, q_r], dim=-1)  # (b, h, i, d_n + d_r)
            k, v = self.expand(c_kv, k_r)  # (b, h, j, d_n + d_r), (b, h, j, d_v)
        result = scaled_dot_product_attention(
            q, k, v, mask, is_causal=is_causal, scale=self.scale, return_weights=need_weights,
            backend=self.backend,
        )  # fmt: skip
        o, weights = result if isinstance(result, tuple) else (result, None)
        if absorb:
            return self.absorb_output(o), weights  # (b, i, h d_v)
        return o.transpose(1, 2).reshape(b, i, h * self.v_dim), weights  # (b, i, h d_v)

    def _attend_absorbed(
        self,
        q_n: Tensor,
        q_r: Tensor,
        kv: Tensor,
        mask: Tensor | None,
        is_causal: bool,
        need_weights: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """The absorbed form with the heads folded into the query rows: every head reads the
        same latents, so ``(b, h, i)`` queries are one ``(b, 1, h i)`` block against one key
        head, and no backend broadcasts (copies) the latents per head. The causal mask then is
        explicit, ``(h i, j)``, built only when a row can see less than every key."""
        b, h, i, _ = q_n.shape
        j = kv.shape[1]
        if mask is not None:  # checked as the expanded form's attention checks it
            check_mask(mask, (b, h, i, j), q_n)
        q = self.absorb_query(q_n, q_r).reshape(b, 1, h * i, -1)  # (b, 1, h i, d_c + d_r)
        keep = None
        if is_causal and i > 1:  # one new query sees every key (it was just appended)
            keep = causal_mask(i, j, device=q.device)  # (i, j), bottom-right
        if mask is not None:
            keep = mask if keep is None else keep & mask
        if keep is not None:
            keep = pad_to_rank(keep, 4).expand(b, h, i, j).reshape(b, 1, h * i, j)  # (b, 1, h i, j)
        values = kv[..., : self.kv_rank]  # c_kv, a view
        result = scaled_dot_product_attention(
            q, kv[:, None], values[:, None], keep, scale=self.scale,
            return_weights=need_weights, backend=self.backend,
        )  # fmt: skip
        o, weights = result if isinstance(result, tuple) else (result, None)
        o = o.view(b, h, i, self.kv_rank)  # (b, h, i, d_c)
        weights = None if weights is None else weights.view(b, h, i, j)  # (b, h, i, j)
        return self.absorb_output(o), weights

    @classmethod
    def from_transformers(
        cls, module: nn.Module, *, backend: str = "auto"
    ) -> MultiHeadLatentAttention:
        """A copy of a ``DeepseekV3Attention`` (or any module of its layout: Kimi K2's,
        DeepSeek-V3.2's without its indexer). Same dtype and device.

        DeepSeek lays its RoPE channels out in interleaved pairs ``(x0, x1), (x2, x3), ...``
        (``rope_interleave``); attnkit's RoPE pairs ``x[k]`` with ``x[k + d_r/2]``. Scores only
        see ``q_r . k_r``, which is unchanged when both are permuted alike, so the copy
        reorders the RoPE rows of ``W_UQ`` and ``W_KR`` to ``[even; odd]`` and the outputs are
        the same. Only the default RoPE (no YaRN rescaling of the angles) is supported.
        """
        new = cls(**_settings(module), backend=backend)
        weight = module.o_proj.weight
        new = new.to(dtype=weight.dtype, device=weight.device)
        interleaved = bool(getattr(module.config, "rope_interleave", True))
        copy_latent_attention(new, module, interleaved=interleaved)
        return new


def _settings(module: nn.Module) -> dict:
    """Constructor arguments of the MLA part of a transformers DeepSeek attention module."""
    name = type(module).__name__
    if not hasattr(module, "kv_a_proj_with_mqa") or not hasattr(module, "kv_b_proj"):
        raise TypeError(f"expected a DeepSeek MLA module (DeepseekV3Attention), got {name}")
    rope = dict(getattr(module.config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"only the default RoPE is supported, this module uses {rope.get('rope_type')!r}"
        )
    if module.num_key_value_groups != 1:
        raise ValueError(
            f"MLA expands every head from the latent: num_key_value_heads must equal "
            f"num_attention_heads, got groups of {module.num_key_value_groups}"
        )
    return dict(
        embed_dim=module.hidden_size,
        num_heads=module.num_heads,
        kv_rank=module.kv_lora_rank,
        nope_dim=module.qk_nope_head_dim,
        rope_dim=module.qk_rope_head_dim,
        v_dim=module.v_head_dim,
        q_rank=module.q_lora_rank,
        rope_base=float(rope.get("rope_theta", 10000.0)),
        scale=float(module.scaling),
        bias=module.kv_a_proj_with_mqa.bias is not None,
    )


def copy_latent_attention(
    new: MultiHeadLatentAttention, module: nn.Module, *, interleaved: bool
) -> None:
    """Copy a transformers DeepSeek MLA module's weights into ``new`` (see ``from_transformers``);
    ``interleaved``: the module rotates RoPE channels in interleaved pairs."""
    d_n, d_r = new.nope_dim, new.rope_dim
    order = torch.cat([torch.arange(0, d_r, 2), torch.arange(1, d_r, 2)]) if interleaved else None

    def rope_rows(w: Tensor, rows_per_head: int, first: int) -> Tensor:
        """``w`` with the RoPE rows ``first .. first + d_r`` of each head reordered."""
        if order is None:
            return w
        w = w.view(-1, rows_per_head, w.shape[-1]).clone()  # (heads, rows_per_head, in)
        w[:, first : first + d_r] = w[:, first + order]
        return w.view(-1, w.shape[-1])  # (heads rows_per_head, in)

    with torch.no_grad():
        q_up = new.q_proj if new.q_proj is not None else new.q_up
        source = module.q_proj if module.q_lora_rank is None else module.q_b_proj
        assert q_up is not None
        q_up.weight.copy_(rope_rows(source.weight, d_n + d_r, d_n))
        if new.q_down is not None and new.q_norm is not None:
            new.q_down.weight.copy_(module.q_a_proj.weight)
            if new.q_down.bias is not None:
                new.q_down.bias.copy_(module.q_a_proj.bias)
            new.q_norm.weight.copy_(module.q_a_layernorm.weight)
            new.q_norm.eps = float(module.q_a_layernorm.variance_epsilon)
        kv_a = module.kv_a_proj_with_mqa
        new.kv_down.weight.copy_(rope_rows(kv_a.weight, new.kv_rank + d_r, new.kv_rank))
        if new.kv_down.bias is not None:
            new.kv_down.bias.copy_(
                rope_rows(kv_a.bias[:, None], new.kv_rank + d_r, new.kv_rank)[:, 0]
            )
        new.kv_norm.weight.copy_(module.kv_a_layernorm.weight)
        new.kv_norm.eps = float(module.kv_a_layernorm.variance_epsilon)
        new.kv_up.weight.copy_(module.kv_b_proj.weight)
        new.out_proj.weight.copy_(module.o_proj.weight)
        if new.out_proj.bias is not None:
            new.out_proj.bias.copy_(module.o_proj.bias)
