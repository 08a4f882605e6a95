"""A pool of fixed-size KV-cache blocks: ids, reference counts, a free queue, and the
prefix cache's index of full blocks by content hash.

A block is free iff its reference count is 0. A free block may still hold cached KV: one
that was published under a hash (docs/prefix_caching.md) keeps it, and can be taken
back by a later request with the same prefix, until its memory is needed. Allocation takes
plain free blocks first, then evicts cached free blocks in least-recently-used order.

A published block may also carry the surprisal of its positions (`scores`): what a block
policy that ranks blocks by prompt surprisal needs to start on a cache hit. The scores are
stored with the block's hash and dropped with it when the block is evicted.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Hashable


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks of size b that hold a tokens."""
    return -(-a // b)


class BlockPoolError(RuntimeError):
    """A block-pool invariant would be broken (double free, freeing an unknown block)."""


class BlockPool:
    """Hands out block ids in [0, num_blocks), shares published blocks by reference count."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # free, holding nothing cached
        # free blocks that hold cached KV, least recently used first
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._hash: list[Hashable | None] = [None] * num_blocks
        self._by_hash: dict[Hashable, int] = {}
        self._scores: list[tuple | None] = [None] * num_blocks  # per published block
        self.num_cache_evictions = 0  # cached blocks whose KV was dropped for new use

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (cached free blocks included)."""
        return len(self._free) + len(self._free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks published under a hash (in use or free)."""
        return len(self._by_hash)

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks (all or nothing): plain ones first, then the least recently
        used cached ones, whose hashes are dropped."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise BlockPoolError(f"asked for {n} blocks, only {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._free_cached.popitem(last=False)
                del self._by_hash[self._hash[b]]
                self._hash[b] = None
                self._scores[b] = None
                self.num_cache_evictions += 1
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block, in order; a block reaching zero becomes free
        (a cached one at the most recently used end, so it is evicted last)."""
        for b in blocks:
            if not 0 <= b < self.num_blocks:
                raise BlockPoolError(f"block {b} is not in this pool of {self.num_blocks}")
        counts: dict[int, int] = {}
        for b in blocks:
            counts[b] = counts.get(b, 0) + 1
        for b, k in counts.items():
            if self._ref[b] < k:
                raise BlockPoolError(f"double free of block {b}")
        for b in blocks:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash[b] is None:
                    self._free.append(b)
                else:
                    self._free_cached[b] = None

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    # ---- the prefix cache's index ---------------------------------------------------
    def publish(self, block: int, key: Hashable, scores: tuple | None = None) -> bool:
        """Index an in-use, full block under `key` (the hash of its content and of every
        token before it), with the surprisal of its positions if known (`scores`). False
        if another block already holds that content (the first stays the cached one) or
        the block is published already; `scores` then fill in the cached block's if it has
        none (they score the same tokens after the same prefix)."""
        if self._ref[block] <= 0:
            raise BlockPoolError(f"cannot publish free block {block}")
        if self._hash[block] is not None or key in self._by_hash:
            cached = self._by_hash.get(key)
            if scores is not None and cached is not None and self._scores[cached] is None:
                self._scores[cached] = tuple(scores)
            return False
        self._hash[block] = key
        self._by_hash[key] = block
        self._scores[block] = tuple(scores) if scores is not None else None
        return True

    def scores(self, block: int) -> tuple | None:
        """The surprisal of a published block's positions, if it was published with it."""
        return self._scores[block]

    def lookup(self, key: Hashable) -> int | None:
        """The block cached under `key`, in use or free; None if there is none."""
        return self._by_hash.get(key)

    def is_free(self, block: int) -> bool:
        return self._ref[block] == 0

    def share(self, blocks: list[int]) -> None:
        """Take one more reference to each of these cached blocks (a prefix-cache hit); a
        free one leaves the free queue."""
        for b in blocks:
            if self._hash[b] is None:
                raise BlockPoolError(f"block {b} holds no cached KV to share")
        for b in blocks:
            if self._ref[b] == 0:
                del self._free_cached[b]
            self._ref[b] += 1

    def block_hash(self, block: int) -> Hashable | None:
        return self._hash[block]
