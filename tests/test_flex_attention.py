"""attnkit.flex.flex_attention against torch's own flex_attention (eager, CPU, float64) for the
attention-gym catalogue, and its gradients against dense float64 autograd of the same formula."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.attention.flex_attention as tf

from attnkit.flex import BlockMask, and_masks, create_block_mask, flex_attention, or_masks
from attnkit.registry import use

F64 = torch.float64
BLOCK = 32
Q_LEN, KV_LEN = 97, 130  # neither a multiple of the block size, and different


def inputs(i: int, j: int, h: int = 4, h_kv: int = 4, b: int = 2, d: int = 8, dv: int = 6):
    g = torch.Generator().manual_seed(i * 1000 + j + h_kv)
    q = torch.randn(b, h, i, d, dtype=F64, generator=g)
    k = torch.randn(b, h_kv, j, d, dtype=F64, generator=g)
    v = torch.randn(b, h_kv, j, dv, dtype=F64, generator=g)
    return q, k, v


def dense_flex(q, k, v, score_mod=None, mask_mod=None, scale=None):
    """The formula in the module docstring of attnkit.flex, on the whole (b, h, i, j) grid."""
    nb, nh, ni, d = q.shape
    g = nh // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (b, h, j, d)
    s = (d**-0.5 if scale is None else scale) * q @ k.transpose(-1, -2)  # (b, h, i, j)
    b = torch.arange(nb).view(-1, 1, 1, 1)
    h = torch.arange(nh).view(1, -1, 1, 1)
    i = torch.arange(ni).view(1, 1, -1, 1)
    j = torch.arange(k.shape[2]).view(1, 1, 1, -1)
    if score_mod is not None:
        s = score_mod(s, b, h, i, j)
    keep = torch.ones_like(s, dtype=torch.bool)
    if mask_mod is not None:
        keep = keep & mask_mod(b, h, i, j)
    p = torch.softmax(s.masked_fill(~keep, torch.finfo(s.dtype).min), dim=-1)
    return (p * keep.any(dim=-1, keepdim=True)) @ v  # a row that sees nothing gives 0


def torch_flex(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager path and deprecated return_lse
        return tf.flex_attention(*args, **kwargs)


# The attention-gym catalogue: mask_mods and score_mods written for torch.


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= 24


def prefix(b, h, q_idx, kv_idx):
    return kv_idx < 20


DOCS = torch.tensor([[0] * 30 + [1] * 50 + [2] * 50, [0] * 90 + [1] * 7 + [2] * 33])


def document(b, h, q_idx, kv_idx):  # packed sequences, ids captured, different per batch
    return DOCS[b, q_idx] == DOCS[b, kv_idx]


def fully_masked_rows(b, h, q_idx, kv_idx):  # queries from 40 on see no key
    return (q_idx < 40) & (kv_idx <= q_idx + 3)


SLOPES = torch.tensor([2.0 ** (-8 * (n + 1) / 4) for n in range(4)], dtype=F64)


def alibi(score, b, h, q_idx, kv_idx):  # Press et al. 2022, arXiv:2108.12409
    return score + SLOPES[h] * (kv_idx - q_idx)


def t5_bias(table: torch.Tensor, buckets: int = 16, max_distance: int = 64):
    """T5-style bidirectional relative buckets (Raffel et al. 2020, section 2.1), from torch ops."""

    def score_mod(score, b, h, q_idx, kv_idx):
        rel = kv_idx - q_idx
        half = buckets // 2
        exact = half // 2
        side = (rel > 0).long() * half
        dist = rel.abs()
        log_ratio = torch.log(dist.clamp_min(1).double() / exact) / math.log(max_distance / exact)
        far = (exact + log_ratio * (half - exact)).long().clamp_max(half - 1)
        bucket = side + torch.where(dist < exact, dist, far)
        return score + table[bucket, h]

    return score_mod


def softcap(score, b, h, q_idx, kv_idx):  # Gemma 2's logit soft-capping, a tight cap
    return 2.0 * torch.tanh(score / 2.0)


def learned_table(table: torch.Tensor):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + KV_LEN - 1]

    return score_mod


def _tables():
    g = torch.Generator().manual_seed(7)
    return {
        "t5": torch.randn(16, 4, dtype=F64, generator=g),
        "learned": torch.randn(4, Q_LEN + KV_LEN - 1, dtype=F64, generator=g),
    }


# name: (mask_mod, block mask B, score_mod factory (tables -> mod), kv heads, self-attention)
CASES = {
    "causal": (causal, None, None, 4, False),
    "sliding_window": (and_masks(causal, sliding_window), None, None, 4, False),
    "prefix_lm": (or_masks(prefix, causal), None, None, 4, False),
    "document": (document, 2, None, 4, True),
    "alibi": (causal, None, lambda t: alibi, 4, False),
    "t5_relative": (None, None, lambda t: t5_bias(t["t5"]), 4, False),
    "softcap": (causal, None, lambda t: softcap, 4, False),
    "learned_table": (sliding_window, None, lambda t: learned_table(t["learned"]), 4, False),
    "gqa": (causal, None, lambda t: alibi, 2, False),
    "fully_masked_rows": (fully_masked_rows, None, None, 4, False),
}


def _case(name: str, tables: dict):
    mask_mod, nb, make_mod, h_kv, self_attention = CASES[name]
    q_len, kv_len = (DOCS.shape[1],) * 2 if self_attention else (Q_LEN, KV_LEN)
    q, k, v = inputs(q_len, kv_len, h_kv=h_kv)
    score_mod = None if make_mod is None else make_mod(tables)
    return q, k, v, mask_mod, nb, score_mod


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_equals_torchs_flex(name: str) -> None:
    q, k, v, mask_mod, nb, score_mod = _case(name, _tables())
    gqa = k.shape[1] != q.shape[1]
    ours_bm = theirs_bm = None
    if mask_mod is not None:
        sizes = (mask_mod, nb, None, q.shape[2], k.shape[2])
        ours_bm = create_block_mask(*sizes, BLOCK_SIZE=BLOCK)
        theirs_bm = tf.create_block_mask(*sizes, device="cpu", BLOCK_SIZE=BLOCK)
        assert torch.equal(ours_bm.to_dense(), theirs_bm.to_dense())
    out, lse = flex_attention(q, k, v, score_mod, ours_bm, enable_gqa=gqa, return_lse=True)
    ref, ref_lse = torch_flex(q, k, v, score_mod, theirs_bm, enable_gqa=gqa, return_lse=True)
    assert out.dtype == F64 and lse.dtype == F64
    assert (out - ref).abs().max() <= 1e-10
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    seen = torch.isfinite(ref_lse)
    assert (lse[seen] - ref_lse[seen]).abs().max() <= 1e-10
    if name == "fully_masked_rows":
        assert bool(torch.isneginf(lse[:, :, 40:]).all()) and not out[:, :, 40:].any()


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradients_equal_dense_autograd(name: str) -> None:
    """Gradients of q, k, v and of the tensors a score_mod captures (learned tables) equal
    float64 autograd through the dense formula."""
    grads = []
    for route in ("flex", "dense"):
        tables = {key: t.clone().requires_grad_() for key, t in _tables().items()}
        q, k, v, mask_mod, nb, score_mod = _case(name, tables)
        for t in (q, k, v):
            t.requires_grad_()
        if route == "flex":
            bm = None
            if mask_mod is not None:
                bm = create_block_mask(mask_mod, nb, None, q.shape[2], k.shape[2], BLOCK_SIZE=BLOCK)
            out = flex_attention(q, k, v, score_mod, bm, enable_gqa=k.shape[1] != q.shape[1])
        else:
            out = dense_flex(q, k, v, score_mod, mask_mod)
        weights = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(3))
        (out * weights).sum().backward()  # type: ignore[operator]
        grads.append([t.grad for t in (q, k, v, *tables.values())])
    for ours, ref in zip(*grads, strict=True):
        assert (ours is None) == (ref is None)
        if ref is not None:
            assert (ours - ref).abs().max() <= 1e-10
    uses_table = name in ("t5_relative", "learned_table")
    assert (grads[0][3] is not None or grads[0][4] is not None) == uses_table


def test_gradcheck_small() -> None:
    """torch.autograd.gradcheck through a captured table and a mask with every block class."""
    q, k, v = (t[:1, :2].clone().requires_grad_() for t in inputs(11, 9, d=3, dv=2))
    table = torch.randn(2, 11 + 9 - 1, dtype=F64, requires_grad=True)
    bm = create_block_mask(lambda b, h, qi, ki: qi + 2 >= ki, None, None, 11, 9, BLOCK_SIZE=4)

    def fn(q, k, v, table):
        def score_mod(score, b, h, q_idx, kv_idx):
            return 3.0 * torch.tanh(score / 3.0) + table[h, q_idx - kv_idx + 8]

        return flex_attention(q, k, v, score_mod, bm)

    assert torch.autograd.gradcheck(fn, (q, k, v, table))


# Mods that mean something only per element, as torch calls them (attention-gym and others).


def _rope_tables(b: int, h: int, i: int, j: int, requires_grad: bool = False):
    g = torch.Generator().manual_seed(9)
    query_rope = torch.randn(b, h, i, 4, dtype=F64, generator=g)  # (b, h, i, d_rope)
    key_rope = torch.randn(b, 1, j, 4, dtype=F64, generator=g)  # (b, 1, j, d_rope): one head
    return query_rope.requires_grad_(requires_grad), key_rope.requires_grad_(requires_grad)


def mla_rope(query_rope: torch.Tensor, key_rope: torch.Tensor, num_heads: int):
    """attention-gym's Multi-head Latent Attention score_mod (DeepSeek-V2's decoupled RoPE):
    ``torch.dot`` of two gathered rows."""

    def mla_rope_score_mod(score, b, h, q_idx, kv_idx):
        return score + 0.5 * torch.dot(query_rope[b, h, q_idx], key_rope[b, h // num_heads, kv_idx])

    return mla_rope_score_mod


def summed_features(qf: torch.Tensor, kf: torch.Tensor):
    def score_mod(score, b, h, q_idx, kv_idx):  # a reduction with no dim: one scalar each
        return score + (qf[q_idx] * kf[kv_idx]).sum()

    return score_mod


IMAGES = torch.tensor([[0, 40], [10, 90], [60, Q_LEN]])  # (images, 2): the text span of each
IMAGE_OF_KEY = torch.arange(3).repeat_interleave(KV_LEN // 3 + 1)[:KV_LEN]


def cross_attention(b, h, q_idx, kv_idx):  # Flamingo's text-to-image mask (attention-gym)
    interval = IMAGES[IMAGE_OF_KEY[kv_idx]]
    return (q_idx >= interval[0]) & (q_idx < interval[1])


def any_shared(b, h, q_idx, kv_idx):  # .any() over a gathered row, and the diagonal
    tags = DOCS[1, :KV_LEN].view(-1, 1) == torch.arange(3)  # (j, 3): one-hot document ids
    return (tags[q_idx] & tags[kv_idx]).any() | (kv_idx == q_idx)


def _per_element_case(name: str):
    q, k, v = inputs(Q_LEN, KV_LEN)
    g = torch.Generator().manual_seed(8)
    if name == "mla_rope":
        return q, k, v, mla_rope(*_rope_tables(2, 4, Q_LEN, KV_LEN), 4), causal
    if name == "summed_features":
        qf = torch.randn(Q_LEN, 5, dtype=F64, generator=g)
        kf = torch.randn(KV_LEN, 5, dtype=F64, generator=g)
        return q, k, v, summed_features(qf, kf), None
    if name == "cross_attention":
        return q, k, v, None, cross_attention
    return q, k, v, alibi, any_shared


@pytest.mark.parametrize("name", ["mla_rope", "summed_features", "cross_attention", "any"])
def test_per_element_mods_equal_torchs_flex(name: str) -> None:
    """score_mods and mask_mods that reduce (``torch.dot``, ``.sum()``, ``.any()`` with no dim)
    or index a gathered row mean what they mean per element, as torch vmaps them (called once
    per tile on broadcast indices, they were 1.5-2.9 off or crashed)."""
    q, k, v, score_mod, mask_mod = _per_element_case(name)
    ours_bm = theirs_bm = None
    if mask_mod is not None:
        sizes = (mask_mod, None, None, Q_LEN, KV_LEN)
        ours_bm = create_block_mask(*sizes, BLOCK_SIZE=BLOCK)
        theirs_bm = tf.create_block_mask(*sizes, device="cpu", BLOCK_SIZE=BLOCK)
        assert torch.equal(ours_bm.to_dense(), theirs_bm.to_dense())
    out, lse = flex_attention(q, k, v, score_mod, ours_bm, return_lse=True)
    ref, ref_lse = torch_flex(q, k, v, score_mod, theirs_bm, return_lse=True)
    assert (out - ref).abs().max() <= 1e-10
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    seen = torch.isfinite(ref_lse)
    assert (lse[seen] - ref_lse[seen]).abs().max() <= 1e-10


def test_per_element_score_mod_gradients_reach_what_it_captures() -> None:
    """MLA's score_mod: gradients of q, k, v and of both captured RoPE tables equal float64
    autograd through the dense formula written out, ``score + 0.5 * q_rope . k_rope``
    (torch's own eager backward fails on this mod)."""
    grads = []
    for route in ("flex", "dense"):
        query_rope, key_rope = _rope_tables(2, 4, Q_LEN, KV_LEN, requires_grad=True)
        q, k, v = (t.requires_grad_() for t in inputs(Q_LEN, KV_LEN))
        if route == "flex":
            bm = create_block_mask(causal, None, None, Q_LEN, KV_LEN, BLOCK_SIZE=BLOCK)
            out = flex_attention(q, k, v, mla_rope(query_rope, key_rope, 4), bm)
        else:
            rope = 0.5 * query_rope @ key_rope.transpose(-1, -2)  # (b, h, i, j)
            out = dense_flex(q, k, v, lambda s, b, h, i, j, r=rope: s + r, causal)
        weights = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(3))
        (out * weights).sum().backward()  # type: ignore[operator]
        grads.append([t.grad for t in (q, k, v, query_rope, key_rope)])
    for ours, ref in zip(*grads, strict=True):
        assert ref is not None and ref.abs().max() > 0
        assert (ours - ref).abs().max() <= 1e-10


