"""Scheduler tests with a fake runner: no model, a handful of blocks."""
from hypothesis import given, settings, strategies as st

from entropic.engine.request import Request, RequestStatus
from entropic.sampling_params import SamplingParams
from fakes import make_scheduler

_t = [0.0]


def req(rid, n_prompt, max_tokens, **kw):
    _t[0] += 1.0
    return Request(rid, [(i * 7 + len(rid)) % 50 for i in range(n_prompt)],
                   SamplingParams(max_tokens=max_tokens, temperature=0, **kw), _t[0])


def run(sched, runner, max_steps=10_000):
    finished = {}
    for _ in range(max_steps):
        if not sched.num_unfinished:
            break
        out = sched.schedule()
        sampled = runner.execute(out)
        for r in sched.update(out, sampled, now=0.0):
            if r.status.finished:
                finished[r.request_id] = r
    return finished


def test_chunked_prefill_and_decode_share_a_step():
    sched, pool, runner = make_scheduler(num_blocks=64, budget=10)
    sched.add(req("a", 3, 5))
    out = sched.schedule()
    runner_out = runner.execute(out)
    sched.update(out, runner_out, 0.0)
    sched.add(req("b", 30, 2))
    out = sched.schedule()
    sizes = {c.request_id: c.num_tokens for c in out.chunks}
    assert sizes == {"a": 1, "b": 9}  # a decodes while b prefills a 9-token chunk
    assert out.num_batched_tokens == 10
    assert not [c for c in out.chunks if c.request_id == "b"][0].sample


def test_max_num_seqs_bounds_running():
    sched, pool, runner = make_scheduler(num_blocks=64, max_num_seqs=2, budget=100)
    for i in range(4):
        sched.add(req(f"r{i}", 3, 3))
    out = sched.schedule()
    assert {c.request_id for c in out.chunks} == {"r0", "r1"}
    done = run(sched, runner)
    assert len(done) == 4 and pool.num_free == 64


def test_fcfs_preempts_newest_and_requeues_it_first():
    # 4 blocks of 4 tokens: "old" (2 blocks) and "new" (1) leave one free, the block of
    # growth admission keeps for "old"; both need one more at their first decode
    sched, pool, runner = make_scheduler(num_blocks=4, budget=100)
    sched.add(req("old", 8, 4))
    sched.add(req("new", 4, 4))
    out = sched.schedule()
    assert [c.request_id for c in out.chunks] == ["old", "new"]
    sched.update(out, runner.execute(out), 0.0)
    out = sched.schedule()  # one block for two: "new" is preempted
    assert out.preempted_ids == ["new"]
    assert [c.request_id for c in out.chunks] == ["old"]
    assert sched.requests["new"].status is RequestStatus.WAITING
    assert sched.requests["new"].num_computed_tokens == 0
    done = run(sched, runner)
    assert set(done) == {"old", "new"} and pool.num_free == 4


def test_eos_and_stop_token_ids_and_length():
    sched, pool, runner = make_scheduler(num_blocks=32, eos=range(50))  # every token is EOS
    sched.add(req("eos", 3, 10))
    sched.add(req("ign", 3, 4, ignore_eos=True))
    done = run(sched, runner)
    assert done["eos"].num_output_tokens == 1
    assert done["eos"].status is RequestStatus.FINISHED_STOPPED
    assert done["ign"].num_output_tokens == 4
    assert done["ign"].status is RequestStatus.FINISHED_LENGTH


def test_abort_anytime_returns_blocks():
    sched, pool, runner = make_scheduler(num_blocks=16, budget=5)
    sched.add(req("a", 12, 8))
    out = sched.schedule()
    sched.update(out, runner.execute(out), 0.0)
    assert pool.num_free < 16
    sched.finish("a", RequestStatus.FINISHED_ABORTED)
    assert pool.num_free == 16 and not sched.num_unfinished
    assert sched.schedule().finished_ids == ["a"]


workload = st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12)), min_size=1, max_size=12)
actions = st.lists(st.tuples(st.sampled_from(["step", "step", "step", "abort"]),
                             st.integers(0, 11)), max_size=80)


