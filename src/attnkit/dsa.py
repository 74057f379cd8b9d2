"""DeepSeek sparse attention, DSA (DeepSeek-V3.2-Exp, "DeepSeek-V3.2: Pushing the Frontier of
Open Large Language Models", 2025, section 2.1): a small *lightning indexer* picks ``top_k`` keys
per query, and MLA attends over those keys only.

Shape vocabulary (used in every comment below):

    b  batch    i  query positions    j  key positions    t  selected keys per query (top_k)
    e  embed_dim    h  attention heads    H  indexer heads    D  indexer head width
    d_c  MLA's latent    d_r  its RoPE width    q  an indexer query latent width (d_q)

The indexer (section 2.1, equation 1) scores every visible key ``s`` for query ``t`` with a few
cheap heads whose ReLU-ed dot products are mixed by per-query weights::

    I[t, s] = sum_H  w[t, H] * ReLU(q[t, H] . k[s] / sqrt(D))       q from MLA's query latent c_q,
                                                                 k one shared key per token
    selected(t) = the top_k visible s by I[t, s]     (every visible s when there are fewer)

(transformers' ``DeepseekV32Indexer`` folds ``H ** -0.5`` into ``w`` and skips the paper's FP8
and Hadamard rotation, which preserve dot products; so does this module.) The main attention is
MLA in its absorbed, multi-query form (``attnkit.mla``): every head of a query shares the same
selected latents ``[c_kv; k_r]``, so ``gather_attention`` gathers each query's ``t`` latents
once and attends over them, a block of queries at a time: memory ``O(block * t * (d_c + d_r))``
and work ``O(i * t)``, never the ``i x j`` score matrix. Its backward recomputes the gathered
scores from the saved log-sum-exp (as FlashAttention does) and scatters key gradients back.

The indexer's own scores are ``O(i * j * H)`` work (it is cheap per pair, which is its point),
computed ``block`` query rows at a time: one ``(b, block, H, j)`` strip of per-head products is
alive at once, never ``(b, i, j)``, and under causality the rows that see at most ``t`` keys
keep all of them unscored. The selection is not differentiable and the indexer is not trained
by the main loss: DeepSeek-V3.2 trains it with a separate KL objective against the main
attention's distribution (not part of this module), and transformers' ``DeepseekV32Indexer``
runs under ``no_grad``. So does everything of the indexer here (its keys, queries and scores):
DSA's output and gradients flow through MLA and the chosen keys only, and the indexer's
parameters get no gradient from it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit._numerics import blocked, compute_dtype
from attnkit.masks import causal_offset
from attnkit.mla import LatentCache, MultiHeadLatentAttention, copy_latent_attention
from attnkit.mla import _settings as mla_settings
from attnkit.positional import RotaryEmbedding

__all__ = ["DeepSeekSparseAttention", "LightningIndexer", "SparseLatentCache", "gather_attention"]

METHODS = ("sparse", "masked")


def _check_positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class SparseLatentCache(LatentCache):
    """``LatentCache`` plus the indexer's keys ``(b, j, D)`` (one per token, after RoPE)."""

    def __init__(self) -> None:
        super().__init__()
        self.index_key: Tensor | None = None

    def reset(self) -> None:
        super().reset()
        self.index_key = None

    def nbytes(self) -> int:
        extra = (
            0 if self.index_key is None else self.index_key.numel() * self.index_key.element_size()
        )
        return super().nbytes() + extra

    def append_index(self, key: Tensor) -> Tensor:
        """Append ``(b, n, D)`` indexer keys; return all so far."""
        self.index_key = key if self.index_key is None else torch.cat([self.index_key, key], dim=1)
        return self.index_key


