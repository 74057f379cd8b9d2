"""Attention variants against direct float64 implementations of their papers' formulas:
soft-capping (Gemma 2), sinks (gpt-oss), qk-norm (Henry et al. 2020), output gates (Qiu et al.
2025), differential attention (Ye et al. 2024) and value residuals (Zhou et al. 2024), alone and
together, forward and gradients, on every backend that serves them; soft-capping and sinks also
against transformers' own eager attention functions fed the same tensors."""

from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch

from attnkit import MultiHeadAttention, RotaryEmbedding, masks, scaled_dot_product_attention
from attnkit.variants import AttentionVariants, ValueResidual, lambda_init

F64 = torch.float64
B, H, H_KV, N = 2, 4, 2, 11

CASES = [
    AttentionVariants(softcap=3.0),
    AttentionVariants(sinks=True),
    AttentionVariants(qk_norm="rms"),
    AttentionVariants(qk_norm="layer"),
    AttentionVariants(gate="head"),
    AttentionVariants(gate="element"),
    AttentionVariants(softcap=2.0, sinks=True, qk_norm="rms", gate="element"),
    AttentionVariants(differential=True, layer=1),
    AttentionVariants(differential=True, layer=4),
    AttentionVariants(differential=True, layer=2, qk_norm="layer", sinks=True, gate="head"),
    AttentionVariants(value_residual="fixed", layer=2),
    AttentionVariants(value_residual="learned", layer=3, differential=True, softcap=4.0),
]


def _module(variants: AttentionVariants, embed_dim: int = 24) -> MultiHeadAttention:
    torch.manual_seed(0)
    m = MultiHeadAttention(embed_dim, H, num_kv_heads=H_KV, variants=variants).double()
    with torch.no_grad():  # away from the initial values, so every parameter matters
        for name, p in m.named_parameters():
            if not name.startswith(("in_proj", "out_proj")):
                p.normal_()
            if ".lambda_" in name:  # lambda = exp(lq1 . lk1) - ...: keep it of order one
                p.mul_(0.3)
    return m


