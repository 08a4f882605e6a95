"""The N-replica simulator (entropic.bench.replicas) on tiny synthetic traces, model-free."""
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from entropic.bench.replicas import (MODES, StepTime, Trace, TraceRequest, load_trace,
                                     simulate, summarize, vllm_route, workload)
from entropic.config import ModelConfig
from entropic.control.scheduling import EntropicPolicy, EntropicSchedulingConfig
from entropic.engine.cost import CostModel

TINY = ModelConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_layers=2,
                   num_heads=2, num_kv_heads=1, head_dim=8, max_position=1024)
QUICK = Path(__file__).parent / "data/replica_trace_quick.json"


def make_trace(reqs, max_num_seqs=2, budget=32) -> Trace:
    """reqs: (arrival, prompt_len, entropies)."""
    cost = CostModel(TINY, 4)
    unit = cost.linear_per_token
    return Trace(tuple(TraceRequest(f"r{i}", a, p, tuple(h)) for i, (a, p, h) in
                       enumerate(reqs)),
                 cost, StepTime(0.01, 0.001 / unit, 0.0), max_num_seqs, budget, 4)


def contended() -> Trace:
    """Two slots, a long low-entropy request first, then a stream of short, uncertain ones:
    entropic displaces, and requests queue."""
    reqs = [(0.0, 30, [0.1] * 40), (0.0, 20, [0.2] * 30)]
    reqs += [(0.05 * i, 3 + i % 5, [3.0 - 0.1 * (j % 7) for j in range(2 + i % 6)])
             for i in range(1, 16)]
    return make_trace(reqs)


def test_one_replica_global_queue_equals_per_replica_queue():
    t = contended()
    g = simulate(t, t.requests, 1, "global", EntropicSchedulingConfig(max_wait=40,
                                                                      min_residency=2))
    p = simulate(t, t.requests, 1, "per_replica", EntropicSchedulingConfig(max_wait=40,
                                                                           min_residency=2))
    assert g.displacements > 0  # the schedule is not trivial
    assert g.first_token == p.first_token and g.finish == p.finish
    assert g.max_wait_steps == p.max_wait_steps and g.steps == p.steps
    f = simulate(t, t.requests, 1, "fifo")
    assert f.finish != g.finish  # and entropic's order is not FIFO's


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_request_finishes_once_and_computes_each_token_once(mode, n):
    t = contended()
    w = workload(t, n, rate=40.0)
    res = simulate(t, w, n, mode, EntropicSchedulingConfig(max_wait=8, min_residency=2))
    assert len(w) == n * len(t.requests)
    assert res.finished_count == {r.id: 1 for r in w}
    assert set(res.served_by.values()) <= set(range(n))
    # displacement pauses with the KV resident: nothing is recomputed
    assert res.computed_tokens == sum(r.prompt_len + r.output_len - 1 for r in w)
    for r in w:
        assert r.arrival < res.first_token[r.id] <= res.finish[r.id]
    s = summarize(res)
    assert s["requests"] == len(w) and 0 < s["utilisation"] <= 1 + 1e-9


def test_vllm_route_least_loaded_ties_round_robin():
    t = contended()
    from entropic.bench.replicas import _new_replica
    from entropic.control.clock import EntropicClock
    reps = [_new_replica(t, "per_replica", EntropicClock(), EntropicSchedulingConfig())
            for _ in range(3)]
    assert [vllm_route(reps, s) for s in range(3)] == [0, 1, 2]  # all empty: the scan start
    from entropic.engine.request import Request
    from entropic.sampling_params import SamplingParams
    for i in range(2):
        reps[0].scheduler.add(Request(f"a{i}", [1, 2], SamplingParams(max_tokens=2), 0.0))
    reps[2].scheduler.add(Request("c", [1, 2], SamplingParams(max_tokens=2), 0.0))
    assert vllm_route(reps, 0) == 1 and vllm_route(reps, 2) == 1


def test_two_replicas_finish_the_same_requests_sooner():
    """The same contended requests on two replicas sharing the global queue end sooner
    than on one (a second replica takes work off the queue at once)."""
    t = contended()
    w = workload(t, 1, rate=40.0)
    one = simulate(t, w, 1, "global")
    two = simulate(t, w, 2, "global")
    assert max(two.finish.values()) < max(one.finish.values())


workloads = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40), st.integers(1, 12),
                               st.floats(0.0, 4.0)), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None)
@given(workloads, st.integers(1, 3), st.sampled_from(["global", "per_replica"]),
       st.integers(1, 3), st.integers(2, 8), st.integers(0, 6))
