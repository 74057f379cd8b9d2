"""GGUF's weight formats as data, and ``dequantize``: the reference every fast path matches.

Shape vocabulary: ``n`` rows (output features), ``k`` values per row (input features), ``nb``
blocks, ``B`` values per block, ``row_bytes`` bytes of one row (``k / B`` whole blocks).

A quantised matrix is stored row by row; each row is a run of independent blocks of ``B``
values, and each block carries its own scale (and minimum) next to its packed integers. A row
is therefore a whole number of blocks, so rows can be selected, permuted and stacked as byte
rows without decoding anything (what ``attnkit.models.llama`` does with them).

``dequantize`` is written once, in torch, for readability: each format's arithmetic in the
order of ``gguf.quants`` (the numpy reference of llama.cpp's ``ggml-quants.c``), so that its
float32 values are bit for bit those of ``gguf.quants.dequantize``. The kernels of
``attnkit.backends.fused`` (``quant.cpp``) compute with exactly these values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["FORMATS", "BlockFormat", "dequantize", "format_of"]


@dataclass(frozen=True)
class BlockFormat:
    """One storage format: ``kind`` (the ggml type id), ``name``, ``block`` values per block,
    ``block_bytes`` bytes per block. The layout of a block is drawn in the format's ``doc``."""

    kind: int
    name: str
    block: int
    block_bytes: int
    doc: str = ""

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of ``k`` values (``k`` must be whole blocks)."""
        if k % self.block:
            raise ValueError(
                f"a {self.name} row holds whole blocks of {self.block} values; k={k} is not a "
                f"multiple of {self.block}"
            )
        return k // self.block * self.block_bytes

    @property
    def bits_per_value(self) -> float:
        return 8 * self.block_bytes / self.block


QK_K = 256  # values per super-block of the k-quants

F32 = BlockFormat(0, "F32", 1, 4, "value f32 (4 bytes, little-endian)")
F16 = BlockFormat(1, "F16", 1, 2, "value f16 (2 bytes)")
BF16 = BlockFormat(30, "BF16", 1, 2, "value bf16 (2 bytes): the top half of a float32")
Q4_0 = BlockFormat(
    2,
    "Q4_0",
    32,
    18,
    """32 values in 18 bytes, value = d * (q - 8), q in 0..15:

    | d f16 (2) | qs (16): byte t = q[t] | q[t + 16] << 4 |""",
)
Q4_1 = BlockFormat(
    3,
    "Q4_1",
    32,
    20,
    """32 values in 20 bytes, value = d * q + m, q in 0..15:

    | d f16 (2) | m f16 (2) | qs (16): byte t = q[t] | q[t + 16] << 4 |""",
)
Q8_0 = BlockFormat(
    8,
    "Q8_0",
    32,
    34,
    """32 values in 34 bytes, value = d * q, q int8:

    | d f16 (2) | qs (32): q[t] int8 |""",
)
Q6_K = BlockFormat(
    14,
    "Q6_K",
    QK_K,
    210,
    """256 values in 210 bytes: 16 groups of 16 values, value = d * scale[g] * (q - 32), q in
    0..63 split into its low 4 bits (ql) and high 2 bits (qh):

    | ql (128) | qh (64) | scale (16): int8 per group | d f16 (2) |

    Value ``128 h + 32 j + t`` (half ``h`` = 0..1, ``j`` = 0..3, ``t`` = 0..31) takes nibble
    ``j >> 1`` of ql byte ``64 h + 32 (j & 1) + t`` and bits ``2j, 2j + 1`` of qh byte
    ``32 h + t``; its group is ``g = (128 h + 32 j + t) // 16``.""",
)

FORMATS: dict[int, BlockFormat] = {f.kind: f for f in (F32, F16, Q4_0, Q4_1, Q8_0, Q6_K, BF16)}


def format_of(kind: int) -> BlockFormat:
    """The ``BlockFormat`` of ggml type ``kind``; a ``ValueError`` lists the ones attnkit reads."""
    try:
        return FORMATS[kind]
    except (KeyError, TypeError):
        known = ", ".join(f"{f.name} ({f.kind})" for f in FORMATS.values())
        raise ValueError(f"ggml type {kind!r} is not one attnkit reads; it reads {known}") from None


def _f16(blocks: Tensor, start: int) -> Tensor:
    """The float16 field at byte ``start`` of each block, as float32 ``(nb, 1)``."""
    return blocks[:, start : start + 2].view(torch.float16).float()


def _nibbles(qs: Tensor) -> Tensor:
    """``(nb, t)`` bytes -> ``(nb, 2t)`` 4-bit values: all low nibbles, then all high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def dequantize(raw: Tensor, kind: int, k: int) -> Tensor:
    """Decode ``raw`` (uint8 ``(n, row_bytes)``, rows of ``k`` values of ggml type ``kind``) to
    float32 ``(n, k)``: exactly ``gguf.quants.dequantize`` (same operations in the same order).
    """
    fmt = format_of(kind)
    if raw.dtype != torch.uint8 or raw.ndim != 2:
        raise ValueError(f"raw must be uint8 (n, row_bytes), got {raw.dtype} {tuple(raw.shape)}")
    row_bytes = fmt.row_bytes(k)
    if raw.shape[1] != row_bytes:
        raise ValueError(
            f"raw has rows of {raw.shape[1]} bytes; {k} values of {fmt.name} take {row_bytes}"
        )
    n = raw.shape[0]
    blocks = raw.contiguous().view(n * (k // fmt.block), fmt.block_bytes)  # (nb, block_bytes)
    nb = blocks.shape[0]
    if fmt is F32:
        values = blocks.view(torch.float32)  # (nb, 1)
    elif fmt is F16:
        values = blocks.view(torch.float16).float()  # (nb, 1)
    elif fmt is BF16:
        values = blocks.view(torch.bfloat16).float()  # (nb, 1)
    elif fmt is Q8_0:
        d = _f16(blocks, 0)  # (nb, 1)
        q = blocks[:, 2:].view(torch.int8).float()  # (nb, 32)
        values = q * d
    elif fmt is Q4_0:
        d = _f16(blocks, 0)
        q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8  # (nb, 32)
        values = d * q.float()
    elif fmt is Q4_1:
        d, m = _f16(blocks, 0), _f16(blocks, 2)
        q = _nibbles(blocks[:, 4:]).float()  # (nb, 32)
        values = d * q + m  # two roundings, as gguf (no fused multiply-add)
    else:  # Q6_K
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        scale = blocks[:, 192:208].view(torch.int8).float()  # (nb, 16)
        d = (_f16(blocks, 208) * scale).view(nb, 16, 1)  # (nb, groups, 1)
        shifts = torch.tensor([0, 4], dtype=torch.uint8, device=raw.device).view(1, 1, 2, 1)
        low = (ql.view(nb, 2, 1, 64) >> shifts) & 0x0F  # (nb, half, nibble, 64)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=raw.device)
        high = (qh.view(nb, 2, 1, 32) >> shifts.view(1, 1, 4, 1)) & 0x03  # (nb, half, s, 32)
        # 6-bit values (nb, 8, 32): the low 4 bits from ql, the top 2 from qh
        q = (low.reshape(nb, 8, 32) | (high.reshape(nb, 8, 32) << 4)).to(torch.int8) - 32
        values = d * q.view(nb, 16, 16).float()  # (nb, groups, 16)
    return values.reshape(n, k)  # (n, k)
