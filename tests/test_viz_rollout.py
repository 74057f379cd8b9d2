"""Attention rollout against a hand-computed float64 example and its invariants."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnkit.viz import attention_rollout, plot_rollout

# Two layers, two heads, two tokens. Mean of heads:
# W1 = [[1, 0], [.5, .5]], W2 = [[.5, .5], [0, 1]].
LAYER1 = [[[1.0, 0.0], [0.0, 1.0]], [[1.0, 0.0], [1.0, 0.0]]]
LAYER2 = [[[0.0, 1.0], [0.0, 1.0]], [[1.0, 0.0], [0.0, 1.0]]]
ATT = torch.tensor([LAYER1, LAYER2], dtype=torch.float64)  # (l=2, h=2, i=2, j=2)

# By hand: A1 = (W1 + I) / rowsum = [[1, 0], [.25, .75]]; A2 = [[.75, .25], [0, 1]];
# R2 = A2 @ A1 = [[.75 + .0625, .1875], [.25, .75]].
A1 = [[1.0, 0.0], [0.25, 0.75]]
R2 = [[0.8125, 0.1875], [0.25, 0.75]]


def test_hand_computed_two_layers() -> None:
    got = attention_rollout(ATT)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(R2, dtype=torch.float64), rtol=0, atol=1e-15)


def test_all_layers_returns_each_step() -> None:
    got = attention_rollout(ATT, all_layers=True)
    expected = torch.tensor([A1, R2], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-15)


def test_max_fusion_by_hand() -> None:
    # max of heads: W1 = [[1, 0], [1, 1]] -> [[1, 0], [1/3, 2/3]]; W2 = [[1, 1], [0, 1]] ->
    # [[2/3, 1/3], [0, 1]]; R = [[2/3 + 1/9, 2/9], [1/3, 2/3]].
    expected = torch.tensor([[7 / 9, 2 / 9], [1 / 3, 2 / 3]], dtype=torch.float64)
    torch.testing.assert_close(attention_rollout(ATT, head_fusion="max"), expected)


def test_without_residual_is_the_plain_product() -> None:
    # W2 @ W1 = [[.5, .5], [0, 1]] @ [[1, 0], [.5, .5]] = [[.75, .25], [.5, .5]].
    expected = torch.tensor([[0.75, 0.25], [0.5, 0.5]], dtype=torch.float64)
    torch.testing.assert_close(attention_rollout(ATT, residual=False), expected)


def _numpy_rollout(att: np.ndarray) -> np.ndarray:
    """An independent float64 loop over layers, one input (l, h, i, i)."""
    n = att.shape[-1]
    result = np.eye(n)
    for layer in att:
        a = layer.mean(axis=0) + np.eye(n)
        a = a / a.sum(axis=1, keepdims=True)
        result = a @ result
    return result


def test_random_batch_matches_numpy_and_rows_sum_to_one() -> None:
    gen = torch.Generator().manual_seed(0)
    att = torch.softmax(torch.randn(5, 3, 4, 9, 9, generator=gen, dtype=torch.float64), dim=-1)
    got = attention_rollout(att)  # (l, b, h, i, i) -> (b, i, i)
    assert got.shape == (3, 9, 9)
    for b in range(3):
        np.testing.assert_allclose(got[b].numpy(), _numpy_rollout(att[:, b].numpy()), atol=1e-14)
    torch.testing.assert_close(got.sum(-1), torch.ones(3, 9, dtype=torch.float64))
    assert (got >= 0).all()
    every = attention_rollout(att, all_layers=True)
    torch.testing.assert_close(every.sum(-1), torch.ones(5, 3, 9, dtype=torch.float64))


def test_list_of_layers_like_hugging_face() -> None:
    att = torch.softmax(torch.randn(4, 2, 3, 7, 7), dim=-1)
    torch.testing.assert_close(attention_rollout(list(att)), attention_rollout(att))
    assert attention_rollout(att).dtype == torch.float32


def test_fully_masked_row_without_residual_stays_zero() -> None:
    att = torch.softmax(torch.randn(2, 1, 3, 3, dtype=torch.float64), dim=-1)
    att[:, :, 2] = 0.0  # a query that attends to nothing
    got = attention_rollout(att, residual=False)
    assert torch.isfinite(got).all()
    assert (got[2] == 0).all()


@pytest.mark.parametrize(
    ("att", "kwargs", "message"),
    [
        (torch.rand(2, 3, 4, 5), {}, "i == j"),
        (torch.rand(3, 4, 4), {}, "at least 4 dims"),
        (torch.rand(2, 3, 4, 4), {"head_fusion": "median"}, "head_fusion"),
        ([], {}, "empty"),
        (torch.full((1, 1, 2, 2), float("nan")), {}, "NaN"),
    ],
)
def test_bad_input(att: object, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        attention_rollout(att, **kwargs)  # type: ignore[arg-type]


def test_plot_rollout_shows_the_rollout() -> None:
    fig = plot_rollout(ATT, ["a", "b"], layer=1)
    shown = fig.axes[0].images[0].get_array()
    np.testing.assert_allclose(np.asarray(shown), R2, atol=1e-12)
    with pytest.raises(ValueError, match="layer=2 is out of range"):
        plot_rollout(ATT, ["a", "b"], layer=2)
