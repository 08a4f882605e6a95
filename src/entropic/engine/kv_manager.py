"""Per-request KV bookkeeping over the block pool: block tables grown on demand, and the
prefix cache (docs/prefix_caching.md).

A table entry can be EVICTED: the block was given back to the pool for good (KV-block
pruning under memory pressure) and the positions it held are never attended again.

Prefix caching: a full block is named by a hash of its token ids and of every token before
it (a chain: the parent block's hash goes into each hash), seeded with what else decides
its KV (`salt`: model, dtype). The scheduler publishes blocks once their KV is computed and
final, and a new request starts on the longest chain of published blocks that matches its
tokens, sharing them by reference count instead of computing them again."""
from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

from entropic.engine.block_pool import BlockPool, cdiv

EVICTED = -1


def block_hashes(token_ids: Sequence[int], block_size: int, parent: bytes,
                 start_block: int = 0) -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids` from block `start_block` on;
    `parent` is the hash of the block before it (the salt's hash for block 0)."""
    out = []
    for i in range(start_block, len(token_ids) // block_size):
        tokens = array("q", token_ids[i * block_size:(i + 1) * block_size])
        parent = hashlib.sha256(parent + tokens.tobytes()).digest()
        out.append(parent)
    return out


class KVCacheManager:
    """Maps each request id to its block table (list of block ids, in token order).

    `prefix_caching` turns on sharing of published blocks; `salt` names everything besides
    the tokens that changes a block's KV (the engine passes the model and dtype)."""

    def __init__(self, pool: BlockPool, block_size: int, prefix_caching: bool = False,
                 salt: str = "") -> None:
        self.pool = pool
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._root = hashlib.sha256(salt.encode()).digest()
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # per request: its full blocks' hashes
        self._published: dict[str, int] = {}  # per request: blocks published so far

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- allocation -------------------------------------------------------------------
    def shortfall(self, request_id: str, num_tokens: int, cached: Sequence[int] = ()) -> int:
        """Blocks missing for the request's table to cover `num_tokens` tokens, beyond the
        blocks free now (<= 0: it fits). `cached`: a prefix-cache hit the table would
        start with (only for a request holding no blocks); its free blocks are taken off
        the free count, since sharing them takes them out of the free queue."""
        have = len(self._tables.get(request_id, ())) + len(cached)
        taken = sum(self.pool.is_free(b) for b in cached)
        return self.blocks_needed(num_tokens) - have - (self.pool.num_free - taken)

    def can_fit(self, request_id: str, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        return self.shortfall(request_id, num_tokens, cached) <= 0

    def allocate(self, request_id: str, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Make the request's table cover `num_tokens` tokens, starting with the shared
        blocks `cached` if given (a prefix-cache hit, for a request holding no blocks).
        False (and no change) if the pool cannot supply the missing blocks."""
        if cached and self._tables.get(request_id):
            raise ValueError(f"request {request_id!r} already holds blocks: no cache hit")
        if not self.can_fit(request_id, num_tokens, cached):
            if not self._tables.get(request_id):
                self._tables.pop(request_id, None)
            return False
        table = self._tables.setdefault(request_id, [])
        if cached:
            self.pool.share(list(cached))
            table.extend(cached)
            self._published[request_id] = len(cached)
        missing = self.blocks_needed(num_tokens) - len(table)
        if missing > 0:
            table.extend(self.pool.allocate(missing))
        return True

    def free(self, request_id: str) -> None:
        """Return all of the request's blocks to the pool (no-op if it holds none); the
        hashes of its tokens are kept (it may come back: a recompute after preemption)."""
        table = self._tables.pop(request_id, None)
        self._published.pop(request_id, None)
        if table:
            # last block first: among equally old cached blocks, a prefix's tail goes first
            self.pool.free([b for b in reversed(table) if b != EVICTED])

    def release(self, request_id: str) -> None:
        """A finished request: free its blocks and forget its hashes."""
        self.free(request_id)
        self._hashes.pop(request_id, None)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens (a verify's rejected
        tail)."""
        table = self._tables.get(request_id)
        if not table:
            return
        keep = self.blocks_needed(num_tokens)
        if len(table) > keep:
            self.pool.free([b for b in reversed(table[keep:]) if b != EVICTED])
            del table[keep:]
            if self._published.get(request_id, 0) > keep:
                self._published[request_id] = keep

    def evict(self, request_id: str, index: int) -> None:
        """Give block `index` of the request's table back to the pool for good."""
        table = self._tables[request_id]
        if table[index] == EVICTED:
            raise ValueError(f"block {index} of request {request_id!r} is already evicted")
        self.pool.free([table[index]])
        table[index] = EVICTED

    # ---- the prefix cache ---------------------------------------------------------------
    def _hashes_of(self, request_id: str, token_ids: Sequence[int], num_blocks: int
                   ) -> list[bytes]:
        """The request's first `num_blocks` full-block hashes (computed once, kept: the
        token ids of a live request never change where they are full blocks)."""
        hashes = self._hashes.setdefault(request_id, [])
        if len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else self._root
            hashes += block_hashes(token_ids[:num_blocks * self.block_size], self.block_size,
                                   parent, len(hashes))
        return hashes[:num_blocks]

    def cached_prefix(self, request_id: str, token_ids: Sequence[int], max_tokens: int
                      ) -> list[int]:
        """The blocks of the longest published prefix of `token_ids` made of full blocks
        within the first `max_tokens` tokens ([] with prefix caching off). Nothing is taken
        yet: `allocate(..., cached=blocks)` shares them."""
        if not self.prefix_caching or max_tokens < self.block_size:
            return []
        blocks = []
        for h in self._hashes_of(request_id, token_ids, max_tokens // self.block_size):
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def cached_scored_prefix(self, request_id: str, token_ids: Sequence[int], max_tokens: int
                             ) -> tuple[list[int], list[float | None]]:
        """`cached_prefix` for a request that needs the surprisal of every position of
        `token_ids` (a block policy that ranks blocks by it): only blocks published with
        their positions' surprisal, and the surprisal of positions 0 .. the first one
        computed (entry 0, token 0's, is None). The first computed position's surprisal
        comes from the row before it, inside the hit: so the hit stops one block short of
        the chain found, whose next block supplies that score (a hit of m blocks needs
        m + 1 scored blocks in the cache). ([], [None]) if nothing usable is cached."""
        if not self.prefix_caching:
            return [], [None]
        bs = self.block_size
        chain = []
        for h in self._hashes_of(request_id, token_ids, len(token_ids) // bs):
            b = self.pool.lookup(h)
            if b is None or self.pool.scores(b) is None:
                break
            chain.append(b)
        m = min(len(chain) - 1, max_tokens // bs)
        if m <= 0:
            return [], [None]
        scores = [s for b in chain[:m + 1] for s in self.pool.scores(b)]
        return chain[:m], scores[:m * bs + 1]

    def prefix_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """The prefix cache's keys of the full blocks of `token_ids` in this cache (its
        salt: the model, dtype and kernels)."""
        return block_hashes(token_ids, self.block_size, self._root)

    def publish(self, request_id: str, token_ids: Sequence[int], num_tokens: int,
                surprisal: Sequence[float | None] = ()) -> int:
        """Publish the request's full blocks among its first `num_tokens` tokens, whose KV
        the caller vouches is computed and final; `surprisal`: the known surprisal of its
        positions from 0 on (entry 0 None), stored with each block it covers. Returns how
        many were newly indexed."""
        if not self.prefix_caching:
            return 0
        table = self._tables.get(request_id)
        if not table:
            return 0
        done = self._published.get(request_id, 0)
        full = min(num_tokens // self.block_size, len(table))
        if full <= done:
            return 0
        new, bs = 0, self.block_size
        for i, h in enumerate(self._hashes_of(request_id, token_ids, full)[done:], done):
            if table[i] != EVICTED:
                scores = (surprisal[i * bs:(i + 1) * bs] if len(surprisal) >= (i + 1) * bs
                          else None)
                new += self.pool.publish(table[i], h, scores)
        self._published[request_id] = full
        return new

    # ---- queries ----------------------------------------------------------------------
    def live_indices(self, request_id: str) -> list[int]:
        """Indices of the table entries not evicted."""
        return [i for i, b in enumerate(self._tables.get(request_id, ())) if b != EVICTED]

    def num_evicted(self, request_id: str) -> int:
        return sum(b == EVICTED for b in self._tables.get(request_id, ()))

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_blocks_held(self, request_id: str) -> int:
        return sum(b != EVICTED for b in self._tables.get(request_id, ()))

    def is_shared(self, block: int) -> bool:
        """Another table holds this block too."""
        return self.pool.ref_count(block) > 1

    @property
    def num_tracked(self) -> int:
        return len(self._tables)
