"""Mask builders against hand-drawn masks, and the function forms against the tensors."""

from __future__ import annotations

import pytest
import torch

from attnkit import masks

T, F = True, False


def test_causal_alignments_drawn() -> None:
    assert masks.causal_mask(2, 5).tolist() == [[T, T, T, T, F], [T, T, T, T, T]]
    assert masks.causal_mask(2, 5, align="top-left").tolist() == [
        [T, F, F, F, F],
        [T, T, F, F, F],
    ]
    assert torch.equal(masks.causal_mask(4), torch.ones(4, 4, dtype=torch.bool).tril())
    # more queries than keys: the first rows see nothing
    assert masks.causal_mask(3, 2).tolist() == [[F, F], [T, F], [T, T]]
    with pytest.raises(ValueError, match="align must be"):
        masks.causal_mask(2, align="left")  # type: ignore[arg-type]


def test_sliding_window() -> None:
    m = masks.sliding_window_mask(5, left=1)
    expected = [
        [T, F, F, F, F],
        [T, T, F, F, F],
        [F, T, T, F, F],
        [F, F, T, T, F],
        [F, F, F, T, T],
    ]
    assert m.tolist() == expected
    both = masks.sliding_window_mask(4, left=1, right=1)
    assert both.tolist() == [[T, T, F, F], [T, T, T, F], [F, T, T, T], [F, F, T, T]]
    # a window as wide as the sequence is plain causal
    assert torch.equal(masks.sliding_window_mask(6, 9, left=9), masks.causal_mask(6, 9))


def test_padding_masks() -> None:
    m = masks.padding_mask([3, 1, 0], max_len=4)
    assert m.shape == (3, 1, 1, 4)
    assert m[:, 0, 0].tolist() == [[T, T, T, F], [T, F, F, F], [F, F, F, F]]
    ids = torch.tensor([[5, 6, 0, 0], [7, 0, 0, 0]])
    assert torch.equal(masks.padding_mask_from_ids(ids, pad_id=0), masks.padding_mask([2, 1], 4))
    with pytest.raises(ValueError, match="max_len=2 is shorter than the longest length 3"):
        masks.padding_mask([3], max_len=2)
    with pytest.raises(ValueError, match="lengths must be a 1-D integer tensor"):
        masks.padding_mask(torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match=r"ids must have shape \(b, j\)"):
        masks.padding_mask_from_ids(torch.tensor([1, 2]), 0)


def test_block_diagonal_for_packed_sequences() -> None:
    m = masks.block_diagonal_mask(torch.tensor([0, 0, 1, 1, 1, -1]))
    assert m.shape == (1, 1, 6, 6)
    dense = m[0, 0]
    assert dense[:2, :2].all() and dense[2:5, 2:5].all()
    assert not dense[:2, 2:].any() and not dense[5].any() and not dense[:, 5].any()


def test_combine_and_convert() -> None:
    a = masks.causal_mask(3)
    b = masks.padding_mask([2], 3)
    c = masks.combine_masks(a, None, b)
    assert c is not None and torch.equal(c, a & b)
    assert masks.combine_masks(None) is None
    with pytest.raises(TypeError, match="bool masks"):
        masks.combine_masks(a.float())
    add = masks.to_additive(c, torch.float16)
    assert add.dtype == torch.float16 and torch.isfinite(add).all()
    assert torch.equal(add == 0, c) and add.min() == torch.finfo(torch.float16).min


def test_from_torch_conventions() -> None:
    # torch: key_padding_mask True = ignore, bool attn_mask True = NOT allowed, float -inf blocks
    kpm = torch.tensor([[False, False, True]])
    attn = torch.tensor([[False, True, True], [False, False, True]])
    ours = masks.from_torch(attn, kpm)
    assert ours is not None and ours.shape == (1, 1, 2, 3)
    assert ours[0, 0].tolist() == [[T, F, F], [T, T, F]]
    float_mask = torch.zeros(2, 3).masked_fill(attn, float("-inf"))
    assert torch.equal(masks.from_torch(float_mask), ~attn)
    with pytest.raises(ValueError, match="that is a bias"):
        masks.from_torch(torch.randn(2, 3))


@pytest.mark.parametrize("i, j", [(5, 5), (3, 7), (7, 3)])
def test_functions_equal_tensors(i: int, j: int) -> None:
    off = j - i
    grid = masks.materialize(masks.causal_fn(off), (2, 3, i, j))
    assert grid.shape == (2, 3, i, j) or grid.shape == (1, 1, i, j)
    assert torch.equal(grid.expand(2, 3, i, j)[1, 2], masks.causal_mask(i, j))
    win = masks.materialize(masks.window_fn(2, 1, off), (1, 1, i, j))[0, 0]
    assert torch.equal(win, masks.sliding_window_mask(i, j, left=2, right=1))
    with pytest.raises(ValueError, match=r"\(b, h, i, j\) shape"):
        masks.materialize(masks.causal_fn(), (i, j))


