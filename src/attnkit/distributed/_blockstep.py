"""TEMPORARY stand-in for the tiled backend's block step, until branch `efficient` lands.

Dense math, one block at a time; replaced by ``attnkit.backends.tiled``'s functions on merge.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.masks import BiasFn, MaskFn


def _scores(q, k, scale, mask_fn, bias_fn, q_offset, k_offset):
    acc = torch.promote_types(q.dtype, torch.float32)
    s = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * scale  # (b, h, i, j)
    b, h, i, j = s.shape
    ib = torch.arange(b, device=q.device).view(b, 1, 1, 1)
    ih = torch.arange(h, device=q.device).view(1, h, 1, 1)
    ii = torch.arange(i, device=q.device).view(1, 1, i, 1) + q_offset
    ij = torch.arange(j, device=q.device).view(1, 1, 1, j) + k_offset
    if bias_fn is not None:
        s = s + bias_fn(ib, ih, ii, ij).to(acc)
    keep = None
    if mask_fn is not None:
        keep = mask_fn(ib, ih, ii, ij).expand(s.shape)
        s = s.masked_fill(~keep, float("-inf"))
    return s, keep


def forward_blocks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    mask_fn: MaskFn | None = None,
    bias_fn: BiasFn | None = None,
    q_offset: int = 0,
    k_offset: int = 0,
) -> tuple[Tensor, Tensor]:
    s, _ = _scores(q, k, scale, mask_fn, bias_fn, q_offset, k_offset)
    lse = torch.logsumexp(s, dim=-1)  # (b, h, i)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))
    out = p @ v.to(s.dtype)
    return out, lse


def merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    lse = torch.logaddexp(lse_a, lse_b)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)
    wa = torch.exp(lse_a - safe).unsqueeze(-1)
    wb = torch.exp(lse_b - safe).unsqueeze(-1)
    return out_a * wa + out_b * wb, lse


def backward_blocks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    *,
    scale: float,
    mask_fn: MaskFn | None = None,
    bias_fn: BiasFn | None = None,
    q_offset: int = 0,
    k_offset: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    s, _ = _scores(q, k, scale, mask_fn, bias_fn, q_offset, k_offset)
    acc = s.dtype
    lse_safe = lse.to(acc).masked_fill(torch.isinf(lse), float("inf"))
    p = torch.exp(s - lse_safe.unsqueeze(-1))  # (b, h, i, j), zero where masked
    do = grad_out.to(acc)
    delta = (do * out.to(acc)).sum(-1, keepdim=True)  # (b, h, i, 1)
    dv = p.transpose(-2, -1) @ do
    dp = do @ v.to(acc).transpose(-2, -1)
    ds = p * (dp - delta) * scale
    dq = ds @ k.to(acc)
    dk = ds.transpose(-2, -1) @ q.to(acc)
    return dq, dk, dv
