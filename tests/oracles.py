"""Shared inputs for the backend tests: seeded float64 q, k, v with grouped-query heads."""

from __future__ import annotations

import torch

F64 = torch.float64


def qkv(i: int, j: int, h: int = 4, h_kv: int = 2, d: int = 8, dv: int = 6, b: int = 2):
    """``q (b, h, i, d)``, ``k (b, h_kv, j, d)``, ``v (b, h_kv, j, dv)`` in float64, seeded by
    the lengths (so every test of a shape sees the same inputs)."""
    g = torch.Generator().manual_seed(i * 1000 + j)
    q = torch.randn(b, h, i, d, dtype=F64, generator=g)
    k = torch.randn(b, h_kv, j, d, dtype=F64, generator=g)
    v = torch.randn(b, h_kv, j, dv, dtype=F64, generator=g)
    return q, k, v
