"""Exercise checks for the course (docs/learn): compare a learner's function with attnkit's.

``check("masks", my_causal_mask)`` calls the learner's function on hidden cases (odd sizes,
large scores, several batches) and compares what it returns with what attnkit computes for the
same inputs; it prints, in words, the first thing that differs (a shape, a dtype, a value and
where), or that every case agrees, and returns a ``CheckResult`` (``passed``, ``message``). A
function that cannot be called the way the exercise says (wrong number of parameters) is told
so plainly, with the signature the check expects, before anything runs.

``TOPICS`` lists every exercise with its signature; the solutions are in ``docs/learn/
solutions.py`` and the test suite checks them here.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnkit.functional import scaled_dot_product_attention
from attnkit.masks import causal_mask, padding_mask, sliding_window_mask
from attnkit.positional import RotaryEmbedding, alibi_slopes, sinusoidal_table
from attnkit.viz.rollout import attention_rollout

__all__ = ["TOPICS", "CheckResult", "Topic", "check"]


@dataclass(frozen=True)
class CheckResult:
    """What a check found: ``passed`` and one message in words (also printed)."""

    topic: str
    passed: bool
    message: str

    def __repr__(self) -> str:
        return self.message

    def __bool__(self) -> bool:
        return self.passed


@dataclass(frozen=True)
class Topic:
    """One exercise: its signature in words, the reference, and the hidden cases."""

    signature: str
    reference: Callable[..., Any]
    cases: Callable[[], Iterator[tuple[Any, ...]]]
    what: str
    atol: float = 1e-5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _qkv_cases() -> Iterator[tuple[Any, ...]]:
    for seed, (b, i, j, d) in enumerate([(1, 3, 3, 4), (2, 5, 7, 8), (3, 1, 9, 16), (2, 7, 5, 3)]):
        g = _gen(seed)
        q, k, v = (torch.randn(b, n, d, generator=g, dtype=torch.float64) for n in (i, j, j))
        yield q, k, v


def _scores(q: Tensor, k: Tensor) -> Tensor:
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (b, i, j)


def _softmax_cases() -> Iterator[tuple[Any, ...]]:
    g = _gen(0)
    yield (torch.randn(3, 5, generator=g, dtype=torch.float64),)
    yield (torch.randn(2, 4, 7, generator=g, dtype=torch.float64) * 50 + 1000,)  # overflows exp
    yield (torch.tensor([[-1000.0, 0.0, 1000.0]], dtype=torch.float64),)


def _attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return scaled_dot_product_attention(q, k, v)


def _mask_cases() -> Iterator[tuple[Any, ...]]:
    yield from [(1, 1), (3, 3), (4, 7), (5, 2), (6, 6)]


def _masked_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return scaled_dot_product_attention(q, k, v, causal_mask(q.shape[-2], k.shape[-2]))


def _padding_cases() -> Iterator[tuple[Any, ...]]:
    yield torch.tensor([3, 1, 4]), 5
    yield torch.tensor([7]), 7
    yield torch.tensor([2, 2, 6, 1, 5]), 6


def _heads_cases() -> Iterator[tuple[Any, ...]]:
    g = _gen(1)
    for b, i, e, h in [(1, 3, 8, 2), (2, 5, 12, 3), (3, 1, 16, 4), (2, 7, 6, 6)]:
        yield torch.randn(b, i, e, generator=g), h


def _split_heads(x: Tensor, num_heads: int) -> Tensor:
    b, i, e = x.shape
    return x.reshape(b, i, num_heads, e // num_heads).transpose(1, 2)  # (b, h, i, d)


def _sinusoidal(n: int, embed_dim: int) -> Tensor:
    return sinusoidal_table(n, embed_dim)


def _rope_cases() -> Iterator[tuple[Any, ...]]:
    g = _gen(2)
    for b, h, i, d, offset in [(1, 1, 3, 4, 0), (2, 3, 5, 8, 0), (1, 2, 4, 16, 7)]:
        yield torch.randn(b, h, i, d, generator=g, dtype=torch.float64), offset


def _rope(x: Tensor, offset: int) -> Tensor:
    return RotaryEmbedding(x.shape[-1]).rotate(x, offset)


def _window(n: int, window: int) -> Tensor:
    return sliding_window_mask(n, left=window - 1)


def _layer_norm_cases() -> Iterator[tuple[Any, ...]]:
    g = _gen(3)
    yield (torch.randn(2, 3, 8, generator=g, dtype=torch.float64) * 4 + 2,)
    yield (torch.randn(5, 6, generator=g, dtype=torch.float64),)


def _layer_norm(x: Tensor) -> Tensor:
    return torch.nn.functional.layer_norm(x, x.shape[-1:], eps=1e-5)


def _tiled_cases() -> Iterator[tuple[Any, ...]]:
    for (q, k, v), tile in zip(_qkv_cases(), (1, 2, 3, 4), strict=True):
        yield q, k * 20, v, tile  # large scores: a softmax that is not online overflows nothing,
        # but one that forgets to rescale earlier tiles is visibly wrong


def _tiled(q: Tensor, k: Tensor, v: Tensor, tile: int) -> Tensor:
    return scaled_dot_product_attention(q, k, v)


def _patches_cases() -> Iterator[tuple[Any, ...]]:
    g = _gen(4)
    yield torch.randn(2, 8, 8, generator=g), 2
    yield torch.randn(1, 8, 8, generator=g), 4
    yield torch.randn(3, 6, 6, generator=g), 3


def _patches(images: Tensor, patch: int) -> Tensor:
    b, side, _ = images.shape
    g = side // patch
    x = images.reshape(b, g, patch, g, patch).permute(0, 1, 3, 2, 4)  # (b, row, col, y, x)
    return x.reshape(b, g * g, patch * patch)  # (b, patches, pixels per patch)


def _seasonal_cases() -> Iterator[tuple[Any, ...]]:
    g = _gen(5)
    yield torch.randn(3, 104, generator=g), 52, 52
    yield torch.randn(2, 30, generator=g), 7, 10
    yield torch.arange(24.0)[None], 12, 5


def _seasonal_naive(past: Tensor, period: int, horizon: int) -> Tensor:
    steps = torch.arange(horizon)
    return past[:, past.shape[1] - period + steps % period]


def _merge_cases() -> Iterator[tuple[Any, ...]]:
    for x, h in _heads_cases():
        yield (_split_heads(x, h),)


def _merge_heads(x: Tensor) -> Tensor:
    b, h, i, d = x.shape
    return x.transpose(1, 2).reshape(b, i, h * d)  # (b, i, e)


def _pool_cases() -> Iterator[tuple[Any, ...]]:
    g = _gen(6)
    yield torch.randn(3, 5, 4, generator=g), torch.tensor([5, 1, 3])
    yield torch.randn(1, 7, 2, generator=g), torch.tensor([7])


def _mean_pool(x: Tensor, lengths: Tensor) -> Tensor:
    keep = padding_mask(lengths, x.shape[1]).reshape(len(lengths), -1, 1).to(x.dtype)  # (b, i, 1)
    return (x * keep).sum(1) / keep.sum(1)  # (b, e)


def _rollout_cases() -> Iterator[tuple[Any, ...]]:
    g = _gen(7)
    for layers, h, n in [(1, 2, 3), (3, 4, 5), (2, 1, 6)]:
        yield (torch.rand(layers, h, n, n, generator=g, dtype=torch.float64).softmax(-1),)


def _windows_cases() -> Iterator[tuple[Any, ...]]:
    yield torch.arange(10.0), 3, 2
    yield torch.randn(30, generator=_gen(8)), 12, 5


def _windows(series: Tensor, context: int, horizon: int) -> Tensor:
    n = len(series) - context - horizon + 1
    idx = torch.arange(n)[:, None] + torch.arange(context + horizon)[None, :]
    return series[idx]  # (n, context + horizon)


def _decode_cases() -> Iterator[tuple[Any, ...]]:
    g = _gen(9)
    for b, t, d in [(1, 1, 4), (2, 5, 8), (3, 9, 3)]:
        yield tuple(torch.randn(b, n, d, generator=g, dtype=torch.float64) for n in (1, t, t, 1, 1))


def _decode_step(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return scaled_dot_product_attention(
        q, torch.cat([k_cache, k], dim=-2), torch.cat([v_cache, v], dim=-2)
    )


TOPICS: dict[str, Topic] = {
    "scores": Topic(
        "scores(q, k) -> (b, i, j)",
        _scores,
        lambda: ((q, k) for q, k, _ in _qkv_cases()),
        "scaled dot-product scores q k^T / sqrt(d)",
    ),
    "softmax": Topic(
        "softmax(x) -> same shape",
        lambda x: torch.softmax(x, -1),
        _softmax_cases,
        "a softmax over the last dimension that survives large scores",
    ),
    "attention": Topic(
        "attention(q, k, v) -> (b, i, d)",
        _attention,
        _qkv_cases,
        "softmax(q k^T / sqrt(d)) v",
    ),
    "masks": Topic(
        "causal_mask(i, j) -> bool (i, j)",
        causal_mask,
        _mask_cases,
        "a causal mask aligned bottom-right (True = may attend)",
    ),
    "padding": Topic(
        "padding_mask(lengths, max_len) -> bool (b, max_len)",
        lambda lengths, n: padding_mask(lengths, n).reshape(len(lengths), n),
        _padding_cases,
        "True for the real tokens of each sequence, False for its padding",
    ),
    "masked_attention": Topic(
        "masked_attention(q, k, v) -> (b, i, d)",
        _masked_attention,
        # i <= j: with more queries than keys the first rows would see no key at all
        lambda: (c for c in _qkv_cases() if c[0].shape[-2] <= c[1].shape[-2]),
        "causal attention, the mask aligned bottom-right",
    ),
    "window": Topic(
        "window_mask(n, window) -> bool (n, n)",
        _window,
        lambda: iter([(1, 1), (5, 2), (7, 3), (6, 6)]),
        "causal sliding window: query q sees keys q - window + 1 .. q",
    ),
    "split_heads": Topic(
        "split_heads(x, num_heads) -> (b, h, i, e // h)",
        _split_heads,
        _heads_cases,
        "each head's slice of the embedding, heads before positions",
    ),
    "merge_heads": Topic(
        "merge_heads(x) -> (b, i, h * d)",
        _merge_heads,
        _merge_cases,
        "the heads' outputs side by side again, the inverse of split_heads",
    ),
    "mean_pool": Topic(
        "mean_pool(x, lengths) -> (b, e)",
        _mean_pool,
        _pool_cases,
        "the mean over each sequence's real tokens only (padding excluded)",
    ),
    "rollout": Topic(
        "rollout(attentions) -> (i, i)",
        lambda a: attention_rollout(a),
        _rollout_cases,
        "attention rollout: per layer mean of heads, plus identity, rows renormalised, "
        "multiplied from the first layer up (Abnar and Zuidema 2020)",
    ),
    "windows": Topic(
        "windows(series, context, horizon) -> (n, context + horizon)",
        _windows,
        _windows_cases,
        "every run of context + horizon consecutive values, in order",
    ),
    "decode_step": Topic(
        "decode_step(q, k_cache, v_cache, k, v) -> (b, 1, d)",
        _decode_step,
        _decode_cases,
        "the new token attending over the cached keys and values and its own",
    ),
    "sinusoidal": Topic(
        "sinusoidal(n, embed_dim) -> (n, embed_dim)",
        _sinusoidal,
        lambda: iter([(1, 4), (5, 8), (7, 6), (3, 16)]),
        "the table of Vaswani et al. 2017: sin on even columns, cos on odd ones",
    ),
    "rope": Topic(
        "rope(x, offset) -> same shape",
        _rope,
        _rope_cases,
        "rotary positions: pairs (first half, second half) rotated by position * frequency",
    ),
    "alibi": Topic(
        "alibi_slopes(num_heads) -> (h,)",
        alibi_slopes,
        lambda: iter([(1,), (4,), (6,), (8,)]),
        "the geometric ALiBi slopes (Press et al. 2022), interleaved when h is not a power of 2",
    ),
    "layer_norm": Topic(
        "layer_norm(x) -> same shape",
        _layer_norm,
        _layer_norm_cases,
        "mean 0 and variance 1 over the last dimension (eps 1e-5, no weights)",
    ),
    "tiled_attention": Topic(
        "tiled_attention(q, k, v, tile) -> (b, i, d)",
        _tiled,
        _tiled_cases,
        "attention computed over key tiles with an online softmax",
    ),
    "patches": Topic(
        "patches(images, patch) -> (b, n, patch * patch)",
        _patches,
        _patches_cases,
        "square patches in reading order, each flattened row by row",
    ),
    "seasonal_naive": Topic(
        "seasonal_naive(past, period, horizon) -> (b, horizon)",
        _seasonal_naive,
        _seasonal_cases,
        "each step ahead repeats the value one period earlier",
    ),
}


def _arity_problem(fn: Callable[..., Any], topic: str, n_args: int) -> str | None:
    """Why ``fn`` cannot be called with ``n_args`` positional arguments, or None."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: just call it
    try:
        sig.bind(*range(n_args))
    except TypeError:
        return (
            f"check({topic!r}): your function has the signature {fn.__name__}{sig}, but this "
            f"exercise calls it with {n_args} argument{'s' * (n_args != 1)}: "
            f"{TOPICS[topic].signature}. Change its parameters and run the check again."
        )
    return None


