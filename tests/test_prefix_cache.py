"""Prefix caching: the pool's sharing invariants, the scheduler's use of cached blocks (no
model: a fake runner whose 'KV' at a position is a hash of every token up to it), and the
real model's outputs with and without the cache."""
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from entropic.engine.block_pool import BlockPool, BlockPoolError
from entropic.engine.kv_manager import EVICTED, KVCacheManager
from entropic.engine.request import Request
from entropic.engine.scheduler import SampledToken
from entropic.sampling_params import SamplingParams
from fakes import make_scheduler

# ---- the pool -------------------------------------------------------------------------


def test_free_published_block_stays_cached_until_memory_is_needed():
    pool = BlockPool(3)
    a = pool.allocate(2)
    pool.publish(a[0], "h0")
    pool.free(a)
    assert pool.num_free == 3 and pool.lookup("h0") == a[0]
    b = pool.allocate(2)  # the plain free blocks go first
    assert a[0] not in b and pool.lookup("h0") == a[0]
    pool.share([a[0]])  # a hit on a free cached block takes it out of the free queue
    assert pool.ref_count(a[0]) == 1 and pool.num_free == 0
    pool.free([a[0]])
    pool.free(b)
    assert pool.allocate(3) and pool.lookup("h0") is None  # evicted: its hash is gone
    assert pool.num_cache_evictions == 1


def test_publish_rejects_free_blocks_and_duplicate_content():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.publish(a, "h")
    assert not pool.publish(b, "h")  # the first block with that content stays the cached one
    pool.free([b])
    with pytest.raises(BlockPoolError, match="free block"):
        pool.publish(b, "g")
    with pytest.raises(BlockPoolError, match="no cached KV"):
        pool.share([b])


pool_ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "publish", "hit"]),
                              st.integers(0, 4), st.integers(0, 7)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(pool_ops)
def test_sharing_never_frees_a_referenced_block_nor_leaks_and_evicts_lru(seq):
    """Holders take plain blocks, publish them, share published ones and free; against a
    model of who holds what: reference counts equal the holders, a block is free iff no
    holder has it, nothing leaks, and allocation evicts cached blocks oldest-freed first."""
    n = 8
    pool = BlockPool(n)
    held: dict[int, list[int]] = {}
    freed_order: list[int] = []  # cached free blocks, least recently freed first
    keys = {}
    for op, who, x in seq:
        mine = held.setdefault(who, [])
        if op == "alloc":
            k = 1 + x % 3
            if k > pool.num_free:
                with pytest.raises(BlockPoolError):
                    pool.allocate(k)
                continue
            plain = pool.num_free - len(freed_order)
            expect_evicted = freed_order[:max(0, k - plain)]
            got = pool.allocate(k)
            for b in expect_evicted:
                assert b in got, "cached blocks are evicted least recently freed first"
                keys.pop(b)
            freed_order = freed_order[len(expect_evicted):]
            mine += got
        elif op == "free" and mine:
            b = mine.pop(x % len(mine))
            pool.free([b])
            if not any(b in h for h in held.values()) and b in keys:
                freed_order.append(b)
        elif op == "publish" and mine:
            b = mine[x % len(mine)]
            key = ("k", who, x, b)
            if pool.publish(b, key):
                keys[b] = key
        elif op == "hit" and keys:
            b = sorted(keys)[x % len(keys)]
            assert pool.lookup(keys[b]) == b
            pool.share([b])
            if b in freed_order:
                freed_order.remove(b)
            mine.append(b)
        counts = {}
        for h in held.values():
            for b in h:
                counts[b] = counts.get(b, 0) + 1
        for b in range(n):
            assert pool.ref_count(b) == counts.get(b, 0), "reference count != holders"
            assert pool.is_free(b) == (b not in counts)
        assert len(counts) + pool.num_free == n, "a block leaked"
        assert set(keys) == {b for b in range(n) if pool.block_hash(b) is not None}
    for h in held.values():
        pool.free(h)
    assert pool.num_free == n


# ---- the KV manager ---------------------------------------------------------------------