def test_full_blocks_skip_the_mask_and_empty_blocks_are_never_visited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Causal, 4 x 4 blocks, on the tiled engine: mask_mod is evaluated only on the diagonal
    (partial) blocks, all of them in one call that the forward and the backward share (the
    blocks it is vmapped over are recorded). (auto may choose torch's kernel for a call without
    score_mod: it then reads the mask function whole.)"""
    import attnkit.flex.block_mask as block_mask

    calls: list[set[tuple[int, int]]] = []
    per_element = block_mask.per_element

    def recording(fn, *, score):  # type: ignore[no-untyped-def]
        tile = per_element(fn, score=score)

        def recorded(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            rows = q_idx.reshape(-1, q_idx.shape[-2])  # (blocks, bi): one row per block
            cols = kv_idx.reshape(-1, kv_idx.shape[-1])  # (blocks, bj)
            calls.append(
                {
                    (int(r.min()) // 32, int(c.min()) // 32)
                    for r, c in zip(rows, cols, strict=True)
                    if int(r.min()) // 32 == int(r.max()) // 32
                    and int(c.min()) // 32 == int(c.max()) // 32
                }
            )
            return tile(b, h, q_idx, kv_idx)

        return recorded

    monkeypatch.setattr(block_mask, "per_element", recording)
    bm = create_block_mask(causal, None, None, 128, 128, BLOCK_SIZE=32)
    calls.clear()
    q, k, v = (t.requires_grad_() for t in inputs(128, 128))
    with use("tiled"):
        out = flex_attention(q, k, v, block_mask=bm)
        out.sum().backward()  # type: ignore[union-attr]
    assert calls == [{(r, r) for r in range(4)}]  # once, the forward and the backward


def test_block_layout_is_read_as_torchs_kernels_read_it() -> None:
    """A hand-made layout: a full block attends everywhere whatever mask_mod says, an empty
    block nowhere, a partial block where mask_mod allows; classes may differ per batch."""
    states = torch.tensor([[[[2, 1], [0, 2]]], [[[1, 1], [2, 0]]]], dtype=torch.int8)  # (2,1,2,2)
    bm = BlockMask.from_states(states, (60, 64), 32, causal)
    q, k, v = inputs(60, 64, h=2, h_kv=2)
    visible = states.repeat_interleave(32, 2)[:, :, :60].repeat_interleave(32, 3)  # (2,1,60,64)

    def expected(b, h, q_idx, kv_idx):
        return (visible == 2) | ((visible == 1) & causal(b, h, q_idx, kv_idx))

    out = flex_attention(q, k, v, block_mask=bm)
    assert (out - dense_flex(q, k, v, mask_mod=expected)).abs().max() <= 1e-12


def test_torchs_block_mask_is_accepted() -> None:
    q, k, v = inputs(Q_LEN, KV_LEN)
    theirs = tf.create_block_mask(causal, None, None, Q_LEN, KV_LEN, "cpu", BLOCK_SIZE=BLOCK)
    out = flex_attention(q, k, v, block_mask=theirs)  # type: ignore[arg-type]
    assert (out - dense_flex(q, k, v, mask_mod=causal)).abs().max() <= 1e-12


def test_float32_is_as_close_as_torchs() -> None:
    """In float32, the error against the float64 formula is at most twice torch's eager flex
    (flash-attention's rule), plus a float32 rounding floor."""
    q, k, v = inputs(Q_LEN, KV_LEN)
    bm = create_block_mask(causal, None, None, Q_LEN, KV_LEN, BLOCK_SIZE=BLOCK)
    tbm = tf.create_block_mask(causal, None, None, Q_LEN, KV_LEN, "cpu", BLOCK_SIZE=BLOCK)
    ref = dense_flex(q, k, v, alibi, causal)
    q32, k32, v32 = (t.float() for t in (q, k, v))
    ours = flex_attention(q32, k32, v32, alibi, bm)
    theirs = torch_flex(q32, k32, v32, alibi, tbm)
    assert ours.dtype == torch.float32  # type: ignore[union-attr]
    err = (ours.double() - ref).abs().max()  # type: ignore[union-attr]
    assert err <= 2 * (theirs.double() - ref).abs().max() + 1e-6


def test_named_errors() -> None:
    q, k, v = inputs(64, 64)
    bm = create_block_mask(causal, None, None, 64, 64, BLOCK_SIZE=32)
    with pytest.raises(ValueError, match="block_mask was built for"):
        flex_attention(q[:, :, :40], k, v, block_mask=bm)
    with pytest.raises(ValueError, match="block_mask was built for"):
        flex_attention(q, k, v, block_mask=create_block_mask(causal, 3, None, 64, 64))
    with pytest.raises(ValueError, match=r"one value per element .* got shape \(2,\)"):
        flex_attention(q, k, v, lambda s, b, h, qi, ki: s.expand(2))
    with pytest.raises(NotImplementedError, match="no dropout"):
        flex_attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        flex_attention(q, k[:, :2], v[:, :2])
    with pytest.raises(ValueError, match="must divide"):
        flex_attention(q, k[:, :3], v[:, :3], enable_gqa=True)
    with pytest.raises(ValueError, match="4-D"):
        flex_attention(q[0], k[0], v[0])

    def scores(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx).float()

    lying = BlockMask.from_states(bm.block_states(), (64, 64), 32, scores)  # partial: evaluated
    with pytest.raises(TypeError, match="mask_mod 'scores' must return a bool tensor"):
        flex_attention(q, k, v, block_mask=lying)


def test_integer_and_mixed_dtypes_are_refused_by_name() -> None:
    q = torch.randn(1, 1, 4, 8)
    for args in ((q.long(), q.long(), q.long()), (q, q.double(), q), (q.half(), q, q)):
        with pytest.raises(TypeError, match="one floating-point dtype; got"):
            flex_attention(*args)


def test_flex_attention_is_one_scaled_dot_product_attention_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The adapter makes exactly one ``attnkit.scaled_dot_product_attention`` call: the block
    mask as a mask function with its ``BLOCK_SIZE`` as the tile sizes, grouped heads as they
    are, the log-sum-exp asked of the call; what it returns is torch's flex forward's."""
    import attnkit.flex.attention as adapter

    seen: list[dict] = []
    real = adapter.scaled_dot_product_attention

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append({"args": args, **kwargs})
        return real(*args, **kwargs)

    monkeypatch.setattr(adapter, "scaled_dot_product_attention", recording)
    q, k, v = inputs(97, 97, h=4, h_kv=2)
    ours_bm = create_block_mask(causal, None, None, 97, 97, BLOCK_SIZE=(16, 32))
    out, lse = flex_attention(q, k, v, block_mask=ours_bm, enable_gqa=True, return_lse=True)
    ((call,),) = [seen]
    assert call["block_sizes"] == (16, 32) and call["return_lse"] is True
    assert call["args"][1].shape[1] == 2  # key heads: grouped-query attention, not repeated
    theirs_bm = tf.create_block_mask(causal, None, None, 97, 97, device="cpu", BLOCK_SIZE=(16, 32))
    ref, ref_lse = torch_flex(q, k, v, None, theirs_bm, enable_gqa=True, return_lse=True)
    assert (out - ref).abs().max() < 1e-12 and (lse - ref_lse).abs().max() < 1e-12


def test_flex_imported_alone_routes_through_auto_not_the_reference() -> None:
    """``from attnkit.flex import ...`` in a fresh interpreter registers the backends, so auto
    chooses a tiled engine for a block mask instead of the n x n reference math."""
    import os
    import subprocess
    import sys

    code = """
import torch
import attnkit.functional as fn
from attnkit.flex import create_block_mask, flex_attention
chosen = []
pick = fn.select_backend
fn.select_backend = lambda name, call: chosen.append(pick(name, call)) or chosen[-1]
def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx
q = torch.randn(1, 2, 512, 16)
with torch.no_grad():
    flex_attention(q, q, q, None, create_block_mask(causal, None, None, 512, 512))
print(chosen[-1].name)
"""
    env = {**os.environ, "ATTNKIT_BACKGROUND": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] not in ("math", ""), out.stdout


def test_a_score_mod_that_is_not_a_function_is_named() -> None:
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(TypeError, match="score_mod must be a function"):
        flex_attention(q, q, q, score_mod=3)