def _rope(t: torch.Tensor, width: int) -> torch.Tensor:
    """RoFormer's rotation at positions 0..n-1, channel k paired with k + width/2, angle
    ``p * 10000^(-2k/width)``."""
    half = width // 2
    p = torch.arange(t.shape[-2], dtype=F64)[:, None]
    angle = p * 10000.0 ** (-2.0 * torch.arange(half, dtype=F64) / width)  # (n, width/2)
    cos, sin = angle.cos(), angle.sin()
    a, b = t[..., :half], t[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def _qk_norm(t: torch.Tensor, norm: torch.nn.Module, kind: str) -> torch.Tensor:
    if kind == "rms":  # x / sqrt(mean(x^2) + eps) * g
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    centred = t - t.mean(-1, keepdim=True)  # (x - mean) / sqrt(var + eps) * g + b
    return centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight + (
        norm.bias
    )


def _softmax_map(m: MultiHeadAttention, q, k, v: AttentionVariants) -> torch.Tensor:
    """Causal softmax weights ``(b, h, i, j)`` with soft-capping and sinks as the papers write
    them: Gemma 2 ``softcap * tanh(s / softcap)``, gpt-oss ``exp(sink_h)`` in the denominator."""
    k = k.repeat_interleave(H // H_KV, 1)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if v.softcap is not None:
        s = v.softcap * torch.tanh(s / v.softcap)
    e = torch.exp(s) * torch.ones(N, N, dtype=torch.bool).tril()
    denominator = e.sum(-1, keepdim=True)
    if v.sinks:
        denominator = denominator + torch.exp(m.sinks).view(1, H, 1, 1)
    return e / denominator


def _formula(m, x, v: AttentionVariants, *, rope: bool = False, first=None):
    """The variants written out directly from their papers, causal self-attention.
    Returns ``(output (b, i, e), map (b, h, i, j))``."""
    e = m.embed_dim
    d = e // H
    q, k, val = (x @ m.in_proj.weight.T + m.in_proj.bias).split([e, H_KV * d, H_KV * d], -1)
    q = q.view(B, N, H, d).transpose(1, 2)
    k = k.view(B, N, H_KV, d).transpose(1, 2)
    val = val.view(B, N, H_KV, d).transpose(1, 2)
    if first is not None:  # Zhou et al.: A_n (lambda_1 V_n + lambda_2 V_1)
        lambdas = m.value_mix.lambdas
        val = lambdas[0] * val + lambdas[1] * first
    if v.differential:  # Ye et al.: [Q1; Q2] = X W^Q, [K1; K2] = X W^K, each of width d/2
        pairs = [(q[..., : d // 2], k[..., : d // 2]), (q[..., d // 2 :], k[..., d // 2 :])]
    else:
        pairs = [(q, k)]
    maps = []
    for qh, kh in pairs:
        if v.qk_norm is not None:
            qh = _qk_norm(qh, m.q_norm.norm, v.qk_norm)
            kh = _qk_norm(kh, m.k_norm.norm, v.qk_norm)
        if rope:
            qh, kh = _rope(qh, qh.shape[-1]), _rope(kh, kh.shape[-1])
        maps.append(_softmax_map(m, qh, kh, v))
    attention = maps[0]
    if v.differential:  # lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init
        diff = m.differential
        init = 0.8 - 0.6 * math.exp(-0.3 * (v.layer - 1))
        lam = (
            torch.exp((diff.lambda_q1 * diff.lambda_k1).sum())
            - torch.exp((diff.lambda_q2 * diff.lambda_k2).sum())
            + init
        )
        attention = maps[0] - lam * maps[1]
    out = attention @ val.repeat_interleave(H // H_KV, 1)  # (b, h, i, d)
    if v.differential:  # (1 - lambda_init) RMSNorm(head), eps 1e-5
        rms = torch.sqrt(out.pow(2).mean(-1, keepdim=True) + 1e-5)
        out = out / rms * m.differential.norm.weight * (1 - init)
    if v.gate is not None:  # Qiu et al.: out * sigmoid(x W_g + b_g), per head or channel
        g = torch.sigmoid(x @ m.gate.proj.weight.T + m.gate.proj.bias)
        out = out * g.view(B, N, H, -1).transpose(1, 2)
    out = out.transpose(1, 2).reshape(B, N, e) @ m.out_proj.weight.T + m.out_proj.bias
    return out, attention


@pytest.mark.parametrize("variants", CASES, ids=str)
@pytest.mark.parametrize("backend", ["math", "tiled", "auto"])
def test_each_variant_equals_its_formula_with_gradients(variants, backend) -> None:
    """Differential cases run with RoPE (a rotation of half the head width per half-head) and
    value-residual cases with a given first layer's values, whose gradient is checked too."""
    embed_dim = 32 if variants.differential else 24  # differential + RoPE: head width 8
    m = _module(variants, embed_dim)
    m.backend = backend
    d = embed_dim // H
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, N, embed_dim, dtype=F64, generator=g)
    weight = torch.randn(B, N, embed_dim, dtype=F64, generator=g)
    kwargs = {}
    if variants.differential:
        kwargs["rope"] = RotaryEmbedding(d // 2)
    leaves = [x.requires_grad_(), *m.parameters()]
    first = None
    if variants.value_residual is not None:
        first = torch.randn(B, H_KV, N, d, dtype=F64, generator=g).requires_grad_()
        carrier = ValueResidual()
        carrier.first = first
        kwargs["value_residual"] = carrier
        leaves.append(first)
    ours = m(x, is_causal=True, **kwargs)[0]
    theirs = _formula(m, x, variants, rope="rope" in kwargs, first=first)[0]
    results = [(out, *torch.autograd.grad((out * weight).sum(), leaves)) for out in (ours, theirs)]
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_differential_weights_are_the_difference_of_the_two_maps() -> None:
    """``need_weights`` returns ``softmax1 - lambda softmax2``: rows sum to ``1 - lambda``,
    and some weights are negative (the map can cancel common-mode attention)."""
    variants = AttentionVariants(differential=True, layer=3)
    m = _module(variants, 32)
    x = torch.randn(B, N, 32, dtype=F64, generator=torch.Generator().manual_seed(3))
    _, weights = m(x, is_causal=True, need_weights=True)
    _, expected = _formula(m, x, variants)
    torch.testing.assert_close(weights, expected, atol=1e-12, rtol=0)
    lam = m.differential.lam().detach()
    torch.testing.assert_close(weights.sum(-1), (1 - lam).expand(B, H, N), atol=1e-12, rtol=0)
    assert bool((weights < 0).any())


def test_lambda_init_follows_the_paper_schedule() -> None:
    """Ye et al. 2024, sec. 2.1: 0.8 - 0.6 exp(-0.3 (l - 1)): 0.2 at the first layer, rising
    towards 0.8."""
    assert lambda_init(1) == pytest.approx(0.2, abs=1e-15)
    assert lambda_init(2) == pytest.approx(0.8 - 0.6 * math.exp(-0.3), abs=1e-15)
    assert lambda_init(60) == pytest.approx(0.8, abs=1e-7)
    m = MultiHeadAttention(16, 2, variants=AttentionVariants(differential=True, layer=5))
    assert m.differential.lambda_init == lambda_init(5)


def test_value_residual_first_layer_hands_its_values_on() -> None:
    """Layer 1 stores its projected values ``(b, h_kv, j, d)`` and attends with them
    unchanged; a later layer without them is refused by name."""
    first = _module(AttentionVariants(value_residual="learned", layer=1))
    assert first.value_mix is None
    x = torch.randn(B, N, 24, dtype=F64)
    carrier = ValueResidual()
    out, _ = first(x, is_causal=True, value_residual=carrier)
    _, _, v = (x @ first.in_proj.weight.T + first.in_proj.bias).split([24, 12, 12], -1)
    torch.testing.assert_close(carrier.first, v.view(B, N, H_KV, 6).transpose(1, 2))
    torch.testing.assert_close(out, first(x, is_causal=True)[0])
    later = _module(AttentionVariants(value_residual="fixed", layer=2))
    assert later.value_mix.lambdas.tolist() == [0.5, 0.5]  # ResFormer's fixed mix
    assert not list(later.value_mix.parameters())
    with pytest.raises(ValueError, match="layer 2 with value_residual: pass value_residual"):
        later(x)
    carrier.first = carrier.first[:, :, :5]
    with pytest.raises(ValueError, match="do not match this layer's"):
        later(x, value_residual=carrier)


def test_bad_options_are_named() -> None:
    with pytest.raises(ValueError, match="softcap must be a positive finite number"):
        AttentionVariants(softcap=0.0)
    with pytest.raises(ValueError, match="qk_norm must be None, 'rms' or 'layer'"):
        AttentionVariants(qk_norm="batch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gate must be None, 'head' or 'element'"):
        AttentionVariants(gate="channel")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sinks must be a bool"):
        AttentionVariants(sinks=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="differential must be a bool"):
        AttentionVariants(differential="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="value_residual must be None, 'fixed' or 'learned'"):
        AttentionVariants(value_residual=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layer must be a positive int"):
        AttentionVariants(layer=0)
    with pytest.raises(ValueError, match="head width embed_dim // num_heads = 3 must be even"):
        MultiHeadAttention(12, 4, variants=AttentionVariants(differential=True))
    with pytest.raises(TypeError, match="variants must be AttentionVariants"):
        MultiHeadAttention(8, 2, variants={"softcap": 3.0})  # type: ignore[arg-type]
    m = MultiHeadAttention(8, 2, variants=AttentionVariants(softcap=3.0), backend="torch")
    with pytest.raises(ValueError, match="softcap"):  # torch's kernel declines by name
        m(torch.randn(1, 3, 8))


def test_stacks_take_the_variants_from_their_config() -> None:
    """Every block's self-attention gets the configured variants with its own depth as
    ``layer``; the decoder's KV-cache decoding equals its full forward with all of them on;
    relative positions refuse them."""
    from attnkit import TransformerConfig, TransformerDecoder

    every = AttentionVariants(
        softcap=5.0,
        sinks=True,
        qk_norm="rms",
        gate="head",
        differential=True,
        value_residual="learned",
    )
    config = TransformerConfig(
        embed_dim=32, num_heads=H, num_layers=3, vocab_size=30, positional="rope", variants=every
    )
    torch.manual_seed(0)
    decoder = TransformerDecoder(config).double().eval()
    for n, block in enumerate(decoder.blocks, start=1):
        assert block.attn.variants == dataclasses.replace(every, layer=n)
        assert block.attn.differential.lambda_init == lambda_init(n)
    assert decoder.rope.head_dim == 4  # half the head width: one rotation per half-head
    ids = torch.randint(0, 30, (2, 9))
    full, _ = decoder(ids)
    caches = decoder.new_caches()
    steps = [decoder(ids[:, t : t + 1], caches=caches)[0] for t in range(9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-10, rtol=1e-10)
    with pytest.raises(ValueError, match="variants are not available with positional='relative'"):
        TransformerConfig(
            embed_dim=24, num_heads=H, num_layers=1, positional="relative", variants=every
        )
    with pytest.raises(ValueError, match=r"head width .* = 6\) that divides by 4"):
        TransformerConfig(
            embed_dim=24, num_heads=H, num_layers=1, positional="rope", variants=every
        )


# --- transformers' own eager attention functions, fed the same tensors ------------------------


def _hf_inputs(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, 8, dtype=F64, generator=g) * 2.0  # large enough that capping bites
    k = torch.randn(B, H_KV, N, 8, dtype=F64, generator=g) * 2.0
    v = torch.randn(B, H_KV, N, 8, dtype=F64, generator=g)
    return q, k, v


def _hf_mask() -> torch.Tensor:
    """Causal and padding (the second row has 4 padded keys): bool ``(b, 1, i, j)``."""
    return masks.causal_mask(N, N) & masks.padding_mask(torch.tensor([N, N - 4]))


@pytest.mark.parametrize("backend", ["math", "tiled", "auto"])
def test_softcap_equals_gemma2_eager(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 2's ``eager_attention_forward`` (``softcap=``), forward and gradients. Its softmax
    upcasts to float32 even in float64; that rounding alone is removed, as in the
    integration tests."""
    gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    original = torch.nn.functional.softmax

    def softmax(input, dim=None, _stacklevel=3, dtype=None):  # type: ignore[no-untyped-def]
        if input.dtype == torch.float64 and dtype == torch.float32:
            dtype = None
        return original(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax)
    module = types.SimpleNamespace(num_key_value_groups=H // H_KV, training=False, head_dim=8)
    keep = _hf_mask()
    results = []
    for ours in (True, False):
        q, k, v = (t.clone().requires_grad_() for t in _hf_inputs(0))
        if ours:
            out = scaled_dot_product_attention(q, k, v, keep, softcap=1.5, backend=backend)
        else:
            additive = masks.to_additive(keep, F64)
            out, _ = gemma2.eager_attention_forward(
                module, q, k, v, additive, scaling=8**-0.5, softcap=1.5
            )
            out = out.transpose(1, 2)  # transformers returns (b, i, h, d)
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", ["math", "tiled", "auto"])
def test_sinks_equal_gpt_oss_eager(backend: str) -> None:
    """gpt-oss's ``eager_attention_forward`` (the module's ``sinks``), forward and gradients,
    the sinks' gradient included; its softmax keeps float64."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    keep = _hf_mask()
    sinks0 = torch.linspace(-1.0, 2.0, H, dtype=F64)
    results = []
    for ours in (True, False):
        q, k, v = (t.clone().requires_grad_() for t in _hf_inputs(1))
        sinks = sinks0.clone().requires_grad_()
        if ours:
            out = scaled_dot_product_attention(q, k, v, keep, sinks=sinks, backend=backend)
        else:
            module = types.SimpleNamespace(
                num_key_value_groups=H // H_KV, training=False, sinks=sinks
            )
            additive = masks.to_additive(keep, F64)
            out, _ = gpt_oss.eager_attention_forward(module, q, k, v, additive, scaling=8**-0.5)
            out = out.transpose(1, 2)  # (b, i, h, d) -> (b, h, i, d)
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v, sinks))))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_returned_weights_equal_the_eager_weights() -> None:
    """The weights attnkit returns are eager's: capped (Gemma 2) and with the sink's share
    left out (gpt-oss, rows summing to less than one)."""
    gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    q, k, v = (t.to(torch.float32) for t in _hf_inputs(2))
    keep = _hf_mask()
    additive = masks.to_additive(keep, torch.float32)
    sinks = torch.linspace(-1.0, 2.0, H)
    module = types.SimpleNamespace(
        num_key_value_groups=H // H_KV, training=False, head_dim=8, sinks=sinks
    )
    _, theirs = gemma2.eager_attention_forward(module, q, k, v, additive, softcap=1.5)
    _, ours = scaled_dot_product_attention(q, k, v, keep, softcap=1.5, return_weights=True)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    _, theirs = gpt_oss.eager_attention_forward(module, q, k, v, additive, scaling=8**-0.5)
    _, ours = scaled_dot_product_attention(q, k, v, keep, sinks=sinks, return_weights=True)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    rows = ours.sum(-1)
    assert bool((rows <= 1 + 1e-6).all()) and bool((rows < 0.9).any())