def test_hashes_chain_over_the_whole_prefix():
    kv = KVCacheManager(BlockPool(16), block_size=4, prefix_caching=True)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert kv.allocate("a", 9)
    assert kv.publish("a", a, 9) == 2  # two full blocks; the third is partial
    assert kv.cached_prefix("b", a, 8) == kv.block_table("a")[:2]
    assert kv.cached_prefix("c", a, 7) == kv.block_table("a")[:1]  # max_tokens caps it
    # the same second block after another first block is other KV: no hit past block 0
    assert kv.cached_prefix("d", [9, 9, 9, 9, 5, 6, 7, 8, 1], 8) == []
    assert kv.cached_prefix("e", [1, 2, 3, 4, 0, 6, 7, 8, 1], 8) == kv.block_table("a")[:1]
    off = KVCacheManager(BlockPool(16), block_size=4)
    assert off.allocate("a", 9) and off.publish("a", a, 9) == 0
    assert off.cached_prefix("b", a, 8) == []


def test_salt_separates_models():
    pool = BlockPool(8)
    one = KVCacheManager(pool, 4, True, salt="model-a|float32")
    other = KVCacheManager(pool, 4, True, salt="model-a|bfloat16")
    toks = list(range(8))
    one.allocate("a", 8)
    one.publish("a", toks, 8)
    assert other.cached_prefix("b", toks, 8) == []


def test_cached_free_blocks_are_counted_once_when_fitting():
    kv = KVCacheManager(BlockPool(4), block_size=4, prefix_caching=True)
    toks = list(range(12))
    kv.allocate("a", 12)
    kv.publish("a", toks, 12)
    kv.free("a")  # 4 blocks free, 3 of them holding a's KV
    hit = kv.cached_prefix("b", toks + [1, 2, 3], 14)
    assert len(hit) == 3
    assert kv.can_fit("b", 15, hit)  # 3 shared + 1 new
    assert not kv.can_fit("b", 17, hit)  # 3 shared + 2 new > 4
    assert kv.allocate("b", 15, hit) and kv.block_table("b")[:3] == hit
    assert kv.pool.num_free == 0


# ---- the scheduler (fake runner) ----------------------------------------------------------

_t = [0.0]


def req(rid, tokens, max_tokens, **kw):
    _t[0] += 1.0
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                     ignore_eos=True, **kw), _t[0])


def run(sched, runner, max_steps=20_000):
    finished = {}
    for _ in range(max_steps):
        if not sched.num_unfinished:
            break
        out = sched.schedule()
        for r in sched.update(out, runner.execute(out), now=0.0):
            if r.status.finished:
                finished[r.request_id] = r
    assert not sched.num_unfinished
    return finished


def test_second_request_starts_on_the_first_ones_blocks():
    sched, pool, runner = make_scheduler(num_blocks=32, budget=64, prefix_caching=True)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks of 4
    sched.add(req("a", prompt, 3))
    done = run(sched, runner)
    sched.add(req("b", prompt + [40, 41], 3))
    out = sched.schedule()
    (c,) = out.chunks
    # a's 16 tokens (prompt + 3 outputs, the last without KV) make 3 full blocks with KV
    assert c.start_pos == 12 and c.token_ids == [13, 40, 41]
    assert sched.num_cache_hits == 12 and sched.num_cache_queries == 13 + 15
    sched.update(out, runner.execute(out), 0.0)
    run(sched, runner)
    # the same prompt again: its last token is computed (its logits are sampled)
    sched.add(req("c", prompt[:12], 2))
    out = sched.schedule()
    assert [(c.start_pos, c.num_tokens) for c in out.chunks] == [(8, 4)]
    sched.update(out, runner.execute(out), 0.0)
    run(sched, runner)
    assert pool.num_free == 32 and done["a"].num_output_tokens == 3


def _outputs(workload, prefix_caching, num_blocks, budget, max_num_seqs=4):
    sched, pool, runner = make_scheduler(num_blocks=num_blocks, budget=budget,
                                         max_num_seqs=max_num_seqs,
                                         prefix_caching=prefix_caching)
    pending = list(workload)
    done = {}
    for _ in range(20_000):
        while pending and pending[0][0] <= sched.step_count:
            _, rid, toks, m = pending.pop(0)
            sched.add(req(rid, toks, m))
        if not sched.num_unfinished and not pending:
            break
        out = sched.schedule()
        for r in sched.update(out, runner.execute(out), now=0.0):
            if r.status.finished:
                done[r.request_id] = r.output_token_ids
    assert not pending and not sched.num_unfinished
    assert pool.num_free == num_blocks, "a block leaked"
    return done, sched


workloads = st.lists(st.tuples(st.integers(0, 30), st.integers(0, 3), st.integers(0, 14),
                               st.integers(1, 12)), min_size=1, max_size=12)


