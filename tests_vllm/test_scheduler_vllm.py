"""entropic's scheduling policy inside vLLM (`EntropicScheduler`, CPU build, one engine in
vLLM's default two-process layout), on the run of tests_vllm/sched_runs.py: greedy requests,
then a replayed trace (a long prompt, then a stream of short ones) on two running slots.

Everything about the schedule is read from the scheduler's own per-step log: which
requests were ranked how, which got tokens, which were displaced, which entropies reached
it from the worker."""
from __future__ import annotations

import math

import pytest

ATOL_H = 2e-3  # nats, as the thermostat tests


def core_id(log_id: str, ids: list[str]) -> str:
    """vLLM appends a suffix to request ids inside the engine: map back to ours."""
    return next(i for i in ids if log_id == i or log_id.startswith(i + "-"))


def trace_steps(res: dict) -> list[dict]:
    return [e for e in res["log"][res["greedy_steps"]:] if e["order"]]


def test_scheduler_greedy_output_unchanged(run_scenario):
    """The same greedy requests through vLLM's default scheduler (the baseline scenario) and
    through entropic's (two slots, so a different batching): identical token ids."""
    base, sched = run_scenario("baseline"), run_scenario("scheduler")
    assert len(sched["greedy"]) == len(base["greedy"]) == 4
    for b, s in zip(base["greedy"], sched["greedy"]):
        assert s["prompt_token_ids"] == b["prompt_token_ids"]
        assert s["token_ids"] == b["token_ids"]


def test_every_token_entropy_reaches_the_scheduler(run_scenario, reference):
    """Each kept token's entropy crosses from the worker process to the scheduler exactly
    once (the last token of a request finishes it first, so n - 1 per request), greedy and
    sampled requests alike; the values are the model's temperature-1 entropies (checked
    against transformers' fp32 logits of the same weights on the greedy requests)."""
    res = run_scenario("scheduler")
    rows = res["greedy"] + res["trace"]
    observed = [o for e in res["log"] for o in e["observed"]]
    assert len(observed) == sum(len(r["token_ids"]) - 1 for r in rows)
    ids = [r["request_id"] for r in rows]
    by_req: dict[str, dict[int, float]] = {}
    for rid, n, h in observed:
        by_req.setdefault(core_id(rid, ids), {})[n] = h
    for r in res["greedy"]:
        got = by_req[r["request_id"]]
        assert sorted(got) == list(range(len(r["token_ids"]) - 1))
        _, ents = reference(r["prompt_token_ids"], r["token_ids"], {}, 1.0)
        assert [got[n] for n in sorted(got)] == pytest.approx(ents[:-1], abs=ATOL_H)


def test_admission_follows_pi_not_arrival(run_scenario):
    """At every step the waiting requests vLLM admits are the first ones of entropic's
    ranking (so vLLM's priority heap carries the ranking), and at least once a request
    that arrived later was admitted ahead of an earlier, not yet aged one: FIFO would
    have admitted the earlier one."""
    res = run_scenario("scheduler")
    w = res["max_wait"]
    arrival = {r["request_id"]: i for i, r in enumerate(res["trace"])}
    ids = list(arrival)
    overtakes = 0
    for e in trace_steps(res):
        waiting = [(rid, age) for rid, _pi, age, running, *_ in e["order"] if not running]
        admitted = [rid for rid, _ in waiting if rid in e["scheduled"]]
        assert admitted == [rid for rid, _ in waiting[:len(admitted)]], e
        for rid in admitted:
            overtakes += any(arrival[core_id(o, ids)] < arrival[core_id(rid, ids)] and age < w
                             for o, age in waiting[len(admitted):])
    assert overtakes >= 1


