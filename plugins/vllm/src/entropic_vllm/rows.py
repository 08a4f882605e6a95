"""The batch bookkeeping every entropic processor shares: which batch row holds which
request's state, kept current through vLLM's BatchUpdate (removed rows, moves, swaps)."""
from __future__ import annotations

from typing import TypeVar

from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

S = TypeVar("S")


def drop_removed(rows: dict[int, S], update: BatchUpdate) -> None:
    """Forget the rows vLLM removed (before the added ones take their indices)."""
    for i in update.removed:
        rows.pop(i, None)


def apply_moves(rows: dict[int, S], update: BatchUpdate) -> None:
    """Follow vLLM's moves (a -> b) and swaps (a <-> b), after the added rows."""
    for a, b, kind in update.moved:
        sa, sb = rows.pop(a, None), rows.pop(b, None)
        if sa is not None:
            rows[b] = sa
        if kind is MoveDirectionality.SWAP and sb is not None:
            rows[a] = sb
