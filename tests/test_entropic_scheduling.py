"""The entropic scheduling policy with a fake runner: ordering, victims, aging, no starvation."""
import pytest
from hypothesis import given, settings, strategies as st

from entropic.config import ModelConfig
from entropic.control.clock import EntropicClock
from entropic.control.scheduling import EntropicPolicy, EntropicSchedulingConfig
from entropic.engine.cost import CostModel
from entropic.engine.request import Request
from entropic.sampling_params import SamplingParams
from entropic.control.pruning import EntropicBlockPruner, PruningConfig
from entropic.engine.block_pool import BlockPool
from entropic.engine.kv_manager import KVCacheManager
from entropic.engine.scheduler import Scheduler
from fakes import PrunedFakeRunner, make_scheduler, next_token

CFG = ModelConfig(vocab_size=50, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position=4096)


def fake_entropy(history: list[int]) -> float:
    """A deterministic entropy in [0, 4) from the token history."""
    return (next_token(history + [7]) % 40) / 10.0


def setup(num_blocks, max_num_seqs=4, budget=32, max_wait=8, min_residency=0, **cfg):
    clock = EntropicClock()
    policy = EntropicPolicy(clock, EntropicSchedulingConfig(max_wait=max_wait,
                                                            min_residency=min_residency, **cfg))
    policy.bind(CostModel(CFG, 2), num_blocks, 4, max_num_seqs, budget)
    sched, pool, runner = make_scheduler(num_blocks, max_num_seqs=max_num_seqs, budget=budget,
                                         policy=policy)
    return sched, pool, runner, clock, policy


class _FixedPriority(EntropicPolicy):
    """The entropic policy with each request's priority given (by request id)."""

    def __init__(self, priorities, **cfg):
        super().__init__(EntropicClock(), EntropicSchedulingConfig(**cfg))
        self.priorities = priorities

    def priority(self, req):
        return self.priorities[req.request_id]


def setup_fixed(priorities, num_blocks, max_num_seqs=1, budget=64, **cfg):
    """A scheduler on `_FixedPriority` (no aging unless max_wait is given)."""
    cfg.setdefault("max_wait", 1000)
    policy = _FixedPriority(priorities, **cfg)
    policy.bind(CostModel(CFG, 2), num_blocks, 4, max_num_seqs, budget)
    sched, pool, runner = make_scheduler(num_blocks, max_num_seqs=max_num_seqs, budget=budget,
                                         policy=policy)
    return sched, pool, runner, policy.clock, policy


def step(sched, runner, clock):
    out = sched.schedule()
    sampled = runner.execute(out)
    for rid, s in sampled.items():
        s.entropy = fake_entropy(sched.requests[rid].token_ids)
        clock.observe(rid, s.entropy)
    return out, sched.update(out, sampled, 0.0)


_t = [0.0]


def req(rid, n_prompt, max_tokens):
    _t[0] += 1
    return Request(rid, [(i * 3 + len(rid)) % 50 for i in range(n_prompt)],
                   SamplingParams(max_tokens=max_tokens, temperature=0), _t[0])


def test_unresolved_sequences_rank_before_resolved_ones():
    sched, pool, runner, clock, policy = setup(64)
    a, b = req("a", 4, 50), req("b", 4, 50)
    for r in (a, b):
        sched.add(r)
    for h in [4.0, 3.0, 2.5, 1.5]:  # a is resolving uncertainty fast
        clock.observe("a", h)
    for h in [0.1, 0.1, 0.1, 0.1]:  # b is resolved: flat, near-zero entropy
        clock.observe("b", h)
    assert policy.expected_gain(a) > policy.expected_gain(b)
    assert policy.order([], [b, a], step=1) == [a, b]
    assert policy.choose_victim([a, b], step=1) is b


def test_cost_memory_and_length_lower_priority():
    sched, pool, runner, clock, policy = setup(64)
    short, long_ = req("s", 4, 50), req("l", 200, 50)  # same (prior) gain, costlier prefill
    assert policy.priority(short) > policy.priority(long_)
    old = req("o", 4, 500)
    old.token_ids += [1] * 300  # 300 output tokens: more attained service
    assert policy.priority(short) > policy.priority(old)


