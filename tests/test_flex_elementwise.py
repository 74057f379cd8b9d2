"""attnkit.flex.elementwise: a mod run per element, as torch runs it."""

from __future__ import annotations

import torch

from attnkit.flex.elementwise import per_element


def _index(n_heads: int = 4, bi: int = 5, bj: int = 7) -> tuple[torch.Tensor, ...]:
    b = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    h = torch.arange(n_heads).view(1, -1, 1, 1)
    i = torch.arange(10, 10 + bi).view(1, 1, -1, 1)
    j = torch.arange(8, 8 + bj).view(1, 1, 1, -1)
    return b, h, i, j


def test_a_mask_keeps_size_one_where_it_ignores_an_index() -> None:
    """A mask_mod that does not read the head gives a ``(1, 1, bi, bj)`` tile (not one
    expanded over heads, which every pass over the tile would read h times), with the values
    of the broadcast formula; one that reads the head keeps it."""
    b, h, i, j = _index()

    def window(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 3)

    def by_head(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (q_idx - kv_idx) <= h

    got = per_element(window, score=False)(b, h, i, j)
    assert got.shape == (1, 1, 5, 7)
    assert torch.equal(got, window(b, h, i, j))
    got = per_element(by_head, score=False)(b, h, i, j)
    assert got.shape == (1, 4, 5, 7)
    assert torch.equal(got, by_head(b, h, i, j))


def test_a_score_mod_keeps_the_scores_shape() -> None:
    """A score_mod's result has the score's shape, even where it reads no index."""
    b, h, i, j = _index()
    score = torch.randn(1, 4, 5, 7, dtype=torch.float64)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)

    def alibi(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return score + slopes[h] * (kv_idx - q_idx)

    got = per_element(alibi, score=True)(score, b, h, i, j)
    assert got.shape == score.shape
    torch.testing.assert_close(got, score + slopes.view(1, -1, 1, 1) * (j - i), rtol=0, atol=0)
    got = per_element(lambda s, b, h, q, kv: 2 * s, score=True)(score, b, h, i, j)
    assert torch.equal(got, 2 * score)
