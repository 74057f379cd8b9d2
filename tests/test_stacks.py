"""Stacks: shapes, padding, KV-cache decoding equals a full forward, checkpointing,
initialisation, low precision."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from attnkit import TransformerConfig, TransformerDecoder, TransformerEncoder, masks
from attnkit.variants import AttentionVariants

D64 = torch.float64


CFG = TransformerConfig(embed_dim=16, num_heads=4, num_layers=2, vocab_size=23, ffn_dim=24)


@pytest.mark.parametrize(
    "positional", ["sinusoidal", "learned", "rope", "alibi", "relative", "none"]
)
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_shapes_weights_and_padding(positional: str, norm_first: bool) -> None:
    cfg = dataclasses.replace(CFG, positional=positional, norm_first=norm_first)
    torch.manual_seed(0)
    enc = TransformerEncoder(cfg).to(D64).eval()
    ids = torch.randint(0, 23, (2, 6))
    pad = masks.padding_mask(torch.tensor([6, 3]))
    hidden, weights = enc(ids, pad, need_weights=True)
    assert hidden.shape == (2, 6, 16)
    assert weights is not None and len(weights) == 2
    for w in weights:
        assert w.shape == (2, 4, 6, 6)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 6, dtype=D64))
        assert (w[1, :, :, 3:] == 0).all()  # padded keys get no weight
    # padded positions do not influence real ones
    ids2 = ids.clone()
    ids2[1, 3:] = (ids2[1, 3:] + 1) % 23
    hidden2, none = enc(ids2, pad)
    assert none is None
    torch.testing.assert_close(hidden2[1, :3], hidden[1, :3], atol=1e-12, rtol=0)


def test_encoder_on_vectors_and_bad_inputs() -> None:
    cfg = dataclasses.replace(CFG, vocab_size=None)
    enc = TransformerEncoder(cfg)
    out, _ = enc(torch.randn(2, 4, 16))
    assert out.shape == (2, 4, 16)
    with pytest.raises(ValueError, match=r"float vectors \(b, i, embed_dim=16\)"):
        enc(torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="token ids"):
        TransformerEncoder(CFG)(torch.randn(2, 4, 16))
    with pytest.raises(ValueError, match="divisible by num_heads"):
        TransformerConfig(embed_dim=10, num_heads=4, num_layers=1)
    with pytest.raises(ValueError, match="positional must be one of"):
        TransformerConfig(embed_dim=8, num_heads=2, num_layers=1, positional="xyz")


@pytest.mark.parametrize("positional", ["sinusoidal", "learned", "rope", "alibi", "relative"])
def test_decoder_cache_equals_full_forward_and_is_causal(positional: str) -> None:
    cfg = dataclasses.replace(CFG, positional=positional, cross_attention=True, num_kv_heads=2)
    torch.manual_seed(0)
    dec = TransformerDecoder(cfg).to(D64).eval()
    ids = torch.randint(0, 23, (2, 7))
    memory = torch.randn(2, 5, 16, dtype=D64)
    memory_mask = masks.padding_mask(torch.tensor([5, 2]))
    full, _ = dec(ids, memory, memory_mask=memory_mask)
    for cross_caches in (None, dec.new_caches()):
        kw = dict(memory_mask=memory_mask, caches=dec.new_caches(), cross_caches=cross_caches)
        steps = [dec(ids[:, :2], memory, **kw)[0]]
        for t in range(2, 7):
            steps.append(dec(ids[:, t : t + 1], memory, **kw)[0])
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-10, rtol=0)
    # causality: changing tokens after t leaves logits up to t unchanged
    ids2 = ids.clone()
    ids2[:, 4:] = (ids2[:, 4:] + 3) % 23
    full2, _ = dec(ids2, memory, memory_mask=memory_mask)
    torch.testing.assert_close(full2[:, :4], full[:, :4], atol=1e-12, rtol=0)


@pytest.mark.parametrize("cross_attention", [False, True])
def test_generate_greedy_matches_recomputation(cross_attention: bool) -> None:
    cfg = dataclasses.replace(CFG, positional="rope", cross_attention=cross_attention)
    torch.manual_seed(1)
    dec = TransformerDecoder(cfg).to(D64).eval()
    prompt = torch.randint(0, 23, (2, 3))
    memory = torch.randn(2, 4, 16, dtype=D64) if cross_attention else None
    out = dec.generate(prompt, 5, memory)
    assert out.shape == (2, 8) and torch.equal(out[:, :3], prompt)
    ids = prompt
    with torch.no_grad():
        for _ in range(5):  # no cache: the whole sequence every step
            logits, _ = dec(ids, memory)
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ids)


@pytest.mark.parametrize("norm_first", [False, True])
def test_checkpointing_gives_the_same_gradients(norm_first: bool) -> None:
    cfg = dataclasses.replace(CFG, norm_first=norm_first, positional="alibi")
    torch.manual_seed(0)
    plain = TransformerEncoder(cfg).to(D64).train()
    ckpt = TransformerEncoder(dataclasses.replace(cfg, gradient_checkpointing=True)).to(D64)
    ckpt.load_state_dict(plain.state_dict())
    ckpt.train()
    ids = torch.randint(0, 23, (2, 6))
    pad = masks.padding_mask(torch.tensor([6, 4]))
    for model in (plain, ckpt):
        out, _ = model(ids, pad)
        (out**2).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, atol=1e-12, rtol=0, msg=name)


def test_checkpointing_actually_recomputes() -> None:
    cfg = dataclasses.replace(CFG, gradient_checkpointing=True)
    enc = TransformerEncoder(cfg).train()
    calls = []
    enc.blocks[0].attn.register_forward_pre_hook(lambda *a: calls.append(1))
    out, _ = enc(torch.randint(0, 23, (1, 4)))
    out.sum().backward()
    assert len(calls) == 2  # forward, then again in the backward pass


def test_initialisation_of_stacks() -> None:
    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, embed_dim=64, vocab_size=2000, ffn_dim=128)
    enc = TransformerEncoder(cfg)
    # token embeddings N(0, 1/e), scaled by sqrt(e) in the forward: unit variance
    assert abs(enc.embed.weight.std().item() - 64**-0.5) < 0.05 * 64**-0.5
    block = enc.blocks[0]
    for norm in (block.attn_norm, block.ffn_norm, enc.norm):
        assert (norm.weight == 1).all() and (norm.bias == 0).all()
    assert (block.ffn.up.bias == 0).all() and (block.ffn.down.bias == 0).all()
    # feed-forward weights: torch's Linear default, uniform with bound 1/sqrt(fan_in)
    assert block.ffn.up.weight.abs().max() <= 64**-0.5
    assert block.ffn.down.weight.abs().max() <= 128**-0.5


def test_alibi_encoder_propagates_a_nan_token_and_trains_under_autocast() -> None:
    """A NaN in one token's vectors reaches every row of an ALiBi encoder (bidirectional: every
    row sees every token) on its default backend, instead of vanishing; in a causal stack it
    reaches only the rows after it. The same encoder trains under CPU autocast (bf16, fp16)."""
    torch.manual_seed(0)
    config = TransformerConfig(embed_dim=32, num_heads=4, num_layers=2, positional="alibi")
    encoder = TransformerEncoder(config)
    x = torch.randn(2, 40, 32)
    x[1, 7] = float("nan")
    out, _ = encoder(x)
    assert not bool(torch.isnan(out[0]).any())
    assert bool(torch.isnan(out[1]).all())
    causal_out, _ = encoder(x, is_causal=True)
    assert not bool(torch.isnan(causal_out[1, :7]).any())
    assert bool(torch.isnan(causal_out[1, 7:]).all())
    clean = torch.randn(2, 40, 32)
    for cast in (torch.bfloat16, torch.float16):
        encoder.zero_grad()
        with torch.autocast("cpu", dtype=cast):
            hidden, _ = encoder(clean, masks.padding_mask([40, 25]))
        hidden.float().square().mean().backward()
        grads = [p.grad for p in encoder.parameters() if p.requires_grad]
        assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads), cast


@pytest.mark.parametrize("mode", ["autocast-bf16", "autocast-fp16", "bf16", "fp16"])
@pytest.mark.parametrize("positional", ["sinusoidal", "learned", "rope", "alibi", "relative"])
def test_stacks_run_forward_and_backward_in_low_precision(mode: str, positional: str) -> None:
    """Every positional scheme, encoder and decoder (with a KV cache), forward and backward,
    under CPU autocast and with bfloat16/float16 weights: finite outputs and gradients, and the
    output dtype autocast or the weights give."""
    dtype = torch.bfloat16 if mode.endswith("bf16") else torch.float16
    torch.manual_seed(0)
    config = TransformerConfig(
        embed_dim=32, num_heads=4, num_layers=2, positional=positional, vocab_size=50
    )
    ids = torch.randint(0, 50, (2, 12))
    for stack in (TransformerEncoder(config), TransformerDecoder(config)):
        if not mode.startswith("autocast"):
            stack = stack.to(dtype)
        low = mode.startswith("autocast")
        with torch.autocast("cpu", dtype=dtype) if low else contextlib.nullcontext():
            if isinstance(stack, TransformerDecoder):
                caches = stack.new_caches()
                first, _ = stack(ids[:, :7], caches=caches)
                rest, _ = stack(ids[:, 7:], caches=caches)
                out = torch.cat([first, rest], dim=1)
            else:
                out, _ = stack(ids, masks.padding_mask([12, 5]))
        assert bool(torch.isfinite(out).all()), type(stack).__name__
        if not mode.startswith("autocast"):
            assert out.dtype == dtype
        out.float().square().mean().backward()
        grads = [p.grad for p in stack.parameters() if p.requires_grad and p.grad is not None]
        assert grads and all(bool(torch.isfinite(g).all()) for g in grads)


# --- registers (Darcet et al. 2023) and value residuals (Zhou et al. 2024) --------------------


def _encoder_formula(enc: TransformerEncoder, x: torch.Tensor, lengths: torch.Tensor):
    """A pre-norm encoder on vectors written out directly: ``r`` register vectors before the
    tokens, padded keys masked (registers never are), values ``lambda_1 v_n + lambda_2 v_1``
    from layer 2 on, the registers dropped at the end."""
    c = enc.config
    e, h = c.embed_dim, c.num_heads
    d = e // h
    b, n, _ = x.shape
    r = c.registers
    if r:
        x = torch.cat([enc.registers.tokens.expand(b, r, e), x], dim=1)
    keep = torch.cat([torch.ones(b, r, dtype=torch.bool), torch.arange(n) < lengths[:, None]], 1)
    first = None
    for block in enc.blocks:
        attn = block.attn
        y = F.layer_norm(x, (e,), block.attn_norm.weight, block.attn_norm.bias, c.eps)
        q, k, v = (y @ attn.in_proj.weight.T + attn.in_proj.bias).split(e, dim=-1)
        q, k, v = (t.view(b, r + n, h, d).transpose(1, 2) for t in (q, k, v))
        if first is None:
            first = v
        elif c.variants is not None and c.variants.value_residual is not None:
            lambdas = attn.value_mix.lambdas
            v = lambdas[0] * v + lambdas[1] * first
        s = q @ k.transpose(-2, -1) / d**0.5
        s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
        out = (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(b, r + n, e)
        x = x + out @ attn.out_proj.weight.T + attn.out_proj.bias
        y = F.layer_norm(x, (e,), block.ffn_norm.weight, block.ffn_norm.bias, c.eps)
        x = x + block.ffn(y)
    x = F.layer_norm(x, (e,), enc.norm.weight, enc.norm.bias, c.eps)
    return x[:, r:]


@pytest.mark.parametrize("registers", [0, 3])
@pytest.mark.parametrize("value_residual", [None, "fixed", "learned"])
def test_registers_and_value_residual_equal_their_formula_with_gradients(
    registers: int, value_residual: str | None
) -> None:
    variants = None if value_residual is None else AttentionVariants(value_residual=value_residual)
    config = TransformerConfig(
        embed_dim=16, num_heads=4, num_layers=3, positional="none", registers=registers,
        variants=variants,
    )  # fmt: skip
    torch.manual_seed(0)
    enc = TransformerEncoder(config).to(D64)
    with torch.no_grad():  # registers and mixes away from their initial values
        for name, p in enc.named_parameters():
            if name.startswith("registers") or "value_mix" in name:
                p.normal_()
    lengths = torch.tensor([7, 4])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 16, dtype=D64, generator=g).requires_grad_()
    weight = torch.randn(2, 7, 16, dtype=D64, generator=g)
    leaves = [x, *enc.parameters()]
    results = []
    for out in (enc(x, masks.padding_mask(lengths))[0], _encoder_formula(enc, x, lengths)):
        results.append((out, *torch.autograd.grad((out * weight).sum(), leaves)))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_registers_extend_the_mask() -> None:
    """Every query sees every register; a register's row sees the registers and every key some
    query sees; a mask function is evaluated first."""
    from attnkit.variants import Registers

    registers = Registers(2, 8)
    keep = masks.causal_mask(3, 3) & masks.padding_mask(torch.tensor([3, 2]))  # (2, 1, 3, 3)
    got = registers.extend_mask(keep, 3, 2, 4, torch.device("cpu"))
    expected = torch.tensor(
        [
            [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]],
            [[1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0]],
        ],
        dtype=torch.bool,
    )[:, None]
    assert torch.equal(got, expected)
    pad = registers.extend_mask(masks.padding_mask(torch.tensor([3, 1])), 3, 2, 4, "cpu")
    assert pad.shape == (2, 1, 1, 5) and pad[1, 0, 0].tolist() == [True] * 3 + [False] * 2
    from_fn = registers.extend_mask(masks.causal_fn(), 3, 2, 4, torch.device("cpu"))
    assert torch.equal(from_fn.expand(2, 4, 5, 5), expected[:1].expand(2, 4, 5, 5))
    assert registers.extend_mask(None, 3, 2, 4, "cpu") is None
    with pytest.raises(ValueError, match=r"i = j = 3 tokens, got dtype torch.bool, shape \(4,\)"):
        registers.extend_mask(torch.ones(4, dtype=torch.bool), 3, 2, 4, "cpu")


def test_registers_keep_padding_out_and_show_in_the_weights() -> None:
    """Changing padded tokens changes no real token's output (nor, through the registers,
    anything else); the maps keep the registers first, ``(b, h, r + i, r + i)``."""
    config = dataclasses.replace(CFG, positional="rope", registers=2, num_layers=2)
    torch.manual_seed(0)
    enc = TransformerEncoder(config).to(D64).eval()
    ids = torch.randint(1, 23, (2, 6))
    rows = masks.causal_mask(6, 6) | ~masks.causal_mask(6, 6)  # every row its own (all True)
    for mask in (masks.padding_mask(torch.tensor([6, 3])), rows & masks.padding_mask([6, 3])):
        hidden, weights = enc(ids, mask, need_weights=True)
        assert hidden.shape == (2, 6, 16)
        assert weights is not None and weights[0].shape == (2, 4, 8, 8)
        assert bool((weights[0][1, :, :, 5:] == 0).all())  # padded keys, registers' rows too
        torch.testing.assert_close(weights[0].sum(-1), torch.ones(2, 4, 8, dtype=D64))
        changed = ids.clone()
        changed[1, 3:] = (changed[1, 3:] + 5) % 23
        again, _ = enc(changed, mask)
        torch.testing.assert_close(again[1, :3], hidden[1, :3], atol=1e-12, rtol=0)
        torch.testing.assert_close(again[0], hidden[0], atol=1e-12, rtol=0)
    assert enc.registers.tokens.std() < 1e-5  # DINOv2's initialisation, N(0, 1e-6^2)
    with pytest.raises(ValueError, match="registers are for encoders"):
        TransformerDecoder(config)
    with pytest.raises(ValueError, match="registers must be an int >= 0"):
        dataclasses.replace(CFG, registers=-1)


def test_value_residual_with_checkpointing_and_a_cache() -> None:
    """Gradient checkpointing recomputes each block with the first layer's values it was
    given (same gradients); a decoder's KV-cache decoding equals its full forward."""
    config = dataclasses.replace(
        CFG, num_layers=3, variants=AttentionVariants(value_residual="learned"), registers=2
    )
    torch.manual_seed(0)
    plain = TransformerEncoder(config).to(D64).train()
    ckpt = TransformerEncoder(dataclasses.replace(config, gradient_checkpointing=True)).to(D64)
    ckpt.load_state_dict(plain.state_dict())
    ckpt.train()
    ids = torch.randint(0, 23, (2, 6))
    for model in (plain, ckpt):
        out, _ = model(ids, masks.padding_mask(torch.tensor([6, 4])))
        (out**2).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, atol=1e-12, rtol=0, msg=name)
    decoder = TransformerDecoder(dataclasses.replace(config, registers=0)).to(D64).eval()
    full, _ = decoder(ids)
    caches = decoder.new_caches()
    steps = [decoder(ids[:, :2], caches=caches)[0]]
    steps += [decoder(ids[:, t : t + 1], caches=caches)[0] for t in range(2, 6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-10, rtol=0)


def test_token_ids_outside_the_vocabulary_are_named() -> None:
    config = TransformerConfig(embed_dim=16, num_heads=2, num_layers=1, vocab_size=10)
    decoder = TransformerDecoder(config)
    for ids in (torch.tensor([[10]]), torch.tensor([[3, -1]])):
        with pytest.raises(ValueError, match=r"token ids must lie in 0\.\.9 \(vocab_size\)"):
            decoder(ids)


def test_config_refuses_a_bad_eps_and_variants() -> None:
    base = {"embed_dim": 16, "num_heads": 2, "num_layers": 1}
    for eps in (-1.0, 0.0, float("nan"), True):
        with pytest.raises(ValueError, match="eps must be a positive finite number"):
            TransformerConfig(**base, eps=eps)
    with pytest.raises(TypeError, match="variants must be an AttentionVariants or None"):
        TransformerConfig(**base, variants="x")
