"""The digits ViT's parts against hand-made references: patches in reading order, the 2-D
sinusoidal table, the random shift, the fixed split, CLS attention maps and the config checks."""

from __future__ import annotations

import pytest
import torch

from attnkit.positional import sinusoidal_table
from attnkit.tasks.vit import (
    DigitsViT,
    VitConfig,
    cls_attention,
    digits_datasets,
    sinusoidal_2d,
)


def test_patches_are_in_reading_order_each_row_by_row() -> None:
    model = DigitsViT(VitConfig(patch=2, embed_dim=8, num_heads=2, num_layers=1))
    pixels = torch.arange(64.0)[None]  # pixel (r, c) holds 8 r + c
    patches = model.patches(pixels)  # (1, 16, 4)
    assert patches.shape == (1, 16, 4)
    assert patches[0, 0].tolist() == [0, 1, 8, 9]  # top-left patch
    assert patches[0, 1].tolist() == [2, 3, 10, 11]  # its right neighbour
    assert patches[0, 4].tolist() == [16, 17, 24, 25]  # first patch of the second row
    four = DigitsViT(VitConfig(patch=4, embed_dim=8, num_heads=2, num_layers=1))
    assert four.patches(pixels)[0, 3, -1].item() == 63


def test_sinusoidal_2d_halves_encode_row_and_column() -> None:
    table = sinusoidal_2d(3, 8)  # (9, 8)
    one_d = sinusoidal_table(3, 4).float()
    for r in range(3):
        for c in range(3):
            assert torch.equal(table[3 * r + c, :4], one_d[r])
            assert torch.equal(table[3 * r + c, 4:], one_d[c])


def test_the_shift_moves_whole_digits_and_fills_zeros() -> None:
    torch.manual_seed(0)
    model = DigitsViT(VitConfig(embed_dim=8, num_heads=2, num_layers=1, shift=1))
    img = torch.zeros(1, 8, 8)
    img[0, 3, 4] = 16.0
    moved = model._shifted(img.reshape(1, 64).repeat(50, 1)).reshape(50, 8, 8)
    where = {tuple((m == 16).nonzero()[0].tolist()) for m in moved}
    assert where == {(r, c) for r in (2, 3, 4) for c in (3, 4, 5)}  # every shift, seen
    assert torch.all(moved.sum((1, 2)) == 16)  # nothing else appears


def test_the_split_is_fixed_stratified_and_disjoint() -> None:
    train, val, test = digits_datasets()
    assert (len(train["labels"]), len(val["labels"]), len(test["labels"])) == (1259, 179, 359)
    again = digits_datasets()
    assert torch.equal(test["pixels"], again[2]["pixels"])
    assert torch.bincount(test["labels"]).min() >= 35  # every digit, about 36 each


def test_cls_attention_maps_cover_the_digit() -> None:
    torch.manual_seed(0)
    model = DigitsViT(VitConfig(embed_dim=16, num_heads=2, num_layers=3))
    layers, rolled = cls_attention(model, torch.rand(5, 64) * 16)
    assert layers.shape == rolled.shape == (5, 3, 8, 8)
    patch_share = layers.sum((2, 3)) / 4  # 4 pixels per patch repeat each weight
    assert torch.all(patch_share <= 1 + 1e-5) and torch.all(patch_share > 0)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"patch": 3}, "patch must divide the digit's side 8"),
        ({"positional": "rope"}, "positional must be one of"),
        ({"shift": 8}, "shift must be a whole number of pixels"),
        ({"embed_dim": 30, "num_heads": 4}, "num_heads (4) must divide embed_dim (30)"),
        ({"embed_dim": 6, "num_heads": 2, "positional": "sinusoidal2d"}, "must divide by 4"),
    ],
)
def test_config_refuses_what_cannot_work(kwargs, words) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        VitConfig(**kwargs)