@settings(max_examples=150, deadline=None)
@given(workload, actions, st.integers(8, 24), st.integers(1, 6), st.integers(2, 40))
def test_random_workloads_finish_without_leaks(reqs, acts, num_blocks, max_seqs, budget):
    sched, pool, runner = make_scheduler(num_blocks, max_num_seqs=max_seqs, budget=budget)
    for i, (p, m) in enumerate(reqs):
        if -(-(p + m) // 4) <= num_blocks:  # the engine rejects requests that cannot fit
            sched.add(req(f"r{i}", p, m))
    added = set(sched.requests)
    aborted, finished = set(), {}
    for act, who in acts:
        if act == "abort":
            if sched.finish(f"r{who}", RequestStatus.FINISHED_ABORTED) is not None:
                aborted.add(f"r{who}")
        elif sched.num_unfinished:
            out = sched.schedule()
            for r in sched.update(out, runner.execute(out), 0.0):
                if r.status.finished:
                    finished[r.request_id] = r
        held = sum(sched.kv.num_blocks_held(r) for r in sched.requests)
        assert held + pool.num_free == num_blocks
    finished.update(run(sched, runner))
    assert set(finished) | aborted == added and not set(finished) & aborted
    assert pool.num_free == num_blocks and sched.kv.num_tracked == 0
    for r in finished.values():
        assert r.num_output_tokens == r.params.max_tokens


@settings(max_examples=60, deadline=None)
@given(workload, st.integers(2, 6))
def test_forced_preemption_gives_same_greedy_tokens(reqs, max_seqs):
    def tokens(num_blocks):
        sched, pool, runner = make_scheduler(num_blocks, max_num_seqs=max_seqs, budget=16)
        for i, (p, m) in enumerate(reqs):
            sched.add(req(f"r{i}", p, m))
        done = run(sched, runner)
        assert pool.num_free == num_blocks
        return {k: r.output_token_ids for k, r in done.items()}, sched.num_preemptions

    roomy, n0 = tokens(200)
    need = max(-(-(p + m) // 4) for p, m in reqs)
    tight, n1 = tokens(need)  # just enough for the largest request alone
    assert n0 == 0
    assert roomy == tight


def test_a_recomputed_request_waits_until_its_whole_context_fits():
    """Memory binds (4 requests, blocks for 3.8): the request preempted by recompute is not
    readmitted chunk by chunk as soon as a few blocks free up, only to be preempted again
    when the running ones grow; it waits until its whole context fits, and is preempted
    once."""
    sched, pool, runner = make_scheduler(68, max_num_seqs=8, budget=32)
    reqs = [Request(f"r{i}", [(i * 7 + j) % 50 for j in range(40)],
                    SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), float(i))
            for i in range(4)]
    for r in reqs:
        sched.add(r)
    computed = 0
    while sched.num_unfinished:
        out = sched.schedule()
        computed += sum(c.num_tokens for c in out.chunks)
        sched.update(out, runner.execute(out), 0.0)
    assert max(r.metrics.num_preemptions for r in reqs) == 1
    assert sched.num_preemptions == 1
    assert computed <= 4 * (40 + 32 - 1) + (40 + 32 - 1)  # at most one context recomputed
    assert pool.num_free == 68


def test_a_prompt_is_admitted_only_when_it_fits_whole_beside_the_running_ones():
    """Chunked prefill must not overcommit the pool: 3 requests of 16 prompt tokens and 8
    outputs (6 blocks each at the end) in 13 blocks, 8 tokens a step. Admitted on its first
    chunk alone, the third took blocks the first two needed for their prompts, and memory
    pressure then recomputed someone; now it waits until its whole prompt fits beside
    what the running ones still owe, and every position is computed once."""
    sched, pool, runner = make_scheduler(num_blocks=13, budget=8)
    for name in "abc":
        sched.add(req(name, 16, 8))
    computed = {}
    while sched.num_unfinished:
        out = sched.schedule()
        for c in out.chunks:
            computed[c.request_id] = computed.get(c.request_id, 0) + c.num_tokens
        sched.update(out, runner.execute(out), 0.0)
    assert sched.num_preemptions == 0
    assert computed == {name: 16 + 8 - 1 for name in "abc"}
    assert pool.num_free == 13
