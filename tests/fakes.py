"""A model-free runner for scheduler tests: a fake KV store and deterministic 'logits'."""
from __future__ import annotations

from entropic.engine.block_pool import BlockPool
from entropic.engine.kv_manager import KVCacheManager
from entropic.engine.scheduler import SampledToken, Scheduler, SchedulerOutput

VOCAB = 50


def next_token(history: list[int]) -> int:
    """A deterministic function of the whole token history (as a real greedy model is)."""
    h = 17
    for t in history:
        h = (h * 31 + t) % 1_000_003
    return h % VOCAB


class FakeRunner:
    """Writes (position, token, hash of the tokens up to it) into slots like a KV cache
    would, and checks on every step that each request's context is intact in the slots
    its block table names: the KV at a position depends on every token before it, so a
    slot shared between requests (prefix caching) is right only if their prefixes agree.
    `requests` (the scheduler's) gives the true tokens before each chunk."""

    def __init__(self, block_size: int, requests: dict | None = None) -> None:
        self.block_size = block_size
        self.requests = requests
        self.slots: dict[int, tuple[int, int, int]] = {}

    def slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        sampled = {}
        for c in out.chunks:
            assert len(c.block_table) * self.block_size >= c.start_pos + c.num_tokens, \
                "block table does not cover the chunk"
            # the context before the chunk, as the slots hold it
            history, h = [], 17
            for pos in range(c.start_pos):
                p, t, hh = self.slots[self.slot(c.block_table, pos)]
                h = (h * 31 + t) % 1_000_003
                assert (p, hh) == (pos, h), "KV slot overwritten or shared wrongly"
                history.append(t)
            if self.requests is not None and c.request_id in self.requests:
                truth = self.requests[c.request_id].token_ids[:c.start_pos]
                assert history == truth, "the cached context is not the request's"
            for i, t in enumerate(c.token_ids):
                h = (h * 31 + t) % 1_000_003
                self.slots[self.slot(c.block_table, c.start_pos + i)] = (c.start_pos + i, t, h)
                history.append(t)
            if c.sample:
                sampled[c.request_id] = SampledToken(next_token(history), entropy=0.5)
        return sampled


def make_scheduler(num_blocks: int, block_size: int = 4, max_num_seqs: int = 8,
                   budget: int = 32, max_model_len: int = 10_000, eos=(), policy=None,
                   prefix_caching: bool = False, block_policy=None):
    pool = BlockPool(num_blocks)
    kv = KVCacheManager(pool, block_size, prefix_caching)
    sched = Scheduler(kv, max_num_seqs, budget, max_model_len, eos, policy, block_policy)
    return sched, pool, FakeRunner(block_size, sched.requests)