def test_no_wait_exceeds_the_aging_bound(reqs, n, mode, seqs, max_wait, residency):
    """Random arrivals (in hundredths of a second), prompt lengths, outputs and entropies:
    every request is served within max_wait + Q * (P + M) steps of its replica (Q the
    largest queue a replica ordered, P the longest prefill in chunks, M the most output
    tokens)."""
    t = make_trace([(a / 100, p, [h * (1 + (j % 3)) / 3 for j in range(m)])
                    for a, p, m, h in reqs], max_num_seqs=seqs, budget=16)
    cfg = EntropicSchedulingConfig(max_wait=max_wait, min_residency=residency)
    res = simulate(t, t.requests, n, mode, cfg)
    assert res.finished_count == {r.id: 1 for r in t.requests}
    assert max(res.max_wait_steps.values()) <= res.wait_bound_steps


def test_recorded_quick_trace_runs():
    t = load_trace(QUICK)
    assert len(t.requests) == 8 and all(r.output_len > 0 for r in t.requests)
    assert t.step_time.base >= 0 and t.step_time.per_linear >= 0
    w = workload(t, 2, rate=1.0)
    res = {m: summarize(simulate(t, w, 2, m)) for m in MODES}
    assert all(r["requests"] == 16 for r in res.values())


def test_global_queue_displaces_only_when_no_replica_has_a_free_slot(monkeypatch):
    """Replica 0 is full, replica 1 has a free slot but is in a long prefill: an arrival
    that outranks replica 0's running requests waits for the free slot instead of
    displacing one of them (alone on replica 0, it displaces)."""
    reqs = [(0.0, 4, [0.05] * 60), (0.0, 4, [0.05] * 60), (0.001, 300, [0.05] * 20),
            (0.05, 4, [3.0, 2.0, 1.0])]
    cfg = EntropicSchedulingConfig(max_wait=1000, min_residency=0)
    def outranks(rid):  # it outranks the others by far (a prior gain would not clear the margin)
        monkeypatch.setattr(EntropicPolicy, "expected_gain",
                            lambda self, r: 100.0 if r.request_id == rid else 0.01)

    outranks("r3")
    t = make_trace(reqs, max_num_seqs=2)
    res = simulate(t, t.requests, 2, "global", cfg)
    assert res.served_by["r0"] == res.served_by["r1"] == 0 and res.served_by["r2"] == 1
    assert res.served_by["r3"] == 1 and res.displacements == 0
    alone = make_trace(reqs[:2] + reqs[3:], max_num_seqs=2)
    outranks("r2")  # the same request, numbered by its place in the trace
    assert simulate(alone, alone.requests, 1, "global", cfg).displacements > 0


def _scheduling_tail():
    import importlib.util

    path = Path(__file__).parents[1] / "benchmarks" / "scheduling_tail.py"
    spec = importlib.util.spec_from_file_location("scheduling_tail", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_on_the_regime_a_mix_the_entropic_order_keeps_the_fcfs_tail():
    """The ablation's regime-(a) mix at 3 requests/s (benchmarks/scheduling_tail.py): with
    the default W the entropic order's E2E p99 stays within 6 % of FCFS's on the same
    arrivals (median of 5 seeds; 1.02 here) while its mean TTFT is lower; the rule before
    2026-12-06 (aged requests displacing, paused requests ranked by priority, W 128) reads
    1.17 on these seeds and 1.51 over the benchmark's 40."""
    tail = _scheduling_tail()
    trace = tail.load_mix(0.03, 4.7e-12)
    ratios = {"current": [], "previous": []}
    for seed in range(5):
        work = tail.arrivals(trace, 3.0, seed)
        fcfs = tail.figures(simulate(trace, work, 1, "fifo"))
        cur = tail.figures(simulate(trace, work, 1, "per_replica"))
        prev = tail.figures(simulate(trace, work, 1, "per_replica",
                                     EntropicSchedulingConfig(max_wait=128),
                                     policy_class=tail.PreviousRule))
        assert cur["ttft_mean"] < fcfs["ttft_mean"]
        ratios["current"].append(cur["e2e_p99"] / fcfs["e2e_p99"])
        ratios["previous"].append(prev["e2e_p99"] / fcfs["e2e_p99"])
    median = {k: sorted(v)[len(v) // 2] for k, v in ratios.items()}
    assert median["current"] <= 1.06, ratios
    assert median["previous"] >= 1.12, ratios  # the comparison can tell the rules apart


def test_a_cache_of_no_blocks_is_refused():
    t = contended()
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        simulate(t, t.requests, 1, "per_replica", num_blocks=0)
