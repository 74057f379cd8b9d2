"""A fake BERT for the CLI tests, injected through the ``attnkit.commands.show.load_model`` seam.

A test file takes the ``fake`` fixture by re-exporting it (``from fake_bert import fake as fake``):
pytest finds fixtures by name in the test module.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from attnkit.commands import show

N_LAYERS, N_HEADS = 3, 4


class FakeBert:
    """The BERT API `show` relies on: encode(texts, need_weights=True) -> tokens, attentions."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.attentions: torch.Tensor | None = None

    def encode(self, texts: list[str], need_weights: bool = False) -> SimpleNamespace:
        assert need_weights
        self.texts.extend(texts)
        tokens = [["[CLS]", *t.lower().split(), "[SEP]"] for t in texts]
        n = len(tokens[0])
        gen = torch.Generator().manual_seed(0)
        scores = 3.0 * torch.randn(N_LAYERS, len(texts), N_HEADS, n, n, generator=gen)
        self.attentions = torch.softmax(scores, dim=-1)  # (l, b, h, i, j)
        return SimpleNamespace(tokens=tokens, attentions=self.attentions)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeBert:
    model = FakeBert()
    monkeypatch.setattr(show, "load_model", lambda: model)
    return model
