"""Backend "chunked": exact attention a block of queries at a time, with bounded memory.

The simplest memory fix (Rabe & Staats 2021, arXiv:2112.05682, their query chunking): scores are
``(..., h, i, j)``, but each query row's softmax needs only its own row, so cutting the queries
into chunks of ``c`` rows and running the reference math on each bounds the score memory at
``(..., h, c, j)`` instead of ``(..., h, i, j)``. The result is exactly the reference's.

The chunk size is chosen so one chunk's scores hold at most ``BUDGET`` elements (default 2^24,
64 MB in float32). Under autograd each chunk is checkpointed (its scores are recomputed in
backward), so training memory stays bounded too. Mask and bias functions are evaluated for one
chunk at a time. Not supported: ``dropout_p > 0`` (the reference draws one random tensor for
the whole score matrix) and ``return_weights`` (the weights are what chunking avoids keeping).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from attnkit.functional import attention_math, nested_why_not
from attnkit.masks import causal_offset
from attnkit.registry import AttentionCall, register_backend

__all__ = ["BUDGET", "chunked_attention"]

BUDGET = 1 << 24  # score elements per chunk


def why_not(call: AttentionCall) -> str | None:
    if call.query.is_nested:
        return nested_why_not(call)
    if call.return_weights:
        return "return_weights=True: chunked attention does not keep the full weights"
    if call.return_lse:
        return "return_lse=True: chunked attention does not return the log-sum-exp"
    if call.dropout_p > 0.0:
        return f"dropout_p={call.dropout_p}: chunked attention does not implement dropout"
    # It runs the reference per chunk of queries, whose positions a score_mod would misread.
    reason = call.modification.unserved(("softcap", "bias", "bias_fn"), "chunked attention")
    if reason is not None:
        return reason
    return None


def _shifted(fn, i0: int):
    """A mask/bias function of chunk-local query positions, from one of global positions."""
    return lambda b, h, i, j: fn(b, h, i + i0, j)


def _rows(t: Tensor | None, i0: int, i1: int) -> Tensor | None:
    """Rows ``i0:i1`` of a tensor broadcastable to ``(..., i, j)`` (a broadcast row stays)."""
    if t is None or callable(t) or t.ndim < 2 or t.shape[-2] == 1:
        return t
    return t[..., i0:i1, :]


def chunked_attention(call: AttentionCall, chunk_size: int | None = None) -> Tensor:
    """The reference math over chunks of ``chunk_size`` queries (default: from ``BUDGET``)."""
    ni, nj = call.n_queries, call.n_keys
    if chunk_size is None:
        per_row = max(1, call.query[..., :1, :1].numel() * nj)  # score elements per query row
        chunk_size = max(1, BUDGET // per_row)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad
        for t in (call.query, call.key, call.value, call.bias)
        if isinstance(t, Tensor)
    )
    device = call.query.device
    if ni == 0:  # no query rows: the reference's empty result
        return attention_math(call)[0]
    outs = []
    for i0 in range(0, ni, chunk_size):
        i1 = min(ni, i0 + chunk_size)
        mask = _shifted(call.mask, i0) if callable(call.mask) else _rows(call.mask, i0, i1)
        if call.is_causal:  # bottom-right over the whole call: query i0 + r sees k <= i0 + r + off
            off = i0 + causal_offset(ni, nj)
            if callable(mask):
                mask = _and_causal(mask, off)
            else:
                i = torch.arange(i1 - i0, device=device).view(-1, 1) + off  # (c, 1)
                causal = torch.arange(nj, device=device).view(1, -1) <= i  # (c, j)
                mask = causal if mask is None else mask & causal
        bias = _shifted(call.bias, i0) if callable(call.bias) else _rows(call.bias, i0, i1)
        sub = replace(call, query=call.query[..., i0:i1, :], mask=mask, bias=bias, is_causal=False)
        if needs_grad and ni > chunk_size:
            bias_t = bias if isinstance(bias, Tensor) else None
            outs.append(
                checkpoint(_chunk, sub, sub.query, sub.key, sub.value, bias_t, use_reentrant=False)
            )
        else:
            outs.append(attention_math(sub)[0])
    return torch.cat(outs, dim=-2)


def _chunk(call: AttentionCall, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
    sub = replace(call, query=q, key=k, value=v, bias=bias if bias is not None else call.bias)
    return attention_math(sub)[0]


def _and_causal(fn, offset: int):
    return lambda b, h, i, j: fn(b, h, i, j) & (j <= i + offset)


def run(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    return chunked_attention(call), None


register_backend(
    "chunked",
    run,
    why_not,
    description="exact reference math over query chunks: memory bounded by a score budget",
)
