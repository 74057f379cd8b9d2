"""The Llama forward pass over a paged KV cache, for a batch of sequences of different lengths.

Shape vocabulary: ``b`` sequences, ``t`` new tokens of all sequences packed one after the other,
``e`` embed_dim, ``h`` query heads, ``h_kv`` key/value heads, ``d`` head width, ``V``
vocabulary.

``LlamaModel.forward`` pads a batch to a rectangle and keeps one ``KVCache`` tensor per layer.
A server's batch is ragged instead: one sequence brings a chunk of 200 prompt tokens, fifteen
others one token each. So the new tokens are packed into one ``(t, e)`` matrix: every
projection and feed-forward is one matmul over all of them (they act position by position), and
only attention needs to know which token belongs to which sequence (``paged_attention``, through
the block tables). The model's own modules run here, called as modules (``layer(x)``), so a
model whose projections are quantised runs unchanged::

    x = embed(ids)                                    (t, e)
    per block:  q, k, v = in_proj(attn_norm(x))       RoPE at each token's own position
                pool[slots] = k, v                    the new keys join the cache first
                x = x + out_proj(attention(q, pool))  causal, per sequence
                x = x + ffn(ffn_norm(x))
    logits = output(norm(x[last token of each sequence]))

That loop is the reference. When the model's weights are kept quantised and this process has
loaded the fused kernel, the whole step is one compiled call instead
(``attnkit.models.llama_step.paged_step``: the same loop in C++, every token's products at
once, the pools written at the slots); ``llama_step.why_not_paged`` says why a step takes the
modules. ``ATTENTION`` is the seam where a paged-attention kernel plugs into the module loop:
any function with ``paged_attention``'s signature (setting it, or passing ``attention``, keeps
the module loop). While it is the reference, a step takes the compiled attention
(``attnkit.backends.fused.paged``) instead when the kernel is loaded and can serve the step
(CPU, float32 queries, a float32, bfloat16 or float16 pool); asking costs no file read, and
nothing is ever compiled on a step. ``use_fused_kernel`` loads the kernel at a server's start:
the cached build, or a build then when asked to (about a minute, once per machine).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit._numerics import compute_dtype
from attnkit.backends.fused import jit
from attnkit.backends.fused import paged as fused_paged
from attnkit.models import llama_step
from attnkit.models.llama import LlamaModel
from attnkit.positional import RotaryEmbedding
from attnkit.serve.paged import BlockPool, paged_attention, write_kv

__all__ = ["ATTENTION", "PagedBatch", "paged_forward", "use_fused_kernel"]

ATTENTION: Callable[..., Tensor] = paged_attention


def use_fused_kernel(build: bool = False) -> str | None:
    """Load the compiled paged kernel for the steps to come: the verified cached build, or with
    ``build`` a build now if none is cached (an explicit request, at a server's start). Returns
    why the steps will take the reference instead, in a sentence, or None."""
    if build:
        try:
            jit.build()
        except jit.NotBuilt as reason:
            return str(reason)
        return None
    return None if jit.is_built() else jit.unavailable()


def _attention_for(q: Tensor, pool: BlockPool) -> Callable[..., Tensor]:
    """``ATTENTION``, or the compiled kernel where ``ATTENTION`` is the reference and the kernel
    is loaded and can serve ``q`` over ``pool`` (checked once per step, reading no file)."""
    if ATTENTION is not paged_attention:
        return ATTENTION
    if fused_paged.why_not(q, pool.keys[0], pool.values[0], loaded_only=True) is not None:
        return ATTENTION
    return fused_paged.paged_attention


@dataclass(frozen=True)
class PagedBatch:
    """One step's new tokens, packed: sequence ``n`` owns ``query_lengths[n]`` consecutive rows.

    ``ids``, ``positions`` (each token's position in its sequence) and ``slots`` (where its keys
    go in the pool, ``block * s + offset``) are ``(t,)``; ``block_tables`` ``(b, m)`` and
    ``lengths`` ``(b,)`` (keys after this step) as ``paged_attention`` takes them.
    """

    ids: Tensor
    positions: Tensor
    slots: Tensor
    block_tables: Tensor
    lengths: Tensor
    query_lengths: Sequence[int]

    @classmethod
    def build(
        cls,
        tokens: Sequence[Sequence[int]],
        starts: Sequence[int],
        tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str | None = None,
    ) -> PagedBatch:
        """From each sequence's new ``tokens``, the position of its first (``starts``: keys
        already cached) and its block table (long enough for the new tokens)."""
        ids, positions, slots = [], [], []
        for new, start, table in zip(tokens, starts, tables, strict=True):
            for p, token in enumerate(new, start):
                ids.append(token)
                positions.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
        m = max(len(table) for table in tables)
        padded = [list(table) + [0] * (m - len(table)) for table in tables]  # 0: masked anyway

        def long(x: object) -> Tensor:
            return torch.tensor(x, dtype=torch.long, device=device)

        return cls(
            ids=long(ids),
            positions=long(positions),
            slots=long(slots),
            block_tables=long(padded),
            lengths=long([s + len(n) for s, n in zip(starts, tokens, strict=True)]),
            query_lengths=[len(n) for n in tokens],
        )


def paged_forward(
    model: LlamaModel,
    batch: PagedBatch,
    pool: BlockPool,
    *,
    all_logits: bool = False,
    attention: Callable[..., Tensor] | None = None,
) -> Tensor:
    """Logits ``(b, V)`` of each sequence's last new token (``(t, V)`` of every token with
    ``all_logits``); the new keys and values are written into ``pool`` on the way."""
    if (
        attention is None
        and ATTENTION is paged_attention
        and llama_step.why_not_paged(model, pool.keys, pool.values) is None
    ):
        return _compiled(model, batch, pool, all_logits)
    attend = attention
    c = model.config
    t = batch.ids.shape[0]
    e, h, h_kv, d = c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim
    x = model.embed(batch.ids)  # (t, e)
    # The angles of every token's own position, cast once as LlamaModel.angles does.
    dtype = compute_dtype(x.dtype)
    cos, sin = model.rope.cos_sin_at(batch.positions, device=x.device)  # (t, d)
    cos, sin = cos.to(dtype)[:, None], sin.to(dtype)[:, None]  # (t, 1, d): every head
    for layer, block in enumerate(model.blocks):
        attn = block.attn
        assert attn.in_proj is not None  # self-attention: the fused [q; k; v] projection
        q, k, v = attn.in_proj(block.attn_norm(x)).split([e, h_kv * d, h_kv * d], dim=-1)
        q = RotaryEmbedding.apply(q.view(t, h, d), cos, sin)  # (t, h, d)
        k = RotaryEmbedding.apply(k.view(t, h_kv, d), cos, sin)  # (t, h_kv, d)
        write_kv(pool.keys[layer], pool.values[layer], batch.slots, k, v.view(t, h_kv, d))
        if attend is None:
            attend = _attention_for(q, pool)
        out = attend(
            q,
            pool.keys[layer],
            pool.values[layer],
            batch.block_tables,
            batch.lengths,
            batch.query_lengths,
        )  # (t, h, d)
        x = x + attn.out_proj(out.reshape(t, e))  # (t, e)
        x = x + block.ffn(block.ffn_norm(x))
    if not all_logits:
        last = torch.tensor(batch.query_lengths, device=x.device).cumsum(0) - 1  # (b,)
        x = x.index_select(0, last)  # (b, e)
    x = model.norm(x)
    if model.lm_head is not None:
        return model.lm_head(x)  # (b, V)
    return F.linear(x, model.embed.weight)  # (b, V): tied to the token embedding


def _compiled(model: LlamaModel, batch: PagedBatch, pool: BlockPool, all_logits: bool) -> Tensor:
    """``paged_forward`` as compiled calls (``llama_step.paged_step``): one, or one per piece
    of at most ``step_rows`` packed tokens. The kernel's products take the same bits for any
    number of rows up to there, and its attention for any split of a sequence's tokens, so a
    step of more tokens computed piece by piece gives every token what it gets alone, in a
    prefill chunk of any size or beside other sequences (a greedy request's tokens do not
    depend on its company)."""
    kernel = jit.loaded()
    assert kernel is not None
    most = kernel.step_rows()
    ends = torch.tensor(batch.query_lengths, dtype=torch.long).cumsum(0)  # (b,)
    starts = ends - torch.tensor(batch.query_lengths, dtype=torch.long)  # (b,)
    t = batch.ids.shape[0]
    out = []
    for lo in range(0, t, most):
        hi = min(t, lo + most)
        seqs = ((starts < hi) & (ends > lo)).nonzero().flatten()  # those with tokens here
        if seqs.numel() == 0:  # only sequences without new tokens: nothing to compute
            continue
        first = starts[seqs].clamp_min(lo)
        last = ends[seqs].clamp_max(hi)  # each sequence's tokens here: [first, last)
        piece_ends = (last - first).cumsum(0)
        # every row, or the last of each sequence whose last token is in this piece
        rows = torch.arange(hi - lo) if all_logits else piece_ends[ends[seqs] <= hi] - 1
        wanted = rows.numel()
        if wanted == 0:  # a piece inside one prompt: its keys only (the kernel wants a row)
            rows = piece_ends[-1:] - 1
        logits = llama_step.paged_step(
            model,
            batch.ids[lo:hi],
            batch.positions[lo:hi],
            batch.slots[lo:hi],
            batch.block_tables[seqs],
            batch.lengths[seqs] - (ends[seqs] - last),  # keys after this piece
            torch.cat([piece_ends.new_zeros(1), piece_ends]),
            rows,
            pool.keys,
            pool.values,
        )
        out.append(logits[:wanted])
    if not out:
        return torch.empty(0, model.config.vocab_size)
    return out[0] if len(out) == 1 else torch.cat(out)
