"""Multi-head attention (Vaswani et al. 2017, section 3.2.2) with GQA and a KV cache.

Shape vocabulary (used in every comment below):

    b  batch    i  query positions    j  key positions    e  embed_dim
    h  query heads    h_kv  key/value heads    d  head width (e // h)

The module only *projects*: queries, keys and values are split into heads and handed to
``attnkit.scaled_dot_product_attention``, which holds the one reference math and the backends.

Parameters (stable names; the BERT and training code load weights into them):

* ``in_proj`` (``nn.Linear(e, e + 2 * h_kv * d)``), present when ``kdim == vdim == e``: the fused
  query/key/value projection. Its output rows are stacked ``[q; k; v]`` with sizes
  ``e, h_kv * d, h_kv * d`` (torch's ``in_proj_weight`` layout when ``h_kv == h``). Self-attention
  does one matmul; cross-attention uses the three row blocks separately.
* ``q_proj``, ``k_proj``, ``v_proj``, present instead of ``in_proj`` when ``kdim`` or ``vdim``
  differ from ``e`` (keys and values then come from another space, as in torch).
* ``out_proj`` (``nn.Linear(e, e)``).

Grouped-query attention (Ainslie et al. 2023) and multi-query attention (Shazeer 2019): with
``num_kv_heads = h_kv`` dividing ``num_heads``, keys and values are projected to ``h_kv`` heads
only and passed to the functional as ``(b, h_kv, j, d)``; it broadcasts each key/value head over
its ``h // h_kv`` query heads without copying them.

Initialisation (deliberate, as in torch's ``nn.MultiheadAttention``): every projection weight is
Xavier-uniform (Glorot & Bengio 2010), one projection at a time so each keeps unit gain, and every
bias is zero, so at initialisation attention is a function of the inputs only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnkit.backends  # noqa: F401  (registers the backends a module's `backend=` names)
from attnkit._numerics import autocast_dtype, no_autocast, to_autocast
from attnkit.backends.fused import decode
from attnkit.functional import scaled_dot_product_attention
from attnkit.kv_cache import KVCache
from attnkit.masks import BiasFn, MaskFn
from attnkit.variants import (
    AttentionVariants,
    DifferentialAttention,
    OutputGate,
    QKNorm,
    ValueMix,
    ValueResidual,
)

__all__ = ["KVCache", "MultiHeadAttention", "QKTransform"]


class QKTransform(Protocol):
    """What ``rope=`` accepts: ``rotate(x, offset)`` maps ``(b, h, n, d)`` at positions
    ``offset .. offset + n - 1`` to the same shape (``attnkit.RotaryEmbedding`` is one)."""

    def rotate(self, x: Tensor, offset: int = 0) -> Tensor: ...


def _autocasting(t: Tensor) -> bool:
    """Whether autocast is on for ``t``'s device (its linear layers then cast the inputs)."""
    return torch.is_autocast_enabled(t.device.type)


