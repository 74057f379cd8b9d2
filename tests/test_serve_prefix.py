"""attnkit.serve.prefix: a block's hash names its tokens and everything before them; cached
blocks are shared with reference counts and evicted least recently used."""

from __future__ import annotations

import pytest

from attnkit.serve.paged import BlockPool, PoolExhausted
from attnkit.serve.prefix import PrefixCache, block_hashes


def test_a_block_hash_depends_on_its_tokens_and_everything_before() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 3)
    assert len(a) == 2  # the partial last block has no name
    assert block_hashes([1, 2, 3, 4, 5, 6], 3) == a
    assert block_hashes([1, 2, 3, 4, 5, 9], 3)[0] == a[0] != block_hashes([1, 2, 3, 4, 5, 9], 3)[1]
    # the same second block after another first block is another prefix
    assert block_hashes([9, 2, 3, 4, 5, 6], 3)[1] != a[1]
    # chaining: hashing the rest after the first block's hash gives the same names
    assert block_hashes([4, 5, 6], 3, parent=a[0]) == a[1:]
    # a token id is not confused with a neighbour's bytes
    assert block_hashes([1, 256], 2) != block_hashes([256, 1], 2)


def pool_and_cache(n: int = 4) -> tuple[BlockPool, PrefixCache]:
    pool = BlockPool(n, 2, num_layers=1, num_kv_heads=1, head_dim=2)
    return pool, PrefixCache(pool)


def test_matching_shares_the_longest_known_prefix() -> None:
    pool, cache = pool_and_cache()
    hashes = block_hashes([1, 2, 3, 4, 5, 6], 2)
    table = [cache.allocate() for _ in hashes]
    for h, block in zip(hashes[:2], table, strict=False):
        cache.publish(h, block)
    assert cache.match(hashes) == table[:2]  # the third block was never published
    assert [pool.refs[b] for b in table] == [3, 3, 1]  # writer, cache, reader
    assert cache.hit_tokens == 4
    assert cache.match(block_hashes([1, 2, 9, 9], 2)) == table[:1]
    assert cache.match(block_hashes([7, 7], 2)) == []


def test_eviction_takes_the_least_recently_used_block_that_nobody_holds() -> None:
    pool, cache = pool_and_cache(3)
    names = [block_hashes([k, k], 2)[0] for k in range(3)]
    blocks = [cache.allocate() for _ in names]
    for h, block in zip(names, blocks, strict=True):
        cache.publish(h, block)
        pool.release(block)  # the request ends; only the cache holds it
    assert pool.num_free == 0 and cache.num_evictable == 3
    cache.match([names[0]])  # block 0 is used again: now the most recent, and held
    fresh = cache.allocate()  # evicts block 1, the least recently used that nobody holds
    assert fresh == blocks[1] and cache.evictions == 1
    assert cache.match([names[1]]) == []
    pool.release(blocks[0])
    assert cache.allocate() == blocks[2]  # then 2 (0 was used after it)
    with pytest.raises(PoolExhausted):  # 0 is cached and free to evict ... then nothing
        cache.allocate(), cache.allocate()
    for block in (fresh, blocks[2], blocks[0]):
        pool.release(block)
    cache.clear()
    pool.check_whole()


def test_a_disabled_cache_allocates_but_never_shares() -> None:
    pool = BlockPool(2, 2, num_layers=1, num_kv_heads=1, head_dim=2)
    cache = PrefixCache(pool, enabled=False)
    h = block_hashes([1, 2], 2)
    block = cache.allocate()
    cache.publish(h[0], block)
    assert cache.match(h) == [] and len(cache) == 0 and pool.refs[block] == 1