def _describe(args: tuple[Any, ...]) -> str:
    parts = []
    for a in args:
        if isinstance(a, Tensor):
            small = a.dim() <= 1 and a.numel() <= 8
            parts.append(f"tensor {a.tolist()}" if small else f"tensor of shape {tuple(a.shape)}")
        else:
            parts.append(repr(a))
    return "(" + ", ".join(parts) + ")"


def _compare(mine: Any, ref: Tensor, atol: float) -> str | None:
    """What differs between the learner's output and the reference, in words; None if equal."""
    if mine is None:
        return "it returned None, not a tensor (is its body still `...`, or a `return` missing?)"
    if not isinstance(mine, Tensor):
        return f"it returned a {type(mine).__name__}, not a tensor"
    if tuple(mine.shape) != tuple(ref.shape):
        return f"its result has shape {tuple(mine.shape)}, expected {tuple(ref.shape)}"
    if ref.dtype == torch.bool:
        if mine.dtype != torch.bool:
            return f"its result has dtype {mine.dtype}, expected torch.bool (True = may attend)"
        wrong = (mine != ref).nonzero()
        if len(wrong):
            at = tuple(wrong[0].tolist())
            return (
                f"{len(wrong)} entries differ; the first at {at}: yours is "
                f"{bool(mine[at])}, expected {bool(ref[at])}"
            )
        return None
    if not torch.isfinite(mine).all():
        return "its result holds NaN or infinity (does a large score overflow exp?)"
    diff = (mine.double() - ref.double()).abs()
    if diff.max() > atol + atol * ref.double().abs().max():
        at = tuple(torch.nonzero(diff == diff.max())[0].tolist())
        return (
            f"values differ by up to {float(diff.max()):.3g}; at {at} yours is "
            f"{float(mine[at]):.6g}, expected {float(ref[at]):.6g}"
        )
    return None


