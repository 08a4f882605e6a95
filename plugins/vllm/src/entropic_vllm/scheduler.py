"""entropic's scheduling policy (pi(s) with aging) as a vLLM V1 scheduler class.

    LLM(MODEL, scheduler_cls=EntropicScheduler, scheduling_policy="priority",
        logits_processors=[EntropyLogitsProcessor],
        additional_config={"entropic_scheduler": {"max_wait": 128}})

The law is entropic's own (`entropic.control.scheduling.EntropicPolicy`, imported): pi(s) =
E[dH_s] / (alpha*C_s + beta*M_s + gamma*L_s), E[dH_s] = kappa * H_t from an
`EntropicClock` fed with every request's per-token entropy, aged requests first (not served
for max_wait steps, with max_wait_total set not counting the steps it waited for memory, or
for max_wait_total steps in all; with max_bypass set, also once overtaken by that many later
arrivals). Before each `Scheduler.schedule()` this class
1. reads the entropies the worker's `EntropyLogitsProcessor` wrote to the board since the
   last step (`entropic_vllm.board`) into the clock;
2. ranks running and waiting requests with `EntropicPolicy.order` and writes each one's
   rank into `request.priority` (0 = first), re-heaps vLLM's waiting queues and sorts
   `self.running` by it; vLLM's priority policy then admits waiting requests in that order,
   gives running requests tokens in that order and preempts the last one (the largest
   (priority, arrival)) when KV blocks run out: `EntropicPolicy.choose_victim`'s choice;
3. displaces: while every running slot is taken, the best waiting request may take the
   slot of a running request ranked after it when `EntropicPolicy.displace` allows (a pi
   `displace_margin` times higher, after the victim's `min_residency` steps and a token
   since admission; an aged request displaces nobody, it takes the next free slot), and
   only while the newcomer's whole context fits in the free blocks beside one block of
   growth per running request. The victim *pauses*: it goes through vLLM's own
   `_preempt_request` with its blocks kept and its computed tokens restored, back to
   `self.waiting` under its rank, and resumes where it stopped (vLLM's waiting loop admits
   a request with computed tokens as it does one whose KV arrived from a connector);
Between 2 and 3, under memory pressure (fewer free blocks than running requests, or than
the first waiting request needs while a slot is free) it drops the KV of paused requests,
lowest rank first, before vLLM's running loop would recompute a running one: those are
recomputed when readmitted (counted in `num_recomputes`).
The request's own `priority` argument is overwritten. Options (`additional_config`, key
"entropic_scheduler"): the fields of `EntropicSchedulingConfig`, validated by entropic, and
"log": a path where each step's ranking and decisions are appended as JSON lines.
"""
from __future__ import annotations

import atexit
import itertools
import json
import logging
import time
from dataclasses import dataclass
from importlib import import_module
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus as VllmStatus

from entropic.config import ModelConfig
from entropic.control.clock import EntropicClock
from entropic.control.scheduling import EntropicPolicy, EntropicSchedulingConfig
from entropic.engine.block_pool import cdiv
from entropic.engine.cost import CostModel
from entropic.engine.request import RequestStatus
from entropic_vllm.board import BOARD_KEY, TAG_KEY, EntropyBoard
from entropic_vllm.entropy import EntropyLogitsProcessor

log = logging.getLogger(__name__)
CONFIG_KEY = "entropic_scheduler"
SILENT_STEPS = 16  # steps with sampled tokens and no entropy at all before we give up
SCHEDULABLE = (VllmStatus.WAITING, VllmStatus.PREEMPTED)


@dataclass(eq=False)
class _View:
    """What EntropicPolicy reads of a request, taken from vLLM's Request."""

    req: Request
    request_id: str
    num_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    status: RequestStatus
    seq_no: int
    last_served_step: int
    admitted_step: int
    outputs_at_admission: int
    times_bypassed: int = 0
    memory_wait_steps: int = 0


def scheduling_config(additional: dict | None) -> tuple[EntropicSchedulingConfig, str | None]:
    """The law's parameters and the log path from vLLM's `additional_config`."""
    given = dict((additional or {}).get(CONFIG_KEY) or {})
    path = given.pop("log", None)
    try:
        return EntropicSchedulingConfig(**given), path
    except TypeError as e:
        raise ValueError(f"{CONFIG_KEY}: {e}; known fields: "
                         f"{', '.join(EntropicSchedulingConfig.__dataclass_fields__)}, log") \
            from None


