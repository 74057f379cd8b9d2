"""The KV cache of one attention layer: the keys and values already computed, for incremental
decoding (``MultiHeadAttention(..., cache=KVCache())``).

Shape vocabulary: ``b`` batch, ``h_kv`` key/value heads, ``n`` new positions, ``d`` head width.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.backends.fused import decode

__all__ = ["KVCache"]


class KVCache:
    """Keys and values already computed by *one* attention layer, for incremental decoding.

    Give each layer its own cache (a decoder keeps a list, one per block). On every call the layer
    projects only the new tokens, appends their keys/values here, and attends over everything
    cached. With ``is_causal=True`` the causal mask is aligned bottom-right, so the new queries
    (the last ``i`` positions) see every cached key and the new ones up to themselves::

        cached j=3, new i=2:   1 1 1 1 0
                               1 1 1 1 1

    Decoding token by token therefore gives the same outputs as one causal forward over the whole
    sequence. ``length`` is also the position offset of the next token (used for RoPE).

    Storage: ``key`` is ``(b, h_kv, j, d)``, ``value`` ``(b, h_kv, j, d)``. With ``max_len`` the
    storage is allocated once and filled in place (no re-copy per token); without it each append
    concatenates. The cache remembers ``b``, ``h_kv`` and ``d`` from its first append and refuses
    tensors of any other shape (a cache from another model or batch).

    ``kv_dtype``: how keys and values are stored: ``None`` (default) as they come (float32 for a
    float32 model); ``torch.float16`` or ``torch.bfloat16`` halves the cache and what each step
    reads, at that type's rounding of every cached key and value (float16 keeps 11 significant
    bits, bfloat16 8; queries, scores and softmax keep the model's dtype); ``torch.float32``.
    Attention reads the cache as stored (``attnkit.backends.fused.decode``).

    In cross-attention the same object holds the projected keys/values of the encoder's memory:
    the first call fills it, later calls reuse it instead of projecting the memory again.
    """

    def __init__(self, max_len: int | None = None, *, kv_dtype: torch.dtype | None = None) -> None:
        if max_len is not None and (
            not isinstance(max_len, int) or isinstance(max_len, bool) or max_len <= 0
        ):
            raise ValueError(f"max_len must be a positive int or None, got {max_len!r}")
        if kv_dtype is not None and kv_dtype not in decode.KV_DTYPES:
            raise ValueError(
                "kv_dtype must be torch.float32, torch.bfloat16 or torch.float16 (or None: the "
                f"dtype of the keys appended), got {kv_dtype!r}"
            )
        self.max_len = max_len
        self.kv_dtype = kv_dtype
        self.length = 0
        self._key: Tensor | None = None  # (b, h_kv, j_max, d) when preallocated
        self._value: Tensor | None = None

    @property
    def key(self) -> Tensor | None:
        return None if self._key is None else self._key[:, :, : self.length]

    @property
    def value(self) -> Tensor | None:
        return None if self._value is None else self._value[:, :, : self.length]

    def __len__(self) -> int:
        return self.length

    def reset(self) -> None:
        """Forget every cached position (keeps nothing, so the next append may change shape)."""
        self.length = 0
        self._key = self._value = None

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``(b, h_kv, n, d)`` keys/values; return all cached keys/values so far."""
        for name, t in (("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"KVCache.append takes tensors; {name} is {type(t).__name__}")
        if key.ndim != 4 or value.ndim != 4 or key.shape[:3] != value.shape[:3]:
            raise ValueError(
                f"KVCache.append takes key and value of shape (b, h_kv, n, d) with matching "
                f"(b, h_kv, n); got key {tuple(key.shape)}, value {tuple(value.shape)}"
            )
        if self.kv_dtype is not None:
            key, value = key.to(self.kv_dtype), value.to(self.kv_dtype)
        n = key.shape[2]
        if self._key is not None:
            assert self._value is not None
            want_k = (self._key.shape[0], self._key.shape[1], self._key.shape[3])
            want_v = (self._value.shape[0], self._value.shape[1], self._value.shape[3])
            got_k = (key.shape[0], key.shape[1], key.shape[3])
            got_v = (value.shape[0], value.shape[1], value.shape[3])
            if want_k != got_k or want_v != got_v:
                raise ValueError(
                    f"cache holds keys (b, h_kv, d) = {want_k} and values {want_v} but this "
                    f"call produces keys {got_k} and values {got_v}: the cache comes from "
                    "another layer, model or batch (call reset() or make a new KVCache)"
                )
            if self._key.dtype != key.dtype or self._key.device != key.device:
                raise ValueError(
                    f"cache holds {self._key.dtype} on {self._key.device}, this call gives "
                    f"{key.dtype} on {key.device}"
                )
        if self.max_len is not None:
            if self.length + n > self.max_len:
                raise ValueError(
                    f"KVCache is full: {self.length} cached + {n} new > max_len={self.max_len}"
                )
            if self._key is None:
                b, h_kv, _, d = key.shape
                self._key = key.new_empty(b, h_kv, self.max_len, d)
                self._value = value.new_empty(b, h_kv, self.max_len, value.shape[3])
            assert self._value is not None
            self._key[:, :, self.length : self.length + n] = key
            self._value[:, :, self.length : self.length + n] = value
        elif self._key is None:
            self._key, self._value = key, value
        else:
            assert self._value is not None
            self._key = torch.cat([self._key, key], dim=2)  # (b, h_kv, j + n, d)
            self._value = torch.cat([self._value, value], dim=2)
        self.length += n
        k, v = self.key, self.value
        assert k is not None and v is not None
        return k, v
