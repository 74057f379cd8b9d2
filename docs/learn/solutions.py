"""Solutions to the course's exercises, one function per topic of ``attnkit.learn.check``.

Each is the plain version a learner is expected to write (no attnkit inside), and the test suite
checks every one of them with ``attnkit.learn.check`` (tests/test_learn.py). Read them after
trying: ``check`` tells you what differs in your own.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def scores(q: Tensor, k: Tensor) -> Tensor:
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (b, i, j)


def softmax(x: Tensor) -> Tensor:
    x = x - x.amax(dim=-1, keepdim=True)  # the largest becomes exp(0) = 1: nothing overflows
    e = x.exp()
    return e / e.sum(dim=-1, keepdim=True)


def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return softmax(scores(q, k)) @ v  # (b, i, d)


def causal_mask(i: int, j: int) -> Tensor:
    # bottom-right: the last query is the newest token and sees every key
    return torch.arange(j)[None, :] <= torch.arange(i)[:, None] + (j - i)


def padding_mask(lengths: Tensor, max_len: int) -> Tensor:
    return torch.arange(max_len)[None, :] < lengths[:, None]  # (b, max_len)


def masked_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    s = scores(q, k).masked_fill(~causal_mask(q.shape[-2], k.shape[-2]), float("-inf"))
    return softmax(s) @ v


def window_mask(n: int, window: int) -> Tensor:
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (k <= q) & (k > q - window)


def split_heads(x: Tensor, num_heads: int) -> Tensor:
    b, i, e = x.shape
    return x.view(b, i, num_heads, e // num_heads).transpose(1, 2)  # (b, h, i, d)


def sinusoidal(n: int, embed_dim: int) -> Tensor:
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    two_k = torch.arange(0, embed_dim, 2, dtype=torch.float64)
    angle = pos / 10000 ** (two_k / embed_dim)  # (n, ceil(e/2))
    table = torch.zeros(n, embed_dim, dtype=torch.float64)
    table[:, 0::2] = angle.sin()
    table[:, 1::2] = angle.cos()[:, : embed_dim // 2]
    return table


def rope(x: Tensor, offset: int) -> Tensor:
    d = x.shape[-1]
    half = d // 2
    inv_freq = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    pos = torch.arange(offset, offset + x.shape[-2], dtype=torch.float64)
    angle = pos[:, None] * inv_freq[None, :]  # (i, d/2)
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)  # (i, d)
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def alibi_slopes(num_heads: int) -> Tensor:
    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (k + 1) for k in range(n)]

    if math.log2(num_heads).is_integer():
        return torch.tensor(power_of_two(num_heads))
    closest = 2 ** math.floor(math.log2(num_heads))
    extra = power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(power_of_two(closest) + extra)


def layer_norm(x: Tensor) -> Tensor:
    mean = x.mean(dim=-1, keepdim=True)
    var = x.var(dim=-1, keepdim=True, unbiased=False)
    return (x - mean) / torch.sqrt(var + 1e-5)


def tiled_attention(q: Tensor, k: Tensor, v: Tensor, tile: int) -> Tensor:
    scale = 1 / math.sqrt(q.shape[-1])
    m = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=q.dtype)  # running max
    denom = torch.zeros_like(m)  # running sum of exp
    acc = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=q.dtype)  # running output
    for start in range(0, k.shape[-2], tile):
        s = q @ k[..., start : start + tile, :].transpose(-2, -1) * scale  # (b, i, tile)
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        correction = torch.exp(m - m_new)  # rescale what earlier tiles summed
        p = torch.exp(s - m_new)
        denom = denom * correction + p.sum(dim=-1, keepdim=True)
        acc = acc * correction + p @ v[..., start : start + tile, :]
        m = m_new
    return acc / denom


def patches(images: Tensor, patch: int) -> Tensor:
    b, side, _ = images.shape
    g = side // patch
    x = images.reshape(b, g, patch, g, patch).permute(0, 1, 3, 2, 4)  # (b, row, col, y, x)
    return x.reshape(b, g * g, patch * patch)


def seasonal_naive(past: Tensor, period: int, horizon: int) -> Tensor:
    steps = torch.arange(horizon) % period
    return past[:, past.shape[1] - period + steps]


def merge_heads(x: Tensor) -> Tensor:
    b, h, i, d = x.shape
    return x.transpose(1, 2).reshape(b, i, h * d)  # (b, i, e)


def mean_pool(x: Tensor, lengths: Tensor) -> Tensor:
    keep = padding_mask(lengths, x.shape[1])[..., None].to(x.dtype)  # (b, i, 1)
    return (x * keep).sum(dim=1) / keep.sum(dim=1)  # (b, e)


def rollout(attentions: Tensor) -> Tensor:
    n = attentions.shape[-1]
    result = torch.eye(n, dtype=attentions.dtype)
    for layer in attentions:  # (h, i, i), first layer first
        a = layer.mean(dim=0) + torch.eye(n, dtype=attentions.dtype)  # the residual path
        a = a / a.sum(dim=-1, keepdim=True)
        result = a @ result
    return result


def windows(series: Tensor, context: int, horizon: int) -> Tensor:
    return series.unfold(0, context + horizon, 1)  # (n, context + horizon)


def decode_step(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor) -> Tensor:
    keys = torch.cat([k_cache, k], dim=-2)  # (b, t + 1, d): nothing to mask, the new token is last
    values = torch.cat([v_cache, v], dim=-2)
    return attention(q, keys, values)
