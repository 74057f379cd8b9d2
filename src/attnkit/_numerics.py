"""Numeric facts every path shares, written once: the compute dtype and the blocked minimum."""

from __future__ import annotations

import torch

__all__ = ["blocked", "compute_dtype"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores and softmax statistics are computed in: float32 for float16, bfloat16
    and float32 inputs, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def blocked(dtype: torch.dtype) -> float:
    """The score a blocked position gets: the dtype's finite minimum, never ``-inf`` (a row
    blocked everywhere would become NaN) nor ``-1e9`` (not large enough, and it overflows
    float16)."""
    return torch.finfo(dtype).min
