"""Multi-head latent attention against transformers' DeepseekV3Attention (a float64 copy of its
math, see ``hf_float64``, and the float32 original), the absorbed form against the expanded one
(outputs and every gradient), latent-cached decoding against the full forward, the cache's size,
the prefill on attnkit's backends, and bad input."""

from __future__ import annotations

import pytest
import torch

from attnkit import MultiHeadLatentAttention
from attnkit.mla import LatentCache

pytest.importorskip("transformers")
from hf_float64 import float64_module
from modern_oracles import (
    D_C,
    D_R,
    F64,
    E,
    H,
    assert_equal_with_input_gradients,
    assert_same_model,
    deepseek_attention,
    deepseek_forward,
    deepseek_pair,
    mla_module,
)

V3 = "deepseek_v3.modeling_deepseek_v3"


CASES = [
    dict(),
    dict(rope_interleave=False),
    dict(q_lora_rank=None),
    dict(attention_bias=True),
]


@pytest.mark.parametrize("overrides", CASES, ids=["v3", "halves", "no-q-latent", "bias"])
@pytest.mark.parametrize("absorb", [False, True], ids=["expanded", "absorbed"])
def test_equals_transformers_in_float64_with_input_gradients(overrides, absorb):
    hf, rotary = deepseek_attention(float64_module(V3), **overrides)
    ours = MultiHeadLatentAttention.from_transformers(hf, backend="math")
    x = torch.randn(2, 13, E, dtype=F64, requires_grad=True)
    ref = deepseek_forward(hf, rotary, x)
    out, weights = ours(x, absorb=absorb)
    assert weights is None
    assert_equal_with_input_gradients(out, ref, x)


def test_matches_the_float32_transformers_module():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    hf, rotary = deepseek_attention(modeling_deepseek_v3, dtype=torch.float32)
    ours = MultiHeadLatentAttention.from_transformers(hf)
    assert ours.kv_up.weight.dtype == torch.float32
    x = torch.randn(2, 11, E)
    torch.testing.assert_close(ours(x)[0], deepseek_forward(hf, rotary, x), rtol=0, atol=2e-5)


def _module(**kwargs):
    torch.manual_seed(1)
    m = mla_module(**kwargs).double()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return m


def test_absorbed_equals_expanded_with_all_gradients():
    m = _module(bias=True)
    x = torch.randn(2, 9, E, dtype=F64, requires_grad=True)
    mask = torch.rand(2, 1, 9, 9, generator=torch.Generator().manual_seed(0)) > 0.3
    mask |= torch.eye(9, dtype=torch.bool)  # every row keeps a key
    params = [x, *m.parameters()]
    grads = []
    for absorb in (False, True):
        out, _ = m(x, absorb=absorb, mask=mask)
        grads.append((out, torch.autograd.grad(out.pow(2).sum(), params)))
    (o1, g1), (o2, g2) = grads
    torch.testing.assert_close(o2, o1, rtol=0, atol=1e-10)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10)


@pytest.mark.parametrize("absorb", [None, False])
def test_cached_decoding_equals_the_full_forward(absorb):
    m = _module()
    x = torch.randn(2, 17, E, dtype=F64)
    full, _ = m(x)
    cache = LatentCache()
    steps = [m(x[:, :6], cache=cache, absorb=absorb)[0]]
    for t in range(6, 17):
        steps.append(m(x[:, t : t + 1], cache=cache, absorb=absorb)[0])
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-10)
    # the cache holds the latent and the decoupled RoPE key: d_c + d_r numbers per token
    assert cache.latent.shape == (2, 17, D_C) and cache.rope_key.shape == (2, 17, D_R)
    assert cache.nbytes() == 2 * 17 * (D_C + D_R) * 8
    assert m.cache_bytes_per_token(torch.bfloat16) == (D_C + D_R) * 2


def test_a_preallocated_cache_decodes_the_same_and_refuses_to_overflow():
    m = _module()
    x = torch.randn(2, 9, E, dtype=F64)
    full, _ = m(x)
    cache = LatentCache(max_len=9)
    steps = [m(x[:, :4], cache=cache)[0]]
    steps += [m(x[:, t : t + 1], cache=cache)[0] for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="LatentCache is full"):
        m(x[:, :1], cache=cache)
    with pytest.raises(ValueError, match="max_len"):
        LatentCache(max_len=0)


