"""The block formats and ``dequantize`` against gguf's numpy reference (``gguf.quants``), bit for
bit, on random blocks: odd row counts, several blocks per row, every kind attnkit reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnkit.quant import FORMATS, dequantize, format_of

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

# Byte offsets of each block's float16 fields (scales, minima): random bytes there could be
# inf or NaN, which the comparison would not see through; they get finite float16 values.
_F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q6_K": (208,)}


def random_rows(name: str, n: int, blocks: int, seed: int) -> tuple[np.ndarray, int]:
    """``n`` rows of ``blocks`` random blocks of format ``name``: ``(raw (n, row_bytes), k)``."""
    fmt = next(f for f in FORMATS.values() if f.name == name)
    rng = np.random.default_rng(seed)
    k = blocks * fmt.block
    if name in ("F32", "F16", "BF16"):  # random finite values of that width
        values = rng.standard_normal((n, k)).astype(np.float32) * 10.0
        if name == "F32":
            return values.view(np.uint8), k
        if name == "F16":
            return values.astype(np.float16).view(np.uint8), k
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8), k
    raw = rng.integers(0, 256, (n, fmt.row_bytes(k)), dtype=np.uint8)
    cells = raw.reshape(n * blocks, fmt.block_bytes)  # (nb, block_bytes), a view
    for at in _F16_FIELDS[name]:
        scale = (rng.standard_normal(n * blocks) * 0.05).astype(np.float16)
        cells[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw, k


NAMES = [f.name for f in FORMATS.values()]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("n", "blocks"), [(1, 1), (7, 3), (33, 5)])
def test_dequantize_equals_gguf_bit_for_bit(name: str, n: int, blocks: int) -> None:
    raw, k = random_rows(name, n, blocks, seed=n * 31 + blocks)
    kind = next(f.kind for f in FORMATS.values() if f.name == name)
    want = gguf_dequantize(raw, gguf.GGMLQuantizationType(kind))  # (n, k) float32
    got = dequantize(torch.from_numpy(raw), kind, k)
    assert got.dtype == torch.float32 and tuple(got.shape) == (n, k)
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("name", NAMES)
def test_formats_agree_with_gguf_sizes(name: str) -> None:
    fmt = next(f for f in FORMATS.values() if f.name == name)
    kind = gguf.GGMLQuantizationType(fmt.kind)
    assert kind.name == fmt.name
    assert gguf.GGML_QUANT_SIZES[kind] == (fmt.block, fmt.block_bytes)


def test_a_row_selection_decodes_as_those_rows() -> None:
    # Rows are whole blocks: a row's bytes decode alone (what the embedding lookup relies on).
    raw, k = random_rows("Q6_K", 9, 2, seed=3)
    table = dequantize(torch.from_numpy(raw), 14, k)
    rows = torch.tensor([4, 0, 8, 4])
    torch.testing.assert_close(dequantize(torch.from_numpy(raw)[rows], 14, k), table[rows])


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match=r"ggml type 12 is not one attnkit reads.*Q4_1"):
        format_of(12)  # Q4_K
    with pytest.raises(ValueError, match="k=48 is not a multiple of 32"):
        format_of(3).row_bytes(48)
    with pytest.raises(ValueError, match="rows of 18 bytes; 64 values of Q4_1 take 40"):
        dequantize(torch.zeros(2, 18, dtype=torch.uint8), 3, 64)
    with pytest.raises(ValueError, match="uint8"):
        dequantize(torch.zeros(2, 18), 2, 32)
