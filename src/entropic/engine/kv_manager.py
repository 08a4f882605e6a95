"""Per-request KV bookkeeping over the block pool: block tables grown on demand.

A table entry can be EVICTED: the block was given back to the pool for good (KV-block
pruning under memory pressure) and the positions it held are never attended again."""
from __future__ import annotations

from entropic.engine.block_pool import BlockPool

EVICTED = -1


class KVCacheManager:
    """Maps each request id to its block table (list of block ids, in token order)."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._tables: dict[str, list[int]] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_fit(self, request_id: str, num_tokens: int) -> bool:
        have = len(self._tables.get(request_id, ()))
        return self.blocks_needed(num_tokens) - have <= self.pool.num_free

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Make the request's table cover `num_tokens` tokens. False (and no change) if the
        pool cannot supply the missing blocks."""
        table = self._tables.setdefault(request_id, [])
        missing = self.blocks_needed(num_tokens) - len(table)
        if missing <= 0:
            return True
        if missing > self.pool.num_free:
            if not table:
                del self._tables[request_id]
            return False
        table.extend(self.pool.allocate(missing))
        return True

    def free(self, request_id: str) -> None:
        """Return all of the request's blocks to the pool (no-op if it holds none)."""
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.free([b for b in table if b != EVICTED])

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens (a verify's rejected
        tail)."""
        table = self._tables.get(request_id)
        if not table:
            return
        keep = self.blocks_needed(num_tokens)
        if len(table) > keep:
            self.pool.free([b for b in table[keep:] if b != EVICTED])
            del table[keep:]

    def evict(self, request_id: str, index: int) -> None:
        """Give block `index` of the request's table back to the pool for good."""
        table = self._tables[request_id]
        if table[index] == EVICTED:
            raise ValueError(f"block {index} of request {request_id!r} is already evicted")
        self.pool.free([table[index]])
        table[index] = EVICTED

    def live_indices(self, request_id: str) -> list[int]:
        """Indices of the table entries not evicted."""
        return [i for i, b in enumerate(self._tables.get(request_id, ())) if b != EVICTED]

    def num_evicted(self, request_id: str) -> int:
        return sum(b == EVICTED for b in self._tables.get(request_id, ()))

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_blocks_held(self, request_id: str) -> int:
        return sum(b != EVICTED for b in self._tables.get(request_id, ()))

    @property
    def num_tracked(self) -> int:
        return len(self._tables)
