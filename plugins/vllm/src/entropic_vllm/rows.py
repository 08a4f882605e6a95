"""The batch bookkeeping every entropic processor shares: which batch row holds which
request's state, kept current through vLLM's BatchUpdate (removed rows, moves, swaps)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

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


def update_rows(rows: dict[int, S], update: BatchUpdate | None,
                state_of: Callable[[Any], S | None]) -> None:
    """One BatchUpdate for processors that keep a state per opted-in request: removed
    rows go, each added row gets `state_of(params)` (None: the request did not opt in) with
    its output list attached as `.outputs`, then the moves."""
    if update is None:
        return
    drop_removed(rows, update)
    for i, params, _prompt, outputs in update.added:
        st = state_of(params)
        if st is None:
            rows.pop(i, None)
            continue
        st.outputs = outputs
        rows[i] = st
    apply_moves(rows, update)
