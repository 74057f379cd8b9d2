"""One decoding step of attention over a KV cache: ``decode_attention``, the compiled
flash-decoding kernel (``decode.cpp``) and its reference.

Shape vocabulary: ``b`` batch, ``h`` query heads, ``h_kv`` key/value heads (dividing ``h``),
``L`` positions the cache has room for, ``j`` = ``length`` positions it holds, ``d`` head width.

A decoder's step attends from one new query per head to every cached key, equivalent to::

    k, v = key[:, :, :length], value[:, :, :length]             # (b, h_kv, j, d)
    scores = q @ k.repeat_interleave(h // h_kv, 1).mT * scale    # (b, h, 1, j)
    scores = scores.masked_fill(~key_mask[:, None, None, :], blocked)
    out = softmax(scores, -1) @ v.repeat_interleave(h // h_kv, 1)   # (b, h, 1, d)

(a fully masked row gives zeros; ``decode_reference`` is that math, through
``attnkit.functional``'s reference backend). With one query there is no matrix product to
speed up: the step reads the whole cache once and does two multiply-adds per value read. The
kernel (flash-decoding, Dao, Haziza, Massa and Sizov 2023) therefore splits the keys into
chunks so that one sequence with a few key heads keeps every thread busy, serves all
``h // h_kv`` query heads of a key head in one task (each cached row is read once per group,
not once per query head), merges the chunks' softmax states, and reads a bfloat16 or float16
cache as stored, widening it to float32 in registers.

The kernel runs only when it is already built (``jit.is_built()``: nothing is compiled here),
for float32 queries on the CPU, float32, bfloat16 or float16 caches and no gradient; otherwise
``decode_attention`` computes the reference, and ``why_not`` says why in a sentence.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit.backends.fused import jit
from attnkit.functional import scaled_dot_product_attention

__all__ = ["KV_DTYPES", "decode_attention", "decode_reference", "key_padding", "why_not"]

KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the cache dtypes the kernel reads


def _check(q: Tensor, key: Tensor, value: Tensor, length: int, key_mask: Tensor | None) -> None:
    if not all(isinstance(t, Tensor) for t in (q, key, value)):
        raise TypeError("decode_attention: q, key and value must be torch.Tensors")
    if q.ndim != 4 or q.shape[2] != 1:
        raise ValueError(
            f"decode_attention: q must be (b, h, 1, d) (one new position), got {tuple(q.shape)}"
        )
    b, h, _, d = q.shape
    if key.ndim != 4 or key.shape != value.shape:
        raise ValueError(
            f"decode_attention: key and value must be (b, h_kv, L, d) of one shape, got key "
            f"{tuple(key.shape)}, value {tuple(value.shape)}"
        )
    h_kv = key.shape[1]
    if key.shape[0] != b or key.shape[3] != d or h % h_kv != 0:
        raise ValueError(
            f"decode_attention: q (b, h, 1, d) = {tuple(q.shape)} needs key (b, h_kv, L, d) with "
            f"b = {b}, d = {d} and h_kv dividing h = {h}, got {tuple(key.shape)}"
        )
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= key.shape[2]:
        raise ValueError(
            f"decode_attention: length must be an int in [0, L = {key.shape[2]}] (the cached "
            f"positions), got {length!r}"
        )
    if key_mask is not None and (
        not isinstance(key_mask, Tensor)
        or key_mask.dtype != torch.bool
        or tuple(key_mask.shape) != (b, length)
    ):
        raise ValueError(
            f"decode_attention: key_mask must be a bool (b, length) = ({b}, {length}) tensor, "
            f"True where a key exists, got {getattr(key_mask, 'dtype', type(key_mask))} "
            f"{tuple(getattr(key_mask, 'shape', ()))}"
        )


def key_padding(mask: object, b: int, j: int) -> Tensor | None:
    """The ``key_mask (b, j)`` a bool mask of shape ``(b or 1, 1, 1, j)`` says (which keys
    exist, the same for every head and query), or None for any other mask."""
    if not (
        isinstance(mask, Tensor)
        and mask.dtype == torch.bool
        and mask.ndim == 4
        and mask.shape[1] == mask.shape[2] == 1
        and mask.shape[0] in (1, b)
        and mask.shape[3] == j
    ):
        return None
    return mask[:, 0, 0, :].expand(b, j)  # (b, j)


def why_not(q: Tensor, key: Tensor, value: Tensor, *, loaded_only: bool = False) -> str | None:
    """Why the kernel cannot serve this step, in a sentence, or None (never compiles).

    ``loaded_only``: count the kernel only if this process has loaded it already
    (``jit.loaded``), reading no file: the layer asks once per token and layer, where
    ``jit.unavailable`` (which hashes the sources to find the build) would cost more than the
    step itself."""
    if not (q.is_cpu and key.is_cpu and value.is_cpu):
        return "the decode kernel runs on the CPU only"
    if q.dtype != torch.float32:
        return f"the decode kernel takes float32 queries, got {q.dtype}"
    if key.dtype not in KV_DTYPES or value.dtype != key.dtype:
        return (
            "the decode kernel reads float32, bfloat16 or float16 caches, got "
            f"{key.dtype}/{value.dtype}"
        )
    if q.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        return "the decode kernel reads q, keys and values contiguous in d"
    if torch.is_grad_enabled() and (q.requires_grad or key.requires_grad or value.requires_grad):
        return "the decode kernel has no backward (a tensor requires grad)"
    if jit.loaded() is not None:
        return None
    if loaded_only:
        return "the fused kernel is not loaded in this process (it loads once built)"
    return jit.unavailable()


def decode_reference(
    q: Tensor,
    key: Tensor,
    value: Tensor,
    length: int,
    *,
    scale: float | None = None,
    key_mask: Tensor | None = None,
) -> Tensor:
    """The step as the reference math computes it (``attnkit.functional``, backend "math"), in
    ``q``'s dtype (float64 for checking); same arguments as ``decode_attention``."""
    _check(q, key, value, length, key_mask)
    k = key[:, :, :length].to(q.dtype)  # (b, h_kv, j, d)
    v = value[:, :, :length].to(q.dtype)
    mask = None if key_mask is None else key_mask[:, None, None, :]  # (b, 1, 1, j)
    out = scaled_dot_product_attention(q, k, v, mask, scale=scale, backend="math")
    assert isinstance(out, Tensor)
    return out


