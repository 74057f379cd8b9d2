"""The gated delta rule and Gated DeltaNet against transformers' Qwen3-Next (float64 copies of
its math, see ``hf_float64``), the chunked form against the recurrent reference (outputs, states
and gradients), state-cached decoding against the full forward, and bad input."""

from __future__ import annotations

import pytest
import torch

from attnkit import GatedDeltaNet, gated_delta_rule
from attnkit.gated_delta import GatedDeltaCache

pytest.importorskip("transformers")
from hf_float64 import float64_module
from modern_oracles import (
    F64,
    assert_equal_with_input_gradients,
    assert_same_model,
    gated_delta_layer,
    qwen3_next_pair,
)

QWEN = "qwen3_next.modeling_qwen3_next"


def _inputs(b=2, h=2, h_v=4, n=37, d_k=8, d_v=6, seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d_k, generator=gen, dtype=dtype)
    k = torch.randn(b, h, n, d_k, generator=gen, dtype=dtype)
    v = torch.randn(b, h_v, n, d_v, generator=gen, dtype=dtype)
    g = -torch.rand(b, h_v, n, generator=gen, dtype=dtype)  # decays in (exp(-1), 1]
    beta = torch.rand(b, h_v, n, generator=gen, dtype=dtype)
    state = torch.randn(b, h_v, d_k, d_v, generator=gen, dtype=dtype)
    return q, k, v, g, beta, state


def _hf_layout(*ts):
    """attnkit's (b, h, n, ...) as transformers' (b, n, h, ...)."""
    return [t.transpose(1, 2) for t in ts]


@pytest.mark.parametrize("method", ["recurrent", "chunked"])
def test_rule_equals_transformers_reference_in_float64(method):
    q, k, v, g, beta, s0 = _inputs()
    ref, ref_state = float64_module(QWEN).torch_recurrent_gated_delta_rule(
        *_hf_layout(q, k, v, g, beta),
        initial_state=s0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    out, state = gated_delta_rule(
        q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm=True,
        method=method, chunk_size=8,
    )  # fmt: skip
    torch.testing.assert_close(out.transpose(1, 2), ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=1e-10)


def test_rule_matches_transformers_float32_chunked_to_float32_precision():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k, v, g, beta, _ = _inputs(dtype=torch.float32, n=70)
    ref, _ = torch_chunk_gated_delta_rule(
        *_hf_layout(q, k, v, g, beta), use_qk_l2norm_in_kernel=True
    )
    out, _ = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
    torch.testing.assert_close(out.transpose(1, 2), ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize(("n", "chunk"), [(37, 8), (5, 16), (64, 16), (1, 4)])
@pytest.mark.parametrize("l2norm", [True, False])
def test_chunked_equals_recurrent_with_gradients(n, chunk, l2norm):
    inputs = [t.requires_grad_() for t in _inputs(n=n, seed=n)]
    q, k, v, g, beta, s0 = inputs
    if not l2norm:  # unnormalised keys: keep beta |k|^2 below 2 so the rule stays stable
        with torch.no_grad():
            k.mul_(0.3)
    gen = torch.Generator().manual_seed(1)
    w_out = torch.randn(2, 4, n, 6, generator=gen, dtype=F64)
    w_state = torch.randn(2, 4, 8, 6, generator=gen, dtype=F64)
    results = []
    for method in ("recurrent", "chunked"):
        out, state = gated_delta_rule(
            q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm=l2norm,
            method=method, chunk_size=chunk,
        )  # fmt: skip
        loss = (out * w_out).sum() + (state * w_state).sum()
        results.append((out, state, torch.autograd.grad(loss, inputs)))
    (o1, s1, g1), (o2, s2, g2) = results
    torch.testing.assert_close(o2, o1, rtol=0, atol=1e-10)
    torch.testing.assert_close(s2, s1, rtol=0, atol=1e-10)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    ("n", "chunk", "resets"), [(6, 4, [2]), (13, 4, [0, 5, 12]), (20, 8, [7, 8])]
)
def test_a_decay_of_minus_infinity_empties_the_state_in_both_methods(n, chunk, resets):
    """g = -inf (exp(g) = 0): nothing before it reaches a later position. The chunked form's
    cumulative sums meet -inf - -inf there; it must still equal the recurrent reference."""
    q, k, v, g, beta, s0 = _inputs(n=n, seed=n)
    with torch.no_grad():
        k.mul_(0.3)
        g[:, 1, resets] = float("-inf")
    inputs = [t.requires_grad_() for t in (q, k, v, g, beta, s0)]
    results = []
    for method in ("recurrent", "chunked"):
        out, state = gated_delta_rule(
            q, k, v, g, beta, initial_state=s0, output_final_state=True, method=method,
            chunk_size=chunk,
        )  # fmt: skip
        loss = out.square().sum() + state.square().sum()
        results.append((out, state, torch.autograd.grad(loss, inputs)))
    (o1, s1, g1), (o2, s2, g2) = results
    assert not o2.isnan().any() and not s2.isnan().any()
    torch.testing.assert_close(o2, o1, rtol=0, atol=1e-10)
    torch.testing.assert_close(s2, s1, rtol=0, atol=1e-10)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10)


def test_final_state_continues_a_sequence():
    q, k, v, g, beta, _ = _inputs(n=41)
    full, full_state = gated_delta_rule(q, k, v, g, beta, output_final_state=True, chunk_size=8)
    cut = 19
    first, state = gated_delta_rule(
        *(t[:, :, :cut] for t in (q, k, v, g, beta)), output_final_state=True, chunk_size=8
    )
    rest, last = gated_delta_rule(
        *(t[:, :, cut:] for t in (q, k, v, g, beta)),
        initial_state=state,
        output_final_state=True,
        method="recurrent",
    )
    torch.testing.assert_close(torch.cat([first, rest], dim=2), full, rtol=0, atol=1e-10)
    torch.testing.assert_close(last, full_state, rtol=0, atol=1e-10)


