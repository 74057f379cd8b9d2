"""Blocks: parity with nn.TransformerEncoderLayer/DecoderLayer, the feed-forward formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnkit import (
    FeedForward,
    TransformerBlock,
    masks,
)

D64 = torch.float64


def _torch_layer(norm_first: bool, activation: str, batch_first: bool = True):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        24,
        4,
        40,
        dropout=0.0,
        activation=activation,
        norm_first=norm_first,
        batch_first=batch_first,
    ).to(D64)
    with torch.no_grad():  # non-trivial biases and norm parameters, so every one is tested
        for p in layer.parameters():
            if p.ndim == 1:
                p.normal_()
    return layer


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_block_equals_torch_encoder_layer(norm_first: bool, activation: str) -> None:
    layer = _torch_layer(norm_first, activation)
    block = TransformerBlock.from_torch(layer)
    assert block.norm_first == norm_first and block.ffn.activation == activation
    x = torch.randn(3, 7, 24, dtype=D64)
    lengths = torch.tensor([7, 4, 1])
    key_padding = torch.arange(7)[None, :] >= lengths[:, None]  # torch: True = ignore
    layer.train()  # train mode with dropout 0: no fast path, every position is computed
    block.train()
    ref = layer(x, src_key_padding_mask=key_padding)
    out, _ = block(x, mask=masks.from_torch(key_padding_mask=key_padding))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    # eval mode: torch's fast path may zero padded positions; compare the real tokens
    layer.eval()
    block.eval()
    with torch.no_grad():
        ref = layer(x, src_key_padding_mask=key_padding)
        out, _ = block(x, mask=masks.from_torch(key_padding_mask=key_padding))
    real = ~key_padding
    torch.testing.assert_close(out[real], ref[real], atol=1e-10, rtol=0)


def test_block_from_torch_sequence_first_causal() -> None:
    layer = _torch_layer(True, "gelu", batch_first=False)
    block = TransformerBlock.from_torch(layer)
    x = torch.randn(6, 2, 24, dtype=D64)  # torch: (n, b, e)
    causal = nn.Transformer.generate_square_subsequent_mask(6, dtype=D64)
    ref = layer(x, src_mask=causal, is_causal=True)
    out, _ = block(x.transpose(0, 1), is_causal=True)
    torch.testing.assert_close(out.transpose(0, 1), ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_cross_attention_block_equals_torch_decoder_layer(norm_first: bool, activation: str):
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(
        24, 4, 40, dropout=0.0, activation=activation, norm_first=norm_first, batch_first=True
    ).to(D64)
    with torch.no_grad():
        for p in layer.parameters():
            if p.ndim == 1:
                p.normal_()
    block = TransformerBlock.from_torch(layer)
    assert block.cross_attn is not None
    x, memory = torch.randn(2, 6, 24, dtype=D64), torch.randn(2, 9, 24, dtype=D64)
    mem_pad = torch.arange(9)[None, :] >= torch.tensor([9, 5])[:, None]  # torch: True = ignore
    causal = nn.Transformer.generate_square_subsequent_mask(6, dtype=D64)
    ref = layer(x, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=mem_pad)
    out, _ = block(
        x, is_causal=True, memory=memory, memory_mask=masks.from_torch(key_padding_mask=mem_pad)
    )
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)


def test_from_torch_rejects_other_modules() -> None:
    with pytest.raises(TypeError, match=r"expected nn\.TransformerEncoderLayer"):
        TransformerBlock.from_torch(nn.Linear(2, 2))


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "swiglu"])
def test_feed_forward_against_formula(activation: str) -> None:
    torch.manual_seed(0)
    ffn = FeedForward(8, 12, activation=activation).to(D64)
    x = torch.randn(2, 3, 8, dtype=D64)
    up = x @ ffn.up.weight.T + ffn.up.bias
    if activation == "swiglu":
        gate = x @ ffn.gate.weight.T + ffn.gate.bias
        hidden = gate * torch.sigmoid(gate) * up
    elif activation == "relu":
        hidden = up.clamp(min=0)
    elif activation == "gelu":
        hidden = 0.5 * up * (1 + torch.erf(up / 2**0.5))
    else:
        hidden = F.gelu(up, approximate="tanh")
    expected = hidden @ ffn.down.weight.T + ffn.down.bias
    torch.testing.assert_close(ffn(x), expected, atol=1e-12, rtol=0)
    assert (ffn.gate is not None) == (activation == "swiglu")


def test_feed_forward_bad_activation() -> None:
    with pytest.raises(ValueError, match="activation must be one of"):
        FeedForward(8, 12, activation="tanh")


def test_block_cross_attention_errors() -> None:
    block = TransformerBlock(8, 2, 16, cross_attention=True)
    with pytest.raises(ValueError, match="pass memory"):
        block(torch.randn(1, 3, 8))
    with pytest.raises(ValueError, match="no cross-attention"):
        TransformerBlock(8, 2, 16)(torch.randn(1, 3, 8), memory=torch.randn(1, 2, 8))


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize(
    ("x", "error", "words"),
    [
        (torch.randn(2, 5, 32, dtype=torch.float64), TypeError, "x is torch.float64 but the"),
        (torch.randn(2, 5, 31), ValueError, r"x must have shape \(b, n, embed_dim=32\)"),
        (torch.randn(5, 32), ValueError, r"x must have shape \(b, n, embed_dim=32\)"),
        ([[0.0] * 32], TypeError, "x must be a torch.Tensor, got list"),
    ],
)
def test_block_names_a_bad_x_before_its_norms(norm_first, x, error, words) -> None:
    block = TransformerBlock(32, 4, 64, norm_first=norm_first)
    with pytest.raises(error, match=words):
        block(x)
