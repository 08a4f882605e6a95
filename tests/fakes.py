"""A model-free runner for scheduler tests: a fake KV store and deterministic 'logits'."""
from __future__ import annotations

from entropic.engine.block_pool import BlockPool
from entropic.engine.kv_manager import EVICTED, KVCacheManager
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
    `requests` (the scheduler's) gives the true tokens before each chunk. With `horizon`
    (every layer's sliding window) a chunk reads only the positions its queries' windows
    reach, the earlier ones may be gone; it needs `requests`."""

    def __init__(self, block_size: int, requests: dict | None = None,
                 horizon: int | None = None) -> None:
        self.block_size = block_size
        self.requests = requests
        self.horizon = horizon
        self.slots: dict[int, tuple[int, int, int]] = {}

    def slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        sampled = {}
        for c in out.chunks:
            assert len(c.block_table) * self.block_size >= c.start_pos + c.num_tokens, \
                "block table does not cover the chunk"
            # the context before the chunk, as the slots hold it (from the first position
            # a window reaches; the tokens before it as the request has them)
            history, h = [], 17
            lo = 0 if self.horizon is None else max(0, c.start_pos - self.horizon + 1)
            for t in (self.requests[c.request_id].token_ids[:lo] if lo else ()):
                h = (h * 31 + t) % 1_000_003
                history.append(t)
            for pos in range(lo, c.start_pos):
                assert c.block_table[pos // self.block_size] != EVICTED, \
                    f"position {pos} inside the window was freed"
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
                   prefix_caching: bool = False, block_policy=None, horizon=None):
    pool = BlockPool(num_blocks)
    kv = KVCacheManager(pool, block_size, prefix_caching)
    sched = Scheduler(kv, max_num_seqs, budget, max_model_len, eos, policy, block_policy,
                      attention_horizon=horizon)
    return sched, pool, FakeRunner(block_size, sched.requests, horizon)


class PrunedFakeRunner:
    """Writes (request, position) into slots; checks that every position a chunk attends is
    intact and that no evicted block is ever read; 'mass' is uniform over attended blocks."""

    def __init__(self, block_size):
        self.bs = block_size
        self.slots = {}

    def execute(self, out):
        sampled, mass = {}, {}
        for c in out.chunks:
            assert EVICTED not in [c.block_table[i] for i in (c.attend_blocks or [])]
            for i, t in enumerate(c.token_ids):
                p = c.start_pos + i
                self.slots[c.block_table[p // self.bs] * self.bs + p % self.bs] = (c.request_id, p, t)
            end = c.start_pos + c.num_tokens
            blocks = c.attend_blocks if c.attend_blocks is not None else range(-(-end // self.bs))
            history = []
            for b in blocks:
                assert c.block_table[b] != EVICTED, "an evicted block was attended"
                for p in range(b * self.bs, min(end, (b + 1) * self.bs)):
                    rid, pp, t = self.slots[c.block_table[b] * self.bs + p % self.bs]
                    assert (rid, pp) == (c.request_id, p), "KV slot overwritten"
                    history.append(t)
            if c.sample:
                sampled[c.request_id] = SampledToken(next_token(history), 0.3, 0.0, -1.0)
                if c.collect_attention:
                    mass[c.request_id] = (list(blocks), [1 / len(blocks)] * len(blocks))
        return sampled, mass
