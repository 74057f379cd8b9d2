"""The date translator's data and decoding: formats that name one date, unseen test dates,
ids that round-trip, greedy decoding with the KV cache equal to decoding without it, and the
cross-attention maps."""

from __future__ import annotations

import datetime as dt

import pytest
import torch

from attnkit.tasks.translate import (
    BOS,
    EOS,
    FORMATS,
    SRC_LEN,
    TGT_LEN,
    DateTranslator,
    TranslateConfig,
    cross_attention,
    date_datasets,
    decode,
    encode,
    generate_dates,
    render_date,
    translate,
)

DAY = dt.date(2026, 11, 25)  # a Wednesday


def test_formats_write_the_examples_of_the_issue() -> None:
    texts = [render_date(DAY, k) for k in range(len(FORMATS))]
    assert "Wed 25 Nov 2026" in texts
    assert "25/11/26" in texts
    assert "November 25th, 2026" in texts
    assert render_date(dt.date(2011, 3, 11), 2) == "March 11th, 2011"  # 11th, not 11st
    assert render_date(dt.date(2001, 3, 22), 2) == "March 22nd, 2001"
    assert all(len(t) < SRC_LEN for t in texts)


def test_the_data_is_seeded_and_test_dates_are_never_trained_on() -> None:
    data = generate_dates(3, n_train=2000)
    assert data == generate_dates(3, n_train=2000)
    assert data != generate_dates(4, n_train=2000)
    train_dates = {iso for _, iso in data.train}
    test_dates = [iso for _, iso in data.test]
    assert len(test_dates) == len(set(test_dates)) == 1000
    assert not train_dates & set(test_dates)
    assert not train_dates & {iso for _, iso in data.val}
    longest = max(len(t) for t, _ in data.train + data.test)
    assert longest < SRC_LEN


def test_ids_round_trip_and_the_sets_shift_by_one() -> None:
    texts = ["Tue 25 Nov 2026", "the 1st of May 1970"]
    assert decode(encode(texts, SRC_LEN)) == texts
    sets = date_datasets(generate_dates(0, n_train=50))
    train = sets[0]
    assert train["src"].shape == (50, SRC_LEN) and train["labels"].shape == (50, TGT_LEN)
    assert torch.all(train["tgt_in"][:, 0] == BOS) and torch.all(train["labels"][:, -1] == EOS)
    assert torch.equal(train["tgt_in"][:, 1:], train["labels"][:, :-1])
    with pytest.raises(ValueError, match=r"characters \['é'\] are not in the vocabulary"):
        encode(["é"], 5)


def test_greedy_decoding_with_the_cache_equals_decoding_without_it() -> None:
    torch.manual_seed(0)
    model = DateTranslator(TranslateConfig(embed_dim=16, num_heads=2, num_layers=2)).eval()
    texts = ["25/11/26", "November 25th, 2026", "1.1.1970"]
    written = translate(model, texts)
    src = encode(texts, SRC_LEN)
    ids = torch.full((3, 1), BOS)
    with torch.no_grad():
        for _ in range(TGT_LEN):  # the whole prefix again at every step, no cache
            logits = model(src, ids)  # (b, V, i)
            ids = torch.cat([ids, logits[:, :, -1].argmax(1, keepdim=True)], dim=1)
    assert written == decode(ids[:, 1:])


def test_cross_attention_maps_are_distributions_over_the_text() -> None:
    torch.manual_seed(0)
    model = DateTranslator(TranslateConfig(embed_dim=16, num_heads=2, num_layers=2))
    maps = cross_attention(model, "Tue 25 Nov 2026", "2026-11-25")
    assert maps.shape == (2, 2, 11, 15)  # (layers, h, <s> + 10 characters, 15 characters)
    assert torch.allclose(maps.sum(-1), torch.ones(2, 2, 11), atol=1e-5)
    assert all(len(b.cross_attn._forward_hooks) == 0 for b in model.decoder.blocks)
