"""MultiHeadAttention against torch's nn.MultiheadAttention, GQA, the KV cache, bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from attnkit import KVCache, MultiHeadAttention, RotaryEmbedding, masks

D64 = torch.float64


def _torch_mha(e: int, h: int, *, kdim=None, vdim=None, bias=True, seed=0) -> nn.MultiheadAttention:
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(e, h, kdim=kdim, vdim=vdim, bias=bias, batch_first=True)
    ref = ref.to(D64)
    with torch.no_grad():  # torch zeroes biases at init; give them values so they are tested
        for name, p in ref.named_parameters():
            if "bias" in name:
                p.normal_()
    return ref.eval()


@pytest.mark.parametrize("bias", [True, False])
def test_self_attention_equals_torch_with_masks(bias: bool) -> None:
    e, h, b, n = 24, 4, 3, 7
    ref = _torch_mha(e, h, bias=bias)
    mha = MultiHeadAttention.from_torch(ref).eval()
    x = torch.randn(b, n, e, dtype=D64)
    lengths = torch.tensor([7, 5, 2])
    key_padding = torch.arange(n)[None, :] >= lengths[:, None]  # torch: True = ignore
    attn_mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)  # torch: True = not allowed
    ref_out, ref_w = ref(
        x, x, x, key_padding_mask=key_padding, attn_mask=attn_mask, average_attn_weights=False
    )
    ours_mask = masks.from_torch(attn_mask, key_padding)
    out, w = mha(x, mask=ours_mask, need_weights=True)
    # every row has at least key 0 visible, so torch has no NaN rows here
    assert not torch.isnan(ref_out).any()
    assert w is not None and w.shape == (b, h, n, n)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(w, ref_w, atol=1e-10, rtol=0)
    # the fast path (no weights) gives the same output
    out_fast, none = mha(x, mask=ours_mask)
    assert none is None
    torch.testing.assert_close(out_fast, ref_out, atol=1e-10, rtol=0)


def test_per_head_and_float_attn_masks_equal_torch() -> None:
    e, h, b, n = 16, 4, 2, 5
    ref = _torch_mha(e, h)
    mha = MultiHeadAttention.from_torch(ref)
    x = torch.randn(b, n, e, dtype=D64)
    torch.manual_seed(3)
    blocked = torch.rand(b * h, n, n) < 0.4  # torch: (b * h, i, j), True = not allowed
    blocked[:, :, 0] = False  # keep one key per row: torch would give NaN rows otherwise
    ref_out, ref_w = ref(x, x, x, attn_mask=blocked, average_attn_weights=False)
    ours = masks.from_torch(blocked).view(b, h, n, n)  # (b * h, i, j) -> (b, h, i, j)
    out, w = mha(x, mask=ours, need_weights=True)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(w, ref_w, atol=1e-10, rtol=0)
    # torch's float mask: 0 = attend, -inf = blocked
    float_mask = torch.zeros(n, n, dtype=D64).masked_fill(blocked[0], float("-inf"))
    ref_out, _ = ref(x, x, x, attn_mask=float_mask)
    out, _ = mha(x, mask=masks.from_torch(float_mask))
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)


def test_cross_attention_kdim_vdim_equals_torch() -> None:
    e, h, b, i, j = 16, 2, 2, 5, 9  # key length != query length: catches one used for the other
    ref = _torch_mha(e, h, kdim=6, vdim=10)
    mha = MultiHeadAttention.from_torch(ref)
    assert mha.in_proj is None and mha.k_proj is not None
    q = torch.randn(b, i, e, dtype=D64)
    k = torch.randn(b, j, 6, dtype=D64)
    v = torch.randn(b, j, 10, dtype=D64)
    key_padding = torch.tensor([[False] * 9, [False] * 4 + [True] * 5])
    ref_out, ref_w = ref(q, k, v, key_padding_mask=key_padding, average_attn_weights=False)
    out, w = mha(q, k, v, mask=masks.from_torch(key_padding_mask=key_padding), need_weights=True)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(w, ref_w, atol=1e-10, rtol=0)


def test_cross_attention_same_dims_uses_fused_rows() -> None:
    e, h, b = 16, 4, 2
    ref = _torch_mha(e, h)
    mha = MultiHeadAttention.from_torch(ref)
    q = torch.randn(b, 3, e, dtype=D64)
    mem = torch.randn(b, 11, e, dtype=D64)
    ref_out, _ = ref(q, mem, mem)
    out, _ = mha(q, mem)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)


def test_from_torch_not_batch_first_and_fully_masked_rows() -> None:
    e, h, b, n = 8, 2, 2, 4
    torch.manual_seed(1)
    ref = nn.MultiheadAttention(e, h, batch_first=False).to(D64).eval()
    mha = MultiHeadAttention.from_torch(ref)
    x = torch.randn(n, b, e, dtype=D64)  # torch: (n, b, e)
    attn_mask = torch.zeros(n, n, dtype=torch.bool)
    attn_mask[2] = True  # row 2 fully masked: torch gives NaN, attnkit zeros (then out_proj bias)
    ref_out, _ = ref(x, x, x, attn_mask=attn_mask)
    out, w = mha(x.transpose(0, 1), mask=masks.from_torch(attn_mask), need_weights=True)
    out = out.transpose(0, 1)
    real = torch.tensor([0, 1, 3])
    assert torch.isnan(ref_out[2]).all()
    torch.testing.assert_close(out[real], ref_out[real], atol=1e-10, rtol=0)
    assert w is not None and (w[:, :, 2] == 0).all()
    torch.testing.assert_close(out[2], mha.out_proj.bias.expand(b, e))


def test_gqa_equals_mha_with_repeated_kv_heads() -> None:
    e, h, h_kv, b, n = 32, 8, 2, 2, 6
    torch.manual_seed(0)
    gqa = MultiHeadAttention(e, h, num_kv_heads=h_kv).to(D64)
    mha = MultiHeadAttention(e, h).to(D64)
    d = e // h
    with torch.no_grad():
        wq, wk, wv = gqa.in_proj.weight.split([e, h_kv * d, h_kv * d])
        bq, bk, bv = gqa.in_proj.bias.split([e, h_kv * d, h_kv * d])

        def repeat(t: torch.Tensor) -> torch.Tensor:  # kv head c serves query heads c*g..c*g+g-1
            return t.unflatten(0, (h_kv, d)).repeat_interleave(h // h_kv, dim=0).flatten(0, 1)

        mha.in_proj.weight.copy_(torch.cat([wq, repeat(wk), repeat(wv)]))
        mha.in_proj.bias.copy_(torch.cat([bq, repeat(bk), repeat(bv)]))
        mha.out_proj.load_state_dict(gqa.out_proj.state_dict())
    x = torch.randn(b, n, e, dtype=D64)
    pad = masks.padding_mask(torch.tensor([6, 4]))
    for backend in ("math", "torch"):
        gqa.backend = mha.backend = backend
        out_g, _ = gqa(x, mask=pad, is_causal=True)
        out_m, _ = mha(x, mask=pad, is_causal=True)
        torch.testing.assert_close(out_g, out_m, atol=1e-12, rtol=0)
    # K/V projection is h_kv heads wide: the parameters are not per query head
    assert gqa.in_proj.weight.shape == (e + 2 * h_kv * d, e)


def test_gqa_does_not_copy_kv_per_head(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    import attnkit.attention as attention_module

    real = attention_module.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen["q"], seen["k"], seen["v"] = q.shape, k.shape, v.shape
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention_module, "scaled_dot_product_attention", spy)
    mqa = MultiHeadAttention(16, 4, num_kv_heads=1)
    mqa(torch.randn(2, 5, 16))
    assert seen["q"] == (2, 4, 5, 4) and seen["k"] == (2, 1, 5, 4) and seen["v"] == (2, 1, 5, 4)


@pytest.mark.parametrize("num_kv_heads", [None, 2])
@pytest.mark.parametrize("use_rope", [False, True])
@pytest.mark.parametrize("max_len", [None, 16])
def test_kv_cache_decoding_equals_full_causal_forward(num_kv_heads, use_rope, max_len) -> None:
    e, h, b, n = 16, 4, 2, 9
    torch.manual_seed(0)
    mha = MultiHeadAttention(e, h, num_kv_heads=num_kv_heads).to(D64).eval()
    rope = RotaryEmbedding(e // h) if use_rope else None
    x = torch.randn(b, n, e, dtype=D64)
    full, _ = mha(x, is_causal=True, rope=rope)
    cache = KVCache(max_len)
    # a 3-token prompt, then one token at a time
    steps = [mha(x[:, :3], is_causal=True, rope=rope, cache=cache)[0]]
    for t in range(3, n):
        steps.append(mha(x[:, t : t + 1], is_causal=True, rope=rope, cache=cache)[0])
    assert cache.length == n and cache.key.shape == (b, num_kv_heads or h, n, e // h)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-12, rtol=0)


def test_causal_output_ignores_future_inputs() -> None:
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, num_kv_heads=2).to(D64)
    x = torch.randn(2, 8, 16, dtype=D64)
    y = x.clone()
    y[:, 5:] = torch.randn(2, 3, 16, dtype=D64)
    out_x, _ = mha(x, is_causal=True)
    out_y, _ = mha(y, is_causal=True)
    torch.testing.assert_close(out_x[:, :5], out_y[:, :5], atol=1e-12, rtol=0)
    assert (out_x[:, 5:] - out_y[:, 5:]).abs().max() > 1e-3


def test_dropout_only_in_training() -> None:
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, dropout=0.5)
    x = torch.randn(2, 6, 16)
    mha.eval()
    a, _ = mha(x)
    b, _ = mha(x)
    torch.testing.assert_close(a, b)
    mha.train()
    c, _ = mha(x)
    assert (c - a).abs().max() > 1e-3


def test_bias_is_added_to_scores() -> None:
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2).to(D64)
    x = torch.randn(1, 4, 8, dtype=D64)
    bias = torch.zeros(1, 2, 4, 4, dtype=D64)
    bias[..., 0] = -1e4  # practically blocks key 0
    out_bias, w = mha(x, bias=bias, need_weights=True)
    out_mask, _ = mha(x, mask=torch.tensor([False, True, True, True]).view(1, 1, 1, 4))
    torch.testing.assert_close(out_bias, out_mask, atol=1e-10, rtol=0)
    assert w is not None and (w[..., 0] < 1e-100).all()


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(embed_dim=10, num_heads=3), "divisible by num_heads"),
        (dict(embed_dim=16, num_heads=4, num_kv_heads=3), "must divide num_heads"),
        (dict(embed_dim=0, num_heads=1), "embed_dim must be a positive int"),
        (dict(embed_dim=8, num_heads=2, dropout=1.0), "dropout"),
    ],
)
def test_bad_configuration(kwargs, words) -> None:
    with pytest.raises(ValueError, match=words):
        MultiHeadAttention(**kwargs)


def test_bad_inputs_name_the_problem() -> None:
    mha = MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match=r"query must have shape \(b, n, embed_dim=8\)"):
        mha(torch.randn(2, 3, 6))
    with pytest.raises(ValueError, match=r"key must have shape \(b, n, kdim=8\)"):
        mha(torch.randn(2, 3, 8), torch.randn(2, 5, 7))
    with pytest.raises(ValueError, match="batch size mismatch"):
        mha(torch.randn(2, 3, 8), torch.randn(3, 5, 8))
    with pytest.raises(ValueError, match="same length"):
        mha(torch.randn(2, 3, 8), torch.randn(2, 5, 8), torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="batch first"):
        mha(torch.randn(3, 8))
    cross = MultiHeadAttention(8, 2, kdim=4)
    with pytest.raises(ValueError, match="self-attention needs kdim"):
        cross(torch.randn(2, 3, 8))


def test_cross_attention_cache_projects_memory_once() -> None:
    torch.manual_seed(0)
    cross = MultiHeadAttention(16, 4, num_kv_heads=2, kdim=6, vdim=6).to(D64).eval()
    memory = torch.randn(2, 7, 6, dtype=D64)
    q = torch.randn(2, 5, 16, dtype=D64)
    full, _ = cross(q, memory)
    cache = KVCache()
    calls = []
    cross.k_proj.register_forward_hook(lambda *a: calls.append(1))
    steps = [cross(q[:, t : t + 1], memory, cache=cache)[0] for t in range(5)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-12, rtol=0)
    assert len(calls) == 1 and cache.length == 7
    with pytest.raises(ValueError, match="cross-attention cache holds a memory"):
        cross(q[:, :1], torch.randn(2, 3, 6, dtype=D64), cache=cache)
    with pytest.raises(ValueError, match="rope cannot be combined"):
        cross(q, memory, cache=cache, rope=RotaryEmbedding(4))


def test_cache_from_another_shape_is_refused() -> None:
    cache = KVCache()
    MultiHeadAttention(8, 2)(torch.randn(2, 3, 8), cache=cache)
    with pytest.raises(ValueError, match="cache holds keys"):
        MultiHeadAttention(8, 4)(torch.randn(2, 1, 8), cache=cache)  # other head count
    with pytest.raises(ValueError, match="cache holds keys"):
        MultiHeadAttention(8, 2)(torch.randn(3, 1, 8), cache=cache)  # other batch
    full = KVCache(max_len=4)
    mha = MultiHeadAttention(8, 2)
    mha(torch.randn(1, 3, 8), cache=full)
    with pytest.raises(ValueError, match="KVCache is full"):
        mha(torch.randn(1, 2, 8), cache=full)


def test_initialisation_is_xavier_per_projection_with_zero_biases() -> None:
    torch.manual_seed(0)
    e, h, h_kv = 64, 8, 2
    mha = MultiHeadAttention(e, h, num_kv_heads=h_kv)
    kv = h_kv * (e // h)
    for rows, fan_out in zip(mha.in_proj.weight.split([e, kv, kv]), (e, kv, kv), strict=True):
        bound = math.sqrt(6 / (e + fan_out))  # Glorot & Bengio 2010, uniform
        assert rows.abs().max() <= bound
        assert rows.abs().max() > 0.9 * bound  # the whole range is used, not a smaller one
        assert abs(rows.std().item() - bound / math.sqrt(3)) < 0.1 * bound
    assert (mha.in_proj.bias == 0).all() and (mha.out_proj.bias == 0).all()
    cross = MultiHeadAttention(e, h, kdim=10, vdim=12)
    assert cross.k_proj.weight.abs().max() <= math.sqrt(6 / (10 + e))


@pytest.mark.parametrize("chunks", [[8], [5, 3], [1, 4, 2, 1], [2, 2, 2, 2]])
def test_kv_cache_with_any_chunking_and_padding(chunks: list[int]) -> None:
    # chunked prefill: several tokens per call, with a key padding mask over the whole cache
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, num_kv_heads=1).to(D64).eval()
    rope = RotaryEmbedding(4)
    x = torch.randn(2, 8, 16, dtype=D64)
    keep = torch.ones(2, 8, dtype=torch.bool)
    keep[1, 2] = False  # a "padding" token in the middle of sequence 1
    full, _ = mha(x, mask=keep[:, None, None, :], is_causal=True, rope=rope)
    cache, outs, start = KVCache(), [], 0
    for n in chunks:
        seen = keep[:, None, None, : start + n]  # (b, 1, 1, j): mask over cached + new keys
        outs.append(
            mha(x[:, start : start + n], mask=seen, is_causal=True, rope=rope, cache=cache)[0]
        )
        start += n
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-12, rtol=0)


# The compiled decode step (attnkit.backends.fused.decode): one new token over a KV cache.


@pytest.fixture(scope="module")
def decode_kernel():
    from attnkit.backends.fused import jit

    try:
        return jit.build()
    except jit.NotBuilt as reason:
        pytest.skip(f"the fused kernel is unavailable here: {reason}")


def _spy_decode(monkeypatch) -> list[int]:
    """Count the calls that take the compiled decode step."""
    from attnkit.backends.fused import decode

    calls: list[int] = []
    real = decode.decode_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(decode, "decode_attention", spy)
    return calls


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("max_len", [None, 48])
def test_decoding_with_the_compiled_step_equals_a_full_forward(
    decode_kernel, monkeypatch, padded: bool, max_len: int | None
) -> None:
    """SmolLM2's attention shapes (e = 576, h = 9, h_kv = 3, d = 64) in float32 with RoPE: a
    prompt of 5, then 35 tokens one at a time, every one through the compiled step (with left
    padding: the key padding mask becomes its key_mask), equal to one causal forward."""
    torch.manual_seed(0)
    e, h, b, n = 576, 9, 2, 40
    mha = MultiHeadAttention(e, h, num_kv_heads=3, bias=False).eval()
    rope = RotaryEmbedding(e // h)
    x = torch.randn(b, n, e)
    keep = torch.ones(b, n, dtype=torch.bool)
    if padded:
        keep[1, :3] = False  # row 1 is left-padded by 3
    with torch.no_grad():
        full, _ = mha(x, mask=keep[:, None, None, :], is_causal=True, rope=rope)
        calls = _spy_decode(monkeypatch)
        cache = KVCache(max_len)
        steps = [
            mha(x[:, :5], mask=keep[:, None, None, :5], is_causal=True, rope=rope, cache=cache)
        ]
        for t in range(5, n):
            seen = keep[:, None, None, : t + 1]  # (b, 1, 1, j)
            steps.append(mha(x[:, t : t + 1], mask=seen, is_causal=True, rope=rope, cache=cache))
    assert len(calls) == n - 5
    got = torch.cat([s[0] for s in steps], dim=1)
    torch.testing.assert_close(got[keep], full[keep], atol=2e-6, rtol=2e-5)


def test_the_layer_says_why_a_call_does_not_take_the_decode_step(decode_kernel) -> None:
    mha = MultiHeadAttention(16, 4, num_kv_heads=2).eval()
    cache = KVCache()
    mha(torch.randn(1, 3, 16), cache=cache)
    q = torch.randn(1, 4, 1, 4)
    k = v = torch.randn(1, 2, 4, 4)

    def why(**kw):
        args = dict(mask=None, need_weights=False, bias=None, cache=cache, memory_cache=None)
        return mha._why_not_decode(q, k, v, **{**args, **kw})

    assert why() is None
    assert why(need_weights=True) == "the weights or a bias were asked for"
    assert why(cache=None) == "no self-attention KV cache"
    assert why(mask=lambda b, h, i, j: j >= 0) == "a mask other than key padding (b, 1, 1, j)"
    assert why(mask=torch.ones(1, 1, 1, 3, dtype=torch.bool)).startswith("a mask other")
    assert why(mask=torch.ones(1, 1, 1, 4, dtype=torch.bool)) is None
    two = torch.randn(1, 4, 2, 4)
    assert (
        mha._why_not_decode(two, k, v, None, False, None, cache, None) == "2 new positions, not one"
    )
    mha.backend = "math"
    assert why() == "backend='math' was asked for"
    assert "float32 queries" in MultiHeadAttention(16, 4, backend="auto").double()._why_not_decode(
        q.double(), k.double(), v.double(), None, False, None, cache, None
    )


@pytest.mark.parametrize(("half", "rounding"), [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_a_16_bit_kv_dtype_stores_it_and_decodes_as_stored(decode_kernel, half, rounding) -> None:
    """A bfloat16 (float16) cache holds the keys and values rounded to bfloat16 (float16); the
    compiled step reads them as they are and gives what the general route gives on the same
    (widened) values."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(64, 4, num_kv_heads=2).eval()
    x = torch.randn(2, 20, 64)
    outs = {}
    for kv_dtype, backend in [(half, "auto"), (half, "math"), (None, "auto")]:
        mha.backend = backend
        cache = KVCache(32, kv_dtype=kv_dtype)
        with torch.no_grad():
            steps = [mha(x[:, t : t + 1], is_causal=True, cache=cache)[0] for t in range(20)]
        outs[kv_dtype, backend] = torch.cat(steps, 1)
        assert cache.key.dtype == cache.value.dtype == (kv_dtype or torch.float32)
    k = mha._project(x, 1).view(2, 20, 2, 16).transpose(1, 2)  # (b, h_kv, j, d)
    torch.testing.assert_close(cache.key, k)  # the float32 cache: the projected keys
    rounded = outs[half, "auto"]
    torch.testing.assert_close(rounded, outs[half, "math"], atol=1e-5, rtol=1e-5)
    assert 0 < (rounded - outs[None, "auto"]).abs().max() < rounding  # the 16 bits' rounding


