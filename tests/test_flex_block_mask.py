"""attnkit.flex.block_mask against torch's own BlockMask: the same blocks, full / partial /
empty classification, printing and sparsity, built without an n x n tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as tf

import attnkit.flex.block_mask as fbm
from attnkit.flex import BlockMask, and_masks, create_block_mask, noop_mask, or_masks


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def window(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= 16


def prefix(b, h, q_idx, kv_idx):
    return kv_idx < 20


DOCS = torch.tensor([[0] * 40 + [1] * 70 + [2] * 147, [0] * 100 + [1] * 5 + [2] * 152])


def document(b, h, q_idx, kv_idx):  # packed sequences: ids captured, one row per batch
    return DOCS[b, q_idx] == DOCS[b, kv_idx]


def head_window(b, h, q_idx, kv_idx):  # a different window per head
    return (q_idx - kv_idx).abs() <= 8 * (h + 1)


CATALOGUE = {
    "causal": (causal, None, None),
    "sliding_window": (and_masks(causal, window), None, None),
    "prefix_lm": (or_masks(prefix, causal), None, None),
    "document": (document, 2, None),
    "head_window": (head_window, None, 3),
    "noop": (noop_mask, None, None),
}
SIZES = [(97, 257, 32), (128, 128, 32), (100, 77, (16, 32))]


def _same_blocks(ours: BlockMask, theirs: object) -> None:
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert torch.equal(ours.to_dense(), theirs.to_dense())  # type: ignore[attr-defined]
    assert ours.shape == theirs.shape  # type: ignore[attr-defined]
    assert ours.to_string(limit=99) == theirs.to_string(limit=99)  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(CATALOGUE))
@pytest.mark.parametrize("size", SIZES, ids=str)
def test_block_masks_equal_torchs(name: str, size: tuple) -> None:
    mask_mod, nb, nh = CATALOGUE[name]
    q_len, kv_len, block = size
    if name == "document":
        q_len = kv_len = min(kv_len, DOCS.shape[1])
    args = (mask_mod, nb, nh, q_len, kv_len)
    ours = create_block_mask(*args, device="cpu", BLOCK_SIZE=block)
    _same_blocks(ours, tf.create_block_mask(*args, device="cpu", BLOCK_SIZE=block))


def test_strips_of_bounded_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """mask_mod is vmapped over at most BLOCK_SIZE queries and the evaluation budget per call
    (a tiny budget here: one key block per call), and the result does not change."""
    seen: list[tuple[int, int]] = []
    per_element = fbm.per_element

    def recording(fn, *, score):  # type: ignore[no-untyped-def]
        tile = per_element(fn, score=score)

        def recorded(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            seen.append((q_idx.numel(), kv_idx.numel()))
            return tile(b, h, q_idx, kv_idx)

        return recorded

    monkeypatch.setattr(fbm, "per_element", recording)
    monkeypatch.setattr(fbm, "_EVAL_BUDGET", 1)
    ours = create_block_mask(head_window, 2, 3, 300, 200, BLOCK_SIZE=64)
    assert max(q for q, _ in seen) <= 64 and max(k for _, k in seen) <= 64
    assert len(seen) == 5 * 4  # 5 query strips x 4 key blocks
    _same_blocks(ours, tf.create_block_mask(head_window, 2, 3, 300, 200, "cpu", BLOCK_SIZE=64))


# Mods written per element, as torch calls them: they reduce over a gathered row or index one.
TAGS = torch.rand(257, 3, generator=torch.Generator().manual_seed(4)) > 0.6  # (n, tags)


def shared_tag(b, h, q_idx, kv_idx):  # .any() with no dim: True when one tag is shared
    return (TAGS[q_idx] & TAGS[kv_idx]).any() | (q_idx == kv_idx)


INTERVALS = torch.tensor([[0, 40], [10, 90], [90, 257]])  # (images, 2): text spans per image
IMAGE_OF_KEY = torch.arange(3).repeat_interleave(32)  # 32 tokens per image


def cross_attention(b, h, q_idx, kv_idx):  # Flamingo's text-to-image mask (attention-gym)
    interval = INTERVALS[IMAGE_OF_KEY[kv_idx]]  # a gathered row, indexed below
    return (q_idx >= interval[0]) & (q_idx < interval[1])


@pytest.mark.parametrize("mask_mod", [shared_tag, cross_attention], ids=lambda f: f.__name__)
def test_per_element_mask_mods_equal_torchs(mask_mod) -> None:  # type: ignore[no-untyped-def]
    """A mask_mod means what it means per element: ``.any()`` over a gathered row, and a row
    of a captured table indexed by a gathered index (both broke when called on a tile)."""
    kv_len = 96 if mask_mod is cross_attention else 257
    args = (mask_mod, 2, 2, 257, kv_len)
    ours = create_block_mask(*args, device="cpu", BLOCK_SIZE=32)
    _same_blocks(ours, tf.create_block_mask(*args, device="cpu", BLOCK_SIZE=32))
    assert 1 in ours.block_states().unique().tolist()  # partial blocks: mask_mod decides


def test_classification_by_hand() -> None:
    """Causal over 4 x 4 blocks: full below the diagonal, partial on it, empty above."""
    bm = create_block_mask(causal, None, None, 128, 128, BLOCK_SIZE=32)
    states = bm.block_states()[0, 0]
    expect = torch.tensor([[1, 0, 0, 0], [2, 1, 0, 0], [2, 2, 1, 0], [2, 2, 2, 1]])
    assert torch.equal(states, expect.to(torch.int8))
    assert bm.sparsity() == 100 * 6 / 16
    assert bm.sparsity() == tf.create_block_mask(causal, None, None, 128, 128, "cpu", 32).sparsity()
    picture = "(0, 0)\n██      \n████    \n██████  \n████████\n"
    assert bm.to_string() == picture
    assert str(bm) == f"BlockMask(shape=(1, 1, 128, 128), sparsity=37.50%, \n{picture.strip()}\n)"
    assert "causal" in repr(bm)


def test_edge_blocks_of_uneven_lengths_are_never_full() -> None:
    """Positions past the lengths count as masked (torch's padding), so an all-visible edge block
    is partial."""
    bm = create_block_mask(noop_mask, None, None, 50, 70, BLOCK_SIZE=32)
    states = bm.block_states()[0, 0]
    assert torch.equal(states, torch.tensor([[2, 2, 1], [1, 1, 1]], dtype=torch.int8))
    assert bm.sparsity() == 0.0


def test_from_kv_blocks_and_from_torch_round_trip() -> None:
    theirs = tf.create_block_mask(document, 2, None, 257, 257, "cpu", BLOCK_SIZE=32)
    copied = BlockMask.from_torch(theirs)
    _same_blocks(copied, theirs)
    rebuilt = BlockMask.from_kv_blocks(
        theirs.kv_num_blocks,
        theirs.kv_indices,
        theirs.full_kv_num_blocks,
        theirs.full_kv_indices,
        BLOCK_SIZE=32,
        mask_mod=document,
        seq_lengths=(257, 257),
    )
    _same_blocks(rebuilt, theirs)
    whole = BlockMask.from_kv_blocks(theirs.kv_num_blocks, theirs.kv_indices, BLOCK_SIZE=32)
    assert whole.shape == (2, 1, 9 * 32, 9 * 32) and whole.mask_mod is noop_mask


def test_combinators_equal_torchs() -> None:
    b = torch.arange(2).view(-1, 1, 1, 1)
    h = torch.arange(3).view(1, -1, 1, 1)
    q = torch.arange(60).view(1, 1, -1, 1)
    kv = torch.arange(70).view(1, 1, 1, -1)
    for ours, theirs in [
        (and_masks(causal, window), tf.and_masks(causal, window)),
        (or_masks(prefix, head_window), tf.or_masks(prefix, head_window)),
        (noop_mask, tf.noop_mask),
        (and_masks(), tf.and_masks()),
        (or_masks(), tf.or_masks()),
    ]:
        assert torch.equal(ours(b, h, q, kv), theirs(b, h, q, kv))


def test_mask_function_declares_the_layout() -> None:
    """The engine's view: full tiles True (mask_mod not evaluated), empty False (not visited),
    partial None; key ranges skip the empty blocks."""
    bm = create_block_mask(and_masks(causal, window), None, None, 128, 128, BLOCK_SIZE=16)
    structure = bm.mask_fn(1, 1).structure
    states = bm.block_states()[0, 0].tolist()
    for r in range(8):
        for c in range(8):
            got = structure.classify(16 * r, 16 * r + 16, 16 * c, 16 * c + 16)
            assert got == {0: False, 1: None, 2: True}[states[r][c]]
    assert structure.visible_keys(64, 80, 0, 128) == [(48, 80)]  # window 16, causal


def test_named_errors() -> None:
    def scores(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).float()

    with pytest.raises(TypeError, match="mask_mod 'scores' must return a bool tensor"):
        create_block_mask(scores, None, None, 64, 64, BLOCK_SIZE=32)
    with pytest.raises(TypeError, match="like a score_mod"):
        create_block_mask(lambda s, b, h, q, k: s, None, None, 64, 64)
    with pytest.raises(TypeError, match="mask_mod function"):
        create_block_mask("causal", None, None, 64, 64)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must return a bool tensor"):
        create_block_mask(and_masks(causal, scores), None, None, 64, 64, BLOCK_SIZE=32)
    with pytest.raises(ValueError, match="BLOCK_SIZE must be positive"):
        create_block_mask(causal, None, None, 64, 64, BLOCK_SIZE=0)


def test_sizes_that_cannot_be_are_named() -> None:
    def causal(b, h, q, kv):
        return q >= kv

    cases = [
        ((None, None, -5, 8), {}, "Q_LEN must be an int >= 0, got -5"),
        ((0, None, 8, 8), {}, "B must be None or a positive int, got 0"),
        ((None, -1, 8, 8), {}, "H must be None or a positive int, got -1"),
        ((None, None, 8.0, 8), {}, "Q_LEN must be an int >= 0, got 8.0"),
        ((None, None, 8, None), {}, "KV_LEN must be an int >= 0, got None"),
        ((None, None, 8, 8), {"BLOCK_SIZE": (2, 2, 2)}, "BLOCK_SIZE must be an int or two ints"),
        ((None, None, 8, 8), {"BLOCK_SIZE": 0}, "BLOCK_SIZE must be positive"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            create_block_mask(causal, *args, **kwargs)
    assert create_block_mask(causal, None, None, 0, 8).shape == (1, 1, 0, 8)