def test_aged_request_first_and_never_victim():
    sched, pool, runner, clock, policy = setup(64, max_wait=5)
    a, b = req("a", 4, 50), req("b", 4, 50)
    a.last_served_step, b.last_served_step = 0, 10
    b.token_ids.append(5)  # b has produced a token since its admission
    clock.observe("b", 4.0)
    clock.observe("b", 0.0)  # b looks far more valuable
    assert policy.order([], [b, a], step=10) == [a, b]  # but a has waited 10 >= 5 steps
    assert policy.choose_victim([a, b], step=10) is b
    # a takes the next free slot: an aged request displaces nobody (that only moves the
    # wait onto the victim), and nobody displaces an aged one
    assert not policy.displace(a, b, step=10) and not policy.displace(b, a, step=10)


def test_memory_pressure_drops_the_last_admitted_not_the_lowest_priority():
    """A pause keeps the KV, so priority picks its victim; a recompute throws work away,
    so memory pressure drops the request admitted last (aged ones last of all)."""
    sched, pool, runner, clock, policy = setup(64, max_wait=5)
    deep, fresh = req("deep", 200, 50), req("fresh", 4, 50)
    deep.num_computed_tokens, deep.admitted_step = 200, 1
    fresh.admitted_step = 3
    for r in (deep, fresh):
        r.last_served_step = 4
    assert policy.choose_victim([deep, fresh], step=4) is deep  # lower priority
    assert policy.choose_recompute_victim([deep, fresh], step=4) is fresh
    fresh.last_served_step = 0  # aged: protected while a non-aged candidate exists
    assert policy.choose_recompute_victim([deep, fresh], step=6) is deep


def test_low_priority_request_is_not_starved():
    # max_num_seqs=1: a stream of cheap requests would overtake the costly one forever
    sched, pool, runner, clock, policy = setup(200, max_num_seqs=1, budget=64, max_wait=6)
    sched.add(req("big", 60, 3))
    served_big_at = None
    for i in range(60):
        sched.add(req(f"s{i}", 2, 2))
        out, _ = step(sched, runner, clock)
        if served_big_at is None and any(c.request_id == "big" for c in out.chunks):
            served_big_at = out.step
    assert served_big_at is not None and served_big_at <= 6 + 1 + 1


workload = st.lists(st.tuples(st.integers(0, 30), st.integers(1, 24), st.integers(1, 10)),
                    min_size=1, max_size=14)


@settings(max_examples=120, deadline=None)
@given(workload, st.integers(10, 30), st.integers(1, 4), st.integers(4, 40),
       st.integers(1, 12), st.integers(0, 10), st.sampled_from([1, 2, 4, None]),
       st.sampled_from([None, 0, 5, 40]))
