"""Positional schemes against their papers' formulas and hand-written float64 references."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit import (
    KVCache,
    LearnedPositionalEmbedding,
    MultiHeadAttention,
    RelativePositionAttention,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    alibi_bias,
    alibi_fn,
    alibi_slopes,
    masks,
    scaled_dot_product_attention,
)
from attnkit.positional import sinusoidal_table

D64 = torch.float64


def test_sinusoidal_table_matches_formula() -> None:
    n, e = 11, 7  # odd width: the last sine has no cosine partner
    table = sinusoidal_table(n, e)
    for p in range(n):
        for c in range(e):
            angle = p / 10000 ** ((c - c % 2) / e)
            expected = math.sin(angle) if c % 2 == 0 else math.cos(angle)
            assert abs(table[p, c].item() - expected) < 1e-12
    torch.testing.assert_close(sinusoidal_table(4, e, offset=7), table[7:11])


def test_sinusoidal_module_adds_table_with_offset() -> None:
    enc = SinusoidalPositionalEncoding(8)
    x = torch.randn(2, 5, 8, dtype=D64)
    torch.testing.assert_close(enc(x), x + sinusoidal_table(5, 8))
    torch.testing.assert_close(enc(x[:, 2:], offset=2), enc(x)[:, 2:])
    assert not list(enc.parameters()) and not list(enc.buffers())
    with pytest.raises(ValueError, match=r"x must have shape \(b, n, embed_dim=8\)"):
        enc(torch.randn(2, 5, 6))


def test_learned_embedding_adds_rows_and_checks_length() -> None:
    emb = LearnedPositionalEmbedding(6, 4)
    x = torch.zeros(1, 3, 4)
    torch.testing.assert_close(emb(x, offset=2)[0], emb.weight[2:5].detach())
    with pytest.raises(ValueError, match="exceed max_len=6"):
        emb(torch.zeros(1, 5, 4), offset=2)


def _complex_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0):
    """RoFormer's complex form: x_k + i x_{k+d/2}, times e^{i p theta_k}."""
    d = x.shape[-1]
    theta = base ** (-torch.arange(d // 2, dtype=D64) / (d // 2))
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :])
    z = z * torch.exp(1j * positions[:, None].to(D64) * theta)
    return torch.cat([z.real, z.imag], dim=-1)


def test_rope_matches_complex_formula_and_keeps_norms() -> None:
    rope = RotaryEmbedding(8)
    x = torch.randn(2, 3, 5, 8, dtype=D64)
    rotated = rope.rotate(x, offset=4)
    torch.testing.assert_close(rotated, _complex_rope(x, torch.arange(4, 9)), atol=1e-12, rtol=0)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))


def test_rope_scores_depend_only_on_relative_offset() -> None:
    rope = RotaryEmbedding(16)
    q = torch.randn(16, dtype=D64).expand(1, 1, 1, 16)
    k = torch.randn(16, dtype=D64).expand(1, 1, 1, 16)

    def score(pq: int, pk: int) -> float:
        return (rope.rotate(q, pq) * rope.rotate(k, pk)).sum().item()

    for delta in (-3, 0, 2, 7):
        scores = [score(p + delta, p) for p in (3, 10, 50)]  # query offset delta after the key
        assert max(scores) - min(scores) < 1e-10
    assert abs(score(5, 2) - score(2, 5)) > 1e-6  # but the direction matters


def test_rope_rejects_bad_head_dim() -> None:
    with pytest.raises(ValueError, match="positive even int"):
        RotaryEmbedding(7)
    with pytest.raises(ValueError, match="head_dim=8"):
        RotaryEmbedding(8).rotate(torch.randn(1, 1, 2, 4))


def test_alibi_slopes_follow_the_paper() -> None:
    # power of two: geometric sequence starting at 2^(-8/n) with that ratio
    for n in (1, 2, 4, 8, 16):
        expected = torch.tensor([2 ** (-8 * (k + 1) / n) for k in range(n)], dtype=D64)
        torch.testing.assert_close(alibi_slopes(n), expected)
    assert alibi_slopes(8).tolist() == [0.5, 0.25, 0.125, 0.0625, 2**-5, 2**-6, 2**-7, 2**-8]
    # not a power of two (the paper's code): slopes of 8, then every other slope of 16
    slopes16 = [2 ** (-8 * (k + 1) / 16) for k in range(16)]
    expected12 = alibi_slopes(8).tolist() + slopes16[0::2][:4]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected12, dtype=D64))


@pytest.mark.parametrize(("i", "j"), [(5, 5), (3, 7), (1, 9)])
def test_alibi_function_equals_tensor(i: int, j: int) -> None:
    h = 6
    tensor = alibi_bias(h, i, j, dtype=D64)
    assert tensor.shape == (1, h, i, j)
    from_fn = masks.materialize(alibi_fn(h, offset=j - i), (1, h, i, j)).to(D64)
    torch.testing.assert_close(from_fn, tensor, atol=1e-7, rtol=0)
    slopes = alibi_slopes(h)
    for hh in range(h):  # hand formula: -m_h * |(t + j - i) - s|
        for t in range(i):
            for s in range(j):
                assert abs(tensor[0, hh, t, s].item() + slopes[hh] * abs(t + j - i - s)) < 1e-12


def test_alibi_composes_with_attention_and_cache() -> None:
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4).to(D64).eval()
    x = torch.randn(2, 7, 16, dtype=D64)
    full_t, _ = mha(x, is_causal=True, bias=alibi_bias(4, 7, dtype=D64))
    full_f, _ = mha(x, is_causal=True, bias=alibi_fn(4))
    torch.testing.assert_close(full_f, full_t, atol=1e-6, rtol=0)
    cache = KVCache()
    steps = []
    for t in range(7):
        steps.append(mha(x[:, t : t + 1], is_causal=True, bias=alibi_fn(4, t), cache=cache)[0])
    torch.testing.assert_close(torch.cat(steps, 1), full_f, atol=1e-12, rtol=0)