def test_cache_is_the_size_the_paper_states():
    """DeepSeek-V2 (section 2.1.4, table 1): d_c = 4 d_h and d_r = d_h / 2 cache 4.5 d_h numbers
    per token and layer, against 2 h d_h for multi-head attention's keys and values."""
    h, d_h = 128, 128
    with torch.device("meta"):  # DeepSeek-V2's sizes, without allocating its weights
        m = MultiHeadLatentAttention(
            5120, h, kv_rank=4 * d_h, nope_dim=d_h, rope_dim=d_h // 2, v_dim=d_h, q_rank=1536
        )
    per_token = m.cache_bytes_per_token(torch.bfloat16) // 2
    assert per_token == 4.5 * d_h == 576
    assert per_token / (2 * h * d_h) == pytest.approx(1 / 56.9, rel=1e-3)


@pytest.mark.parametrize("backend", ["tiled", "torch"])
def test_prefill_runs_on_attnkit_backends(backend):
    m = _module()
    x = torch.randn(2, 19, E, dtype=F64)
    ref, _ = m(x)  # "auto"
    m.backend = backend
    out, _ = m(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)


def test_need_weights_returns_rows_that_sum_to_one():
    m = _module()
    x = torch.randn(1, 7, E, dtype=F64)
    _, weights = m(x, need_weights=True)
    assert weights.shape == (1, H, 7, 7)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, H, 7, dtype=F64))
    assert (weights.triu(1) == 0).all()


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="rope_dim must be even"):
        MultiHeadLatentAttention(E, H, kv_rank=8, nope_dim=4, rope_dim=3, v_dim=4)
    with pytest.raises(ValueError, match="kv_rank"):
        MultiHeadLatentAttention(E, H, kv_rank=0, nope_dim=4, rope_dim=4, v_dim=4)
    m = _module()
    with pytest.raises(ValueError, match="embed_dim=32"):
        m(torch.randn(1, 3, E + 1, dtype=F64))
    with pytest.raises(TypeError, match="LatentCache"):
        m(torch.randn(1, 3, E, dtype=F64), cache={})
    cache = LatentCache()
    m(torch.randn(1, 3, E, dtype=F64), cache=cache)
    with pytest.raises(ValueError, match="another layer, model or batch"):
        m(torch.randn(2, 1, E, dtype=F64), cache=cache)
    with pytest.raises(TypeError, match="DeepseekV3Attention"):
        MultiHeadLatentAttention.from_transformers(torch.nn.Linear(2, 2))
    hf, _ = deepseek_attention(float64_module(V3), rope_parameters={
        "rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0,
        "original_max_position_embeddings": 16,
    })  # fmt: skip
    with pytest.raises(ValueError, match="only the default RoPE"):
        MultiHeadLatentAttention.from_transformers(hf)


def test_a_small_deepseek_v3_model_equals_transformers_and_generates_the_same():
    """Embeddings, two layers of MLA + SwiGLU with RMSNorms, a head: logits in float64 against
    DeepseekV3ForCausalLM with the same weights, and greedy decoding through LatentCaches
    against its generate()."""
    assert_same_model(*deepseek_pair())


@pytest.mark.parametrize("absorb", [True, False])
def test_a_bad_mask_is_named_in_both_forms(absorb):
    m = MultiHeadLatentAttention(16, 2, kv_rank=8, nope_dim=4, rope_dim=4, v_dim=4).eval()
    x = torch.randn(1, 3, 16)
    cases = [
        (torch.ones(3, 2, dtype=torch.bool), ValueError, "does not broadcast to the scores"),
        (torch.ones(3, 3), TypeError, "mask must be a bool tensor"),
        ([[True]], TypeError, "mask must be a bool tensor or a mask function, got list"),
    ]
    for mask, error, message in cases:
        with pytest.raises(error, match=message):
            m(x, mask=mask, absorb=absorb)


def test_latent_cache_names_a_kv_that_is_not_a_tensor():
    with pytest.raises(TypeError, match=r"LatentCache\.append takes kv \(b, n, d_c \+ d_r\)"):
        LatentCache().append([1], 3)
