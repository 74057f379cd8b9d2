"""``nn.Linear`` and ``nn.Embedding`` whose weight stays in a GGUF block format.

Shape vocabulary: ``k`` input features (values per weight row), ``n`` output features (weight
rows), ``m`` input rows (every leading dim of ``x`` flattened), ``V`` table rows.

``QuantizedLinear`` holds the raw blocks of its weight as a uint8 buffer ``raw (n, row_bytes)``
and computes ``x @ dequantize(raw).T`` (+ bias)::

    out = F.linear(x, dequantize(raw, kind, k), bias)      # the reference: what every path equals

Two paths compute it, both with exactly the float32 values ``dequantize`` gives:

* the fused kernel's ``qmatmul`` (``attnkit.backends.fused``, ``quant.cpp``), which decodes
  each block inside the product and never materialises the matrix, when that kernel is built
  and binds it;
* otherwise the reference above: de-quantise the whole matrix for this call, multiply, drop it.

The kernel is looked up once per process (``kernel()``; a build is verified by its SHA-256, too
slow to repeat for each of a model's 150 products per token) and never compiled on a forward:
loading a quantised model calls ``prepare_kernel()``, which starts the build in a background
process when it is missing (``attnkit.backends.rates.start_background``, announced once on the
``"attnkit"`` logger; ``ATTNKIT_BACKGROUND=0`` turns it off) and lets a model loaded after the
build has finished use it.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.backends import rates
from attnkit.backends.fused import jit
from attnkit.quant.formats import dequantize, format_of

__all__ = ["ConcatLinear", "QuantizedEmbedding", "QuantizedLinear", "kernel", "prepare_kernel"]

_log = logging.getLogger("attnkit")
_KERNEL: list[ModuleType | None] = []  # [the fused module, or None], once looked up
_ANNOUNCED: list[bool] = []


def kernel() -> ModuleType | None:
    """The fused module when a verified build is cached and binds ``qmatmul``, else None.

    Looked up on the first call of the process (or after ``prepare_kernel`` found none);
    nothing is ever compiled here."""
    if not _KERNEL:
        module = jit.load() if jit.is_built() else None
        _KERNEL.append(module if hasattr(module, "qmatmul") else None)
    return _KERNEL[0]


def why_not_kernel() -> str | None:
    """Why quantised products take the reference path, in a sentence, or None."""
    if kernel() is not None:
        return None
    reason = jit.unavailable()
    if reason is None:
        return "the fused kernel is built but binds no qmatmul (an older quant.cpp)"
    return f"the fused kernel is unavailable: {reason}"


def prepare_kernel() -> str | None:
    """Called when a quantised model is loaded: look the kernel up again if it was missing and,
    when it is still missing but can be built, start its build in the background (once per
    process, said once on the ``"attnkit"`` logger). Returns ``why_not_kernel()``."""
    if _KERNEL and _KERNEL[0] is None:
        _KERNEL.clear()  # built since (by a background process, or by build())
    why = why_not_kernel()
    if why is None or _ANNOUNCED:
        return why
    _ANNOUNCED.append(True)
    started = False
    if jit.prerequisites() is None and not jit.is_built() and rates.background_allowed():
        started = rates.start_background("float32", torch.get_num_threads())
    _log.warning(
        "attnkit: the quantised model multiplies by de-quantised weights (the reference path, "
        "slower) because %s%s",
        why,
        "; the build has started in the background and models loaded after it use the kernel"
        if started
        else "",
    )
    return why


def qlinear(x: Tensor, raw: Tensor, kind: int, k: int, bias: Tensor | None = None) -> Tensor:
    """``x (..., k)`` times the transpose of the ``(n, k)`` matrix ``raw`` holds -> ``(..., n)``.

    float32 CPU inputs go through ``qmatmul`` when the kernel is there; anything else through
    the reference (de-quantise, ``F.linear``). Both compute in float32."""
    ops = _KERNEL[0] if _KERNEL else kernel()
    # About 150 calls per decoded token: the cheapest checks (``x.device.type`` would build a
    # device object each time).
    if ops is not None and x.dtype is torch.float32 and x.is_cpu:
        n = raw.shape[0]
        out = torch.empty((*x.shape[:-1], n), dtype=torch.float32)  # (..., n)
        ops.qmatmul(x.reshape(-1, k).contiguous(), raw, kind, out.view(-1, n))  # (m, k), (m, n)
        return out if bias is None else out + bias
    w = dequantize(raw, kind, k)  # (n, k) float32, for this call only
    out = F.linear(x.float(), w, None if bias is None else bias.float())
    return out.to(x.dtype)


def _check_raw(raw: Tensor, rows: int, row_bytes: int, what: str) -> None:
    if not isinstance(raw, Tensor) or raw.dtype != torch.uint8 or raw.ndim != 2:
        raise ValueError(
            f"raw must be a uint8 tensor (rows, row_bytes), got "
            f"{getattr(raw, 'dtype', type(raw).__name__)} {tuple(getattr(raw, 'shape', ()))}"
        )
    if tuple(raw.shape) != (rows, row_bytes):
        raise ValueError(
            f"raw must be ({rows}, {row_bytes}) bytes for {what}, got {tuple(raw.shape)}"
        )


class QuantizedLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` with its weight in the blocks of ggml type
    ``kind`` (``attnkit.quant.formats.FORMATS``), held as ``raw`` (uint8 ``(n, row_bytes)``).

    ``forward(x (..., k)) -> (..., n)``; ``weight`` de-quantises the whole matrix (float32
    ``(n, k)``, for inspection: the forward never keeps it). ``raw=None`` gives zero bytes (a
    shape to load into); ``bias`` is an optional float tensor ``(n,)``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kind: int,
        *,
        raw: Tensor | None = None,
        bias: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.format = format_of(kind)
        self.kind = kind
        self.in_features, self.out_features = in_features, out_features
        row_bytes = self.format.row_bytes(in_features)
        if raw is None:
            raw = torch.zeros(out_features, row_bytes, dtype=torch.uint8)
        _check_raw(raw, out_features, row_bytes, f"{out_features} rows of {self.format.name}")
        self.register_buffer("raw", raw)
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"bias must be ({out_features},), got {tuple(bias.shape)}")
        self.bias = None if bias is None else nn.Parameter(bias)

    @property
    def weight(self) -> Tensor:
        """The de-quantised weight, float32 ``(n, k)`` (a new tensor each time)."""
        return dequantize(self.raw, self.kind, self.in_features)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x must end in in_features={self.in_features}, got {tuple(x.shape)}")
        return qlinear(x, self.raw, self.kind, self.in_features, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"kind={self.format.name}, bias={self.bias is not None}"
        )


class QuantizedEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim)`` with its table in the blocks of ggml type
    ``kind``, held as ``raw`` (uint8 ``(V, row_bytes)``).

    ``forward(ids (...)) -> (..., e)`` de-quantises only the rows it looks up. ``linear(x)``
    multiplies by the table's transpose, ``x (..., e) -> (..., V)``: the output projection of a
    model whose embeddings are tied, from the same bytes. ``weight`` de-quantises the table.
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, kind: int, *, raw: Tensor | None = None
    ) -> None:
        super().__init__()
        self.format = format_of(kind)
        self.kind = kind
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        row_bytes = self.format.row_bytes(embedding_dim)
        if raw is None:
            raw = torch.zeros(num_embeddings, row_bytes, dtype=torch.uint8)
        _check_raw(raw, num_embeddings, row_bytes, f"{num_embeddings} rows of {self.format.name}")
        self.register_buffer("raw", raw)

    @property
    def weight(self) -> Tensor:
        """The de-quantised table, float32 ``(V, e)`` (a new tensor each time)."""
        return dequantize(self.raw, self.kind, self.embedding_dim)

    def forward(self, ids: Tensor) -> Tensor:
        rows = self.raw[ids.reshape(-1)]  # (ids, row_bytes): only the rows looked up
        values = dequantize(rows, self.kind, self.embedding_dim)  # (ids, e)
        return values.view(*ids.shape, self.embedding_dim)  # (..., e)

    def linear(self, x: Tensor) -> Tensor:
        """``x (..., e) @ weight.T -> (..., V)`` without de-quantising the table on the kernel's
        path (the tied output projection)."""
        return qlinear(x, self.raw, self.kind, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, kind={self.format.name}"


class ConcatLinear(nn.Module):
    """Linear layers on the same input whose outputs are concatenated: one ``(sum n, k)``
    projection made of parts that cannot share one block format (``[q; k; v]`` when a GGUF file
    stores them in different types). ``weight`` concatenates the parts' weights."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    @property
    def weight(self) -> Tensor:
        return torch.cat([p.weight.float() for p in self.parts])  # (sum n, k)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)  # (..., sum n)