def cost_model(vllm_config: Any, kv_element_bytes: int = 2) -> CostModel:
    """entropic's cost model for vLLM's model: only the dense shapes it counts FLOPs from."""
    mc = vllm_config.model_config
    hf = mc.hf_text_config
    hidden = mc.get_hidden_size()
    heads = hf.num_attention_heads
    cfg = ModelConfig(
        vocab_size=mc.get_vocab_size(), hidden_size=hidden,
        intermediate_size=getattr(hf, "intermediate_size", None) or 4 * hidden,
        num_layers=hf.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=mc.get_head_size(), max_position=mc.max_model_len)
    return CostModel(cfg, kv_element_bytes=kv_element_bytes)


def _is_entropy_processor(p: Any) -> bool:
    if isinstance(p, str):
        mod, _, name = p.partition(":") if ":" in p else p.rpartition(".")
        try:
            p = getattr(import_module(mod), name)
        except (ImportError, AttributeError, ValueError):
            return False
    return isinstance(p, type) and issubclass(p, EntropyLogitsProcessor)


def check_layout(vllm_config: Any) -> None:
    """Refuse, at startup, every configuration in which no entropy would reach pi(s)."""
    sc, pc = vllm_config.scheduler_config, vllm_config.parallel_config
    procs = vllm_config.model_config.logits_processors or []
    problems = []
    if sc.policy != "priority":
        problems.append("needs --scheduling-policy priority (it ranks requests through "
                        "request.priority)")
    if not any(_is_entropy_processor(p) for p in procs):
        problems.append("needs --logits-processors entropic_vllm:EntropyLogitsProcessor "
                        "(the worker side that measures each row's entropy)")
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        problems.append("supports tensor and pipeline parallel size 1 only")
    if pc.nnodes != 1 or pc.distributed_executor_backend not in (None, "mp", "uni"):
        problems.append("needs the worker on the scheduler's machine (executor 'mp' or "
                        f"'uni', one node; got {pc.distributed_executor_backend!r}, "
                        f"{pc.nnodes} node(s))")
    if sc.async_scheduling:
        problems.append("needs synchronous scheduling (--no-async-scheduling): it reads a "
                        "step's entropies before scheduling the next; the CPU build "
                        "turns async scheduling off itself")
    if vllm_config.speculative_config is not None:
        problems.append("does not support speculative decoding (vLLM runs no custom logits "
                        "processor with it)")
    if problems:
        raise ValueError("entropic_vllm.scheduler.EntropicScheduler: " + "; ".join(problems))


