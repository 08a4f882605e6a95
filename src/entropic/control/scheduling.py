"""Entropy-aware scheduling (design section 4, macro scale), with bounded waiting.

Priority of a request s:   pi(s) = E[dH_s] / (alpha*C_s + beta*M_s + gamma*L_s + eps)

- E[dH_s], expected entropy reduction of its next step: kappa * H_t, its current entropy
  times kappa, the least-squares slope of realised next-step dH+ on H over every step the
  engine's clock has seen (dH+_{t+1} <= H_t always, and the higher the entropy, the more
  there is to resolve). A request with no token yet gets kappa * (engine-wide mean H), and
  `default_prior` nats before any token has been observed. Measured on ShareGPT traces
  (benchmarks/scheduling.py, docs/scheduling.md), H_t ranks the next step's dH+ far better
  (Spearman ~0.55) than the mean of the request's recent drops (~0.03), which we tried
  first.
- C_s, cost of its next step, from the engine's cost model: FLOPs of the tokens it would
  compute now (a decode token at its context, or its next prefill chunk), in units of one
  decode token at zero context.
- M_s, KV memory it holds (or will need to hold its tokens), in units of a fair share of
  the cache (num_blocks / max_num_seqs).
- L_s, a length term: output tokens generated so far / `length_scale`. Favouring requests
  with less attained service is the classic way to lower mean latency without knowing job
  sizes (least-attained-service); aging protects the long ones.

Displacement: a waiting request that is not aged may take the slot of a running request
whose priority is `displace_margin` times lower, that is not aged, has produced a token since
its admission (else two requests could displace each other forever without progress) and
has run at least `min_residency` steps since admission (R: no time-slicing faster than
that; a first version without it, W = 64, ran a saturated ShareGPT load 2.2-2.5x slower than
FCFS through churn). Displacement only pauses: the victim keeps its KV.

Paused requests resume first: a paused request (waiting, its KV still resident) comes right
after the aged ones, ahead of every other request, longest paused first, so it takes the
next free slot, and no newcomer is admitted or displaces anyone while it waits. Ranked by
its own priority instead, a paused request sat behind every newcomer that outranked it until
it aged and then until a victim had run R steps: in the ablation's regime (a) the ten
requests paused mid-decode made the whole E2E p99 (10-25 s against at most 18 s for the
rest; docs/ablation.md).

Bounded waiting (aging): a request is *aged* once it was not served for `max_wait` (W)
scheduler steps in which its whole context fit in the pool beside what the running requests
still owe (the admission rule), or for `max_wait_total` (T) steps in all; optionally
(`max_bypass` = K, off by default) also once K requests that arrived after it have been
admitted while it waited (bounded bypass: overtaken at most K times).
Aged requests come first, oldest wait first, and are never chosen as victims while a
non-aged candidate exists. An aged request displaces nobody: it takes the next free slot
(nobody overtakes it in the order while it waits). Under saturation a displacement creates
no capacity, it moves the wait onto the victim; with aged requests displacing, regime (a)'s
tail was made of their victims, and with W = 128 (the first default) of long prompts that
waited W steps behind cheaper newcomers (docs/ablation.md). Hence W = 32: a priority order
that can hold a request back by a few seconds at most.
Why W leaves out the waits for memory: W sets how far the priority may reorder, and holding
the long requests back is what buys the mean. In a burst of long documents that wait for
memory (regime (b)) every document waits hundreds of steps, so with every step counted all
of them aged before their turn and the order was FCFS's (the priority's own order cuts mean
E2E by 12.6 % there, counted without a model; a real run: -3 % against -10.8 %). A step in
which a request's context does not fit the pool is one in which no order could have served
it: that wait is memory's, not the priority's, and FCFS makes it too. Counting only the
other steps leaves regime (a), where memory rarely binds, with the same W = 32 by steps
(the same schedule wherever memory never binds), and gives (b) the priority's order. T =
1024 bounds the wait in steps whatever memory does (a request too large to fit beside a
stream of small ones would otherwise never age). Bounded bypass (K = 4, W = T = 1024), the
rule tried before this one, also gave (b) the priority's order, but cost +13 % E2E p99 in
(a) on a slow CPU, where admissions are rare and K bypasses took longer than 32 steps
(docs/scheduling.md); it stays an option.
Bound: the head of the aged set is first in the order, so it gets the next slot that frees
(a running request finishes at most P + M steps after its admission: P the longest prefill
in steps, ceil(context / max_num_batched_tokens), M the most output tokens of a request) and
its blocks as soon as its whole context fits beside what the running ones still owe
(engine/scheduler.py), which running requests finishing or memory pressure preempting them
brings about within the same time. Each aged request ahead of a request costs it at most
P + M steps, and a request is ahead of it at most once (one admitted and later sent back to
wait restarts its wait, so it ranks behind): no request waits more than
T + Q * (P + M) steps (T = max_wait_total, or max_wait where that is None: then every
unserved step counts), Q the number of unfinished requests. Bypass aging and W only make
requests aged sooner than T, so the bound holds with them.
tests/test_entropic_scheduling.py checks this bound on random workloads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from entropic.control.clock import EntropicClock
from entropic.engine.cost import CostModel, dense_work
from entropic.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class EntropicSchedulingConfig:
    """alpha, beta, gamma weigh compute, memory and length; max_wait (W), max_wait_total (T)
    and max_bypass (K, None: off) bound the waiting: a request is aged after W steps unserved
    in which its whole context fit in the pool (steps it waited for memory do not count),
    after T steps unserved in all, or once K later arrivals were admitted while it waited.
    max_wait_total None: every unserved step counts toward W (the rule before 2026-12-08)."""

    alpha: float = 1.0
    beta: float = 1.0
    gamma: float = 1.0
    max_wait: int = 32
    max_bypass: int | None = None
    max_wait_total: int | None = 1024
    min_residency: int = 64  # steps a request runs after admission before it can be displaced
    length_scale: float = 256.0
    default_prior: float = 0.5
    displace_margin: float = 2.0  # a waiting request displaces only if pi is this much higher

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            if getattr(self, name) < 0:
                raise ValueError(f"scheduling.{name} must be >= 0, got {getattr(self, name)}")
        if self.alpha + self.beta + self.gamma <= 0:
            raise ValueError("scheduling: alpha, beta and gamma cannot all be 0")
        if self.max_wait < 1:
            raise ValueError(f"scheduling.max_wait must be >= 1, got {self.max_wait}")
        if self.max_wait_total is not None and self.max_wait_total < self.max_wait:
            raise ValueError(f"scheduling.max_wait_total must be >= max_wait "
                             f"({self.max_wait}) or None, got {self.max_wait_total}")
        if self.max_bypass is not None and self.max_bypass < 1:
            raise ValueError(f"scheduling.max_bypass must be >= 1 or None, got "
                             f"{self.max_bypass}")
        if self.min_residency < 0:
            raise ValueError(f"scheduling.min_residency must be >= 0, got {self.min_residency}")
        if self.length_scale <= 0 or self.default_prior <= 0:
            raise ValueError("scheduling: length_scale and default_prior must be > 0")
        if self.displace_margin < 1:
            raise ValueError(f"scheduling.displace_margin must be >= 1, "
                             f"got {self.displace_margin}")


class EntropicPolicy:
    """The macro control law as a scheduler policy (see the module docstring)."""

    EPS = 1e-6

    def __init__(self, clock: EntropicClock,
                 config: EntropicSchedulingConfig | None = None) -> None:
        self.clock = clock
        self.config = config or EntropicSchedulingConfig()
        self.cost: CostModel | None = None  # the rest is the engine's, given by bind()

    def bind(self, cost_model: CostModel, num_blocks: int, block_size: int,
             max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """The engine's cost model and KV geometry (LLMEngine calls this once)."""
        self.cost = cost_model
        self.block_size = block_size
        self.fair_share = max(1.0, num_blocks / max_num_seqs)
        self.budget = max_num_batched_tokens
        self.unit_cost = cost_model.linear_per_token + cost_model.lm_head_per_row

    # ---- the priority -------------------------------------------------------------------
    def expected_gain(self, req: Request) -> float:
        clock = self.clock
        mean_h = clock.mean_entropy
        if mean_h is None:
            return self.config.default_prior
        h = clock.history(req.request_id)
        return clock.drop_per_nat() * (h[-1] if h else mean_h) + self.EPS

    def next_step_cost(self, req: Request) -> float:
        n = min(max(1, req.num_tokens - req.num_computed_tokens), self.budget)
        w = dense_work(req.request_id, req.num_computed_tokens, n, True)
        return self.cost.chunk_cost(w).flops / self.unit_cost

    def memory(self, req: Request) -> float:
        blocks = -(-req.num_tokens // self.block_size)
        return blocks / self.fair_share

    def priority(self, req: Request) -> float:
        c = self.config
        denom = (c.alpha * self.next_step_cost(req) + c.beta * self.memory(req)
                 + c.gamma * req.num_output_tokens / c.length_scale)
        return self.expected_gain(req) / (denom + self.EPS)

    @property
    def counts_memory_waits(self) -> bool:
        """Whether max_wait leaves out the steps a request waited for memory (the scheduler
        then counts them in `Request.memory_wait_steps`)."""
        c = self.config
        return c.max_wait_total is not None and c.max_wait_total > c.max_wait

    def age(self, req: Request, step: int) -> int:
        return step - req.last_served_step

    def aged(self, req: Request, step: int) -> bool:
        c = self.config
        if c.max_bypass is not None and req.times_bypassed >= c.max_bypass:
            return True
        age = self.age(req, step)
        if self.counts_memory_waits:
            return age - req.memory_wait_steps >= c.max_wait or age >= c.max_wait_total
        return age >= c.max_wait

    def admitted(self, req: Request, waiting: Sequence[Request]) -> None:
        """The scheduler admitted `req`: it starts a new count, and every request still
        waiting that arrived before it has been overtaken once more (counted only where
        `max_bypass` is set: nothing else reads it)."""
        if self.config.max_bypass is None:
            return
        req.times_bypassed = 0
        for w in waiting:
            if w.seq_no < req.seq_no:
                w.times_bypassed += 1

    # ---- the policy hooks --------------------------------------------------------------
    def order(self, running: Sequence[Request], waiting: Sequence[Request],
              step: int) -> list[Request]:
        if self.cost is None:
            raise RuntimeError("EntropicPolicy is not bound to an engine: LLMEngine binds it; "
                               "alone, call bind(cost_model, num_blocks, ...) first")
        everyone = list(running) + list(waiting)
        aged = sorted((r for r in everyone if self.aged(r, step)),
                      key=lambda r: (-self.age(r, step), r.seq_no))
        paused, rest = [], []
        for r in everyone:
            if not self.aged(r, step):
                (paused if self.paused(r) else rest).append(r)
        paused.sort(key=lambda r: (r.last_served_step, r.seq_no))
        # running before waiting at equal priority keeps the batch stable
        rest.sort(key=lambda r: (-self.priority(r), r.status is not RequestStatus.RUNNING,
                                 r.seq_no))
        return aged + paused + rest

    @staticmethod
    def paused(req: Request) -> bool:
        """Waiting with KV computed: a displacement paused it (its KV stays resident)."""
        return req.status is RequestStatus.WAITING and req.num_computed_tokens > 0

    def choose_victim(self, candidates: Sequence[Request], step: int) -> Request:
        fresh = [r for r in candidates if not self.aged(r, step)]
        if fresh:
            return min(fresh, key=lambda r: (self.priority(r), -r.seq_no))
        return min(candidates, key=lambda r: (self.age(r, step), -r.seq_no))

    def choose_recompute_victim(self, candidates: Sequence[Request], step: int) -> Request:
        """Whose KV memory pressure drops (it is computed again on readmission): the
        request admitted last, aged requests last. Priority picks a victim that keeps its
        KV (a pause); for a recompute it picked long documents deep into their decode (high
        cost and memory terms), the costliest work to redo. The last admitted has had the
        least time to compute anything, and picking it again and again does not rotate the
        loss over everyone (fewest computed tokens did: each readmitted request became the
        next victim). On `python benchmarks/scheduling_work.py`-style replicas it threw
        away the least work of priority, fewest computed tokens and newest arrival."""
        fresh = [r for r in candidates if not self.aged(r, step)]
        if fresh:
            return max(fresh, key=lambda r: (r.admitted_step, r.seq_no))
        return self.choose_victim(candidates, step)

    def displace(self, waiting: Request, victim: Request, step: int) -> bool:
        if self.aged(waiting, step):
            return False  # it takes the next free slot: a displacement only moves the wait
        if victim.num_output_tokens == victim.outputs_at_admission:
            return False  # no token since admission: displacing it could livelock
        if step - victim.admitted_step < self.config.min_residency:
            return False  # no time-slicing faster than this
        if self.aged(victim, step):
            return False
        return self.priority(waiting) > self.config.displace_margin * self.priority(victim)