def test_bounded_wait_no_leaks_same_tokens(reqs, num_blocks, max_seqs, budget, max_wait,
                                           residency, max_bypass, total_extra):
    """Random arrivals: every unfinished request is served at least every
    T + Q * (P + M) steps (T = max_wait_total, or max_wait where that is None; Q = unfinished
    requests, P = longest prefill in steps, M = most output tokens: an aged request
    displaces nobody, it waits for a running one to finish), whatever the bypass bound K
    and whether max_wait counts the steps spent waiting for memory (both only age requests
    sooner than T), blocks never leak, and since the fake model is greedy, every request
    gets the same tokens as under FCFS."""
    total = None if total_extra is None else max_wait + total_extra
    sched, pool, runner, clock, policy = setup(num_blocks, max_seqs, budget, max_wait,
                                               residency, max_bypass=max_bypass,
                                               max_wait_total=total)
    fifo, fpool, frunner = make_scheduler(num_blocks, max_num_seqs=max_seqs, budget=budget)
    fits = [(t, p, m) for t, p, m in reqs if -(-(p + m) // 4) <= num_blocks]
    prefill_steps = -(-max((p + m for _, p, m in fits), default=1) // budget)
    max_out = max((m for _, _, m in fits), default=0)
    finished, reference = {}, {}
    for s, (sch, run) in enumerate([(sched, runner), (fifo, frunner)]):
        pending = sorted(enumerate(fits), key=lambda x: x[1][0])
        done = finished if s == 0 else reference
        q_max = 0
        for t in range(2000):
            while pending and pending[0][1][0] <= t:
                i, (_, p, m) = pending.pop(0)
                sch.add(req(f"r{i}", p, m))
            if not sch.num_unfinished:
                if not pending:
                    break
                continue
            q_max = max(q_max, sch.num_unfinished)
            if s == 0:
                _, touched = step(sch, run, clock)
                for r in sch.requests.values():
                    bound = (total or max_wait) + q_max * (prefill_steps + max_out)
                    assert sch.step_count - r.last_served_step <= bound
            else:
                out = sch.schedule()
                touched = sch.update(out, run.execute(out), 0.0)
            for r in touched:
                if r.status.finished:
                    done[r.request_id] = r.output_token_ids
        assert not sch.num_unfinished
    assert pool.num_free == num_blocks and fpool.num_free == num_blocks
    assert finished == reference


def _run_all(sched, runner, clock, arrivals: dict[int, Request], steps: int = 300):
    """Step until done, adding arrivals[t] at step t; return the tokens computed per
    request (prefill and decode, recomputation included) and the final outputs."""
    computed, outputs = {}, {}
    for t in range(steps):
        if t in arrivals:
            sched.add(arrivals[t])
        if not sched.num_unfinished and t > max(arrivals):
            break
        out, touched = step(sched, runner, clock)
        for c in out.chunks:
            computed[c.request_id] = computed.get(c.request_id, 0) + c.num_tokens
        for r in touched:
            if r.status.finished:
                outputs[r.request_id] = r.output_token_ids
    return computed, outputs


def _fcfs_tokens(arrivals: dict[int, Request]) -> dict[str, list[int]]:
    sched, _, runner = make_scheduler(1000, max_num_seqs=8, budget=64)
    for r in arrivals.values():
        sched.add(req(r.request_id, r.num_prompt_tokens, r.params.max_tokens))
    done = {}
    while sched.num_unfinished:
        out = sched.schedule()
        for r in sched.update(out, runner.execute(out), 0.0):
            if r.status.finished:
                done[r.request_id] = r.output_token_ids
    return done


def test_displacement_pauses_with_kv_resident_when_memory_allows():
    """One slot, plenty of blocks: a higher-priority arrival displaces the running request,
    which keeps its KV and later resumes where it stopped: no token is computed twice."""
    sched, pool, runner, clock, _ = setup_fixed({"long": 1.0, "short": 10.0}, 200,
                                                min_residency=2)
    arrivals = {0: req("long", 8, 30), 3: req("short", 4, 3)}
    computed, outputs = _run_all(sched, runner, clock, arrivals)
    assert sched.num_displacements >= 1 and sched.num_pauses == sched.num_preemptions
    assert sched.num_recomputes == 0
    assert computed == {"long": 8 + 30 - 1, "short": 4 + 3 - 1}  # each position once
    assert outputs == _fcfs_tokens(arrivals)  # the fake model is greedy: same tokens
    assert pool.num_free == 200


def test_a_paused_request_takes_the_next_free_slot_before_higher_priority_newcomers():
    """One slot. "hi1" displaces the low-priority "low" (a pause) and finishes; "hi2",
    which outranks "low" and arrived meanwhile, waits: the freed slot goes to the paused
    request. Ranked by priority alone, "low" waited behind every such newcomer until it
    aged, which made the full system's E2E tail in the ablation's regime (a)."""
    sched, pool, runner, _, policy = setup_fixed({"low": 1.0, "hi1": 10.0, "hi2": 10.0}, 200,
                                                 min_residency=2)
    arrivals = {0: req("low", 4, 12), 3: req("hi1", 4, 3), 4: req("hi2", 4, 3)}
    served = []
    for t in range(100):
        if t in arrivals:
            sched.add(arrivals[t])
        if not sched.num_unfinished:
            break
        out = sched.schedule()
        served.append([c.request_id for c in out.chunks])
        sched.update(out, runner.execute(out), 0.0)
    assert sched.num_unfinished == 0 and sched.num_pauses >= 1
    first = [ids[0] for ids in served]
    hi1_done = max(i for i, r in enumerate(first) if r == "hi1")
    assert first.index("hi1") < hi1_done < first.index("hi2")
    assert first[hi1_done + 1] == "low"  # resumed first, though hi2 outranks it
    assert policy.order([], [arrivals[4], arrivals[0]], step=1)[0] is arrivals[4]  # done
    assert pool.num_free == 200


def test_memory_pressure_takes_back_paused_kv_before_preempting_the_running():
    """10 blocks of 4 tokens, one slot. "big" (higher priority) arrives and displaces
    "long" once its residency is over: its prompt (3 blocks) fits beside the 5 that "long"
    holds, so "long" pauses with its KV. When "big"'s output outgrows the free blocks, the
    paused KV is dropped ("long" recomputes later) and "big" is never preempted."""
    sched, pool, runner, clock, _ = setup_fixed({"long": 1.0, "big": 10.0}, 10,
                                                min_residency=12)
    arrivals = {0: req("long", 8, 24), 3: req("big", 12, 16)}
    computed, outputs = _run_all(sched, runner, clock, arrivals)
    assert sched.num_pauses == 1 and sched.num_recomputes == 1
    assert sched.num_preemptions == 1  # the pause: nothing running lost its KV
    assert arrivals[3].metrics.num_preemptions == 0
    assert computed["big"] == 12 + 16 - 1 and computed["long"] > 8 + 24 - 1
    assert outputs == _fcfs_tokens(arrivals)
    assert pool.num_free == 10


def test_memory_pressure_evicts_paused_blocks_before_anything_is_recomputed():
    """The scenario above with the pruner allowed to evict (global coordination): when
    "big" outgrows the free blocks, the paused "long" gives up its lowest-I_b blocks
    instead of its whole KV: nothing is recomputed."""
    policy = _FixedPriority({"long": 1.0, "big": 10.0}, max_wait=1000, min_residency=12)
    policy.bind(CostModel(CFG, 2), 10, 4, 1, 64)
    clock = policy.clock
    pool = BlockPool(10)
    pruner = EntropicBlockPruner(PruningConfig(score="mass", min_keep_fraction=0.25,
                                               min_blocks=2, recent_blocks=1, evict=True,
                                               refresh_interval=1), 4)
    sched = Scheduler(KVCacheManager(pool, 4), 1, 64, 10_000, (), policy, pruner)
    runner = PrunedFakeRunner(4)
    arrivals = {0: req("long", 8, 24), 3: req("big", 12, 16)}
    finished = set()
    for t in range(300):
        if t in arrivals:
            sched.add(arrivals[t])
        if not sched.num_unfinished and t > 3:
            break
        out = sched.schedule()
        sampled, mass = runner.execute(out)
        for rid, st_ in sampled.items():
            st_.entropy = fake_entropy(sched.requests[rid].token_ids)
            clock.observe(rid, st_.entropy)
        for r in sched.update(out, sampled, 0.0):
            if r.status.finished:
                finished.add(r.request_id)
        for c in out.chunks:
            r = sched.requests.get(c.request_id)
            if r is not None and c.request_id in mass:
                pruner.observe(r, [], [], *mass[c.request_id])
    assert finished == {"long", "big"}
    # every preemption is a pause ("long" is shrunk, not dropped, and resumes when "big"
    # is done): nothing is recomputed
    assert sched.num_pauses >= 1 and sched.num_preemptions == sched.num_pauses
    assert sched.num_recomputes == 0
    assert sched.num_evicted_blocks >= 1
    assert pool.num_free == 10


def test_where_memory_is_short_nobody_is_displaced_by_recompute():
    """Regime (b) in small: a pool for two of three long requests, two slots. The third
    ages while the first two run, but their KV cannot stay beside it, so displacing one would
    recompute it: it waits at the head of the order instead, and enters when one finishes.
    Every position is computed once, as under FCFS (a displacement by recompute computed the
    victim's context again: 2.9x the work in the ablation's regime (b))."""
    sched, pool, runner, clock, _ = setup(12, max_num_seqs=2, budget=64, max_wait=2,
                                          min_residency=0)
    arrivals = {0: req("a", 16, 8), 1: req("b", 16, 8), 2: req("c", 16, 8)}
    computed, outputs = _run_all(sched, runner, clock, arrivals)
    assert sched.num_displacements == 0 and sched.num_recomputes == 0
    assert computed == {r: 16 + 8 - 1 for r in "abc"}
    assert outputs == _fcfs_tokens(arrivals)
    assert pool.num_free == 12


def test_an_unbound_policy_says_so():
    policy = EntropicPolicy(EntropicClock())
    with pytest.raises(RuntimeError, match="not bound to an engine"):
        policy.order([], [], 0)


def test_a_burst_of_long_documents_is_reordered_by_the_default_aging(monkeypatch):
    """Regime (b)'s shape without a model (benchmarks/scheduling_work.py): 8 documents that
    wait hundreds of steps for memory. Aged by every step unserved (W = 32 steps, the rule
    before max_wait_total) they all age before their turn and go oldest first, FCFS's order
    but for decodes first; with the default (max_wait counts only the steps a document
    could have been admitted, max_wait_total = 1024) and with bounded bypass (K = 4,
    W = 1024), the priority serves the cheaper documents first and the mean completion
    falls at the same total work (docs/scheduling.md, regime (b))."""
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    from scheduling_work import run
    from entropic.bench.replicas import AgingRule

    shape = ([4160, 6200, 8000], 8, 1, 128, 1024, 16, 8, 512, 0)
    fcfs = run("fcfs", *shape)
    default = run("entropic", *shape)
    steps = run("entropic", *shape, rule=AgingRule(None, 32))
    bypass = run("entropic", *shape, rule=AgingRule(4, 1024))
    for r in (fcfs, default, steps, bypass):
        assert r["work_ratio"] == 1.0 and r["recomputes"] == 0
        assert r["makespan_tflops"] == pytest.approx(fcfs["makespan_tflops"])
    assert default["aging"] == [None, 32, 1024]
    for r in (default, bypass):
        assert r["mean_e2e_tflops"] < 0.9 * fcfs["mean_e2e_tflops"]
    assert 0.9 * fcfs["mean_e2e_tflops"] < steps["mean_e2e_tflops"] < fcfs["mean_e2e_tflops"]


def test_a_request_ages_once_k_later_arrivals_were_admitted_ahead_of_it():
    """Bounded bypass: each admission of a later arrival counts against every earlier one
    still waiting; at K the waiting request is aged (first in the order, never a victim);
    its own admission starts a new count."""
    clock = EntropicClock()
    pol = EntropicPolicy(clock, EntropicSchedulingConfig(max_bypass=2, max_wait=10**6,
                                                          max_wait_total=None))
    params = SamplingParams(max_tokens=4)
    old, a, b, c = (Request(f"r{i}", [1] * 8, params, float(i)) for i in range(4))
    pol.admitted(a, [old, b, c])  # a arrived after old: old overtaken once
    assert (old.times_bypassed, b.times_bypassed, c.times_bypassed) == (1, 0, 0)
    assert not pol.aged(old, 1)
    pol.admitted(b, [old, c])  # c arrived after b: not overtaken by it
    assert (old.times_bypassed, c.times_bypassed) == (2, 0) and pol.aged(old, 1)
    assert not pol.aged(c, 1)
    pol.admitted(old, [c])
    assert old.times_bypassed == 0 and not pol.aged(old, 1)
    with pytest.raises(ValueError, match="max_bypass"):
        EntropicSchedulingConfig(max_bypass=0)


def test_steps_spent_waiting_for_memory_do_not_age_a_request():
    """With max_wait_total set, max_wait counts only the steps a waiting request's whole
    context fit in the pool beside what the running ones owe: a document that waits for
    memory keeps its place in the priority order (regime (b)), and is aged after
    max_wait_total steps in all at the latest; a request that fits and waits for a slot ages
    after max_wait steps as before."""
    # 12 blocks of 4 tokens: "run" holds 8-11 (32 tokens and its output), "big" needs 4
    # more: it waits for memory; "small" (1 block) fits but waits for the one slot
    sched, pool, runner, clock, policy = setup_fixed(
        {"run": 3.0, "big": 1.0, "small": 2.0}, 12, max_num_seqs=1, budget=64,
        max_wait=3, max_wait_total=9)
    assert policy.counts_memory_waits
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    sched.add(Request("run", [1] * 32, params, 0.0))
    step(sched, runner, clock)
    big, small = Request("big", [1] * 16, params, 1.0), Request("small", [1] * 4, params, 2.0)
    sched.add(big)
    sched.add(small)
    start = sched.step_count
    for _ in range(3):
        step(sched, runner, clock)
    assert big.memory_wait_steps == 3 and small.memory_wait_steps == 0
    assert policy.aged(small, sched.step_count) and not policy.aged(big, sched.step_count)
    while sched.step_count - start < 9:
        assert not policy.aged(big, sched.step_count)
        step(sched, runner, clock)
    assert policy.aged(big, sched.step_count)  # max_wait_total: aged by all its steps
    with pytest.raises(ValueError, match="max_wait_total"):
        EntropicSchedulingConfig(max_wait=8, max_wait_total=4)


def test_without_max_wait_total_memory_waits_are_neither_counted_nor_read():
    sched, pool, runner, clock, policy = setup_fixed({"run": 3.0, "big": 1.0}, 12,
                                                     max_num_seqs=1, budget=64, max_wait=3,
                                                     max_wait_total=None)
    assert not policy.counts_memory_waits
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    sched.add(Request("run", [1] * 32, params, 0.0))
    step(sched, runner, clock)
    big = Request("big", [1] * 16, params, 1.0)
    sched.add(big)
    for _ in range(3):
        step(sched, runner, clock)
    assert big.memory_wait_steps == 0 and policy.aged(big, sched.step_count)
