"""Sequence layouts: every position is held by exactly one rank, shards are the positions their
segments name, unsharding inverts sharding (values and gradients), zigzag balances causal work."""

from __future__ import annotations

import pytest
import torch

from attnkit.distributed.layout import (
    LAYOUTS,
    shard_lengths,
    shard_segments,
    shard_sequence,
    unshard_sequence,
)

LENGTHS = [0, 1, 3, 16, 37, 97]
WORLDS = [1, 2, 3, 4, 5]


def _positions(n: int, world: int, rank: int, layout: str) -> list[int]:
    segments = shard_segments(n, world, rank, layout)
    return [p for start, length in segments for p in range(start, start + length)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_position_is_held_exactly_once(layout: str) -> None:
    for n in LENGTHS:
        for world in WORLDS:
            held = [p for r in range(world) for p in _positions(n, world, r, layout)]
            assert sorted(held) == list(range(n)), (n, world)
            lengths = shard_lengths(n, world, layout)
            assert lengths == [len(_positions(n, world, r, layout)) for r in range(world)]
            assert max(lengths) - min(lengths) <= (1 if layout == "contiguous" else 2)


def test_segments_follow_tensor_split() -> None:
    for n in LENGTHS:
        for world in WORLDS:
            pieces = [t.tolist() for t in torch.tensor_split(torch.arange(n), world)]
            chunks = [t.tolist() for t in torch.tensor_split(torch.arange(n), 2 * world)]
            for r in range(world):
                assert _positions(n, world, r, "contiguous") == pieces[r]
                assert _positions(n, world, r, "zigzag") == chunks[r] + chunks[2 * world - 1 - r]
    # The docstring's picture: W = 4, n = 16, chunks of 2; rank 0 holds chunks 0 and 7.
    assert shard_segments(16, 4, 0, "zigzag") == ((0, 2), (14, 2))
    assert shard_segments(16, 4, 3, "zigzag") == ((6, 2), (8, 2))
    assert shard_segments(8, 4, 2, "contiguous") == ((4, 2),)


def test_zigzag_balances_causal_work() -> None:
    """Causal work of a rank = keys its queries see = sum of (position + 1) over its queries."""

    def work(n: int, world: int, layout: str) -> list[int]:
        return [sum(p + 1 for p in _positions(n, world, r, layout)) for r in range(world)]

    for world in (2, 3, 4):
        n = 2 * world * 5  # divisible: every rank does exactly the same work
        zigzag = work(n, world, "zigzag")
        assert len(set(zigzag)) == 1
        assert sum(zigzag) == n * (n + 1) // 2
        contiguous = work(n, world, "contiguous")
        assert max(contiguous) > 2 * min(contiguous)
        odd = work(97, world, "zigzag")  # uneven: still far closer than contiguous
        assert max(odd) - min(odd) < (max(contiguous) - min(contiguous)) / 4


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dim", [-2, 0, 1])
def test_shard_then_unshard_is_the_identity(layout: str, dim: int) -> None:
    for n in (1, 3, 37, 97):
        shape = [2, 3, 5]
        shape[dim] = n
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(n))
        for world in WORLDS:
            shards = [shard_sequence(x, world, r, layout=layout, dim=dim) for r in range(world)]
            for r, shard in enumerate(shards):
                index = torch.tensor(_positions(n, world, r, layout), dtype=torch.long)
                assert torch.equal(shard, x.index_select(dim, index))
            assert torch.equal(unshard_sequence(shards, layout=layout, dim=dim), x)


def test_contiguous_shards_are_views_and_zigzag_shards_copies() -> None:
    x = torch.randn(2, 3, 16, 4)
    view = shard_sequence(x, 4, 1)
    assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    copy = shard_sequence(x, 4, 1, layout="zigzag")
    assert copy.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unshard_reassembles_gradients(layout: str) -> None:
    x = torch.randn(2, 4, 37, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 4, 37, 3, dtype=torch.float64)
    shards = [shard_sequence(x, 3, r, layout=layout) for r in range(3)]
    (unshard_sequence(shards, layout=layout) * weight).sum().backward()
    assert torch.equal(x.grad, weight)
    # Gradients of local shards, unsharded, are the gradient of the full sequence.
    local = [s.detach().requires_grad_() for s in shards]
    (unshard_sequence(local, layout=layout) * weight).sum().backward()
    assert torch.equal(unshard_sequence([s.grad for s in local], layout=layout), weight)


def test_bad_arguments_are_named() -> None:
    x = torch.randn(1, 1, 8, 2)
    with pytest.raises(ValueError, match="layout must be one of contiguous, zigzag; got 'ring'"):
        shard_segments(8, 2, 0, "ring")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        shard_segments(8, 0, 0)
    for world in (0, -3):  # also where no shard is computed
        with pytest.raises(ValueError, match=f"world_size must be a positive int, got {world}"):
            shard_lengths(8, world)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        shard_sequence(x, 2, 2)
    with pytest.raises(ValueError, match="non-negative int, got -1"):
        shard_segments(-1, 2, 0)
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        shard_sequence([1, 2], 2, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty sequence"):
        unshard_sequence([])
    shards = [shard_sequence(x, 2, r) for r in range(2)]
    with pytest.raises(ValueError, match=r"\[4, 3\] along dim -2 are not a zigzag .*\[3, 4\]"):
        unshard_sequence([shards[0], shards[1][:, :, :3]], layout="zigzag")
    with pytest.raises(ValueError, match=r"shard lengths \[3, 4\] along dim -2 .* \[4, 3\]"):
        unshard_sequence([shards[0][:, :, :3], shards[1]])
