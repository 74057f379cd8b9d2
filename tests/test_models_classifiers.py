"""The classifiers: parameter count by hand, attention maps, pooling weights and padding."""

from __future__ import annotations

import pytest
import torch

from attnkit.models.classifiers import (
    AttentionPooling,
    TabularAttentionClassifier,
    TabularConfig,
    TextAttentionClassifier,
    TextConfig,
    count_parameters,
)


def test_tabular_parameter_count_matches_hand_count():
    e, f, c, layers = 64, 4, 3, 2
    block = (3 * e * e + 3 * e) + (e * e + e) + 2 * 2 * e + (e * 4 * e + 4 * e) + (4 * e * e + e)
    expected = 2 * f * e + e + layers * block + 2 * e + (e * c + c)
    model = TabularAttentionClassifier(TabularConfig())
    assert count_parameters(model) == expected == 100_867


def test_tabular_attention_maps_are_distributions_over_cls_and_features():
    model = TabularAttentionClassifier(TabularConfig(d_model=16, num_heads=2)).eval()
    logits, maps = model(torch.randn(7, 4), return_attention=True)
    assert logits.shape == (7, 3) and len(maps) == 2
    for m in maps:
        assert m.shape == (7, 2, 5, 5)  # (b, h, CLS + 4 features, same)
        torch.testing.assert_close(m.sum(-1), torch.ones(7, 2, 5))
    with pytest.raises(ValueError, match=r"features must be \(batch, 4\)"):
        model(torch.randn(7, 5))


def test_tabular_feature_token_is_value_times_embedding_plus_bias():
    model = TabularAttentionClassifier(TabularConfig(d_model=8, num_heads=2, num_layers=1))
    x = torch.tensor([[2.0, 0.0, -1.0, 0.5]])
    tokens = x[:, :, None] * model.feature_weight + model.feature_bias  # (1, 4, 8)
    torch.testing.assert_close(tokens[0, 1], model.feature_bias[1])  # a zero value leaves the bias
    torch.testing.assert_close(tokens[0, 0], 2 * model.feature_weight[0] + model.feature_bias[0])


def test_pooling_weights_sum_to_one_on_real_tokens_and_zero_on_padding():
    pool = AttentionPooling(8)
    x = torch.randn(3, 6, 8)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]]).bool()
    pooled, w = pool(x, mask)
    assert pooled.shape == (3, 8) and w.shape == (3, 6)
    torch.testing.assert_close(w.sum(-1), torch.ones(3))
    assert torch.all(w[~mask] == 0)
    torch.testing.assert_close(w[2, 0], torch.tensor(1.0))
    # Oracle: a hand-written masked softmax of q . tanh(W x) / sqrt(e).
    scores = torch.tanh(pool.key(x)) @ pool.query / 8**0.5
    ref = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    torch.testing.assert_close(w, ref)
    torch.testing.assert_close(pooled, (ref[:, :, None] * x).sum(1))


def test_text_classifier_ignores_padding():
    torch.manual_seed(0)
    model = TextAttentionClassifier(TextConfig(vocab_size=50, max_len=12, d_model=16, num_heads=2))
    model.eval()
    ids = torch.tensor([[5, 9, 3, 0, 0, 0, 0, 0]])
    short = ids[:, :3]
    with torch.no_grad():
        logits, w = model(ids, return_weights=True)
        logits_short, w_short = model(short, return_weights=True)
    torch.testing.assert_close(logits, logits_short, atol=1e-6, rtol=1e-5)
    assert torch.all(w[0, 3:] == 0)
    torch.testing.assert_close(w[0, :3], w_short[0], atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="tokens <= 12"):
        model(torch.ones(1, 13, dtype=torch.long))


def test_pretrained_classifier_pools_real_tokens_freezes_and_reads_cls_attention():
    from attnkit.models.bert import BertConfig, BertModel
    from attnkit.models.classifiers import PretrainedTextClassifier

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    model = PretrainedTextClassifier(BertModel(config), freeze_layers=2).eval()
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert any(n.startswith("bert.embeddings.") for n in frozen)
    assert any(n.startswith("bert.layers.1.") for n in frozen)
    assert not any(n.startswith("bert.layers.2.") for n in frozen)
    assert model.head.weight.requires_grad
    ids = torch.tensor([[2, 7, 9, 3, 0, 0], [2, 5, 3, 0, 0, 0]])
    mask = ids != 0
    with torch.no_grad():
        logits, cls = model(ids, mask, return_weights=True)
        alone = model(ids[1:, :3], mask[1:, :3])  # the same text without padding
    assert logits.shape == (2, 2) and cls.shape == (2, 6)
    torch.testing.assert_close(logits[1:], alone, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(cls.sum(-1), torch.ones(2))
    assert torch.all(cls[~mask] == 0)
    with pytest.raises(ValueError, match="freeze_layers"):
        PretrainedTextClassifier(BertModel(config), freeze_layers=4)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: TabularConfig(d_model=16, num_heads=3), r"num_heads \(3\) must divide d_model"),
        (lambda: TextConfig(vocab_size=9, d_model=30), r"num_heads \(4\) must divide d_model"),
        (lambda: TabularConfig(num_layers=0), "num_layers must be a positive int, got 0"),
        (lambda: TextConfig(vocab_size=0), "vocab_size must be a positive int, got 0"),
        (lambda: TextConfig(vocab_size=9, max_len=2.5), "max_len must be a positive int"),
        (lambda: TabularConfig(ff_mult=True), "ff_mult must be a positive int, got True"),
        (lambda: TabularConfig(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
    ],
)
def test_configs_refuse_what_no_model_can_be_built_from(make, match) -> None:
    """Checked when the config is made, before any model (or a run's folder) exists."""
    with pytest.raises(ValueError, match=match):
        make()