def decode_attention(
    q: Tensor,
    key: Tensor,
    value: Tensor,
    length: int,
    *,
    scale: float | None = None,
    key_mask: Tensor | None = None,
) -> Tensor:
    """Attention of one new query per head over the first ``length`` positions of a KV cache.

    Args:
        q: ``(b, h, 1, d)``, the layout ``MultiHeadAttention`` hands its backends.
        key, value: ``(b, h_kv, L, d)`` with ``L >= length``: a cache's storage (its first
            ``length`` positions are read) or any view of it contiguous in ``d``; float32 or
            bfloat16 (read as stored).
        length: how many cached positions to attend over.
        scale: multiplies ``q @ k^T``; ``None`` means ``1 / sqrt(d)``.
        key_mask: bool ``(b, length)``, ``True`` = the key exists (left-padded batches);
            ``None``: every key exists. A row without keys gives zeros.

    Returns:
        ``(b, h, 1, d)`` in ``q``'s dtype: the kernel's result when it can serve the call
        (``why_not``), else ``decode_reference``'s.
    """
    _check(q, key, value, length, key_mask)
    if why_not(q, key, value) is not None:
        return decode_reference(q, key, value, length, scale=scale, key_mask=key_mask)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out = torch.empty(q.shape, dtype=q.dtype)  # (b, h, 1, d), float32 on the CPU
    kernel = jit.loaded() or jit.load()  # loaded by why_not when it said None
    kernel.decode(q, key, value, length, scale, key_mask, out)
    return out