class LightningIndexer(nn.Module):
    """The lightning indexer of DeepSeek-V3.2 (see the module docstring).

    Args:
        embed_dim: ``e`` (keys and head weights come from the layer input).
        q_rank: ``d_q``, the width of MLA's query latent ``c_q`` (queries come from it).
        num_heads: ``H`` (V3.2: 64).
        head_dim: ``D`` (V3.2: 128).
        rope_dim: RoPE rotates the first ``rope_dim`` channels of q and k ("half" pairing).
        top_k: keys kept per query (V3.2: 2048).
        rope_base: RoPE's base.

    Parameters: ``q_proj`` (``d_q -> H D``), ``k_proj`` (``e -> D``), ``k_norm`` (LayerNorm),
    ``weights_proj`` (``e -> H``).
    """

    def __init__(
        self,
        embed_dim: int,
        q_rank: int,
        num_heads: int,
        head_dim: int,
        *,
        rope_dim: int,
        top_k: int,
        rope_base: float = 10000.0,
    ) -> None:
        super().__init__()
        e = _check_positive("embed_dim", embed_dim)
        self.q_rank = _check_positive("q_rank", q_rank)
        self.num_heads = _check_positive("num_heads", num_heads)
        self.head_dim = _check_positive("head_dim", head_dim)
        self.rope_dim = _check_positive("rope_dim", rope_dim)
        self.top_k = _check_positive("top_k", top_k)
        if rope_dim % 2 or rope_dim > head_dim:
            raise ValueError(
                f"rope_dim must be even and at most head_dim={head_dim} (RoPE rotates pairs of "
                f"the first rope_dim channels), got {rope_dim}"
            )
        self.q_proj = nn.Linear(q_rank, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(e, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(e, num_heads, bias=False)
        self.rope = RotaryEmbedding(rope_dim, base=rope_base)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, head_dim={self.head_dim}, rope_dim={self.rope_dim}, "
            f"top_k={self.top_k}"
        )

    def _rotate(self, x: Tensor, offset: int) -> Tensor:
        """RoPE on the first ``rope_dim`` channels of ``x (..., n, D)``."""
        x_r, x_pass = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([self.rope.rotate(x_r, offset), x_pass], dim=-1)

    def keys(self, x: Tensor, offset: int) -> Tensor:
        """The shared key of each new token ``(b, j, D)``, at positions ``offset ..``."""
        return self._rotate(self.k_norm(self.k_proj(x)), offset)

    def queries(self, c_q: Tensor, offset: int) -> Tensor:
        """``(b, H, i, D)`` from MLA's query latent ``c_q (b, i, d_q)``."""
        b, i, _ = c_q.shape
        q = self.q_proj(c_q).view(b, i, self.num_heads, self.head_dim)  # (b, i, H, D)
        q = q.transpose(1, 2)  # (b, H, i, D)
        return self._rotate(q, offset)  # (b, H, i, D)

    def head_weights(self, x: Tensor) -> Tensor:
        """``w (b, i, H)``, with the ``H ** -0.5`` of transformers' indexer folded in."""
        return self.weights_proj(x) * self.num_heads**-0.5

    def scores(self, q: Tensor, w: Tensor, k: Tensor) -> Tensor:
        """``I (b, i, j) = sum_H w[b, i, H] ReLU(q[b, H, i] . k[b, j] / sqrt(D))``."""
        work = compute_dtype(q.dtype)
        q = (q.to(work) * self.head_dim**-0.5).transpose(1, 2)  # (b, i, H, D)
        return _index_scores(q, w.to(work), k.to(work).transpose(-1, -2))  # k^T: (b, D, j)

    @torch.no_grad()
    def select(
        self, x: Tensor, c_q: Tensor, keys: Tensor, *, is_causal: bool = True, block: int = 64
    ) -> tuple[Tensor, Tensor]:
        """The keys each new query keeps: ``(indices (b, i, t), valid (b, i, t))``.

        ``x (b, i, e)`` and ``c_q (b, i, d_q)`` are the new tokens, ``keys (b, j, D)`` every key
        (cached ones first). ``t = min(top_k, j)``; ``valid`` is False where a row had fewer
        visible keys than ``t`` (early rows under ``is_causal``, aligned bottom-right). Under
        ``is_causal`` the rows that see at most ``t`` keys keep all of them (``indices`` the
        first ``t`` positions, ``valid`` the visible ones) and are not scored. The others are
        scored ``block`` rows at a time: the largest temporary is one ``(b, block, H, j)``
        strip of per-head products (``scratch``, reused by every tile), never ``(b, i, j)``;
        under ``is_causal`` a tile stops at its last row's last visible key (at least ``t``
        keys), so the work is about half of ``i * j``.
        """
        b, i, _ = x.shape
        j = keys.shape[1]
        offset = causal_offset(i, j)
        work = compute_dtype(c_q.dtype)
        q = self.queries(c_q, offset).to(work) * self.head_dim**-0.5  # (b, H, i, D)
        q = q.transpose(1, 2)  # (b, i, H, D)
        w = self.head_weights(x).to(work)  # (b, i, H)
        k = keys.to(work).contiguous()  # (b, j, D)
        t = min(self.top_k, j)
        indices = torch.empty(b, i, t, dtype=torch.long, device=x.device)
        valid = torch.ones(b, i, t, dtype=torch.bool, device=x.device)
        key_pos = torch.arange(j, device=x.device)
        # Causal rows that see at most t keys (query q sees q + 1) keep all of them: no scores.
        first = min(i, max(0, t - offset)) if is_causal else 0
        if first:
            indices[:, :first] = key_pos[:t]
            valid[:, :first] = key_pos[:t] <= torch.arange(first, device=x.device)[:, None] + offset
        scratch = torch.empty(b * min(block, i) * self.num_heads * j, dtype=work, device=x.device)
        for r0 in range(first, i, block):
            r1 = min(i, r0 + block)
            # causal: keys past the tile's last row are never visible; keep >= t columns
            end = min(j, max(t, r1 + offset)) if is_causal else j
            k_t = k[:, :end].transpose(-1, -2)  # (b, D, end)
            s = _index_scores(q[:, r0:r1], w[:, r0:r1], k_t, scratch)  # (b, rows, end)
            if is_causal:  # s: (b, rows, end); only keys past the first row can be hidden
                rows = torch.arange(r0, r1, device=x.device)[:, None] + offset
                lo = min(end, r0 + offset + 1)
                hidden = key_pos[None, lo:end] > rows  # (rows, end - lo)
                s[..., lo:end].masked_fill_(hidden, blocked(s.dtype))
                idx = s.topk(t, dim=-1).indices  # (b, rows, t)
                valid[:, r0:r1] = idx <= rows[None]
            else:
                idx = s.topk(t, dim=-1).indices
            indices[:, r0:r1] = idx
        return indices, valid


def _index_scores(q: Tensor, w: Tensor, k_t: Tensor, scratch: Tensor | None = None) -> Tensor:
    """``(b, rows, j)`` indexer scores from pre-scaled ``q (b, rows, H, D)``, ``w (b, rows, H)``
    and ``k_t (b, D, j)``: the per-head products as one GEMM over ``rows H`` query rows, ReLU
    in place, and the head mix as a batched ``(1, H) @ (H, j)`` per row, so the only
    ``(b, rows, H, j)`` temporary is the first, written into ``scratch`` (flat, reused across
    tiles: a fresh one per tile costs page faults) when given."""
    b, rows, heads, _ = q.shape
    j = k_t.shape[-1]
    # (b, rows H, j): one score row per query row and head
    s = None if scratch is None else scratch[: b * rows * heads * j].view(b, rows * heads, j)
    s = torch.relu_(torch.matmul(q.reshape(b, rows * heads, -1), k_t, out=s))  # one GEMM
    return (w[:, :, None] @ s.view(b, rows, heads, -1))[:, :, 0]  # (b, rows, j)


class _GatherAttention(torch.autograd.Function):
    """Forward and recomputing backward of ``gather_attention`` (see there).

    Inside, queries are read in the layout ``(b, i, h, d)`` (a view when ``q`` is a transposed
    contiguous tensor of the compute dtype, else one copy), so a block's scores are one batched
    matmul per query row against its ``t`` gathered keys, shared by all ``h`` heads, scaled in
    place. The softmax runs in place on the score block (max, subtract, exp, sum), and invalid
    indices are blocked only in blocks that have any (the first ``t`` causal rows). The
    backward recomputes ``p`` from the saved log-sum-exp and takes ``delta = rowsum(dO * O)``
    a block at a time (FlashAttention-2's backward), so per block it runs three matmuls (five
    when the values are not the keys' first channels), two in-place passes, and one sparse
    segment sum for the key gradients; nothing it allocates is larger than ``dQ`` itself.
    """

    @staticmethod
    def forward(ctx, q, k, v, indices, valid, scale, block):  # type: ignore[no-untyped-def,override]
        b, h, i, _ = q.shape
        j, dv = k.shape[1], v.shape[-1]
        work = compute_dtype(q.dtype)
        qs = q.transpose(1, 2)  # (b, i, h, d)
        if qs.dtype != work or not qs.is_contiguous():
            qs = qs.to(work).contiguous()
        out = torch.empty(b, i, h, dv, dtype=work, device=q.device)
        lse = torch.empty(b, i, h, 1, dtype=work, device=q.device)
        tables = _tables(k, v)
        buffers: dict[str, Tensor] = {}  # gather scratch, reused by every block
        for r0 in range(0, i, block):
            r1 = min(i, r0 + block)
            kg, vg = _gather(*tables, dv, indices[:, r0:r1], j, work, buffers)  # (b, rows, t, .)
            _zero_invalid(kg, vg, valid[:, r0:r1])
            p = _scores(qs[:, r0:r1], kg, valid[:, r0:r1], scale)  # (b, rows, h, t)
            m = p.amax(-1, keepdim=True)  # (b, rows, h, 1)
            p.sub_(m).exp_()
            total = p.sum(-1, keepdim=True)
            torch.matmul(p, vg, out=out[:, r0:r1])  # (b, rows, h, dv), unnormalised
            out[:, r0:r1].div_(total)
            lse[:, r0:r1] = m + total.log()
        # A row with no valid index sees nothing: its output is already 0 (its values were
        # zeroed); an lse of +inf makes its weights exp(s - lse) = 0 in the backward too.
        empty = ~valid.any(-1)  # (b, i)
        if bool(empty.any()):
            lse.masked_fill_(empty[:, :, None, None], float("inf"))
        ctx.save_for_backward(qs, k, v, indices, valid, out, lse)
        ctx.scale, ctx.block, ctx.q_dtype = scale, block, q.dtype
        return out.transpose(1, 2).to(q.dtype)  # (b, h, i, dv)

    @staticmethod
    def backward(ctx, d_out):  # type: ignore[no-untyped-def,override]
        qs, k, v, indices, valid, out, lse = ctx.saved_tensors
        scale, block = ctx.scale, ctx.block
        b, i, h, d = qs.shape
        j, dv_width = k.shape[1], v.shape[-1]
        work = lse.dtype
        d_out = d_out.transpose(1, 2)  # (b, i, h, dv), converted a block at a time
        dq = torch.empty_like(qs)  # (b, i, h, d)
        dk = torch.zeros(b * j, k.shape[-1], dtype=work, device=k.device)
        tables = _tables(k, v)
        shared = tables[1] is None  # values are the keys' first channels: one gradient table
        dv = None if shared else torch.zeros(b * j, dv_width, dtype=work, device=v.device)
        base = (torch.arange(b, device=k.device) * j).view(b, 1, 1)  # (b, 1, 1): first rows
        buffers: dict[str, Tensor] = {}  # gather and key-gradient scratch, reused by every block
        if shared:  # [Q; dO_pad; Q] per block: [Q; dO_pad] and [dO_pad; Q] are two views of it
            stack = torch.zeros(b, min(block, i), 3 * h, d, dtype=work, device=qs.device)
        for r0 in range(0, i, block):
            r1 = min(i, r0 + block)
            idx = indices[:, r0:r1]
            kg, vg = _gather(*tables, dv_width, idx, j, work, buffers)
            _zero_invalid(kg, vg, valid[:, r0:r1])
            qt, do = qs[:, r0:r1], d_out[:, r0:r1].to(work)  # (b, rows, h, d), (b, rows, h, dv)
            delta = (do * out[:, r0:r1]).sum(-1, keepdim=True)  # (b, rows, h, 1): rowsum(dO O)
            scatter = _scatter_matrix((idx + base).flatten(), b * j, work)
            if shared:
                # One matmul of 2h rows gives [S; dP] against the gathered keys, in place
                # [P; dS]; then [P; dS]^T [dO_pad; Q] = P^T dO + dS^T Q, the key and value
                # gradients of each gathered row summed in the same matmul (dO is padded with
                # zeros to the keys' width: dP = dO_pad K^T, as S = Q K^T).
                rows = stack[:, : r1 - r0]
                rows[:, :, :h] = qt
                rows[:, :, h : 2 * h, :dv_width] = do
                rows[:, :, 2 * h :] = qt
                sd = rows[:, :, : 2 * h] @ kg.transpose(-1, -2)  # (b, rows, 2h, t)
                p = _mask_invalid(sd[:, :, :h].mul_(scale), valid[:, r0:r1])
                p.sub_(lse[:, r0:r1]).exp_()
                ds = sd[:, :, h:].sub_(delta).mul_(p).mul_(scale)  # (b, rows, h, t)
                torch.matmul(ds, kg, out=dq[:, r0:r1])  # dQ = scale dS K
                dk_g = _buffer(buffers, "dk", kg.shape[:-1].numel(), d, work, k.device)
                dk_g = dk_g.view(kg.shape)  # (b, rows, t, d)
                # [P; dS]^T [dO_pad; Q]: (b, rows, t, d)
                torch.matmul(sd.transpose(-1, -2), rows[:, :, h:], out=dk_g)
            else:
                p = _scores(qt, kg, valid[:, r0:r1], scale).sub_(lse[:, r0:r1]).exp_()
                ds = (do @ vg.transpose(-1, -2)).sub_(delta).mul_(p).mul_(scale)  # softmax bwd
                torch.matmul(ds, kg, out=dq[:, r0:r1])  # dQ = scale dS K
                dk_g = ds.transpose(-1, -2) @ qt  # (b, rows, t, d): per gathered key
                dv_g = p.transpose(-1, -2) @ do  # (b, rows, t, dv)
                assert dv is not None
                torch.addmm(dv, scatter, dv_g.flatten(0, 2), out=dv)
            # dk += scatter @ dk_g, accumulated in place: sums the rows that share a key
            torch.addmm(dk, scatter, dk_g.flatten(0, 2), out=dk)
        dq = dq.transpose(1, 2).to(ctx.q_dtype)  # (b, h, i, d)
        dk = dk.view(b, j, -1).to(k.dtype)  # (b, j, d)
        dv = None if dv is None else dv.view(b, j, -1).to(v.dtype)  # (b, j, dv)
        return dq, dk, dv, None, None, None, None


def _scatter_matrix(rows: Tensor, size: int, dtype: torch.dtype) -> Tensor:
    """The sparse ``(size, N)`` matrix with a one at ``(rows[n], n)``: times an ``(N, d)``
    tensor it sums the rows that point at the same key (a segment sum that, on CPU, runs far
    faster than ``index_add_`` when many rows share a target). Used through
    ``torch.addmm(acc, scatter, rows, out=acc)``, which adds into ``acc`` without building a
    dense ``(size, d)`` product first (several times faster than ``acc += sparse.mm(..)``)."""
    n = rows.numel()
    at = torch.stack([rows, torch.arange(n, device=rows.device)])
    ones = torch.ones(n, dtype=dtype, device=rows.device)
    return torch.sparse_coo_tensor(at, ones, (size, n), check_invariants=False)


def _tables(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor | None]:
    """``k (b, j, d)`` as a contiguous ``(b j, d)`` table, and ``v``'s, or None when the values
    are the keys' first ``dv`` channels (MLA's ``c_kv`` in ``[c_kv; k_r]``): they are then
    sliced from the gathered keys instead of gathered again."""
    b, j, d = k.shape
    shared = v.data_ptr() == k.data_ptr() and v.stride() == k.stride()
    k_table = k.reshape(b * j, d).contiguous()  # (b j, d)
    return k_table, None if shared else v.reshape(b * j, v.shape[-1]).contiguous()  # (b j, dv)


def _gather(
    k_table: Tensor,
    v_table: Tensor | None,
    dv: int,
    idx: Tensor,
    j: int,
    work: torch.dtype,
    buffers: dict[str, Tensor],
) -> tuple[Tensor, Tensor]:
    """The keys and values ``idx (b, rows, t)`` points at: ``(b, rows, t, d)``, ``(.., dv)``."""
    b = idx.shape[0]
    base = (torch.arange(b, device=idx.device) * j).view(b, 1, 1)  # (b, 1, 1)
    flat = (idx + base).flatten()  # (b rows t,): rows of the (b j, .) tables
    kg = _take(k_table, flat, work, buffers, "k").view(*idx.shape, -1)  # (b, rows, t, d)
    if v_table is None:
        return kg, kg[..., :dv]
    return kg, _take(v_table, flat, work, buffers, "v").view(*idx.shape, -1)  # (b, rows, t, dv)


def _zero_invalid(kg: Tensor, vg: Tensor, valid: Tensor) -> None:
    """The gathered keys and values of invalid indices ``valid (b, rows, t)`` set to zero, in
    place (they are copies): their weight is 0, and a NaN or infinity there must not reach a
    row as ``0 * nan``. No pass when every index of the block is valid."""
    if not bool(valid.all()):
        hidden = ~valid[..., None]
        kg.masked_fill_(hidden, 0.0)
        vg.masked_fill_(hidden, 0.0)  # a view of kg when the values are its first channels


def _take(
    table: Tensor, rows: Tensor, work: torch.dtype, buffers: dict[str, Tensor], name: str
) -> Tensor:
    """``table[rows]`` in ``work``, written into a buffer kept across blocks: a fresh tensor of
    tens of MB per block costs more in page faults than the copy itself (on CPU, several times
    the time of ``index_select(..., out=)`` into memory already touched)."""
    raw = _buffer(buffers, name, rows.numel(), table.shape[1], table.dtype, table.device)
    torch.index_select(table, 0, rows, out=raw)
    if table.dtype == work:
        return raw
    return _buffer(buffers, name + "_work", *raw.shape, work, table.device).copy_(raw)


def _buffer(
    buffers: dict[str, Tensor], name: str, n: int, d: int, dtype: torch.dtype, device
) -> Tensor:
    """The first ``n`` rows of the ``(>= n, d)`` scratch tensor ``buffers[name]`` (made once)."""
    buf = buffers.get(name)
    if buf is None or buf.shape[0] < n:
        buf = buffers[name] = torch.empty(n, d, dtype=dtype, device=device)
    return buf[:n]


def _scores(qs: Tensor, kg: Tensor, valid: Tensor, scale: float) -> Tensor:
    """Scores ``(b, rows, h, t)`` of ``qs (b, rows, h, d)`` on gathered keys
    ``kg (b, rows, t, d)``, times ``scale`` and blocked (in place) where not valid."""
    return _mask_invalid((qs @ kg.transpose(-1, -2)).mul_(scale), valid)  # (b, rows, h, t)


def _mask_invalid(s: Tensor, valid: Tensor) -> Tensor:
    """``s (b, rows, h, t)`` with the scores of invalid indices ``valid (b, rows, t)`` blocked, in
    place; untouched (no pass over it) when every index of the block is valid."""
    if not bool(valid.all()):
        s.masked_fill_(~valid[:, :, None], blocked(s.dtype))
    return s


def gather_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    indices: Tensor,
    valid: Tensor | None = None,
    *,
    scale: float | None = None,
    block: int = 64,
) -> Tensor:
    """Softmax attention of each query over the keys ``indices`` names, shared by all heads.

    Args:
        q: ``(b, h, i, d)``.
        k: ``(b, j, d)`` and v: ``(b, j, dv)``, one key/value head shared by every query head
            (DSA's absorbed MLA: keys ``[c_kv; k_r]``, values ``c_kv``).
        indices: ``(b, i, t)`` integer key positions per query.
        valid: ``(b, i, t)`` bool, False for an index to ignore; ``None``: all valid. A row
            with no valid index sees no key: its output is zeros (as a fully masked row's).
        scale: multiplies the scores; ``None`` means ``d ** -0.5``.
        block: query rows per step; memory is ``O(b * block * t * (d + dv))``.

    Equals ``scaled_dot_product_attention`` under the mask that keeps exactly the valid indexed
    keys of each row (``DeepSeekSparseAttention(method="masked")`` is that reference).
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("indices", indices), ("valid", valid)):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(
                f"gather_attention: {name} must be a torch.Tensor, got {type(t).__name__}"
            )
    if q.ndim != 4 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(
            f"gather_attention takes q (b, h, i, d), k (b, j, d), v (b, j, dv); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, _, i, d = q.shape
    if k.shape[0] != b or k.shape[2] != d or v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"k must be (b, j, d) = ({b}, j, {d}) and v (b, j, dv) with k's (b, j); got k "
            f"{tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if indices.ndim != 3 or indices.shape[:2] != (b, i) or indices.dtype.is_floating_point:
        raise ValueError(
            f"indices must be integers of shape (b, i, t) = ({b}, {i}, t), got "
            f"{indices.dtype} {tuple(indices.shape)}"
        )
    j, t = k.shape[1], indices.shape[2]
    if t > j or t == 0:
        raise ValueError(f"top-k of {t} keys per query out of j={j} keys: need 1 <= t <= j")
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= j):
        raise ValueError(
            f"indices must lie in [0, j={j}), got {int(indices.min())}..{int(indices.max())}"
        )
    valid = torch.ones_like(indices, dtype=torch.bool) if valid is None else valid
    if valid.shape != indices.shape or valid.dtype != torch.bool:
        raise ValueError(f"valid must be bool of indices' shape {tuple(indices.shape)}")
    _check_positive("block", block)
    scale = d**-0.5 if scale is None else float(scale)
    return _GatherAttention.apply(q, k, v, indices.long(), valid, scale, block)


class DeepSeekSparseAttention(nn.Module):
    """MLA whose queries attend only the keys a ``LightningIndexer`` picks (DeepSeek-V3.2).

    Built from its two parts: ``DeepSeekSparseAttention(attention, indexer)`` with a
    ``MultiHeadLatentAttention`` that has a query latent (``q_rank``, which the indexer reads)
    and a ``LightningIndexer`` of the same ``q_rank``. Call convention as
    ``MultiHeadAttention``: ``module(x, is_causal=True, cache=None) -> (out, weights | None)``;
    positions are ``cache.length ..`` as in MLA.

    ``method="sparse"`` runs ``gather_attention`` over the selected latents (the absorbed form,
    never the ``i x j`` scores); ``method="masked"`` is the reference: MLA's expanded form under
    the bool mask of the selected keys (``i x j``), which is also what ``need_weights`` runs.
    """

    def __init__(
        self, attention: MultiHeadLatentAttention, indexer: LightningIndexer, *, block: int = 32
    ) -> None:
        super().__init__()
        if not isinstance(attention, MultiHeadLatentAttention):
            raise TypeError(
                f"attention must be a MultiHeadLatentAttention, got {type(attention).__name__}"
            )
        if not isinstance(indexer, LightningIndexer):
            raise TypeError(f"indexer must be a LightningIndexer, got {type(indexer).__name__}")
        if attention.q_rank is None or attention.q_rank != indexer.q_rank:
            raise ValueError(
                f"the indexer reads MLA's query latent: attention.q_rank ({attention.q_rank}) "
                f"must be set and equal indexer.q_rank ({indexer.q_rank})"
            )
        self.attention = attention
        self.indexer = indexer
        self.block = _check_positive("block", block)

    @property
    def embed_dim(self) -> int:
        return self.attention.embed_dim

    def forward(
        self,
        x: Tensor,
        *,
        is_causal: bool = True,
        cache: SparseLatentCache | None = None,
        need_weights: bool = False,
        method: str = "sparse",
    ) -> tuple[Tensor, Tensor | None]:
        """``(out (b, i, e), weights (b, h, i, j) or None)`` for the new tokens ``x (b, i, e)``."""
        mla = self.attention
        if not isinstance(x, Tensor) or x.ndim != 3 or x.shape[-1] != mla.embed_dim:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (b, i, embed_dim={mla.embed_dim}), got {shape}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if cache is not None and not isinstance(cache, SparseLatentCache):
            raise TypeError(f"cache must be a SparseLatentCache, got {type(cache).__name__}")
        offset = 0 if cache is None else cache.length
        c_q = mla.query_latent(x)  # (b, i, d_q)
        assert c_q is not None
        kv = mla.latents(x, offset)  # (b, i, d_c + d_r)
        with torch.no_grad():  # the indexer is not trained by this output (module docstring)
            index_keys = self.indexer.keys(x, offset)  # (b, i, D)
        if cache is not None:
            kv = cache.append(kv, mla.kv_rank)  # (b, j, d_c + d_r)
            index_keys = cache.append_index(index_keys)
        q_n, q_r = mla.queries(x, offset, c_q)  # (b, h, i, d_n), (b, h, i, d_r)
        indices, valid = self.indexer.select(x, c_q, index_keys, is_causal=is_causal)
        if method == "masked" or need_weights:
            b, i, _ = x.shape
            keep = torch.zeros(b, i, kv.shape[1], dtype=torch.bool, device=x.device)
            keep.scatter_(-1, indices, valid)  # (b, i, j): the selected, visible keys
            out, weights = mla.attend(
                q_n, q_r, kv, mask=keep[:, None], is_causal=is_causal,
                need_weights=need_weights, absorb=False,
            )  # fmt: skip
            return mla.out_proj(out), weights
        q = mla.absorb_query(q_n, q_r)  # (b, h, i, d_c + d_r)
        del q_n, q_r  # (autograd keeps what it needs)
        # laid out (b, i, h, d) in memory, as gather_attention reads it: the one copy is made
        # here, where the (b, h, i, d) original is dropped at once, not beside it in the kernel
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
        c_kv = kv[..., : mla.kv_rank]  # the values: a view of the keys' first d_c channels
        o_c = gather_attention(q, kv, c_kv, indices, valid, scale=mla.scale, block=self.block)
        return mla.out_proj(mla.absorb_output(o_c)), None

    @classmethod
    def from_transformers(
        cls, module: nn.Module, *, backend: str = "auto"
    ) -> DeepSeekSparseAttention:
        """A copy of a ``DeepseekV32Attention`` and its ``DeepseekV32Indexer``. Same dtype and
        device. DeepSeek-V3.2 rotates MLA's RoPE channels in interleaved pairs (reordered here
        as in ``MultiHeadLatentAttention.from_transformers``) and the indexer's in halves,
        which is attnkit's pairing already."""
        if type(module).__name__ != "DeepseekV32Attention":
            raise TypeError(f"expected DeepseekV32Attention, got {type(module).__name__}")
        weight = module.o_proj.weight
        mla = MultiHeadLatentAttention(**mla_settings(module), backend=backend)
        mla = mla.to(dtype=weight.dtype, device=weight.device)
        copy_latent_attention(mla, module, interleaved=True)
        hf = module.indexer
        settings = mla_settings(module)
        indexer = LightningIndexer(
            module.hidden_size,
            hf.q_lora_rank,
            hf.n_heads,
            hf.head_dim,
            rope_dim=hf.qk_rope_head_dim,
            top_k=hf.index_topk,
            rope_base=settings["rope_base"],
        ).to(dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            indexer.q_proj.weight.copy_(hf.wq_b.weight)
            indexer.k_proj.weight.copy_(hf.wk.weight)
            indexer.k_norm.weight.copy_(hf.k_norm.weight)
            indexer.k_norm.bias.copy_(hf.k_norm.bias)
            indexer.k_norm.eps = hf.k_norm.eps
            indexer.weights_proj.weight.copy_(hf.weights_proj.weight)
        return cls(mla, indexer)