def _shaw_reference(mod: RelativePositionAttention, x: torch.Tensor, allowed: torch.Tensor):
    """Equations 3-4 of Shaw et al. 2018, one query/key pair at a time, in float64."""
    b, n, e = x.shape
    h, d, k = mod.num_heads, mod.head_dim, mod.max_distance
    q, kk, v = mod.in_proj(x).split([e, e, e], dim=-1)
    out = torch.zeros(b, n, e, dtype=D64)
    for bb in range(b):
        for hh in range(h):
            sl = slice(hh * d, (hh + 1) * d)
            for t in range(n):
                logits = []
                for s in range(n):
                    r = max(-k, min(k, s - t)) + k
                    logits.append(q[bb, t, sl] @ (kk[bb, s, sl] + mod.rel_key[r]) / math.sqrt(d))
                logits = torch.stack(logits)
                logits = logits.masked_fill(~allowed[bb, t], -math.inf)
                alpha = torch.softmax(logits, dim=0)
                for s in range(n):
                    if allowed[bb, t, s]:
                        r = max(-k, min(k, s - t)) + k
                        out[bb, t, sl] += alpha[s] * (v[bb, s, sl] + mod.rel_value[r])
    return mod.out_proj(out)


@pytest.mark.parametrize("causal", [False, True])
def test_shaw_relative_attention_equals_loop_reference(causal: bool) -> None:
    torch.manual_seed(0)
    mod = RelativePositionAttention(8, 2, max_distance=2).to(D64)
    x = torch.randn(2, 6, 8, dtype=D64)
    lengths = torch.tensor([6, 4])
    pad = masks.padding_mask(lengths)  # (b, 1, 1, j)
    allowed = pad[:, 0].expand(2, 6, 6)
    if causal:
        allowed = allowed & masks.causal_mask(6)
    out, w = mod(x, mask=pad, is_causal=causal, need_weights=True)
    with torch.no_grad():
        ref = _shaw_reference(mod, x, allowed)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    assert w is not None
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 6, dtype=D64))


def test_shaw_relative_attention_cache_and_gradients() -> None:
    torch.manual_seed(0)
    mod = RelativePositionAttention(8, 2, max_distance=3, num_kv_heads=1).to(D64).eval()
    x = torch.randn(1, 6, 8, dtype=D64)
    full, _ = mod(x, is_causal=True)
    cache = KVCache()
    steps = [mod(x[:, t : t + 1], is_causal=True, cache=cache)[0] for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-12, rtol=0)
    full.sum().backward()
    assert mod.rel_key.grad is not None and mod.rel_key.grad.abs().sum() > 0
    assert mod.rel_value.grad is not None and mod.rel_value.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="max_distance"):
        RelativePositionAttention(8, 2, max_distance=-1)


@pytest.mark.parametrize("base", [0.0, -2.0, float("nan"), float("inf"), True])
def test_a_base_that_is_not_a_positive_number_is_refused(base) -> None:
    for build in (
        lambda: RotaryEmbedding(4, base=base),
        lambda: SinusoidalPositionalEncoding(4, base=base),
        lambda: sinusoidal_table(3, 4, base=base),
    ):
        with pytest.raises(ValueError, match="base must be a positive finite number"):
            build()
    with pytest.raises(ValueError, match="embed_dim must be a positive int"):
        SinusoidalPositionalEncoding(-2)
    with pytest.raises(ValueError, match="max_len must be a positive int"):
        LearnedPositionalEmbedding(-1, 4)


@pytest.mark.parametrize("num_kv_heads", [None, 1])
def test_shaw_relative_attention_keeps_a_nan_to_the_rows_that_see_it(num_kv_heads) -> None:
    """A NaN token poisons only the rows that attend it, as the reference math does (the value
    sum reads hidden keys as 0 instead of multiplying their NaN by a zero weight)."""
    torch.manual_seed(0)
    m = RelativePositionAttention(16, 4, max_distance=2, num_kv_heads=num_kv_heads)
    m = m.eval().double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    x[0, 3] = float("nan")
    clean = x.nan_to_num(0.0)
    padding = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    padding[0, ..., 3] = False
    with torch.no_grad():
        for kwargs, nan_rows in (
            ({"is_causal": True}, [3, 4]),  # rows 3 and 4 see token 3
            ({"mask": padding}, [3]),  # every row hides key 3; row 3's own query is NaN
        ):
            out, ref = m(x, **kwargs)[0], m(clean, **kwargs)[0]
            rows = out.isnan().any(-1)
            assert rows[0].nonzero().flatten().tolist() == nan_rows
            assert not rows[1].any()
            torch.testing.assert_close(out[~rows], ref[~rows], rtol=0, atol=1e-12)


def test_alibi_fn_for_fewer_heads_than_the_query_has_is_named() -> None:
    q = torch.randn(1, 8, 2, 4)
    for backend in ("math", "tiled", "auto"):
        with pytest.raises(ValueError, match="alibi_fn was made for num_heads=4"):
            scaled_dot_product_attention(q, q, q, bias=alibi_fn(4), backend=backend)


def test_alibi_slopes_want_a_positive_int() -> None:
    for heads in (True, 0, 2.0):
        with pytest.raises(ValueError, match="num_heads must be a positive int"):
            alibi_slopes(heads)