def test_from_torch_refuses_integer_padding_masks() -> None:
    """An integer key_padding_mask used to keep every key (its padding silently ignored)."""
    kpm = torch.tensor([[0, 0, 1]], dtype=torch.uint8)
    for dtype in (torch.uint8, torch.int64):
        with pytest.raises(TypeError, match=f"key_padding_mask must be bool .* got dtype {dtype}"):
            masks.from_torch(None, kpm.to(dtype))
    with pytest.raises(ValueError, match="values other than 0 and -inf"):
        masks.from_torch(None, torch.tensor([[0.0, 0.5]]))
    additive = torch.tensor([[0.0, 0.0, float("-inf")]])
    assert masks.from_torch(None, additive).flatten().tolist() == [True, True, False]
    assert masks.from_torch(None, kpm.bool()).flatten().tolist() == [True, True, False]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: masks.causal_fn(2**63), r"offset must be an int from -2\*\*62 to 2\*\*62"),
        (lambda: masks.causal_fn(-(2**62) - 1), r"offset must be an int from -2\*\*62"),
        (lambda: masks.causal_fn(1.5), r"offset must be an int"),
        (lambda: masks.causal_fn(True), r"offset must be an int"),
        (lambda: masks.window_fn(10**30), r"left must be an int from 0 to 2\*\*62"),
        (lambda: masks.window_fn(-1), r"left must be an int from 0 to 2\*\*62, got -1"),
        (lambda: masks.window_fn(2, right=2**63), r"right must be an int from 0 to 2\*\*62"),
        (lambda: masks.window_fn(2, 0, offset=2**63 - 1), r"offset must be an int from"),
        (lambda: masks.sliding_window_mask(4, left=10**30), r"left must be an int from 0 to"),
    ],
)
def test_band_sizes_and_offsets_that_would_wrap_int64_are_refused(make, match) -> None:
    """``i + offset - j`` is int64 arithmetic: causal_fn(2**63) wrapped around, and the math
    backend saw no key while the tiled one saw every key."""
    with pytest.raises(ValueError, match=match):
        make()


def test_the_largest_offsets_keep_their_meaning_on_every_backend() -> None:
    """At the bound, a causal offset of 2**62 lets every query see every key and -2**62 none:
    the same on the reference and on the backends that read the declared band."""
    from attnkit import scaled_dot_product_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    full = scaled_dot_product_attention(q, k, v, backend="math")
    for backend in ("math", "tiled", "sparse"):
        everything = scaled_dot_product_attention(q, k, v, masks.causal_fn(2**62), backend=backend)
        torch.testing.assert_close(everything, full)
        nothing = scaled_dot_product_attention(q, k, v, masks.causal_fn(-(2**62)), backend=backend)
        assert torch.equal(nothing, torch.zeros_like(nothing))
        window = scaled_dot_product_attention(
            q, k, v, masks.window_fn(2**62, 2**62), backend=backend
        )
        torch.testing.assert_close(window, full)


@pytest.mark.parametrize("backend", ["math", "tiled", "fused", "auto"])
def test_a_function_that_returns_the_wrong_thing_is_named(backend) -> None:
    """A mask or bias function's output must be a bool / float tensor that broadcasts to the
    (b, h, i, j) grid of the indices it is given: anything else is named, on every backend."""
    from attnkit import scaled_dot_product_attention

    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    cases = [
        ({"bias": lambda b, h, i, j: 0.5}, TypeError, "must return a floating-point tensor"),
        ({"mask": lambda b, h, i, j: (i >= j).float()}, TypeError, "must return a bool tensor"),
        ({"mask": lambda b, h, i, j: torch.ones(2, 2, dtype=torch.bool)}, ValueError,
         r"a mask function must return a tensor that broadcasts to the \(b, h, i, j\) grid"),
        ({"bias": lambda b, h, i, j: torch.zeros(3, 1, 1, 1)}, ValueError,
         r"a bias function must return a tensor that broadcasts"),
    ]  # fmt: skip
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            scaled_dot_product_attention(q, k, v, backend=backend, **kwargs)
    # what does broadcast is served: (i, j) alone, or with a head term
    for fn in (lambda b, h, i, j: (i >= j)[0, 0], lambda b, h, i, j: (i >= j) & (h < 3)):
        out = scaled_dot_product_attention(q, k, v, fn, backend=backend)
        ref = scaled_dot_product_attention(q, k, v, fn, backend="math")
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_padding_mask_max_len_is_an_int() -> None:
    with pytest.raises(ValueError, match=r"max_len must be an int or None, got 5\.5"):
        masks.padding_mask([2, 3], max_len=5.5)
    assert masks.padding_mask([2, 3], max_len=torch.tensor(4)).shape == (2, 1, 1, 4)


def test_mask_helpers_name_an_argument_that_is_not_a_tensor() -> None:
    for call, message in [
        (lambda: masks.padding_mask_from_ids([[1, 0]], 0), "padding_mask_from_ids: ids"),
        (lambda: masks.block_diagonal_mask([[0, 0, 1]]), "block_diagonal_mask: segment_ids"),
        (lambda: masks.combine_masks([[True]], None), "combine_masks: mask"),
        (lambda: masks.from_torch([[True]]), "from_torch: attn_mask"),
        (lambda: masks.to_additive([[True]]), "to_additive: mask"),
    ]:
        with pytest.raises(TypeError, match=f"{message} must be a torch.Tensor, got list"):
            call()