class EntropicScheduler(Scheduler):
    """vLLM's scheduler ordered by entropic's pi(s) with aging (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_layout(self.vllm_config)
        self.law_config, log_path = scheduling_config(self.vllm_config.additional_config)
        self.clock = EntropicClock()
        self.law = EntropicPolicy(self.clock, self.law_config)
        self.law.bind(cost_model(self.vllm_config), self.kv_cache_config.num_blocks,
                      self.block_size, self.max_num_running_reqs,
                      self.max_num_scheduled_tokens)
        self.board = EntropyBoard.create()
        atexit.register(self.board.unlink)
        self.step = 0
        self.num_displacements = 0
        self.num_pauses = 0  # displaced with their KV kept
        self.num_recomputes = 0  # paused requests whose KV memory pressure took back
        self.num_entropies = 0
        self.seconds = 0.0
        self._silent_steps = 0
        self._seq = itertools.count()
        self._tag: dict[str, int] = {}  # request id -> board tag (also its arrival order)
        self._by_tag: dict[int, str] = {}
        self._last_served: dict[str, int] = {}
        self._admitted: dict[str, tuple[int, int]] = {}  # id -> (step, outputs then)
        self._observed: dict[str, int] = {}  # id -> last output index given to the clock
        self._bypassed: dict[str, int] = {}  # id -> later arrivals admitted while it waited
        self._memory_waits: dict[str, int] = {}  # id -> steps it waited for memory
        self._log = open(log_path, "a") if log_path else None

    # ---- vLLM's hooks ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        super().add_request(request)
        rid = request.request_id
        if rid in self._tag or request.sampling_params is None:
            return
        tag = next(self._seq)
        self._tag[rid], self._by_tag[tag] = tag, rid
        self._last_served[rid] = self.step  # waiting time counts from arrival
        sp = request.sampling_params
        sp.extra_args = {**(sp.extra_args or {}), BOARD_KEY: self.board.path, TAG_KEY: tag}

    def schedule(self, *args: Any, **kwargs: Any):
        self.step += 1
        step = self.step
        t0 = time.perf_counter()
        self._forget_finished()
        seen = self._read_board()
        order = self._rank(step)
        dropped = self._relieve_pressure(order)
        displaced = self._displace(order, step)
        self.seconds = time.perf_counter() - t0  # entropic's share of this step's scheduling
        out = super().schedule(*args, **kwargs)
        for rid in out.num_scheduled_tokens:
            self._last_served[rid] = step
            self._memory_waits.pop(rid, None)
        admitted = [req for req in self.running if req.request_id not in self._admitted]
        for req in admitted:
            self._admitted[req.request_id] = (step, req.num_output_tokens)
        self._count_bypasses(admitted)
        if self.law.counts_memory_waits:
            self._count_memory_waits(out.num_scheduled_tokens)
        running = {r.request_id for r in self.running}
        for rid in [r for r in self._admitted if r not in running]:
            del self._admitted[rid]  # preempted or finished: admitted anew when it returns
        if self._log is not None:
            self._write_log(step, order, displaced, dropped, out, seen)
        return out

    def shutdown(self) -> None:
        super().shutdown()
        self.board.unlink()
        if self._log is not None:
            self._log.close()

    # ---- the law -----------------------------------------------------------------------
    def _read_board(self) -> list[tuple[str, int, float]]:
        sampled = False
        seen = []
        for tag, n, h in self.board.read():
            rid = self._by_tag.get(tag)
            req = self.requests.get(rid) if rid is not None else None
            # a row whose token vLLM threw away (a prefill chunk that is not the last) has
            # no output n yet; a recomputed row repeats an index already observed
            if req is None or n >= req.num_output_tokens or n <= self._observed.get(rid, -1):
                continue
            if self.num_entropies == 0:
                # the worker has the board mapped: drop the name, so that no file outlives
                # an engine that is killed
                self.board.unlink()
            self.clock.observe(rid, h)
            self._observed[rid] = n
            seen.append((rid, n, h))
            self.num_entropies += 1
        for req in self.running:
            sampled |= req.num_output_tokens > 0
        if self.num_entropies == 0 and sampled:
            self._silent_steps += 1
            if self._silent_steps >= SILENT_STEPS:
                raise RuntimeError(
                    "entropic_vllm.scheduler: requests have produced tokens for "
                    f"{SILENT_STEPS} steps and no entropy reached the scheduler through "
                    f"{self.board.path}; is EntropyLogitsProcessor running in the worker?")
        return seen

    def _view(self, req: Request, running: bool) -> _View:
        rid = req.request_id
        admitted, outputs_then = self._admitted.get(rid, (0, 0))
        return _View(req, rid, req.num_tokens, req.num_computed_tokens, req.num_output_tokens,
                     RequestStatus.RUNNING if running else RequestStatus.WAITING,
                     self._tag.get(rid, 0), self._last_served.get(rid, self.step), admitted,
                     outputs_then, self._bypassed.get(rid, 0), self._memory_waits.get(rid, 0))

    def _count_bypasses(self, admitted: list[Request]) -> None:
        """The law's bounded bypass: each request vLLM admitted this step overtook the
        requests still waiting that arrived before it (`EntropicPolicy.admitted`)."""
        if not admitted or self.law_config.max_bypass is None:
            return
        waiting = [self._view(r, False) for q in (self.kv_holding_waiting, self.waiting)
                   for r in q]
        for req in admitted:
            self.law.admitted(self._view(req, True), waiting)
            self._bypassed[req.request_id] = 0
        for v in waiting:
            self._bypassed[v.request_id] = v.times_bypassed

    def _count_memory_waits(self, served: dict[str, int]) -> None:
        """The law's `max_wait_total`: a request left waiting this step whose blocks do not
        fit beside one more block for each running request (the test `_displace` applies)
        waited for memory, not for its turn (`Request.memory_wait_steps` in entropic)."""
        if not self.running:
            return
        free = self._num_free_blocks() - len(self.running)
        for q in (self.kv_holding_waiting, self.waiting):
            for r in q:
                if r.request_id not in served and self._blocks_owed(r) > free:
                    rid = r.request_id
                    self._memory_waits[rid] = self._memory_waits.get(rid, 0) + 1

    def _rank(self, step: int) -> list[_View]:
        running = [self._view(r, True) for r in self.running]
        waiting = [self._view(r, False) for q in (self.kv_holding_waiting, self.waiting)
                   for r in q]
        order = self.law.order(running, waiting, step)
        for i, v in enumerate(order):
            v.req.priority = i
        for q in (self.waiting, self.kv_holding_waiting):
            reqs = list(q)
            q.remove_requests(reqs)
            for r in reqs:
                q.add_request(r)  # a heap on (priority, arrival): re-pushed under new keys
        self.running.sort(key=lambda r: r.priority)
        return order

    def _displace(self, order: list[_View], step: int) -> list[str]:
        """Free running slots for the best waiting requests where the law allows it and the
        newcomer's blocks fit; vLLM's own admission then takes them in rank order."""
        # vLLM's own admission test (Scheduler.schedule, the waiting loop)
        free = (self.max_num_active_reqs - len(self.running)
                - self.num_waiting_for_streaming_input)
        blocks = self._num_free_blocks()
        done: list[str] = []
        for i, w in enumerate(order):
            if w.status is RequestStatus.RUNNING or w.req.status not in SCHEDULABLE:
                continue
            if free > 0:
                free -= 1
                blocks -= self._blocks_owed(w.req)
                continue
            later = [v for v in order[i + 1:] if v.status is RequestStatus.RUNNING
                     and v.req in self.running]
            if not later:
                break
            victim = self.law.choose_victim(later, step)
            owed = self._blocks_owed(w.req)
            if (not self.law.displace(w, victim, step)
                    or owed + len(self.running) > blocks):
                # no overtaking in the order: admission stops here, as in entropic; where
                # the newcomer's blocks do not fit beside the victim's KV it waits at the
                # head of the order (a displacement there would be time-slicing by
                # recompute)
                break
            self.running.remove(victim.req)
            self._pause(victim.req)
            blocks -= owed
            self.num_displacements += 1
            done.append(victim.request_id)
        return done

    def _num_free_blocks(self) -> int:
        return self.kv_cache_manager.block_pool.get_num_free_blocks()

    def _blocks_owed(self, req: Request) -> int:
        """Blocks a waiting request needs for the rest of its context (a paused one holds
        those of its computed tokens already)."""
        return (cdiv(req.num_tokens, self.block_size)
                - cdiv(req.num_computed_tokens, self.block_size))

    def _pause(self, req: Request) -> None:
        """vLLM's preemption without its block free: the request keeps its KV and its
        computed tokens and waits under its rank in `self.waiting` (where vLLM put it)."""
        computed = req.num_computed_tokens
        self._free_request_blocks = lambda _req: None  # shadows the method for this call
        try:
            self._preempt_request(req, time.monotonic())
        finally:
            del self._free_request_blocks
        req.num_computed_tokens = computed
        self.num_pauses += 1

    def _relieve_pressure(self, order: list[_View]) -> list[str]:
        """Memory is short: fewer free blocks than running requests (each may need one more
        this step), or than the first waiting request needs for its context while a slot
        is free for it. Drop the KV of paused requests, lowest rank first, before vLLM's
        running loop recomputes a running one (or the waiting head waits for blocks that
        paused requests behind it hold). A dropped request is recomputed when readmitted."""
        need = len(self.running)
        head = next((v.req for v in order if v.status is not RequestStatus.RUNNING
                     and v.req.status in SCHEDULABLE), None)
        if (head is not None and not head.num_computed_tokens
                and len(self.running) < self.max_num_active_reqs):
            need += self._blocks_owed(head)
        dropped: list[str] = []
        paused = [v.req for v in reversed(order) if v.status is not RequestStatus.RUNNING
                  and v.req.status is VllmStatus.PREEMPTED and v.req.num_computed_tokens]
        for req in paused:
            if self._num_free_blocks() >= need:
                break
            self._free_request_blocks(req)
            req.num_computed_tokens = 0
            if req in self.kv_holding_waiting:
                self.kv_holding_waiting.remove_request(req)
                self.waiting.add_request(req)
            self.num_recomputes += 1
            dropped.append(req.request_id)
        return dropped

    def _forget_finished(self) -> None:
        gone = [rid for rid in self._tag if rid not in self.requests]
        for rid in gone:
            self._by_tag.pop(self._tag.pop(rid), None)
            for d in (self._last_served, self._admitted, self._observed, self._bypassed,
                      self._memory_waits):
                d.pop(rid, None)
        if gone:
            self.clock.release(gone)

    def _write_log(self, step: int, order: list[_View], displaced: list[str],
                   dropped: list[str], out, seen: list[tuple[str, int, float]]) -> None:
        cached = out.scheduled_cached_reqs
        rows = [[v.request_id, self.law.priority(v), self.law.age(v, step),
                 v.status is RequestStatus.RUNNING, v.num_output_tokens,
                 len(self.clock.history(v.request_id)), v.memory_wait_steps] for v in order]
        self._log.write(json.dumps({
            "step": step, "order": rows, "displaced": displaced, "kv_dropped": dropped,
            "free_blocks": self._num_free_blocks(),  # after vLLM's allocations of this step
            "scheduled": sorted(out.num_scheduled_tokens),
            "new": [r.req_id for r in out.scheduled_new_reqs],
            "preempted": sorted(out.preempted_req_ids or ()),
            # resumed after a preemption: [id, tokens computed before this step, scheduled]
            "resumed": [[rid, n, out.num_scheduled_tokens.get(rid, 0)] for rid, n in
                        zip(cached.req_ids, cached.num_computed_tokens)
                        if rid in cached.resumed_req_ids],
            "observed": seen, "kappa": self.clock.drop_per_nat(),
            "entropic_s": self.seconds}) + "\n")
        self._log.flush()

