"""A pool of fixed-size KV-cache blocks: ids, reference counts and a free queue."""
from __future__ import annotations

from collections import deque


class BlockPoolError(RuntimeError):
    """A block-pool invariant would be broken (double free, freeing an unknown block)."""


class BlockPool:
    """Hands out block ids in [0, num_blocks). A block is free iff its ref count is 0."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Fraction of blocks in use."""
        return self.num_used / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks (all or nothing)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise BlockPoolError(f"asked for {n} blocks, only {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._ref[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero return to the queue."""
        for b in blocks:
            if not 0 <= b < self.num_blocks:
                raise BlockPoolError(f"block {b} is not in this pool of {self.num_blocks}")
            if self._ref[b] <= 0:
                raise BlockPoolError(f"double free of block {b}")
        for b in blocks:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._ref[block]