def _check_positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class MultiHeadAttention(nn.Module):
    """Multi-head attention over batch-first inputs ``(b, i, e)``.

    Args:
        embed_dim: model width ``e``; must be divisible by ``num_heads``.
        num_heads: query heads ``h``; head width ``d = e // h``.
        num_kv_heads: key/value heads ``h_kv`` (must divide ``h``); ``None`` means ``h``
            (ordinary attention), ``1`` is multi-query attention.
        kdim: feature size of ``key`` inputs (cross-attention from another space); ``None``
            means ``embed_dim``.
        vdim: feature size of ``value`` inputs; ``None`` means ``embed_dim``.
        bias: whether the projections have biases.
        dropout: probability of dropping an attention weight, applied only in training mode.
        backend: attention backend name (``"auto"``, ``"math"``, ``"torch"``, or any registered).
        variants: soft-capping, attention sinks, qk-norm, output gates, differential attention
            and value residuals (``attnkit.variants.AttentionVariants``); ``None``: none.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        backend: str = "auto",
        variants: AttentionVariants | None = None,
    ) -> None:
        super().__init__()
        _check_positive("embed_dim", embed_dim)
        _check_positive("num_heads", num_heads)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        _check_positive("num_kv_heads", num_kv_heads)
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
            )
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads}) for "
                "grouped-query attention"
            )
        kdim = embed_dim if kdim is None else _check_positive("kdim", kdim)
        vdim = embed_dim if vdim is None else _check_positive("vdim", vdim)
        if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a float in [0, 1), got {dropout!r}")
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a string, got {type(backend).__name__}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.kdim, self.vdim = kdim, vdim
        self.dropout = float(dropout)
        self.backend = backend
        kv_dim = num_kv_heads * self.head_dim
        self.in_proj: nn.Linear | None = None
        self.q_proj: nn.Linear | None = None
        self.k_proj: nn.Linear | None = None
        self.v_proj: nn.Linear | None = None
        if kdim == vdim == embed_dim:
            self.in_proj = nn.Linear(embed_dim, embed_dim + 2 * kv_dim, bias=bias)
        else:
            self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
            self.k_proj = nn.Linear(kdim, kv_dim, bias=bias)
            self.v_proj = nn.Linear(vdim, kv_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.variants = AttentionVariants() if variants is None else variants
        if not isinstance(self.variants, AttentionVariants):
            raise TypeError(f"variants must be AttentionVariants, got {type(variants).__name__}")
        var = self.variants
        if var.differential and self.head_dim % 2:
            raise ValueError(
                f"differential attention splits each head in two: head width embed_dim // "
                f"num_heads = {self.head_dim} must be even"
            )
        self.differential = (
            DifferentialAttention(self.head_dim, var.layer) if var.differential else None
        )
        # qk-norm normalises what a map's scores see: each half of a differential head
        qk_width = self.head_dim // 2 if var.differential else self.head_dim
        self.q_norm = None if var.qk_norm is None else QKNorm(qk_width, var.qk_norm)
        self.k_norm = None if var.qk_norm is None else QKNorm(qk_width, var.qk_norm)
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if var.sinks else None
        self.gate = None if var.gate is None else OutputGate(embed_dim, num_heads, var.gate)
        # the first layer hands its values on; later layers mix them in (Zhou et al. 2024)
        takes_values = var.value_residual is not None and var.layer > 1
        self.value_mix = ValueMix(var.value_residual == "learned") if takes_values else None
        self.reset_parameters()

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def reset_parameters(self) -> None:
        """Xavier-uniform projection weights (per projection), zero biases; see module doc."""
        e, kv = self.embed_dim, self.kv_dim
        with torch.no_grad():
            if self.in_proj is not None:
                for rows in self.in_proj.weight.split([e, kv, kv], dim=0):
                    nn.init.xavier_uniform_(rows)
            for lin in (self.in_proj, self.q_proj, self.k_proj, self.v_proj, self.out_proj):
                if lin is None:
                    continue
                if lin is not self.in_proj:
                    nn.init.xavier_uniform_(lin.weight)
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)

    def extra_repr(self) -> str:
        kv = f", num_kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}{kv}, "
            f"dropout={self.dropout}, backend={self.backend!r}"
        )

    def _project(self, x: Tensor, which: int) -> Tensor:
        """Project with the q (0), k (1) or v (2) rows of the projections."""
        if self.in_proj is None:
            lin = (self.q_proj, self.k_proj, self.v_proj)[which]
            assert lin is not None
            return lin(x)
        e, kv = self.embed_dim, self.kv_dim
        start, size = (0, e) if which == 0 else (e + (which - 1) * kv, kv)
        w = self.in_proj.weight[start : start + size]
        b = None if self.in_proj.bias is None else self.in_proj.bias[start : start + size]
        return F.linear(x, w, b)

    def _check_inputs(
        self, query: Tensor, key: Tensor, value: Tensor, names: tuple[str, ...] = ()
    ) -> None:
        """Shapes and dtypes against the module's; ``names`` renames the three in the errors."""
        qn, kn, vn = names or ("query", "key", "value")
        for name, t, width, wname in (
            (qn, query, self.embed_dim, "embed_dim"),
            (kn, key, self.kdim, "kdim"),
            (vn, value, self.vdim, "vdim"),
        ):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.ndim != 3 or t.shape[-1] != width:
                raise ValueError(
                    f"{name} must have shape (b, n, {wname}={width}) (batch first), "
                    f"got {tuple(t.shape)}"
                )
        weight = next((p for p in self.parameters() if p.is_floating_point()), None)
        for name, t in ((qn, query), (kn, key), (vn, value)):
            if weight is not None and t.dtype != weight.dtype and not _autocasting(t):
                raise TypeError(
                    f"{name} is {t.dtype} but the module's weights are {weight.dtype}: cast one "
                    f"of them (module.to({t.dtype}) or {name}.to({weight.dtype}))"
                )
        if not (query.shape[0] == key.shape[0] == value.shape[0]):
            raise ValueError(
                f"batch size mismatch: query {tuple(query.shape)}, key {tuple(key.shape)}, "
                f"value {tuple(value.shape)} must share dim 0 (b)"
            )
        if key.shape[1] != value.shape[1]:
            raise ValueError(
                f"key and value must have the same length (dim 1); got key "
                f"{tuple(key.shape)}, value {tuple(value.shape)}"
            )

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Tensor | MaskFn | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        bias: Tensor | BiasFn | None = None,
        rope: QKTransform | None = None,
        cache: KVCache | None = None,
        value_residual: ValueResidual | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` to ``key``/``value``.

        Args:
            query: ``(b, i, e)``.
            key: ``(b, j, kdim)``; ``None`` (or ``query`` itself) means self-attention.
            value: ``(b, j, vdim)``; ``None`` means ``key``.
            mask: bool, ``True`` = may attend, broadcastable to ``(b, h, i, j)`` (for example
                ``attnkit.masks.padding_mask(lengths)`` of shape ``(b, 1, 1, j)``), or a mask
                function. With a cache, ``j`` counts the cached keys too.
            is_causal: causal self-attention, aligned bottom-right (see ``KVCache``).
            need_weights: also return the per-head weights ``(b, h, i, j)`` (before dropout);
                this runs the ``"math"`` backend when ``backend="auto"``.
            bias: additive score bias broadcastable to ``(b, h, i, j)``, or a bias function
                (relative positions, ALiBi).
            rope: a q/k transform such as ``attnkit.RotaryEmbedding``, applied to queries and
                new keys at positions ``cache.length ..`` (``0 ..`` without a cache).
            cache: a ``KVCache`` for incremental decoding. In self-attention the new keys and
                values are appended to it. In cross-attention (``key`` given) it holds the
                memory's projected keys and values: filled on the first call, reused on later
                calls (the memory itself is then only checked for its shape).
            value_residual: with ``variants.value_residual``, carries the first layer's values:
                layer 1 stores its new values there, later layers mix them into theirs (before
                the cache, so cached values are mixed ones). Stacks pass one per forward.

        Returns:
            ``(output (b, i, e), weights (b, h, i, j) or None)``.
        """
        self_attention = key is None or (key is query and (value is None or value is query))
        if key is None:
            if value is not None:
                raise ValueError("value was given without key; pass both or neither")
            key = query
        value = key if value is None else value
        if self_attention and not (self.kdim == self.vdim == self.embed_dim):
            raise ValueError(
                f"self-attention needs kdim == vdim == embed_dim; this module has kdim="
                f"{self.kdim}, vdim={self.vdim}, embed_dim={self.embed_dim}: pass key and value"
            )
        self._check_inputs(query, key, value)
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"cache must be an attnkit.KVCache, got {type(cache).__name__}")
        memory_cache = cache if cache is not None and not self_attention else None
        if memory_cache is not None and rope is not None:
            raise ValueError("rope cannot be combined with a cross-attention cache")
        if rope is not None and not callable(getattr(rope, "rotate", None)):
            raise TypeError(
                f"rope must have rotate(x, offset) (attnkit.RotaryEmbedding), got {rope!r}"
            )
        b, i, _ = query.shape
        j = key.shape[1]
        h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim

        if self_attention and self.in_proj is not None:
            q, k, v = self.in_proj(query).split([self.embed_dim, self.kv_dim, self.kv_dim], -1)
        elif memory_cache is not None and memory_cache.length > 0:
            q, k, v = self._project(query, 0), None, None  # keys/values come from the cache
        else:
            q, k, v = self._project(query, 0), self._project(key, 1), self._project(value, 2)
        q = q.view(b, i, h, d).transpose(1, 2)  # (b, h, i, d)
        if k is not None and v is not None:
            k = k.view(b, j, h_kv, d).transpose(1, 2)  # (b, h_kv, j, d)
            v = v.view(b, j, h_kv, d).transpose(1, 2)  # (b, h_kv, j, d)
        if self.q_norm is not None and self.k_norm is not None:  # qk-norm, before RoPE
            q = self._per_map(self.q_norm, q)
            k = None if k is None else self._per_map(self.k_norm, k)
        if self.variants.value_residual is not None and self_attention and v is not None:
            v = self._value_residual(v, value_residual)

        offset = 0 if cache is None or memory_cache is not None else cache.length
        if rope is not None:
            # RoFormer (Su et al. 2021): rotate q and k by their absolute positions, so their dot
            # product depends only on the relative offset. New keys sit at the queries' positions.
            q = self._per_map(lambda x: rope.rotate(x, offset), q)
            k = self._per_map(lambda x: rope.rotate(x, offset), k)
        if memory_cache is not None:
            k, v = self._memory_keys(memory_cache, k, v, key)  # (b, h_kv, j, d)
        elif cache is not None:
            k, v = cache.append(k, v)  # (b, h_kv, offset + j, d)
        assert k is not None and v is not None

        weights = None
        why = self._why_not_decode(q, k, v, mask, need_weights, bias, cache, memory_cache)
        if why is None:  # one new token over the cache, as stored
            key_mask = None if mask is None else decode.key_padding(mask, b, k.shape[2])  # (b, j)
            out = decode.decode_attention(q, k, v, k.shape[2], key_mask=key_mask)  # (b, h, 1, d)
        else:
            k, v = k.to(q.dtype), v.to(q.dtype)  # a bfloat16 cache, read by float32 math
            q, k, v = to_autocast(q, k, v)  # attention's autocast policy, for every subclass
            with no_autocast(q.device):
                out, weights = self._attend(
                    q, k, v, mask=mask, is_causal=is_causal, need_weights=need_weights, bias=bias
                )
        if self.gate is not None:
            out = self.gate(out, query)  # (b, h, i, d), gated by the layer input
        out = out.transpose(1, 2).reshape(b, i, self.embed_dim)  # (b, i, h * d)
        return self.out_proj(out), weights

    def _why_not_decode(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | MaskFn | None,
        need_weights: bool,
        bias: Tensor | BiasFn | None,
        cache: KVCache | None,
        memory_cache: KVCache | None,
    ) -> str | None:
        """Why this call does not take the compiled decode step (one query per head over a
        self-attention cache), or None. One new query: bottom-right causal changes nothing."""
        if cache is None or memory_cache is not None:
            return "no self-attention KV cache"
        if q.shape[2] != 1:
            return f"{q.shape[2]} new positions, not one"
        if need_weights or bias is not None:
            return "the weights or a bias were asked for"
        if self.training and self.dropout > 0.0:
            return "dropout is active"
        if type(self)._attend is not MultiHeadAttention._attend:
            return f"{type(self).__name__} computes attention its own way"
        if any(x is not None for x in (self.differential, self.sinks, self.variants.softcap)):
            return "an attention variant (differential, sinks or soft-capping)"
        if self.backend not in ("auto", "fused"):
            return f"backend={self.backend!r} was asked for"
        if autocast_dtype(q.device) is not None:
            return "autocast is on"
        if mask is not None and decode.key_padding(mask, q.shape[0], k.shape[2]) is None:
            return "a mask other than key padding (b, 1, 1, j)"
        return decode.why_not(q, k, v, loaded_only=True)  # no file read per token

    def _per_map(self, fn: Callable[[Tensor], Tensor], x: Tensor | None) -> Tensor | None:
        """``fn`` on each head of ``x (b, h, n, d)``, or on each half of a differential head."""
        if x is None or self.differential is None:
            return None if x is None else fn(x)
        return self.differential.per_half(fn, x)

    def _value_residual(self, v: Tensor, carrier: ValueResidual | None) -> Tensor:
        """Layer 1 stores its values ``v (b, h_kv, j, d)`` in the carrier; later layers return
        ``lambda_1 v + lambda_2 v_1`` (Zhou et al. 2024)."""
        if self.value_mix is None:
            if carrier is not None:
                carrier.first = v
            return v
        if carrier is None or carrier.first is None:
            raise ValueError(
                f"this attention is layer {self.variants.layer} with value_residual: pass "
                "value_residual=ValueResidual() that layer 1 has filled with its values"
            )
        return self.value_mix(v, carrier.first)

    @staticmethod
    def _memory_keys(
        cache: KVCache, k: Tensor | None, v: Tensor | None, key: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Cross-attention cache: store the memory's projected keys once, then reuse them."""
        if k is not None and v is not None:
            return cache.append(k, v)
        cached_k, cached_v = cache.key, cache.value
        assert cached_k is not None and cached_v is not None
        if key.shape[1] != cache.length or key.shape[0] != cached_k.shape[0]:
            raise ValueError(
                f"cross-attention cache holds a memory of (b, j) = "
                f"({cached_k.shape[0]}, {cache.length}) but key is {tuple(key.shape)}: a "
                "cross-attention cache belongs to one memory (call reset() for another)"
            )
        return cached_k, cached_v

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
        """Attention over heads: ``q (b, h, i, d)``, ``k, v (b, h_kv, j, d)`` -> ``(b, h, i, d)``.

        The one place the math is called; subclasses (relative positions) override it.
        Differential attention calls it twice (``attnkit.variants.DifferentialAttention``).
        """

        def attend(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor | None]:
            result = scaled_dot_product_attention(
                q,
                k,
                v,
                mask,
                bias=bias,
                is_causal=is_causal,
                dropout_p=self.dropout if self.training else 0.0,
                return_weights=need_weights,
                backend=self.backend,
                softcap=self.variants.softcap,
                sinks=self.sinks,
            )
            return result if isinstance(result, tuple) else (result, None)

        if self.differential is not None:
            return self.differential(attend, q, k, v)
        return attend(q, k, v)

    @classmethod
    def from_torch(
        cls, module: nn.MultiheadAttention, *, backend: str = "auto"
    ) -> MultiHeadAttention:
        """A ``MultiHeadAttention`` holding a copy of ``nn.MultiheadAttention``'s weights.

        Same dtype and device. The result is always batch-first ``(b, n, e)``, whatever the
        torch module's ``batch_first``. ``add_bias_kv`` and ``add_zero_attn`` are not supported.
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"expected nn.MultiheadAttention, got {type(module).__name__}")
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn have no attnkit equivalent")
        weight = module.out_proj.weight
        has_bias = module.out_proj.bias is not None
        new = cls(
            module.embed_dim,
            module.num_heads,
            kdim=module.kdim,
            vdim=module.vdim,
            bias=has_bias,
            dropout=module.dropout,
            backend=backend,
        ).to(dtype=weight.dtype, device=weight.device)
        e = module.embed_dim
        with torch.no_grad():
            if new.in_proj is not None:
                if module.in_proj_weight is not None:
                    new.in_proj.weight.copy_(module.in_proj_weight)
                else:  # torch keeps separate weights whenever kdim/vdim were passed
                    new.in_proj.weight.copy_(
                        torch.cat(
                            [module.q_proj_weight, module.k_proj_weight, module.v_proj_weight]
                        )
                    )
                if has_bias:
                    new.in_proj.bias.copy_(module.in_proj_bias)
            else:
                assert new.q_proj is not None and new.k_proj is not None
                assert new.v_proj is not None
                new.q_proj.weight.copy_(module.q_proj_weight)
                new.k_proj.weight.copy_(module.k_proj_weight)
                new.v_proj.weight.copy_(module.v_proj_weight)
                if has_bias:
                    qb, kb, vb = module.in_proj_bias.split([e, e, e])
                    new.q_proj.bias.copy_(qb)
                    new.k_proj.bias.copy_(kb)
                    new.v_proj.bias.copy_(vb)
            new.out_proj.weight.copy_(module.out_proj.weight)
            if has_bias:
                new.out_proj.bias.copy_(module.out_proj.bias)
        return new