def test_kv_dtype_rounds_on_append_and_refuses_other_dtypes() -> None:
    cache = KVCache(kv_dtype=torch.bfloat16)
    key, value = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    k, v = cache.append(key, value)
    assert k.dtype == v.dtype == torch.bfloat16
    assert torch.equal(k, key.bfloat16()) and torch.equal(v.float(), value.bfloat16().float())
    assert KVCache(kv_dtype=torch.float32).append(key.double(), value.double())[0].dtype == (
        torch.float32
    )
    for bad in (torch.float64, torch.int8, "bfloat16"):
        with pytest.raises(
            ValueError, match=r"kv_dtype must be torch\.float32, torch\.bfloat16 or"
        ):
            KVCache(kv_dtype=bad)


def test_inputs_the_module_cannot_take_are_named() -> None:
    mha = MultiHeadAttention(16, 2)
    x = torch.randn(1, 3, 16)
    with pytest.raises(TypeError, match=r"query is torch\.float64 but the module's weights"):
        mha(x.double())
    with pytest.raises(TypeError, match=r"rope must have rotate\(x, offset\)"):
        mha(x, rope=3)
    with pytest.raises(TypeError, match=r"KVCache\.append takes tensors; key is list"):
        KVCache().append([1], [2])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts the inputs: allowed
        assert mha(x.bfloat16())[0].dtype == torch.bfloat16


def test_kv_cache_sizes_are_ints() -> None:
    for max_len in (True, 0, 2.5):
        with pytest.raises(ValueError, match="max_len must be a positive int or None"):
            KVCache(max_len)