@settings(max_examples=120, deadline=None)
@given(workloads, st.integers(10, 40), st.integers(3, 24))
def test_outputs_identical_with_and_without_the_cache(spec, num_blocks, budget):
    """Requests built from a few shared prefixes arrive over time, under memory pressure
    (preemption, pause, recompute) and small budgets (chunked prefill): every request
    gets the outputs it gets without the cache, its context checked slot by slot."""
    stems = [[(7 * s + 3 * i) % 50 for i in range(20)] for s in range(4)]
    workload = []
    for k, (at, s, cut, m) in enumerate(sorted(spec)):
        toks = stems[s][:6 + cut] + [k % 50]
        if -(-(len(toks) + m) // 4) <= num_blocks:
            workload.append((at, f"r{k}", toks, m))
    off, _ = _outputs(workload, False, num_blocks, budget)
    on, sched = _outputs(workload, True, num_blocks, budget)
    assert on == off
    assert sched.num_cache_hits <= sched.num_cache_queries


class RandomDrafts:
    """A draft policy that proposes mostly wrong tokens: verifies are mostly rejected."""

    def __init__(self):
        self.n = 0

    def propose(self, requests, base_rows):
        self.n += 1
        return {r.request_id: [(self.n * 13 + j) % 50 for j in range(min(cap, 5))]
                for r, cap in requests}

    def commit(self, req, drafted, accepted, committed):
        pass

    def observe_step(self, rows, seconds, sampling):
        pass

    def release(self, request_ids):
        pass


def test_rejected_drafts_are_never_published():
    """Verifies write drafted tokens' KV past the committed ones; later requests that
    start on cached blocks find only committed tokens' KV there (the fake runner checks
    each cached context against the request's own tokens)."""
    from entropic.engine.block_pool import BlockPool
    from entropic.engine.scheduler import Scheduler
    from fakes import FakeRunner
    kv = KVCacheManager(BlockPool(64), 4, prefix_caching=True)
    sched = Scheduler(kv, 4, 64, 10_000, (), draft_policy=RandomDrafts())
    runner = FakeRunner(4, sched.requests)
    sched.add(req("a", list(range(10)), 20))
    done = run(sched, runner)
    full = done["a"].token_ids
    assert kv.pool.num_cached >= len(full) // 4 - 1
    # continue a's conversation: hits its prompt and output blocks
    sched.add(req("b", full + [1, 2], 3))
    run(sched, runner)
    assert sched.requests == {} and sched.num_cache_hits >= 4 * (len(full) // 4 - 1)


class OfferNothing:
    """A block policy that attends everything, checks the eviction candidates it is
    offered and evicts none of them (memory pressure then preempts)."""

    wants_prompt_surprisal = False
    wants_key_bounds = False

    def __init__(self, kv):
        self.kv = kv
        self.calls = 0

    def bind(self, cost):
        pass

    def prefill_sparsity(self, req, start, num_tokens):
        return None

    def select(self, req, live, num_blocks, decode_rows):
        from entropic.engine.block_policy import BlockSelection
        return BlockSelection(None)

    def observe(self, *a):
        pass

    def evict(self, candidates, need):
        self.calls += 1
        for r, live in candidates:
            table = self.kv.block_table(r.request_id)
            assert all(self.kv.pool.ref_count(table[i]) == 1 for i in live), \
                "a block shared with another request was offered for eviction"
        return []

    def release(self, ids):
        pass


def test_block_policy_never_offers_shared_blocks_and_publishes_the_prompt_only():
    sched, pool, runner = make_scheduler(num_blocks=11, budget=64, prefix_caching=True)
    sched.block_policy = bp = OfferNothing(sched.kv)
    prompt = list(range(1, 18))  # 4 full blocks and one token
    sched.add(req("a", prompt, 5))
    run(sched, runner)
    # a computed 21 tokens (5 full blocks) but only its prompt's are offered to the cache
    assert pool.num_cached == 4
    sched.add(req("b", prompt + [5], 12))
    sched.add(req("c", prompt + [6], 12))
    done = run(sched, runner)
    assert set(done) == {"b", "c"} and bp.calls > 0 and sched.num_preemptions > 0
    assert sched.num_cache_hits == 3 * 16


def test_prompt_logprobs_skip_the_cache():
    sched, pool, runner = make_scheduler(num_blocks=32, budget=64, prefix_caching=True)
    prompt = list(range(1, 14))
    sched.add(req("a", prompt, 2))
    run(sched, runner)
    sched.add(req("b", prompt, 2, prompt_logprobs=0))
    out = sched.schedule()
    assert out.chunks[0].start_pos == 0 and out.chunks[0].score_targets == prompt[1:]


# ---- the real model -----------------------------------------------------------------------


def _engine(llm, prefix_caching):
    from entropic.engine.engine import LLMEngine
    e = llm.engine
    return LLMEngine(e.model, e.tokenizer, replace(e.config, enable_prefix_caching=prefix_caching))


def _chat(engine, tok, turns, max_tokens):
    """A multi-turn chat: each turn resends the whole conversation."""
    msgs, outs = [], []
    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    for i, user in enumerate(turns):
        msgs.append({"role": "user", "content": user})
        engine.add_request(f"t{i}", tok.apply_chat_template(msgs), sp)
        (o,) = engine.run_until_done()
        outs.append(o)
        msgs.append({"role": "assistant", "content": o.text})
    return outs


TURNS = ["Name three colours.", "Which of them is the warmest?", "Why?"]


@pytest.mark.model
def test_multi_turn_greedy_identical_with_and_without_cache(llm_fp32):
    tok = llm_fp32.tokenizer
    on = _engine(llm_fp32, True)
    with_cache = _chat(on, tok, TURNS, 24)
    without = _chat(_engine(llm_fp32, False), tok, TURNS, 24)
    assert [o.token_ids for o in with_cache] == [o.token_ids for o in without]
    s = on.stats
    assert s.prefix_cache_hits > 0.5 * sum(len(o.prompt_token_ids) for o in with_cache[1:])
    assert on.pool.num_used == 0


@pytest.mark.model
def test_cached_prefix_gives_the_logits_of_a_computed_one(llm_fp32):
    """fp32: the first token's logits after a cached prefix against the same prompt
    computed whole. Not bit-identical in general: the suffix runs as a shorter chunk (or a
    one-row decode), whose matmuls and attention sum in another order."""
    import torch
    tok = llm_fp32.tokenizer
    base = tok.apply_chat_template([{"role": "user", "content": "Tell me about the sea. " * 8}])
    prompt = base + tok.encode(" And about rivers, please.")
    sp = SamplingParams(max_tokens=1, temperature=0)
    got, prefix_kv, tables = {}, {}, {}
    n = len(base) // 16 * 16
    for name, caching in (("cached", True), ("fresh", False)):
        eng = _engine(llm_fp32, caching)
        if caching:
            eng.add_request("warm", base, sp)
            eng.run_until_done()
        eng.runner.keep_logits = True
        run_chunks = eng.runner.execute
        seen = []

        def execute(sched, run_chunks=run_chunks, seen=seen):
            seen.append([(c.start_pos, c.num_tokens) for c in sched.chunks])
            tables[name] = sched.chunks[0].block_table
            res = run_chunks(sched)
            got[name] = res.logits[0].clone()
            return res
        eng.runner.execute = execute
        eng.add_request("x", prompt, sp)
        eng.run_until_done()
        start = len(base) // 16 * 16 if caching else 0
        assert seen == [[(start, len(prompt) - start)]]
        table = tables[name]  # freed now, but nothing has written over them
        slots = [table[p // 16] * 16 + p % 16 for p in range(n)]
        prefix_kv[name] = eng.runner.kv.kv[:, slots].clone()
    a, b = got["cached"], got["fresh"]
    diff = (a - b).abs().max().item()
    kv_diff = (prefix_kv["cached"] - prefix_kv["fresh"]).abs().max().item()
    print(f"max |logit difference| cached vs computed prefix: {diff:.3g}; "
          f"max |KV difference| of the prefix ({n} tokens alone vs within the prompt): "
          f"{kv_diff:.3g}")
    assert torch.argmax(a) == torch.argmax(b)
    assert diff < 1e-3


def test_server_metrics_count_queries_and_hits():
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from entropic.engine.engine import EngineStats
    from entropic.server.metrics import ServerMetrics
    eng = SimpleNamespace(stats=EngineStats(), speculator=None)
    m = ServerMetrics("m", eng)
    eng.stats.prefix_cache_queries, eng.stats.prefix_cache_hits = 100, 64
    m.on_step(eng, [])
    eng.stats.prefix_cache_queries, eng.stats.prefix_cache_hits = 150, 96
    m.on_step(eng, [])
    text = generate_latest(m.registry).decode()
    assert "entropic_prefix_cache_queries_total 150.0" in text
    assert "entropic_prefix_cache_hits_total 96.0" in text
    assert eng.stats.prefix_cache_hit_rate == 96 / 150
