"""Prefix caching: full KV blocks found again by a hash of their tokens and everything before.

Many requests start the same way (a system prompt, a few-shot preamble, the earlier turns of a
chat). Their keys and values are the same too, because a position's keys depend only on the
tokens up to it. So a *full* block is named by a hash of its ``s`` tokens chained with the hash
of the block before it (vLLM's automatic prefix caching; SGLang's RadixAttention keeps the same
information as a tree)::

    tokens     [ 5 9 2 7 | 1 1 4 8 | 3 6 ]      s = 4
    hashes       H0 = h(-, 5 9 2 7)   H1 = h(H0, 1 1 4 8)   (the last, partial block: none)

Equal hashes mean equal prefixes, so a new request whose first blocks have known hashes takes
those blocks into its own table (one more reference each) and prefills only the rest.

The cache holds one reference to every block it knows, so a cached block outlives the request
that filled it. When the pool has no free block, ``allocate`` evicts the least recently used
cached block that no sequence holds (reference count 1: only the cache's), and uses it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from attnkit.serve.paged import BlockPool, PoolExhausted

__all__ = ["PrefixCache", "block_hashes"]


def block_hashes(tokens: Sequence[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """The chained hash of every *full* block of ``tokens`` (a partial last block has none).

    BLAKE2b, not Python's ``hash``: a collision would hand one request the keys of another
    prompt, so the names must not collide by accident nor be easy to collide on purpose.
    """
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(b"".join(int(t).to_bytes(4, "little") for t in block))
        parent = digest.digest()
        out.append(parent)
    return out


class PrefixCache:
    """The blocks known by hash, least recently used first, over a ``BlockPool``.

    Every block the server allocates comes from ``allocate`` (which evicts when the pool is
    full); ``enabled=False`` keeps the allocator and never matches nor publishes.
    Counters: ``hit_tokens`` (prompt tokens whose prefill was skipped), ``evictions``.
    """

    def __init__(self, pool: BlockPool, *, enabled: bool = True) -> None:
        self.pool = pool
        self.enabled = enabled
        self._blocks: OrderedDict[bytes, int] = OrderedDict()  # hash -> block, oldest first
        self.hit_tokens = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def num_evictable(self) -> int:
        """Cached blocks that no sequence holds: free as soon as they are needed."""
        return sum(1 for block in self._blocks.values() if self.pool.refs[block] == 1)

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks of the longest cached prefix of ``hashes``, each held once more by the
        caller (release them like any block of its table); marks them recently used."""
        if not self.enabled:
            return []
        found = []
        for h in hashes:
            block = self._blocks.get(h)
            if block is None:
                break
            self.pool.share(block)
            self._blocks.move_to_end(h)
            found.append(block)
        self.hit_tokens += len(found) * self.pool.block_size
        return found

    def publish(self, h: bytes, block: int) -> None:
        """Make a full, written block findable by its hash (a no-op when the hash is known
        already: two requests prefilled the same prefix at once, and the first one stays)."""
        if self.enabled and h not in self._blocks:
            self.pool.share(block)
            self._blocks[h] = block

    def allocate(self) -> int:
        """A block for new keys, from the free list, else by evicting the least recently used
        cached block that only the cache holds. Raises ``PoolExhausted`` if there is none."""
        try:
            return self.pool.allocate()
        except PoolExhausted:
            if not self.evict():
                raise
            return self.pool.allocate()

    def evict(self) -> bool:
        """Free the least recently used block that only the cache holds; False if none."""
        for h, block in self._blocks.items():
            if self.pool.refs[block] == 1:
                del self._blocks[h]
                self.pool.release(block)
                self.evictions += 1
                return True
        return False

    def clear(self) -> None:
        """Forget every block no sequence holds (the pool is whole again once none run)."""
        while self.evict():
            pass
