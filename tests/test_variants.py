"""Attention variants against direct float64 implementations of their papers' formulas:
soft-capping (Gemma 2), sinks (gpt-oss), qk-norm (Henry et al. 2020) and output gates
(Qiu et al. 2025), alone and together, forward and gradients, on every backend that serves
them."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit import MultiHeadAttention
from attnkit.variants import AttentionVariants

F64 = torch.float64
E, H, H_KV, N = 24, 4, 2, 11
D = E // H

CASES = [
    AttentionVariants(softcap=3.0),
    AttentionVariants(sinks=True),
    AttentionVariants(qk_norm="rms"),
    AttentionVariants(qk_norm="layer"),
    AttentionVariants(gate="head"),
    AttentionVariants(gate="element"),
    AttentionVariants(softcap=2.0, sinks=True, qk_norm="rms", gate="element"),
]


def _module(variants: AttentionVariants) -> MultiHeadAttention:
    torch.manual_seed(0)
    m = MultiHeadAttention(E, H, num_kv_heads=H_KV, variants=variants).double()
    with torch.no_grad():  # away from the initial values, so every parameter matters
        for name, p in m.named_parameters():
            if not name.startswith(("in_proj", "out_proj")):
                p.normal_()
    return m


def _formula(m: MultiHeadAttention, x: torch.Tensor, v: AttentionVariants) -> torch.Tensor:
    """The variants written out directly from their papers, causal self-attention."""
    q, k, val = (x @ m.in_proj.weight.T + m.in_proj.bias).split([E, H_KV * D, H_KV * D], -1)
    q = q.view(2, N, H, D).transpose(1, 2)
    k = k.view(2, N, H_KV, D).transpose(1, 2)
    val = val.view(2, N, H_KV, D).transpose(1, 2)
    if v.qk_norm == "rms":  # x / sqrt(mean(x^2) + eps) * g
        q = q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * m.q_norm.norm.weight
        k = k / torch.sqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * m.k_norm.norm.weight
    elif v.qk_norm == "layer":  # (x - mean) / sqrt(var + eps) * g + b

        def layer(t, norm):
            centred = t - t.mean(-1, keepdim=True)
            var = centred.pow(2).mean(-1, keepdim=True)
            return centred / torch.sqrt(var + 1e-6) * norm.weight + norm.bias

        q, k = layer(q, m.q_norm.norm), layer(k, m.k_norm.norm)
    k, val = k.repeat_interleave(H // H_KV, 1), val.repeat_interleave(H // H_KV, 1)
    s = q @ k.transpose(-2, -1) / math.sqrt(D)
    if v.softcap is not None:  # Gemma 2: softcap * tanh(s / softcap)
        s = v.softcap * torch.tanh(s / v.softcap)
    e = torch.exp(s) * torch.ones(N, N, dtype=torch.bool).tril()
    denominator = e.sum(-1, keepdim=True)
    if v.sinks:  # gpt-oss: exp(sink_h) joins the denominator
        denominator = denominator + torch.exp(m.sinks).view(1, H, 1, 1)
    out = (e / denominator) @ val  # (b, h, i, d)
    if v.gate is not None:  # Qiu et al.: out * sigmoid(x W_g + b_g), per head or channel
        g = torch.sigmoid(x @ m.gate.proj.weight.T + m.gate.proj.bias)
        out = out * g.view(2, N, H, -1).transpose(1, 2)
    return out.transpose(1, 2).reshape(2, N, E) @ m.out_proj.weight.T + m.out_proj.bias


@pytest.mark.parametrize("variants", CASES, ids=str)
@pytest.mark.parametrize("backend", ["math", "tiled", "auto"])
def test_each_variant_equals_its_formula_with_gradients(variants, backend) -> None:
    m = _module(variants)
    m.backend = backend
    x = torch.randn(2, N, E, dtype=F64, generator=torch.Generator().manual_seed(1))
    weight = torch.randn(2, N, E, dtype=F64, generator=torch.Generator().manual_seed(2))
    params = [x.requires_grad_(), *m.parameters()]
    results = []
    for out in (m(x, is_causal=True)[0], _formula(m, x, variants)):
        results.append((out, *torch.autograd.grad((out * weight).sum(), params)))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_bad_options_are_named() -> None:
    with pytest.raises(ValueError, match="softcap must be a positive finite number"):
        AttentionVariants(softcap=0.0)
    with pytest.raises(ValueError, match="qk_norm must be None, 'rms' or 'layer'"):
        AttentionVariants(qk_norm="batch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gate must be None, 'head' or 'element'"):
        AttentionVariants(gate="channel")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sinks must be a bool"):
        AttentionVariants(sinks=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="variants must be AttentionVariants"):
        MultiHeadAttention(8, 2, variants={"softcap": 3.0})  # type: ignore[arg-type]
    m = MultiHeadAttention(8, 2, variants=AttentionVariants(softcap=3.0), backend="torch")
    with pytest.raises(ValueError, match="softcap"):  # torch's kernel declines by name
        m(torch.randn(1, 3, 8))


def test_stacks_take_the_variants_from_their_config() -> None:
    """Every block's self-attention gets the configured variants; the decoder's KV-cache
    decoding equals its full forward with all of them on; relative positions refuse them."""
    from attnkit import TransformerConfig, TransformerDecoder

    every = AttentionVariants(softcap=5.0, sinks=True, qk_norm="rms", gate="head")
    config = TransformerConfig(
        embed_dim=E, num_heads=H, num_layers=2, vocab_size=30, positional="rope", variants=every
    )
    torch.manual_seed(0)
    decoder = TransformerDecoder(config).double().eval()
    assert all(block.attn.variants == every for block in decoder.blocks)
    ids = torch.randint(0, 30, (2, 9))
    full, _ = decoder(ids)
    caches = decoder.new_caches()
    steps = [decoder(ids[:, t : t + 1], caches=caches)[0] for t in range(9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-10, rtol=1e-10)
    with pytest.raises(ValueError, match="variants are not available with positional='relative'"):
        TransformerConfig(
            embed_dim=E, num_heads=H, num_layers=1, positional="relative", variants=every
        )