def test_aging_bound_on_replayed_trace(run_scenario):
    """No request waits longer than entropic's bound W + Q * (P + M) steps (W = max_wait,
    every unserved step counted here: the pool holds every request, so none waits for memory;
    P = the longest prefill in chunks, M = the most output tokens, Q = unfinished requests),
    counted from the steps at which each request got tokens; and aging is what admitted the
    long prompt: ranked first when aged, though its pi was the lowest of the waiting ones,
    and first in every order from then until it got tokens (an aged request displaces
    nobody: it takes the next free slot, and nobody overtakes it)."""
    res = run_scenario("scheduler")
    steps = trace_steps(res)
    w = res["max_wait"]
    # the defaults leave out the steps a request waited for memory (max_wait_total set);
    # this trace's pool holds every request, so none waited for memory and W counts every
    # unserved step, as the bound below assumes
    assert res["max_wait_total"] and res["max_wait_total"] > w
    assert all(row[6] == 0 for e in steps for row in e["order"])
    longest = max(len(t["prompt_token_ids"]) + len(t["token_ids"]) for t in res["trace"])
    p = math.ceil(longest / res["max_num_batched_tokens"])
    m = max(len(t["token_ids"]) for t in res["trace"])
    q = max(len(e["order"]) for e in steps)
    bound = w + q * (p + m)
    last: dict[str, int] = {}
    worst: dict[str, int] = {}
    for e in steps:
        for rid, *_ in e["order"]:
            last.setdefault(rid, e["step"] - 1)  # waiting counts from arrival
            if rid in e["scheduled"]:
                last[rid] = e["step"]
            else:
                worst[rid] = max(worst.get(rid, 0), e["step"] - last[rid])
    assert len(last) == len(res["trace"])
    assert max(worst.values()) <= bound, (worst, bound)
    long_id = next(rid for rid in last if rid.startswith("t01-long"))
    aged_first = [e for e in steps if e["order"][0][0] == long_id and e["order"][0][2] >= w
                  and not e["order"][0][3]]
    assert aged_first, "the long prompt was never admitted by aging"
    e = aged_first[0]
    waiting_pi = [pi for rid, pi, _age, running, *_ in e["order"] if not running]
    assert e["order"][0][1] == min(waiting_pi) and len(waiting_pi) > 1
    until = next(x for x in steps if x["step"] >= e["step"] and long_id in x["scheduled"])
    assert until["step"] - e["step"] <= p + m
    assert all(x["order"][0][0] == long_id for x in steps
               if e["step"] <= x["step"] <= until["step"])


def test_displaced_requests_pause_and_resume_where_they_stopped(run_scenario):
    """A displaced request keeps its KV blocks (the trace's pool holds every request): it
    comes back as vLLM's resumed request with all its tokens but the pending one computed,
    and is scheduled one decode token, not its context again; no KV is dropped."""
    res = run_scenario("scheduler")
    steps = trace_steps(res)
    displaced = [(e["step"], rid) for e in steps for rid in e["displaced"]]
    assert displaced, "the trace displaced nobody: the test checks nothing"
    assert not any(e["kv_dropped"] for e in steps)
    for step, rid in displaced:
        back = next(e for e in steps if e["step"] > step
                    and any(r[0] == rid for r in e["resumed"]))
        _, computed, scheduled = next(r for r in back["resumed"] if r[0] == rid)
        assert computed > 0 and scheduled == 1, (rid, back["resumed"])


def test_memory_pressure_drops_paused_kv_before_vllm_preempts(run_scenario):
    """A short pool (sched_runs.PRESSURE_BLOCKS blocks): two greedy counts are paused by two
    newcomers whose outputs then need the blocks the counts hold. The scheduler drops paused
    KV, lowest rank first, so that vLLM never preempts a running request itself; a dropped
    request is recomputed when it returns (none of its tokens computed, its context
    scheduled again), and the counts end with the same greedy tokens as in the roomy run,
    where they were paused and resumed."""
    res = run_scenario("scheduler-pressure")
    steps = [e for e in res["log"] if e["order"]]
    dropped = [(e["step"], rid) for e in steps for rid in e["kv_dropped"]]
    assert dropped, "the short pool never bound: the test checks nothing"
    for e in steps:
        assert set(e["preempted"]) <= set(e["displaced"]), e  # no preemption of vLLM's own
    for step, rid in dropped:
        assert any(rid in e["displaced"] for e in steps if e["step"] < step)
        before = next(e for e in steps if e["step"] == step)
        ranks = [r[0] for r in before["order"]]
        paused_behind = [r for r in ranks[ranks.index(rid) + 1:]
                         if any(r in e["displaced"] for e in steps if e["step"] < step)
                         and not any(r in e["kv_dropped"] for e in steps if e["step"] <= step)
                         and not any(o[0] == r and o[3] for o in before["order"])]
        assert not paused_behind, (rid, paused_behind)  # lowest rank dropped first
        back = next(e for e in steps if e["step"] > step
                    and any(r[0] == rid for r in e["resumed"]))
        _, computed, scheduled = next(r for r in back["resumed"] if r[0] == rid)
        assert computed == 0 and scheduled > 1, (rid, back["resumed"])
    roomy = {tuple(t["prompt_token_ids"]): t["token_ids"]
             for t in run_scenario("scheduler")["trace"] if "count" in t["request_id"]}
    counts = [t for t in res["trace"] if "count" in t["request_id"]]
    assert len(counts) == 2
    for t in counts:
        assert t["token_ids"] == roomy[tuple(t["prompt_token_ids"])], t["request_id"]
