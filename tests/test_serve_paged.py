"""attnkit.serve.paged: paged attention equals dense causal attention (float64, ragged batches,
any block size, GQA), and the block pool stays whole under random use."""

from __future__ import annotations

import random

import pytest
import torch

from attnkit.serve.paged import BlockPool, PoolExhausted, paged_attention, write_kv
from serve_oracles import one_thread as one_thread


def dense(q, k, v):
    """Causal attention of the last ``i`` positions of one sequence, the textbook way:
    ``q (i, h, d)``, ``k``/``v`` ``(j, h_kv, d)`` repeated over each group of query heads."""
    i, h, d = q.shape
    j, h_kv, _ = k.shape
    k = k.repeat_interleave(h // h_kv, dim=1)  # (j, h, d)
    v = v.repeat_interleave(h // h_kv, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q, k) / d**0.5
    causal = torch.ones(i, j, dtype=torch.bool).tril(diagonal=j - i)  # bottom-right
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hij,jhd->ihd", weights, v)


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize(("h", "h_kv"), [(4, 4), (6, 2), (5, 1)])
def test_paged_attention_equals_dense_attention_in_float64(block_size, h, h_kv) -> None:
    gen = torch.Generator().manual_seed(block_size * 100 + h * 10 + h_kv)
    rng = random.Random(block_size + h)
    d, b, num_blocks = 8, 7, 700
    lengths = [rng.choice([1, 2, 13, 31, 97]) for _ in range(b)]
    news = [rng.randint(1, n) if k % 2 else 1 for k, n in enumerate(lengths)]  # decode + chunks
    pool_k = torch.randn(num_blocks, block_size, h_kv, d, generator=gen, dtype=torch.float64)
    pool_v = torch.randn(num_blocks, block_size, h_kv, d, generator=gen, dtype=torch.float64)
    free = list(range(num_blocks))
    rng.shuffle(free)  # blocks scattered over the pool, in no order
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    m = max(map(len, tables))
    padded = torch.tensor([t + [0] * (m - len(t)) for t in tables])
    q = torch.randn(sum(news), h, d, generator=gen, dtype=torch.float64)
    out = paged_attention(q, pool_k, pool_v, padded, torch.tensor(lengths), news)
    start = 0
    for table, n, i in zip(tables, lengths, news, strict=True):
        k = pool_k[table].reshape(-1, h_kv, d)[:n]  # (j, h_kv, d)
        v = pool_v[table].reshape(-1, h_kv, d)[:n]
        expected = dense(q[start : start + i], k, v)
        torch.testing.assert_close(out[start : start + i], expected, rtol=0, atol=1e-12)
        start += i


def test_write_kv_puts_each_position_in_its_block() -> None:
    pool_k = torch.zeros(5, 4, 2, 3)
    pool_v = torch.zeros(5, 4, 2, 3)
    table = [3, 0]  # positions 0-3 in block 3, 4-7 in block 0
    slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(6)])
    k = torch.arange(6 * 2 * 3, dtype=torch.float32).view(6, 2, 3)
    write_kv(pool_k, pool_v, slots, k, -k)
    assert torch.equal(pool_k[3], k[:4]) and torch.equal(pool_k[0, :2], k[4:])
    assert torch.equal(pool_v[0, :2], -k[4:]) and not pool_k[[1, 2, 4]].any()


def test_paged_attention_names_what_is_wrong() -> None:
    pool = torch.zeros(4, 2, 3, 8)
    with pytest.raises(ValueError, match="h_kv dividing h"):
        paged_attention(torch.zeros(1, 4, 8), pool, pool, torch.zeros(1, 1), torch.ones(1), [1])
    with pytest.raises(ValueError, match="sum to 2"):
        paged_attention(torch.zeros(1, 6, 8), pool, pool, torch.zeros(1, 1), torch.ones(1), [2])


def test_the_pool_is_whole_after_thousands_of_random_operations() -> None:
    rng = random.Random(0)
    pool = BlockPool(37, 4, num_layers=1, num_kv_heads=1, head_dim=2)
    tables: list[list[int]] = []
    for _ in range(5000):
        op = rng.random()
        try:
            if op < 0.3:
                tables.append([pool.allocate()])
            elif op < 0.6 and tables:
                rng.choice(tables).append(pool.allocate())  # grow: the table only gets longer
            elif op < 0.75 and tables:
                shared = rng.choice(tables)[: rng.randint(0, 3)]  # a prefix, shared
                for block in shared:
                    pool.share(block)
                tables.append(list(shared))
            elif tables:
                for block in tables.pop(rng.randrange(len(tables))):
                    pool.release(block)
        except PoolExhausted:
            assert pool.num_free == 0
        held = [0] * 37
        for table in tables:
            for block in table:
                held[block] += 1
        assert held == pool.refs
        assert pool.num_free == sum(1 for n in held if n == 0)
    for table in tables:
        for block in table:
            pool.release(block)
    pool.check_whole()
    with pytest.raises(ValueError, match="released twice"):
        pool.release(0)


pytestmark = pytest.mark.usefixtures("one_thread")
