"""The entropy board: per-token entropies from vLLM's worker to entropic's scheduler.

vLLM computes logits in its worker; the scheduler runs in the engine-core process. On the
CPU build these are two processes (`CpuPlatform.check_and_update_config` turns the "uni"
executor into "mp" whenever VLLM_ENABLE_V1_MULTIPROCESSING is on, the default), and nothing
a logits processor computes reaches the scheduler through `ModelRunnerOutput`. The board is
the side channel: a file in shared memory (/dev/shm) that the scheduler creates and names
in each request's `extra_args`; the worker's `EntropyLogitsProcessor` appends one record per
row and step, and the scheduler reads the records it has not seen yet before each
`schedule()`.

Layout: float64, a header [records written] and a ring of CAPACITY records
(request tag, output index, entropy). One writer (the worker), one reader (the scheduler).
The writer fills records before it advances the count; with synchronous scheduling (the
only mode on CPU) the scheduler reads after the step's output came back, so every record of
the step is in place.
"""
from __future__ import annotations

import os
import tempfile
import uuid

import numpy as np

BOARD_KEY = "entropic_board"  # extra_args: the board's path
TAG_KEY = "entropic_tag"  # extra_args: the request's tag on the board (an int)
PREFIX = "entropic-board-"  # file names; the worker opens nothing else
CAPACITY = 1 << 16  # records; the scheduler reads every step, a step writes <= max_num_seqs
_HEADER = 1


class RecordsLost(RuntimeError):
    """The reader fell more than CAPACITY records behind the writer."""


def _directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class EntropyBoard:
    """One board. `create()` on the scheduler's side, `open(path)` on the worker's."""

    def __init__(self, path: str, data: np.memmap, owner: bool) -> None:
        self.path = path
        self._data = data
        self._owner = owner
        self._cursor = 0  # records read (reader)
        self._written = int(data[0])  # records written (writer)

    @classmethod
    def create(cls) -> "EntropyBoard":
        path = os.path.join(_directory(), f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
        data = np.memmap(path, dtype=np.float64, mode="w+", shape=(_HEADER + 3 * CAPACITY,))
        return cls(path, data, owner=True)

    @classmethod
    def open(cls, path: str) -> "EntropyBoard":
        name = os.path.basename(path)
        if os.path.dirname(path) != _directory() or not name.startswith(PREFIX):
            raise ValueError(f"entropic: {path!r} is not an entropy board "
                             f"({_directory()}/{PREFIX}*)")
        if not os.path.exists(path):
            raise RuntimeError(
                f"entropic: the entropy board {path} does not exist in this process's "
                f"filesystem: the worker does not share a host with the scheduler "
                f"(EntropicScheduler needs both on one machine)")
        data = np.memmap(path, dtype=np.float64, mode="r+", shape=(_HEADER + 3 * CAPACITY,))
        return cls(path, data, owner=False)

    def write(self, tags: list[int], outputs: list[int], entropies: list[float]) -> None:
        """Append one record per row: (tag, index of the output token sampled, H)."""
        n = len(tags)
        if n == 0:
            return
        rows = np.asarray([tags, outputs, entropies], dtype=np.float64).T
        ring = self._data[_HEADER:].reshape(CAPACITY, 3)
        start = self._written % CAPACITY
        first = min(n, CAPACITY - start)
        ring[start:start + first] = rows[:first]
        if first < n:
            ring[:n - first] = rows[first:]
        self._written += n
        self._data[0] = self._written  # after the records: the reader trusts the count

    def read(self) -> list[tuple[int, int, float]]:
        """The records written since the last read, oldest first."""
        written = int(self._data[0])
        n = written - self._cursor
        if n <= 0:
            return []
        if n > CAPACITY:
            raise RecordsLost(f"entropic: {n - CAPACITY} entropy records were overwritten "
                              f"before the scheduler read them")
        ring = self._data[_HEADER:].reshape(CAPACITY, 3)
        idx = np.arange(self._cursor, written) % CAPACITY
        rows = ring[idx]
        self._cursor = written
        return [(int(t), int(o), float(h)) for t, o, h in rows]

    def unlink(self) -> None:
        """Remove the name (the scheduler's side); mappings already made stay valid."""
        if self._owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