def test_rule_keeps_the_input_dtype_and_computes_in_float32():
    q, k, v, g, beta, _ = _inputs(dtype=torch.bfloat16)
    out, state = gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True)
    assert out.dtype == state.dtype == torch.bfloat16
    ref, _ = gated_delta_rule(*(t.to(F64) for t in (q, k, v, g, beta)), use_qk_l2norm=True)
    assert (out.to(F64) - ref).abs().max() < 0.05


def test_layer_equals_transformers_in_float64_with_input_gradients():
    hf = gated_delta_layer(float64_module(QWEN))
    ours = GatedDeltaNet.from_transformers(hf)
    x = torch.randn(2, 37, 32, dtype=F64, requires_grad=True)
    ref = hf(x)
    out, weights = ours(x)
    assert weights is None
    assert_equal_with_input_gradients(out, ref, x)


def test_layer_matches_the_float32_transformers_module():
    from transformers.models.qwen3_next import modeling_qwen3_next

    hf = gated_delta_layer(modeling_qwen3_next).float()
    ours = GatedDeltaNet.from_transformers(hf)
    assert ours.q_proj.weight.dtype == torch.float32
    x = torch.randn(2, 23, 32)
    torch.testing.assert_close(ours(x)[0], hf(x), rtol=0, atol=2e-5)


def test_cached_decoding_equals_the_full_forward():
    hf = gated_delta_layer(float64_module(QWEN))
    ours = GatedDeltaNet.from_transformers(hf)
    x = torch.randn(2, 29, 32, dtype=F64)
    full, _ = ours(x)
    cache = GatedDeltaCache()
    steps = [ours(x[:, :11], cache=cache)[0]]  # a prefill (chunked), then one token at a time
    for t in range(11, 29):
        steps.append(ours(x[:, t : t + 1], cache=cache)[0])
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-10)
    assert len(cache) == 29
    assert cache.state.shape == (2, 4, 8, 6) and cache.conv.shape == (2, 2 * 16 + 24, 3)
    assert cache.nbytes() == 8 * (2 * 4 * 8 * 6 + 2 * 56 * 3)  # constant in the length


def test_bad_input_is_named():
    q, k, v, g, beta, s0 = _inputs()
    with pytest.raises(ValueError, match="chunk_size"):
        gated_delta_rule(q, k, v, g, beta, chunk_size=0)
    with pytest.raises(ValueError, match="method"):
        gated_delta_rule(q, k, v, g, beta, method="parallel")
    with pytest.raises(ValueError, match="multiple of the key heads"):
        gated_delta_rule(q, k, v[:, :3], g[:, :3], beta[:, :3])
    with pytest.raises(ValueError, match="g must have shape"):
        gated_delta_rule(q, k, v, g[:, :, :-1], beta)
    with pytest.raises(ValueError, match="initial_state"):
        gated_delta_rule(q, k, v, g, beta, initial_state=s0[..., :-1])
    with pytest.raises(ValueError, match="q and k"):
        gated_delta_rule(q, k[..., :-1], v, g, beta)
    with pytest.raises(ValueError, match=r"v must have shape"):
        gated_delta_rule(q, k, v[0], g, beta)
    with pytest.raises(ValueError, match="at least one position"):
        gated_delta_rule(q[:, :, :0], k[:, :, :0], v[:, :, :0], g[:, :, :0], beta[:, :, :0])
    with pytest.raises(ValueError, match="multiple of num_heads"):
        GatedDeltaNet(32, 3, 8, num_value_heads=4)
    layer = GatedDeltaNet(32, 2, 8)
    with pytest.raises(ValueError, match="is_causal"):
        layer(torch.randn(1, 3, 32), is_causal=False)
    with pytest.raises(ValueError, match="embed_dim=32"):
        layer(torch.randn(1, 3, 31))
    with pytest.raises(TypeError, match="Qwen3NextGatedDeltaNet"):
        GatedDeltaNet.from_transformers(torch.nn.Linear(2, 2))


def test_a_small_qwen3_next_model_equals_transformers_and_generates_the_same():
    """Gated DeltaNet, Gated DeltaNet, gated softmax attention (attnkit's MultiHeadAttention with
    qk-norm, an output gate and partial RoPE), SwiGLU MLPs: logits in float64 against
    Qwen3NextForCausalLM with the same weights, and greedy decoding through GatedDeltaCaches
    and KVCaches against its generate()."""
    assert_same_model(*qwen3_next_pair())


def test_empty_heads_and_a_state_that_is_not_a_tensor_are_named():
    q, k, v, g, beta, _ = _inputs(n=3)
    with pytest.raises(ValueError, match="at least one position, head and key channel"):
        gated_delta_rule(q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0])
    with pytest.raises(ValueError, match="at least one position, head and key channel"):
        gated_delta_rule(q[..., :0], k[..., :0], v, g, beta)
    with pytest.raises(TypeError, match="initial_state must be a tensor or None, got list"):
        gated_delta_rule(q, k, v, g, beta, initial_state=[[0.0]])


def test_a_cache_from_another_layer_is_named():
    first, other = GatedDeltaNet(16, 2, 8).eval(), GatedDeltaNet(32, 4, 8).eval()
    cache = GatedDeltaCache()
    with torch.no_grad():
        first(torch.randn(1, 3, 16), cache=cache)
        with pytest.raises(ValueError, match="the cache comes from another layer or batch"):
            other(torch.randn(1, 2, 32), cache=cache)
        with pytest.raises(ValueError, match="the cache comes from another layer or batch"):
            first(torch.randn(2, 2, 16), cache=cache)
