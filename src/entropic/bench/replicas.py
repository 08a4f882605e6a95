"""N replicas on a recorded trace: one global pi queue against per-replica pi queues.

Each replica is entropic's own continuous-batching `Scheduler` (max_num_seqs slots, a token
budget per step, chunked prefill) with entropic's own `EntropicPolicy` (pi(s) and aging) or
`FCFSPolicy`; only the model is replaced: a request's next token carries the entropy H_t
recorded for it, and a step takes the time the step-time law (fitted on the recorded steps
against the engine's cost model, `engine/cost.py`) gives its chunks. No wall clock, and no random numbers
but the seeded permutations of `workload`: a run is a pure function of its arguments.

Modes:
- "global": one queue. Requests that no replica has admitted wait in it; whenever a
  replica schedules a step, its policy orders its own running and paused requests together
  with every request in the global queue, so the global queue is served in pi order (aged
  first) by whichever replica has room; an admitted request stays with its replica (its KV
  lives there). A queued request displaces a running one only when no replica has a free
  slot (`GlobalQueuePolicy`).
- "per_replica": each request goes to one replica on arrival, chosen as vLLM's
  data-parallel load balancer chooses an engine, and waits in that replica's pi queue.
- "fifo": the same routing, each replica FCFS (the control).
- "global_fifo": one FCFS queue feeding all replicas (what pooling alone does, without pi).

vLLM's choice (vLLM 0.32, vllm/v1/engine/core_client.py, DPLBAsyncMPClient.
get_core_engine_for_request): the engine with the least
`max(client_count * inflight, waiting + running) + waiting * 6 * max(0, kv_usage - 0.5)`,
inflight being the client's exact count of its unfinished requests on that engine and
(waiting, running, kv_usage) the coordinator's snapshot (every 100 ms); the scan starts at
an index that rotates by one per request, so ties go round-robin. Here, one client and the
snapshot current: the least unfinished requests, with the KV penalty.

Aging is counted in scheduler steps of the replica that does the counting: a request in the
global queue is, for replica r, as old as the number of steps r has scheduled since the
request arrived (exactly what r's own scheduler would count had it been added to r).
Memory never binds (a replica's pool holds max_num_seqs requests of the longest length and
every paused one besides; the policy prices memory against the first part only), so
displacement pauses with the KV resident and nothing is recomputed. Prefix caching is off:
every prompt is computed whole.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

from entropic.config import ModelConfig
from entropic.control.clock import EntropicClock, entropic_time
from entropic.control.scheduling import EntropicPolicy, EntropicSchedulingConfig
from entropic.engine.block_pool import BlockPool
from entropic.engine.cost import CostModel, dense_work
from entropic.engine.kv_manager import KVCacheManager
from entropic.engine.policy import FCFSPolicy
from entropic.engine.request import Request, RequestStatus
from entropic.engine.scheduler import SampledToken, Scheduler, SchedulerOutput
from entropic.sampling_params import SamplingParams

MODES = ("global", "per_replica", "fifo", "global_fifo")
FIFO_MODES = ("fifo", "global_fifo")
GLOBAL_MODES = ("global", "global_fifo")
_COST_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "max_position")


@dataclass(frozen=True)
class TraceRequest:
    """One recorded request: arrival offset (s), prompt length, and the entropy of each of
    its output tokens (so its output length)."""

    id: str
    arrival: float
    prompt_len: int
    entropies: tuple[float, ...]

    @property
    def output_len(self) -> int:
        return len(self.entropies)


@dataclass(frozen=True)
class StepTime:
    """seconds = base + per_linear * linear FLOPs + per_attention * attention FLOPs."""

    base: float
    per_linear: float
    per_attention: float

    def seconds(self, cost: CostModel, out: SchedulerOutput) -> float:
        lin = att = 0.0
        for c in out.chunks:
            w = cost.chunk_cost(dense_work(c.request_id, c.start_pos, c.num_tokens, c.sample))
            lin += w.flops_linear
            att += w.flops_attention
        return self.base + self.per_linear * lin + self.per_attention * att


@dataclass(frozen=True)
class Trace:
    """What the simulation needs of a recording (benchmarks/record_replica_trace.py).
    The step-time law is fitted when the trace is loaded, from the steps it recorded."""

    requests: tuple[TraceRequest, ...]
    cost: CostModel
    step_time: StepTime
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int = 16


def fit_step_time(cost: dict, steps: list[list[float]], quantile: float = 0.1) -> dict:
    """Quantile regression of recorded step seconds on the cost model's linear and
    attention FLOPs (`steps`: [tokens, sampled rows, attention pairs, seconds] rows;
    `cost`: the CostModel's coefficients). On a loaded machine a step's time is its own
    plus whatever other jobs took from it, a one-sided error: a low quantile of seconds
    given the FLOPs (default the 10th percentile) estimates the undisturbed step, where
    least squares would fit the load. Iteratively reweighted least squares on the check
    loss; a negative coefficient (other than the base) is dropped and the rest refitted.
    Returns the StepTime fields, the quantile and the number of steps."""
    rows = np.array(steps, dtype=float)
    lin = cost["linear_per_token"] * rows[:, 0] + cost["lm_head_per_row"] * rows[:, 1]
    att = cost["attention_per_pair"] * rows[:, 2]
    y = rows[:, 3]
    cols = {"base": np.ones_like(y), "per_linear": lin / 1e9, "per_attention": att / 1e9}
    keep = list(cols)
    while True:
        x = np.stack([cols[k] for k in keep], axis=1)
        w = np.ones_like(y)
        for _ in range(200):
            sw = np.sqrt(w)[:, None]
            coef, *_ = np.linalg.lstsq(x * sw, y * sw[:, 0], rcond=None)
            r = y - x @ coef
            w = np.where(r > 0, quantile, 1 - quantile) / np.maximum(np.abs(r), 1e-6)
        bad = [k for k, v in zip(keep, coef) if v < 0 and k != "base"]
        if not bad:
            break
        keep.remove(bad[0])
    fit = {k: 0.0 for k in cols}
    fit.update({k: float(v) / (1e9 if k != "base" else 1.0) for k, v in zip(keep, coef)})
    fit["quantile"] = quantile
    fit["below"] = float(np.mean(y - x @ coef < 0))
    fit["steps"] = len(y)
    return fit


def load_trace(path: str | Path) -> Trace:
    d = json.loads(Path(path).read_text())
    mc = ModelConfig(**{k: d["model_config"][k] for k in _COST_FIELDS})
    st = fit_step_time(d["cost"], d["steps"] + d.get("calibration", {}).get("steps", []))
    reqs = tuple(TraceRequest(r["id"], r["arrival"], r["prompt_len"], tuple(r["entropies"]))
                 for r in d["requests"])
    m = d["meta"]
    return Trace(reqs, CostModel(mc, d["kv_element_bytes"]),
                 StepTime(st["base"], st["per_linear"], st["per_attention"]),
                 m["max_num_seqs"], m["max_num_batched_tokens"], m["block_size"])


def workload(trace: Trace, copies: int, rate: float, seed: int = 0) -> list[TraceRequest]:
    """`copies` superposed copies of the trace's arrival process, rescaled to `rate`
    requests per second per copy (N copies for N replicas: each replica equally loaded).
    Copy k shifts its arrivals by k / (copies * rate) and takes the trace's requests in an
    order of its own (a permutation fixed by seed and k; copy 0 keeps the trace's), so the
    copies do not arrive in lockstep with identical requests."""
    base = trace.requests
    span = base[-1].arrival / max(1, len(base) - 1) or 1.0  # the trace's mean gap
    scale = 1.0 / (span * rate)
    out = []
    for k in range(copies):
        order = list(range(len(base)))
        if k:
            np.random.default_rng([seed, k]).shuffle(order)
        shift = k / (copies * rate)
        for i, j in enumerate(order):
            r = base[j]
            out.append(TraceRequest(f"{k}:{r.id}", base[i].arrival * scale + shift,
                                    r.prompt_len, r.entropies))
    out.sort(key=lambda r: (r.arrival, r.id))
    return out


def vllm_route(replicas: Sequence["Replica"], start: int) -> int:
    """vLLM's DP load balancer with one client and a current snapshot (module docstring):
    the least unfinished requests plus the KV penalty on waiting ones; the scan starts at
    `start`, so the first of equal scores from there wins."""
    best, best_score = 0, math.inf
    n = len(replicas)
    for i in range(n):
        idx = (start + i) % n
        s = replicas[idx].scheduler
        waiting, running = len(s.waiting), len(s.running)
        used = s.kv.pool.num_blocks - s.kv.pool.num_free
        usage = min(1.0, used / replicas[idx].nominal_blocks)
        score = waiting + running + waiting * 6.0 * max(0.0, usage - 0.5)
        if score < best_score:
            best, best_score = idx, score
    return best


class GlobalQueuePolicy:
    """A replica's entropic policy as one global scheduler uses it: the same order and
    victims, but a request from the global queue may displace a running request only when
    no other replica has a free slot (a central scheduler puts it in the free slot first;
    without this, whichever replica happened to step first displaced for it)."""

    def __init__(self, policy: EntropicPolicy) -> None:
        self.inner = policy
        self.clock = policy.clock
        self.held_back: set[str] = set()  # this step: requests that may not displace

    def order(self, running, waiting, step):
        return self.inner.order(running, waiting, step)

    def choose_victim(self, candidates, step):
        return self.inner.choose_victim(candidates, step)

    def choose_recompute_victim(self, candidates, step):
        return self.inner.choose_recompute_victim(candidates, step)

    def displace(self, waiting, victim, step) -> bool:
        if waiting.request_id in self.held_back:
            return False
        return self.inner.displace(waiting, victim, step)

    def admitted(self, req, waiting) -> None:
        self.inner.admitted(req, waiting)

    @property
    def counts_memory_waits(self) -> bool:
        return self.inner.counts_memory_waits


class AgingRule(NamedTuple):
    """Entropic scheduling's aging bounds as the benchmarks' --rules name them."""

    max_bypass: int | None
    max_wait: int
    max_wait_total: int | None = None

    def config(self, **kw) -> EntropicSchedulingConfig:
        return EntropicSchedulingConfig(max_bypass=self.max_bypass, max_wait=self.max_wait,
                                        max_wait_total=self.max_wait_total, **kw)

    @property
    def label(self) -> str:
        """How a table names it: "W 32 (steps only)", "K 4, W 1024", or "K 4, W 32 (turn),
        T 1024" (W counting only the steps a request's context fit in the pool)."""
        k = "" if self.max_bypass is None else f"K {self.max_bypass}, "
        if self.max_wait_total is not None and self.max_wait_total > self.max_wait:
            return f"{k}W {self.max_wait} (turn), T {self.max_wait_total}"
        if self.max_bypass is None:
            return f"W {self.max_wait} (steps only)"
        return f"{k}W {self.max_wait}"


def aging_rules(text: str) -> list[AgingRule]:
    """Parse "K:W[:T],..." (max_bypass:max_wait[:max_wait_total]; K "off": no bypass bound;
    with T, W counts only the steps a request could have been admitted) into rules;
    ValueError naming the bad item."""
    rules = []
    for item in text.split(","):
        parts = item.strip().split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            rule = AgingRule(None if parts[0] == "off" else int(parts[0]), int(parts[1]),
                             int(parts[2]) if len(parts) == 3 else None)
            rule.config()  # the config's own checks
        except ValueError:
            raise ValueError(f"aging rule {item.strip()!r}: expected K:W or K:W:T with K (or "
                             "off), W and T >= W whole numbers >= 1, e.g. off:32, 4:1024 or "
                             "4:32:1024") from None
        rules.append(rule)
    return rules


@dataclass
class Replica:
    """One engine: a scheduler, its policy, and when its current step ends."""

    scheduler: Scheduler
    policy: EntropicPolicy | GlobalQueuePolicy | FCFSPolicy
    busy_until: float | None = None
    current: SchedulerOutput | None = None
    steps: int = 0
    busy_seconds: float = 0.0
    max_queue: int = 0  # most unfinished requests its scheduler ordered in one step
    nominal_blocks: int = 0  # the cache a real engine would have (KV usage is against it)


@dataclass
class SimResult:
    """Per request: arrival, first token and finish times (s), the longest wait between
    two services in its replica's steps, the replica that finished it."""

    mode: str
    replicas: int
    arrival: dict[str, float] = field(default_factory=dict)
    first_token: dict[str, float] = field(default_factory=dict)
    finish: dict[str, float] = field(default_factory=dict)
    max_wait_steps: dict[str, int] = field(default_factory=dict)
    served_by: dict[str, int] = field(default_factory=dict)
    finished_count: dict[str, int] = field(default_factory=dict)
    tau: float = 0.0
    steps: int = 0
    busy_seconds: float = 0.0
    displacements: int = 0
    computed_tokens: int = 0  # every chunk's tokens (a recompute would count twice)
    wait_bound_steps: int = 0  # W + Q * (P + M), Q the largest queue a replica ordered


def _new_replica(trace: Trace, mode: str, clock: EntropicClock,
                 config: EntropicSchedulingConfig, num_requests: int = 0,
                 policy_class: type[EntropicPolicy] = EntropicPolicy,
                 num_blocks: int | None = None) -> Replica:
    """The policy prices memory against a nominal cache of max_num_seqs requests of the
    longest length (M_s's fair share is one such request); the pool itself also holds
    every paused request's KV (`num_requests` more), so memory never binds. With
    `num_blocks`, the pool and the nominal cache are that many blocks: memory binds as in
    an engine with that cache."""
    per_request = -(-max(r.prompt_len + r.output_len for r in trace.requests)
                    // trace.block_size)
    nominal = num_blocks or trace.max_num_seqs * per_request
    policy = FCFSPolicy() if mode in FIFO_MODES else policy_class(clock, config)
    if mode not in FIFO_MODES:
        policy.bind(trace.cost, nominal, trace.block_size, trace.max_num_seqs,
                    trace.max_num_batched_tokens)
    if mode == "global":
        policy = GlobalQueuePolicy(policy)
    pool = num_blocks or nominal + num_requests * per_request
    kv = KVCacheManager(BlockPool(pool), trace.block_size)
    sched = Scheduler(kv, trace.max_num_seqs, trace.max_num_batched_tokens,
                      max_model_len=per_request * trace.block_size + 1, policy=policy)
    return Replica(sched, policy, nominal_blocks=nominal)


def simulate(trace: Trace, requests: Sequence[TraceRequest], num_replicas: int, mode: str,
             config: EntropicSchedulingConfig | None = None,
             policy_class: type[EntropicPolicy] = EntropicPolicy,
             num_blocks: int | None = None) -> SimResult:
    """Run `requests` (each carries its arrival offset) on `num_replicas` replicas;
    `policy_class`: the entropic policy's class (a variant of it, for comparisons);
    `num_blocks`: each replica's KV blocks (default: so many that memory never binds)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if num_blocks is not None and num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1 (or None: memory never binds), "
                         f"got {num_blocks}")
    config = config or EntropicSchedulingConfig()
    shared = EntropicClock()  # the global queue's scheduler sees every replica's tokens
    replicas = [_new_replica(trace, mode, shared if mode == "global" else EntropicClock(),
                             config, len(requests), policy_class, num_blocks)
                for _ in range(num_replicas)]
    res = SimResult(mode, num_replicas)
    by_id = {r.id: r for r in requests}
    if len(by_id) != len(requests):
        raise ValueError("request ids must be unique")
    pending = sorted(requests, key=lambda r: (r.arrival, r.id))
    queue: list[Request] = []  # global mode: not yet admitted anywhere
    arrival_steps: dict[str, list[int]] = {}  # per replica, its step count at arrival
    rotate = 0
    i, now = 0, 0.0
    while True:
        ends = [r.busy_until for r in replicas if r.busy_until is not None]
        nxt = min(ends + ([pending[i].arrival] if i < len(pending) else []), default=None)
        if nxt is None:
            break
        now = max(now, nxt)
        for k, rep in enumerate(replicas):  # steps that end now: their tokens
            if rep.busy_until is not None and rep.busy_until <= now:
                _finish_step(rep, k, by_id, res)
        while i < len(pending) and pending[i].arrival <= now:
            tr = pending[i]
            i += 1
            req = Request(tr.id, [0] * tr.prompt_len,
                          SamplingParams(max_tokens=tr.output_len, temperature=0,
                                         ignore_eos=True), tr.arrival)
            res.arrival[tr.id] = tr.arrival
            if mode in GLOBAL_MODES:
                queue.append(req)
                arrival_steps[tr.id] = [rep.scheduler.step_count for rep in replicas]
            else:
                k = vllm_route(replicas, rotate) if num_replicas > 1 else 0
                rotate = (rotate + 1) % num_replicas
                replicas[k].scheduler.add(req)
        for k, rep in enumerate(replicas):  # idle replicas start a step
            if rep.busy_until is None:
                if mode == "global":
                    rep.policy.held_back = {r.request_id for r in queue} if any(
                        len(o.scheduler.running) < o.scheduler.max_num_seqs
                        for o in replicas if o is not rep) else set()
                _start_step(rep, k, trace, queue, arrival_steps, now, res)
    for rep in replicas:
        res.steps += rep.steps
        res.busy_seconds += rep.busy_seconds
        res.displacements += rep.scheduler.num_displacements
        if rep.scheduler.num_unfinished:
            raise RuntimeError("simulation ended with unfinished requests")
    if queue:
        raise RuntimeError("simulation ended with requests in the global queue")
    q = max(rep.max_queue for rep in replicas)
    p = -(-max(r.prompt_len for r in requests) // trace.max_num_batched_tokens)
    m = max(r.output_len for r in requests)
    res.wait_bound_steps = (config.max_wait_total or config.max_wait) + q * (p + m)
    return res


def _start_step(rep: Replica, k: int, trace: Trace, queue: list[Request],
                arrival_steps: dict[str, list[int]], now: float, res: SimResult) -> None:
    sched = rep.scheduler
    offered = list(queue)
    for req in offered:  # the global queue, aged in this replica's steps
        req.last_served_step = arrival_steps[req.request_id][k]
        sched.requests[req.request_id] = req
        sched.waiting.append(req)
    rep.max_queue = max(rep.max_queue, len(sched.requests))
    before = {rid: r.last_served_step for rid, r in sched.requests.items()}
    out = sched.schedule()
    for req in offered:
        if req.status is RequestStatus.WAITING:  # not admitted: back to the global queue
            sched.waiting.remove(req)
            del sched.requests[req.request_id]
        else:
            queue.remove(req)
    if out.is_empty:
        sched.step_count -= 1  # an idle replica counts no step (an engine steps only
        return                 # when it has work)
    for c in out.chunks:
        wait = out.step - before[c.request_id]
        res.max_wait_steps[c.request_id] = max(res.max_wait_steps.get(c.request_id, 0), wait)
    res.computed_tokens += out.num_batched_tokens
    dt = trace.step_time.seconds(trace.cost, out)
    rep.current, rep.busy_until = out, now + dt
    rep.steps += 1
    rep.busy_seconds += dt


def _finish_step(rep: Replica, k: int, by_id: dict[str, TraceRequest],
                 res: SimResult) -> None:
    out, done = rep.current, rep.busy_until
    rep.current = rep.busy_until = None
    sched = rep.scheduler
    sampled = {}
    for c in out.chunks:
        if c.sample:
            req = sched.requests[c.request_id]
            sampled[c.request_id] = SampledToken(0, by_id[c.request_id].entropies[
                req.num_output_tokens])
    for req in sched.update(out, sampled, done):
        h = req.entropies[-1]
        if not isinstance(rep.policy, FCFSPolicy):
            rep.policy.clock.observe(req.request_id, h)
        res.first_token.setdefault(req.request_id, done)
        if req.status.finished:
            rid = req.request_id
            res.finish[rid] = done
            res.served_by[rid] = k
            res.finished_count[rid] = res.finished_count.get(rid, 0) + 1
            res.tau += entropic_time(req.entropies)
            if not isinstance(rep.policy, FCFSPolicy):
                rep.policy.clock.release([rid])


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summarize(res: SimResult) -> dict:
    """TTFT and E2E mean/p99 (s), tau per second of makespan, the longest wait (steps)
    against the aging threshold W and the bound W + Q * (P + M)."""
    ids = list(res.arrival)
    ttft = [res.first_token[r] - res.arrival[r] for r in ids]
    e2e = [res.finish[r] - res.arrival[r] for r in ids]
    makespan = max(res.finish.values()) - min(res.arrival.values())
    return {"mode": res.mode, "replicas": res.replicas, "requests": len(ids),
            "ttft_mean": float(np.mean(ttft)), "ttft_p99": _pct(ttft, 99),
            "e2e_mean": float(np.mean(e2e)), "e2e_p99": _pct(e2e, 99),
            "makespan": makespan, "tau_per_s": res.tau / makespan,
            "max_wait_steps": max(res.max_wait_steps.values()),
            "wait_bound_steps": res.wait_bound_steps, "displacements": res.displacements,
            "steps": res.steps, "utilisation": res.busy_seconds / (makespan * res.replicas)}
