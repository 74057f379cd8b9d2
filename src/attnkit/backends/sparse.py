"""Backend "sparse": attention restricted to a sparse layout, costing what the layout keeps.

Sparse Transformers (Child et al. 2019, arXiv:1904.10509) and Longformer (Beltagy et al. 2020,
arXiv:2004.05150) restrict each query to a few keys: a sliding window, a dilated or strided set
of blocks. The cost should grow with the kept blocks, not with ``n^2``. Here a layout is a mask
*function* that declares its structure (``attnkit.masks.Structure``): for each block of
queries it lists the key ranges it keeps. The backend visits only those ranges, gathering the
kept K/V blocks of a query block into one group (one matmul instead of many small ones), and
runs the tiled engine on them (``attnkit.backends.tiled``: online softmax, recomputing
backward), so the result is *exact* attention under the layout's mask: it equals the reference
given ``masks.materialize(layout, ...)``.

Layouts (block size ``block`` positions; ``i``/``j`` absolute positions)::

    masks.window_fn(left, right)  key k visible from q when -right <= q - k <= left
    block_sparse(layout, block)   q sees k when layout[q // block, k // block] (any bool matrix)
    dilated_layout(...)           block I sees blocks I, I - dilation, I - 2 dilation, ...
    strided_layout(...)           block I sees the `local` previous blocks and every
                                  `stride`-th block before them (Child et al. 2019, sec. 4.2)

``is_causal`` and any other mask combine with the layout (both apply).

``topk_attention`` is different: each query keeps its ``top_k`` largest scores and renormalises
over them (Gupta et al. 2021, arXiv:2106.06899). It is an *approximation* of softmax attention
(exact only when the dropped weights are zero), so it is a function of its own, not a backend.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit._numerics import attention_op, blocked, compute_dtype
from attnkit.backends.tiled import run_call
from attnkit.backends.tiled import why_not as tiled_why_not
from attnkit.functional import make_call
from attnkit.masks import MaskFn, Structure, causal_offset, exactly, pad_to_rank, structure_of
from attnkit.registry import AttentionCall, register_backend

__all__ = [
    "block_sparse",
    "dilated_layout",
    "strided_layout",
    "topk_attention",
]

WINDOW_BLOCK = 128  # tile size for windows and other layouts that declare none


def dilated_layout(n_blocks: int, window: int, dilation: int) -> Tensor:
    """Bool ``(n_blocks, n_blocks)``: block ``I`` sees ``I - t * dilation`` for ``t < window``."""
    if window < 1 or dilation < 1:
        raise ValueError(f"window and dilation must be >= 1, got {window}, {dilation}")
    I = torch.arange(n_blocks).unsqueeze(1)  # (I, 1)
    J = torch.arange(n_blocks).unsqueeze(0)  # (1, J)
    back = I - J
    return (back >= 0) & (back % dilation == 0) & (back < window * dilation)


def strided_layout(n_blocks: int, local: int, stride: int) -> Tensor:
    """Bool ``(n_blocks, n_blocks)``: the ``local`` latest blocks and every ``stride``-th one."""
    if local < 1 or stride < 1:
        raise ValueError(f"local and stride must be >= 1, got {local}, {stride}")
    I = torch.arange(n_blocks).unsqueeze(1)  # (I, 1)
    J = torch.arange(n_blocks).unsqueeze(0)  # (1, J)
    back = I - J
    return (back >= 0) & ((back < local) | (back % stride == 0))


def block_sparse(layout: Tensor, block: int) -> MaskFn:
    """A mask function from a bool block layout ``(n_query_blocks, n_key_blocks)``.

    Query ``q`` may attend key ``k`` when ``layout[q // block, k // block]``. Positions beyond the
    layout are blocked. Combine with ``is_causal=True`` for causal layouts within blocks.
    """
    if layout.dtype != torch.bool or layout.ndim != 2:
        raise ValueError(
            f"layout must be a 2-D bool tensor (query blocks, key blocks), got dtype "
            f"{layout.dtype} and shape {tuple(layout.shape)}"
        )
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    nqb, nkb = layout.shape
    padded = torch.nn.functional.pad(layout, (0, 1, 0, 1))  # out-of-range index -> False

    def mask(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        I = (i // block).clamp(0, nqb)  # beyond the layout -> the padding row
        J = (j // block).clamp(0, nkb)
        return padded.to(i.device)[I, J]

    return exactly(mask, Structure(layout=layout.cpu(), block=block))


def why_not(call: AttentionCall) -> str | None:
    reason = tiled_why_not(call)
    if reason is not None:
        return reason
    if not (callable(call.mask) and structure_of(call.mask).skips):
        return (
            "the sparse backend needs a mask function that declares its layout (masks.window_fn, "
            "block_sparse or one declared with masks.declare); "
            "use backend='tiled' for other masks"
        )
    return None


def run(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    block = structure_of(call.mask).block or WINDOW_BLOCK
    block_q, block_k = call.block_sizes or (block, block)
    return run_call(call, block_q=block_q, block_k=block_k, gather=True)


register_backend(
    "sparse",
    run,
    why_not,
    description="exact attention over a declared sparse layout: cost grows with kept blocks",
)


@attention_op
def topk_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    top_k: int,
    *,
    mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    chunk_size: int = 256,
) -> Tensor:
    """Each query attends only its ``top_k`` highest-scoring visible keys (an approximation).

    Shapes as ``scaled_dot_product_attention`` for 4-D inputs: ``query (b, h, i, d)``,
    ``key (b, h_kv, j, d)``, ``value (b, h_kv, j, dv)``; ``mask`` bool broadcastable to
    ``(b, h, i, j)``; ``is_causal`` bottom-right. Equals softmax attention under the mask that
    keeps, for each row, its ``top_k`` largest visible scores. Scores are computed ``chunk_size``
    query rows at a time, so memory is O(chunk_size * j); differentiable.
    """
    make_call(query, key, value, mask, is_causal=is_causal, scale=scale)  # checked as sdpa's
    if callable(mask):
        raise TypeError("topk_attention takes a bool mask tensor, not a mask function")
    if query.ndim != 4:
        raise ValueError(f"topk_attention needs 4-D (b, h, i, d) inputs, got {tuple(query.shape)}")
    for name, n in (("top_k", top_k), ("chunk_size", chunk_size)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    b, h, ni, _ = query.shape
    if ni == 0 or key.shape[2] == 0:  # no row, or rows that see no key: zeros, as every backend
        return query.new_zeros(b, h, ni, value.shape[-1])
    nj, dv = key.shape[2], value.shape[-1]
    g = h // key.shape[1]
    k_eff = min(top_k, nj)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    compute = compute_dtype(query.dtype)
    floor = blocked(compute)
    k = key.to(compute).repeat_interleave(g, dim=1) if g > 1 else key.to(compute)  # (b, h, j, d)
    v = value.to(compute).repeat_interleave(g, dim=1) if g > 1 else value.to(compute)
    v_flat = v.reshape(b * h * nj, dv)  # (b * h * j, dv): one row per (batch, head, key)
    base = (torch.arange(b * h, device=query.device) * nj).view(b, h, 1, 1)  # v_flat's first rows
    outs = []
    for i0 in range(0, ni, chunk_size):
        i1 = min(ni, i0 + chunk_size)
        s = query[:, :, i0:i1].to(compute) @ k.transpose(-2, -1) * scale  # (b, h, c, j)
        allowed = None
        if mask is not None:
            m = pad_to_rank(mask, 4)
            allowed = m[:, :, i0:i1] if m.shape[2] != 1 else m
        if is_causal:
            i = torch.arange(i0, i1, device=query.device).view(-1, 1) + causal_offset(ni, nj)
            causal = torch.arange(nj, device=query.device).view(1, -1) <= i  # (c, j)
            allowed = causal if allowed is None else allowed & causal
        if allowed is not None:
            s = s.masked_fill(~allowed, floor)
        vals, idx = s.topk(k_eff, dim=-1)  # (b, h, c, k)
        visible = vals > floor
        m = vals.amax(dim=-1, keepdim=True)
        w = torch.exp(vals - m) * visible  # blocked entries (fewer than k visible) weigh 0
        w = w / w.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(compute).tiny)
        picked = v_flat[(idx + base).flatten()].view(*idx.shape, dv)  # (b, h, c, k, dv)
        # a blocked key's value weighs 0 and is left out: a NaN there must not reach the row
        picked = picked.masked_fill(~visible.unsqueeze(-1), 0.0)
        outs.append((w.unsqueeze(-2) @ picked).squeeze(-2))  # (b, h, c, dv)
    return torch.cat(outs, dim=2).to(query.dtype)
