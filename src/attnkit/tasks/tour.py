"""The measured steps of ``attnkit demo``: one layer by two routes, and KV-cache decoding.

``compare_routes(n)`` runs one ``MultiHeadAttention`` layer (8 heads of 64, ALiBi positions,
Press et al. 2022) over ``n`` tokens twice, with the same weights and input:

- torch's dense route: the ALiBi bias materialised as a ``(1, h, n, n)`` tensor (``alibi_bias``,
  512 MB at n = 4096 in float32), then torch's fused kernel (backend ``"torch"``);
- attnkit's tiled route: ALiBi as a bias function (``alibi_fn``) that the tiled backend
  evaluates tile by tile (backend ``"tiled"``), so no ``n x n`` tensor is ever built.

Forward passes without autograd. Each round runs both routes, one right after the other (in
alternating order), so a change in the machine's load hits both; the time ratio is the median
of the rounds' own ratios, so one slow round (or two of five) cannot flip it, and each route's
time is its median over the rounds. Peak extra memory is what the call adds to the process's
resident memory at its highest (Linux: ``VmHWM`` after resetting it through
``/proc/self/clear_refs``; ``None`` elsewhere).

``kv_cache_gap(n)`` decodes ``n`` tokens one at a time through a ``KVCache`` and compares the
outputs with one causal pass over the whole sequence (grouped-query heads, rotary positions).
"""

from __future__ import annotations

import contextlib
import ctypes
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from attnkit._memory import check_fits
from attnkit.attention import KVCache, MultiHeadAttention
from attnkit.positional import RotaryEmbedding, alibi_bias, alibi_fn
from attnkit.registry import use

__all__ = [
    "Route",
    "RouteComparison",
    "check_length",
    "compare_routes",
    "kv_cache_gap",
    "paired_ratios",
    "peak_extra_mb",
]

HEADS = 8
HEAD_DIM = 64


@dataclass(frozen=True)
class Route:
    """One way to run the layer: its name, median seconds per forward, peak extra MB."""

    name: str
    seconds: float
    peak_mb: float | None


@dataclass(frozen=True)
class RouteComparison:
    """The two routes over ``n`` tokens and the largest difference between their outputs."""

    n: int
    dense: Route
    tiled: Route
    max_difference: float
    bias_mb: float  # the size of the dense route's materialised bias
    ratios: tuple[float, ...] = ()  # each round's tiled time / dense time, in round order

    @property
    def time_ratio(self) -> float:
        """The tiled route's time over the dense route's: the median of the rounds' ratios."""
        return statistics.median(self.ratios)


def paired_ratios(dense: list[float], tiled: list[float]) -> tuple[float, ...]:
    """Each round's ``tiled / dense`` time: both routes of a round ran under the same load."""
    if len(dense) != len(tiled) or not dense:
        raise ValueError(f"need as many dense as tiled times (>= 1), got {len(dense)} and "
                         f"{len(tiled)}")  # fmt: skip
    return tuple(t / d for d, t in zip(dense, tiled, strict=True))


def check_length(n: int) -> None:
    """Refuse an ``n`` the dense route cannot run: an int >= 16 whose ``(1, h, n, n)`` float32
    bias fits the machine's memory (the bias alone; the route needs a little more)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 16:
        raise ValueError(f"n must be an int >= 16, got {n!r}")
    check_fits(
        HEADS * n * n * 4, f"n = {n:,}: torch's dense route, whose (1, {HEADS}, n, n) ALiBi bias"
    )


def compare_routes(n: int = 4096, *, rounds: int = 5, seed: int = 0) -> RouteComparison:
    """Time and peak memory of the dense and the tiled route for one layer over ``n`` tokens."""
    check_length(n)
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
    with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
        torch.manual_seed(seed)
        layer = MultiHeadAttention(HEADS * HEAD_DIM, num_heads=HEADS).eval()
        x = torch.randn(1, n, HEADS * HEAD_DIM)  # (b, i, embed_dim)
    alibi = alibi_fn(HEADS)

    def dense(x: Tensor = x) -> Tensor:
        bias = alibi_bias(HEADS, x.shape[1])  # (1, h, n, n): built for the call, as it must be
        with use("torch"):
            return layer(x, bias=bias)[0]

    def tiled(x: Tensor = x) -> Tensor:
        with use("tiled"):
            return layer(x, bias=alibi)[0]

    with torch.no_grad():
        small = x[:, :64]
        dense(small), tiled(small)  # load the code both routes run before measuring
        out_tiled, tiled_mb = peak_extra_mb(tiled)
        out_dense, dense_mb = peak_extra_mb(dense)
        difference = float((out_dense - out_tiled).abs().max())
        del out_dense, out_tiled
        times: dict[str, list[float]] = {"dense": [], "tiled": []}
        for r in range(rounds):
            order = (("dense", dense), ("tiled", tiled))
            for name, fn in order if r % 2 == 0 else order[::-1]:  # who goes first alternates
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return RouteComparison(
        n=n,
        dense=Route("dense", statistics.median(times["dense"]), dense_mb),
        tiled=Route("tiled", statistics.median(times["tiled"]), tiled_mb),
        max_difference=difference,
        bias_mb=HEADS * n * n * 4 / 2**20,
        ratios=paired_ratios(times["dense"], times["tiled"]),
    )


def kv_cache_gap(n: int = 64, *, seed: int = 0) -> float:
    """Largest difference between decoding ``n`` tokens one at a time with a ``KVCache`` and
    one causal pass over all of them (8 query heads sharing 2 key/value heads, rotary
    positions)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        raise ValueError(f"n must be an int >= 2, got {n!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = MultiHeadAttention(64, num_heads=8, num_kv_heads=2).eval()
        x = torch.randn(1, n, 64)  # (b, i, embed_dim)
    rope = RotaryEmbedding(64 // 8)
    with torch.no_grad():
        full, _ = layer(x, is_causal=True, rope=rope)  # (b, n, embed_dim)
        cache = KVCache()
        steps = [
            layer(x[:, t : t + 1], is_causal=True, rope=rope, cache=cache)[0]  # (b, 1, embed_dim)
            for t in range(n)
        ]
    return float((torch.cat(steps, dim=1) - full).abs().max())


_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _release_free_heap() -> None:
    """Hand the C allocator's freed pages back to the system (glibc's ``malloc_trim``).

    Memory freed earlier stays resident inside the heap; an allocation that reuses it adds nothing
    to the resident size, so a peak reading would miss it. After this, reused pages are new pages.
    """
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to hand back
        ctypes.CDLL(None).malloc_trim(0)


def peak_extra_mb(fn: Callable[[], Tensor]) -> tuple[Tensor, float | None]:
    """``fn()`` and the most memory (MB) it added to the process at any moment while it ran.

    Linux only (``None`` elsewhere, or where ``/proc/self/clear_refs`` cannot be written).
    """
    try:
        _release_free_heap()
        before = _status_kb("VmRSS")
        _CLEAR_REFS.write_text("5")  # resets VmHWM, the peak, to the current resident size
    except OSError:
        return fn(), None
    out = fn()
    return out, max(0.0, (_status_kb("VmHWM") - before) / 1024)


def _status_kb(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"{field} is not in {_STATUS}")
