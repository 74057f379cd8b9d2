"""The attention inspector against the models' own weights and hand-computed statistics."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from attnkit import (
    MultiHeadAttention,
    TransformerConfig,
    TransformerDecoder,
    TransformerEncoder,
    masks,
)
from attnkit.debug import head_stats, inspect_attention

D64 = torch.float64
CFG = TransformerConfig(embed_dim=16, num_heads=4, num_layers=2, vocab_size=20, ffn_dim=24)


def test_report_matches_the_encoders_own_weights() -> None:
    torch.manual_seed(0)
    enc = TransformerEncoder(CFG).to(D64).eval()
    ids = torch.randint(0, 20, (2, 5))
    pad = masks.padding_mask(torch.tensor([5, 3]))
    report = inspect_attention(enc, ids, pad)
    with torch.no_grad():
        hidden, weights = enc(ids, pad, need_weights=True)
    torch.testing.assert_close(report.output[0], hidden)
    assert report.output[1] is None  # the caller's own request is left as it was
    assert [layer.name for layer in report.layers] == ["blocks.0.attn", "blocks.1.attn"]
    for layer, w in zip(report.layers, weights, strict=True):
        assert layer.query_shape == (2, 5, 16) and layer.key_shape == (2, 5, 16)
        assert layer.weights_shape == (2, 4, 5, 5)
        torch.testing.assert_close(layer.weights, w)
        for s in layer.heads:
            assert s.empty_rows == 0
            assert abs(s.row_sum_min - 1) < 1e-12 and abs(s.row_sum_max - 1) < 1e-12
            assert 0 <= s.entropy <= s.max_entropy + 1e-12
            # visible keys: 5 for the first sequence, 3 for the second
            assert abs(s.max_entropy - (5 * math.log(5) + 5 * math.log(3)) / 10) < 1e-12
            mean_key = w[:, s.head].mean((0, 1))
            assert s.top_positions[0] == int(mean_key.argmax())
            assert abs(s.top_weights[0] - float(mean_key.max())) < 1e-12
    # hooks are gone afterwards
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in enc.modules())


def test_head_stats_hand_computed() -> None:
    w = torch.zeros(1, 2, 3, 4, dtype=D64)
    w[0, 0] = 0.25  # uniform over 4 keys: entropy log 4, the maximum
    w[0, 1, 0, 2] = 1.0  # one-hot rows: entropy 0
    w[0, 1, 1, 2] = 1.0  # row 2 of head 1 stays zero: a fully masked row
    s0, s1 = head_stats(w)
    assert abs(s0.entropy - math.log(4)) < 1e-12 and abs(s0.max_entropy - math.log(4)) < 1e-12
    assert s0.empty_rows == 0 and s0.row_sum_min == 1.0
    assert s1.entropy == 0.0 and s1.max_entropy == 0.0
    assert s1.empty_rows == 1 and s1.row_sum_min == 0.0 and s1.row_sum_max == 1.0
    assert s1.top_positions[0] == 2 and s1.top_weights[0] == 1.0


def test_decoder_cross_attention_and_pinned_backend() -> None:
    cfg = TransformerConfig(
        embed_dim=8,
        num_heads=2,
        num_layers=1,
        vocab_size=11,
        cross_attention=True,
        backend="torch",
    )
    dec = TransformerDecoder(cfg).eval()
    report = inspect_attention(dec, torch.randint(0, 11, (1, 4)), torch.randn(1, 6, 8))
    cross = report.layer("blocks.0.cross_attn")
    assert cross.query_shape == (1, 4, 8) and cross.key_shape == (1, 6, 8)
    assert cross.weights_shape == (1, 2, 4, 6)
    causal = report.layer("blocks.0.attn").weights
    assert (causal.triu(1) == 0).all()
    assert all(m.backend == "torch" for m in dec.modules() if isinstance(m, MultiHeadAttention))
    with pytest.raises(KeyError, match="modules seen"):
        report.layer("nope")


def test_table_has_one_line_per_head() -> None:
    enc = TransformerEncoder(CFG)
    text = str(inspect_attention(enc, torch.randint(0, 20, (1, 6))))
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["layer", "call", "query"]
    assert len(lines) == 2 + 2 * 4
    assert sum("blocks.1.attn" in line for line in lines) == 4


def test_model_without_attention_is_refused() -> None:
    with pytest.raises(ValueError, match=r"contains no attnkit\.MultiHeadAttention"):
        inspect_attention(nn.Linear(2, 2), torch.randn(1, 2))
