"""Hook for choosing which KV blocks a decode step attends, and which to evict.

The engine core knows nothing of how blocks are valued: a `KVBlockPolicy` (the entropic
pruner in entropic.control.pruning is one) is asked, per decode step, for the blocks of a
request's table to attend, and, when KV blocks run out, for blocks it may evict for good
instead of preempting a whole request. It observes what each step produced: the
surprisal of the tokens just scored and the attention mass each attended block received.
Without a policy (the default) every decode attends its whole context: a plain engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from entropic.engine.cost import CostModel
from entropic.engine.request import Request
from entropic.model.attention import PrefillSparsity


@dataclass(frozen=True)
class BlockBudget:
    """Query-aware selection: attend `blocks` of the decode's live blocks, chosen inside
    attention for each layer and KV head by an upper bound on their keys' scores against
    that layer's query; the first `sink` and the last `recent` live blocks always count
    among them."""

    blocks: int
    sink: int
    recent: int


@dataclass(frozen=True)
class BlockSelection:
    """What one decode attends: `attend`, indices into its block table (ascending, the
    last block included; None: every live block), and whether to report the attention mass
    each attended block receives (explicit softmax: slower than the fused kernel).
    `budget` (with attend None): choose the blocks per layer inside attention instead."""

    attend: list[int] | None = None
    collect_attention: bool = False
    budget: BlockBudget | None = None


class KVBlockPolicy(Protocol):
    """Block selection and eviction for decode steps."""

    # Ask the runner for teacher-forced surprisal of prompt tokens (costs an lm_head row
    # per prompt token).
    wants_prompt_surprisal: bool
    # Ask the KV cache to keep each full block's key bounds (query-aware selection needs
    # them: 1 / block_size more KV memory).
    wants_key_bounds: bool

    def bind(self, cost: CostModel) -> None:
        """The engine's cost model, given once before the first step."""
        ...

    def select(self, req: Request, live: list[int], num_blocks: int,
               decode_rows: int) -> BlockSelection:
        """The blocks the request's next decode attends, chosen from `live` (the indices of
        its table not evicted); `num_blocks` blocks hold its context; the step decodes
        `decode_rows` rows."""
        ...

    def prefill_sparsity(self, req: Request, start: int, num_tokens: int
                         ) -> PrefillSparsity | None:
        """How a prefill chunk of `num_tokens` prompt tokens after `start` computed ones
        attends (block-sparse prefill), or None: densely."""
        ...

    def observe(self, req: Request, positions: Sequence[int], surprisal: Sequence[float],
                attended: Sequence[int] | None, block_mass: Sequence[float] | None) -> None:
        """After a step: surprisal (-log p, nats) of the tokens at `positions`; for a decode,
        the block indices it attended and the attention mass share each received (summed
        over layers and heads, divided by their number: shares sum to 1)."""
        ...

    def evict(self, candidates: Sequence[tuple[Request, list[int]]],
              need: int) -> list[tuple[str, int]]:
        """Up to `need` (request id, block index) pairs to drop for good, chosen among the
        candidates' live blocks (indices of blocks holding computed tokens)."""
        ...

    def release(self, request_ids: Sequence[str]) -> None:
        """Forget finished requests."""
        ...


def decode_context_length(attend: Sequence[int], start_pos: int, block_size: int) -> int:
    """KV positions a decode at `start_pos` reads when it attends blocks `attend`: every
    block but the last is full; the last holds the tokens up to and including the new one."""
    return (len(attend) - 1) * block_size + start_pos % block_size + 1