def check(topic: str, fn: Callable[..., Any], *, quiet: bool = False) -> CheckResult:
    """Run ``fn`` on the topic's hidden cases against attnkit; print and return the verdict."""
    if topic not in TOPICS:
        raise ValueError(f"unknown topic {topic!r}; the exercises are: {', '.join(TOPICS)}")
    if not callable(fn):
        raise TypeError(f"check({topic!r}, fn): fn must be a function, got {type(fn).__name__}")
    spec = TOPICS[topic]
    cases = list(spec.cases())
    problem = _arity_problem(fn, topic, len(cases[0]))
    message = problem
    if message is None:
        for n, args in enumerate(cases, start=1):
            ref = spec.reference(*args)
            try:
                mine = fn(*args)
            except Exception as exc:  # the learner's error, reported in words
                message = (
                    f"check({topic!r}): case {n} of {len(cases)}, {_describe(args)}: your "
                    f"function raised {type(exc).__name__}: {exc}"
                )
                break
            differs = _compare(mine, ref, spec.atol)
            if differs:
                message = (
                    f"check({topic!r}): case {n} of {len(cases)}, {_describe(args)}: {differs}. "
                    f"Expected {spec.what}."
                )
                break
    passed = message is None
    if passed:
        message = f"check({topic!r}): all {len(cases)} hidden cases agree with attnkit. Well done."
    result = CheckResult(topic, passed, message)
    if not quiet:
        print(message)
    return result
