"""Continuous-batching scheduler: who computes how many tokens this step.

No prefill/decode phases: each request has `num_computed_tokens` against its `num_tokens`,
and a step grants tokens under a budget (`max_num_batched_tokens`), so chunked prefill and
mixed prefill/decode batches come for free. The scheduler never touches tensors; it emits a
`SchedulerOutput` that the model runner turns into tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from entropic.engine.block_policy import BlockBudget, KVBlockPolicy
from entropic.engine.block_pool import cdiv
from entropic.engine.kv_manager import EVICTED, KVCacheManager
from entropic.engine.policy import FCFSPolicy, SchedulingPolicy
from entropic.engine.request import Request, RequestStatus
from entropic.model.attention import PrefillSparsity
from entropic.outputs import TokenLogprob
from entropic.sampling_params import SamplingParams


@dataclass
class ScheduledChunk:
    """One request's share of a step: compute KV for `token_ids` at `start_pos`..."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool  # this chunk reaches the end of the request's tokens: sample the next one
    params: SamplingParams
    num_output_tokens: int  # output tokens before this step's sample (for seeded sampling)
    # Prompt tokens to score by teacher forcing: row j of the chunk predicts score_targets[j]
    # (the prompt token after it). Set when the request asked for prompt logprobs that are
    # not recorded yet; None otherwise.
    score_targets: list[int] | None = None
    # A decode that attends only these indices of block_table (ascending, the last block
    # included); None: its whole context. collect_attention: report the attention mass
    # each attended block receives.
    attend_blocks: list[int] | None = None
    collect_attention: bool = False
    # Query-aware selection: attention chooses this many of the blocks above (per layer and
    # KV head); None: it attends them all.
    attend_budget: BlockBudget | None = None
    # A verify: the decode's pending token is followed by these drafted tokens
    # (token_ids[1:]); each of the chunk's rows is sampled, and the drafted tokens are
    # committed while they match what the target model samples.
    draft: list[int] = field(default_factory=list)
    # The first chunk after a prefix-cache hit of a request whose block policy wants prompt
    # surprisal: the surprisal of positions 1..start_pos, found with the cached blocks
    # (the runner computes those of the positions after start_pos).
    cached_surprisal: list[float] | None = None
    # A prefill chunk (more than one token, no draft) that attends block-sparsely; None:
    # densely
    prefill_sparsity: PrefillSparsity | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One new token after a cached context (a prefill chunk of one token counts too;
        a verify is not one: it is made of decode rows)."""
        return self.num_tokens == 1 and self.start_pos > 0


@dataclass
class SchedulerOutput:
    """The plan of one step."""

    step: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # since the last step: drop their state

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SampledToken:
    """What the runner produced for one sampling row."""

    token_id: int
    entropy: float
    temperature: float = 0.0
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
    # H^T: entropy of the tempered distribution it was drawn from (None: not measured)
    tempered_entropy: float | None = None


class DraftPolicy(Protocol):
    """Hook for speculative decoding (entropic.speculative.Speculator is one)."""

    def propose(self, requests: Sequence[tuple[Request, int]], base_rows: int
                ) -> dict[str, list[int]]:
        """Drafted tokens per request id, for decoding requests given with the most tokens
        each may draft; `base_rows`: the step's decode rows without drafts."""
        ...

    def commit(self, req: Request, drafted: int, accepted: int, committed: int) -> None:
        """A decode step of `req` verified `drafted` tokens, of which `accepted` matched;
        `committed` tokens were appended in all."""
        ...

    def observe_step(self, rows: int, seconds: float, sampling: bool) -> None:
        """The wall time of a step of decode and verify rows only (the engine calls it)."""
        ...

    def release(self, request_ids: Sequence[str]) -> None: ...


@dataclass
class PromptScores:
    """Teacher-forced scores of one chunk's `score_targets`."""

    logprobs: list[float]
    top: list[dict[int, float]] | None = None


class Scheduler:
    """Owns the waiting and running sets and the KV manager's allocations."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: Sequence[int] = (),
                 policy: SchedulingPolicy | None = None,
                 block_policy: KVBlockPolicy | None = None,
                 draft_policy: DraftPolicy | None = None,
                 attention_horizon: int | None = None) -> None:
        self.kv = kv
        # every layer attends at most this many positions back (its own included): blocks
        # wholly before that are given back (None: some layer attends everything)
        if attention_horizon is not None and attention_horizon <= 0:
            raise ValueError(f"attention_horizon must be positive, got {attention_horizon}")
        self.attention_horizon = attention_horizon
        self.num_window_freed_blocks = 0
        self._window_mark: dict[str, int] = {}  # per request: table entries freed below
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy: SchedulingPolicy = policy or FCFSPolicy()
        self.block_policy = block_policy
        self.draft_policy = draft_policy
        self.num_evicted_blocks = 0
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.step_count = 0
        self.num_preemptions = 0  # all preemptions, displacements included
        self.num_displacements = 0
        self.num_pauses = 0  # preemptions that kept the KV resident (the request resumes)
        self.num_recomputes = 0  # KV dropped (memory needed): recomputed on readmission
        # prefix cache, in tokens: looked up at admission, and found computed already
        self.num_cache_queries = 0
        self.num_cache_hits = 0
        self._finished_since_step: list[str] = []

    # ---- queue operations -------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        req.last_served_step = self.step_count  # waiting time counts from here
        req.memory_wait_steps = 0
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request at any time; its blocks go back to the pool."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = status
        self.kv.release(request_id)
        self._window_mark.pop(request_id, None)
        self._finished_since_step.append(request_id)
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ---- one step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Walk all unfinished requests in the policy's order under the token budget.

        A running request gets its next tokens, preempting requests later in the order if
        KV blocks run out (the policy picks the victim). A waiting request is admitted if a
        slot and blocks are free, or if the policy lets it displace a running request later
        in the order; otherwise admission stops there (no overtaking in the order)."""
        self.step_count += 1
        step = self.step_count
        out = SchedulerOutput(step=step, finished_ids=self._finished_since_step)
        self._finished_since_step = []
        budget = self.max_num_batched_tokens
        granted: list[tuple[Request, int]] = []
        queue = self.policy.order(self.running, self.waiting, step)
        preempted: set[str] = set()
        memory_tight = admission_closed = False
        scored_hits: dict[str, list[float]] = {}  # admitted on a hit with surprisal
        for i, req in enumerate(queue):
            if budget <= 0:
                break
            if req.request_id in preempted:
                continue
            later = [r for r in queue[i + 1:]
                     if r.status is RequestStatus.RUNNING and r.request_id not in preempted]
            if req.status is RequestStatus.RUNNING:
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                if not self._grow(req, n, later, out, preempted):
                    memory_tight = True
                    continue
            else:
                if memory_tight or admission_closed:
                    continue
                hit, surprisal = self._cached_prefix(req)
                computed = req.num_computed_tokens + len(hit) * self.kv.block_size
                n = min(req.num_tokens - computed, budget)
                if not self._admit(req, n, later, out, preempted, hit, surprisal):
                    admission_closed = True
                    continue
                if hit and len(surprisal) > 1:
                    scored_hits[req.request_id] = surprisal[1:]
            req.last_served_step = step
            req.memory_wait_steps = 0
            granted.append((req, n))
            budget -= n
        if getattr(self.policy, "counts_memory_waits", False):
            self._count_memory_waits(step)
        drafts = self._drafts(granted, budget) if self.draft_policy is not None else {}
        decode_rows = sum(1 + len(drafts.get(req.request_id, ())) for req, n in granted
                          if n == 1)
        for req, n in granted:  # after every eviction of this step: tables are final
            start = req.num_computed_tokens
            attend, collect, attend_budget = self._decode_blocks(req, start, n, decode_rows)
            draft = drafts.get(req.request_id, [])
            sparsity = None
            if self.block_policy is not None and n > 1:
                sparsity = self.block_policy.prefill_sparsity(req, start, n)
            out.chunks.append(ScheduledChunk(
                request_id=req.request_id,
                token_ids=req.token_ids[start:start + n] + draft,
                start_pos=start,
                block_table=list(self.kv.block_table(req.request_id)),
                sample=start + n == req.num_tokens,
                params=req.params,
                num_output_tokens=req.num_output_tokens,
                score_targets=self._score_targets(req, start, n),
                attend_blocks=attend,
                collect_attention=collect and not draft,
                attend_budget=attend_budget,
                draft=draft,
                cached_surprisal=scored_hits.get(req.request_id),
                prefill_sparsity=sparsity,
            ))
        return out

    def _drafts(self, granted: list[tuple[Request, int]], budget: int) -> dict[str, list[int]]:
        """Drafted tokens for the decoding requests of this step, within the token budget
        left and the blocks free now: speculation never preempts or evicts anything."""
        decoding = [req for req, n in granted if n == 1 and self._is_decoding(req)]
        if not decoding or budget <= 0:
            return {}
        eligible = []
        for req in decoding:
            if self.kv.num_evicted(req.request_id):
                continue  # a multi-row verify reads whole blocks; evicted ones are gone
            cap = min(req.params.max_tokens - req.num_output_tokens - 1,
                      self.max_model_len - req.num_tokens - 1)
            if cap > 0:
                eligible.append((req, cap))
        if not eligible:
            return {}
        proposed = self.draft_policy.propose(eligible, len(decoding))
        drafts = {}
        for req, _ in eligible:
            draft = proposed.get(req.request_id)
            if not draft:
                continue
            draft = draft[:budget]
            while draft and not self.kv.allocate(req.request_id,
                                                 req.num_computed_tokens + 1 + len(draft)):
                draft = draft[:-1]  # only what fits in the blocks free now
            if draft:
                drafts[req.request_id] = draft
                budget -= len(draft)
        return drafts

    @staticmethod
    def _is_decoding(req: Request) -> bool:
        """One pending output token after a computed context: the next row is a decode."""
        return (req.num_tokens - req.num_computed_tokens == 1
                and req.num_computed_tokens >= req.num_prompt_tokens)

    def _score_targets(self, req: Request, start: int, n: int) -> list[int] | None:
        """The prompt tokens this chunk predicts, if the request wants prompt logprobs that
        are not recorded yet (a recompute after preemption does not score them twice), or
        the block policy wants prompt surprisal."""
        if start + 1 >= req.num_prompt_tokens:
            return None
        have = req.prompt_logprobs
        wanted = have is not None and len(have) == start + 1
        if not wanted and not (self.block_policy is not None
                               and self.block_policy.wants_prompt_surprisal):
            return None
        return req.token_ids[start + 1:min(start + n + 1, req.num_prompt_tokens)]

    def _decode_blocks(self, req: Request, start: int, n: int, decode_rows: int
                       ) -> tuple[list[int] | None, bool, BlockBudget | None]:
        """The blocks a decode attends (None: all), whether to report attention mass, and
        the budget of a query-aware selection among them."""
        rid = req.request_id
        bp = self.block_policy
        if bp is None:
            if n == 1 and self.kv.num_evicted(rid):  # blocks freed outside the window
                num = start // self.kv.block_size + 1
                attend = [i for i in self.kv.live_indices(rid) if i < num]
                return attend, False, None
            return None, False, None
        if n != 1 or start < req.num_prompt_tokens:
            if n > 1 and self._evicted_in_window(rid, start):
                raise RuntimeError(f"request {rid!r}: a {n}-token chunk over evicted blocks")
            return None, False, None
        num = start // self.kv.block_size + 1  # blocks holding positions 0..start
        live = [i for i in self.kv.live_indices(rid) if i < num]
        selection = bp.select(req, live, num, decode_rows)
        budget = selection.budget
        if budget is not None and (selection.attend is not None or selection.collect_attention
                                   or not 1 <= budget.blocks):
            raise RuntimeError(f"block policy chose an invalid budget {budget} for request "
                               f"{rid!r}")
        if budget is not None and budget.blocks >= len(live):
            budget = None
        attend = selection.attend
        if attend is None and len(live) < num:
            attend = live
        if attend is not None:
            live_set = set(live)
            if (not attend or attend[-1] != num - 1 or any(i not in live_set for i in attend)
                    or any(a >= b for a, b in zip(attend, attend[1:]))):
                raise RuntimeError(f"block policy chose invalid blocks {attend} for request "
                                   f"{rid!r} (live {live}, last block {num - 1})")
            if len(attend) == num:
                attend = None
        return attend, selection.collect_attention, budget

    def _grow(self, req: Request, n: int, later: list[Request], out: SchedulerOutput,
              preempted: set[str]) -> bool:
        """Blocks for a running request's next n tokens: evicting blocks if the block policy
        allows, then taking back the KV of paused requests, else preempting (maybe itself)."""
        need = req.num_computed_tokens + n
        while not self.kv.allocate(req.request_id, need):
            if (self._evict(max(1, self.kv.shortfall(req.request_id, need)))
                    or self._reclaim_paused(req)):
                continue
            victim = self.policy.choose_recompute_victim(later + [req], self.step_count)
            self._preempt(victim, out)
            preempted.add(victim.request_id)
            if victim is req:
                return False
            later.remove(victim)
        return True

    def _cached_prefix(self, req: Request) -> tuple[list[int], list[float | None]]:
        """Published blocks a waiting request holding no KV can start on (prefix caching):
        full blocks only, never the one with its last token (whose logits it samples from),
        and the surprisal of positions 0..the first computed one where the cache has it
        (else [None]). A request that still wants prompt logprobs computes its whole prompt
        instead; one whose block policy wants prompt surprisal starts only on blocks that
        carry it, within its prompt (docs/prefix_caching.md)."""
        if (not self.kv.prefix_caching or req.num_computed_tokens
                or self.kv.block_table(req.request_id)):
            return [], [None]
        scores = req.prompt_logprobs
        if scores is not None and len(scores) < req.num_prompt_tokens:
            return [], [None]
        if self.block_policy is not None and self.block_policy.wants_prompt_surprisal:
            return self.kv.cached_scored_prefix(
                req.request_id, req.token_ids[:req.num_prompt_tokens],
                min(req.num_prompt_tokens, req.num_tokens - 1))
        return self.kv.cached_prefix(req.request_id, req.token_ids, req.num_tokens - 1), [None]

    def _admit(self, req: Request, n: int, later: list[Request], out: SchedulerOutput,
               preempted: set[str], hit: list[int],
               surprisal: list[float | None] = (None,)) -> bool:
        """Admit a waiting request, displacing lower-ranked running ones if the policy
        allows; `hit`: the cached blocks it starts on, `surprisal`: what the cache knows
        of its positions' surprisal (from position 0).

        No overcommitted prompts: while requests run, a waiting request is admitted only if
        its whole context fits in the pool beside what the running ones still owe (the
        blocks their own contexts still need, plus one block of growth each), not just its
        first chunk. Admitted on its first chunk, a long prompt took blocks that the
        running requests needed a few steps later, and memory pressure then recomputed
        someone: in the ablation's regime (b) (8 documents of 4k-8k tokens, a pool for 2-3)
        FCFS recomputed 3-4 documents and the entropic order, which admits by priority
        ahead of running requests, 11-12 (+65 % linear work). Only output growth, which
        nobody knows in advance, can still run the pool out (docs/scheduling.md).

        Displacement only ever pauses: a running request gives up its slot to a
        higher-ranked (or aged) waiting one only while the newcomer's blocks fit beside its
        KV. Where memory is short, a displacement would drop the victim's KV and compute
        it again (time-slicing by recompute): in regime (b) of the ablation (8 long
        documents, a pool for 2-3) aged documents displaced running ones every ~64 steps,
        30 recomputes and 2.9x the baseline's linear work (docs/scheduling.md). There the
        waiting request waits at the head of the order instead (nobody overtakes it) until
        running requests finish; memory pressure itself still preempts (`_grow`)."""
        rid = req.request_id
        need = req.num_computed_tokens + len(hit) * self.kv.block_size + n
        if self.running and not self._context_fits(req, self._owed_by_running(), hit):
            return False
        while len(self.running) >= self.max_num_seqs or not self.kv.can_fit(rid, need, hit):
            fits = self.kv.can_fit(rid, need, hit)
            if (len(self.running) < self.max_num_seqs and not fits
                    and (self._evict(max(1, self.kv.shortfall(rid, need, hit)))
                         or self._reclaim_paused(req))):
                continue
            if not later or not fits:
                return False
            victim = self.policy.choose_victim(later, self.step_count)
            if not self.policy.displace(req, victim, self.step_count):
                return False
            self.num_displacements += 1
            # only a slot is needed (the blocks fit): the victim pauses, KV resident
            self._preempt(victim, out, keep_kv=True)
            preempted.add(victim.request_id)
            later.remove(victim)
        if not self.kv.allocate(rid, need, hit):
            return False
        if not req.num_computed_tokens:  # its KV starts from scratch or from the cache
            req.prompt_surprisal = list(surprisal)
        if self.kv.prefix_caching and not req.num_computed_tokens:
            self.num_cache_queries += req.num_tokens
            self.num_cache_hits += len(hit) * self.kv.block_size
            req.num_computed_tokens = len(hit) * self.kv.block_size
            req.num_cached_tokens = req.num_computed_tokens
        self.waiting.remove(req)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        req.outputs_at_admission = req.num_output_tokens
        req.admitted_step = self.step_count
        admitted = getattr(self.policy, "admitted", None)
        if admitted is not None:
            admitted(req, self.waiting)
        return True

    def _count_memory_waits(self, step: int) -> None:
        """Each request left waiting this step whose whole context does not fit in the
        pool beside what the running ones still owe (the admission rule of `_admit`) waited
        for memory, not for its turn in the order: counted in `memory_wait_steps`."""
        if not self.running or not self.waiting:
            return
        owed = self._owed_by_running()
        for req in self.waiting:
            if req.last_served_step != step and not self._context_fits(req, owed):
                req.memory_wait_steps += 1

    def _context_fits(self, req: Request, owed: int, hit: Sequence[int] = ()) -> bool:
        """Whether the request's whole context fits in the pool beside `owed` blocks (what
        the running requests still need), starting on the cached blocks `hit`."""
        return self.kv.shortfall(req.request_id, req.num_tokens, hit) + owed <= 0

    def _owed_by_running(self) -> int:
        return sum(map(self._owed_blocks, self.running))

    def _owed_blocks(self, req: Request) -> int:
        """Blocks a running request still needs for its whole context and one token more."""
        return max(0, self.kv.blocks_needed(req.num_tokens + 1)
                   - len(self.kv.block_table(req.request_id)))

    def _evict(self, need: int) -> bool:
        """Evict up to `need` blocks the block policy offers; True if any were freed.
        Paused requests are asked first (they hold memory without computing; design
        section 4, global coordination), the running ones only when no paused block is
        offered: shrinking a paused request comes before recomputing anything. Blocks
        shared with another request (prefix cache) are not offered: dropping one frees no
        memory."""
        if self.block_policy is None:
            return False
        bs = self.kv.block_size
        paused = [r for r in self.waiting if self.kv.num_blocks_held(r.request_id)]
        for group in (paused, self.running):
            candidates = []
            for r in group:
                table = self.kv.block_table(r.request_id)
                candidates.append((r, [i for i in self.kv.live_indices(r.request_id)
                                       if i < cdiv(r.num_computed_tokens, bs)
                                       and not self.kv.is_shared(table[i])]))
            pairs = self.block_policy.evict(candidates, need) if candidates else []
            for rid, index in pairs:
                self.kv.evict(rid, index)
            self.num_evicted_blocks += len(pairs)
            if pairs:
                return True
        return False

    def _preempt(self, req: Request, out: SchedulerOutput, keep_kv: bool = False) -> None:
        """Take a running request out of the batch and requeue it, keeping its tokens.
        keep_kv (pause): its blocks stay resident and it resumes where it stopped; else
        (recompute) its KV goes back to the pool and is computed again on readmission."""
        if keep_kv:
            self.num_pauses += 1
        else:
            self._drop_kv(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.waiting.append(req)
        self.num_preemptions += 1
        out.preempted_ids.append(req.request_id)

    def _drop_kv(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        self.num_recomputes += 1

    def _reclaim_paused(self, needy: Request) -> bool:
        """Memory is short: drop the KV of one paused request (the policy's victim among
        them; never `needy` itself). True if blocks came back."""
        paused = [r for r in self.waiting
                  if r is not needy and self.kv.num_blocks_held(r.request_id)]
        if not paused:
            return False
        self._drop_kv(self.policy.choose_recompute_victim(paused, self.step_count))
        return True

    def update(self, out: SchedulerOutput, sampled: dict[str, SampledToken],
               now: float, prompt_scores: dict[str, PromptScores] | None = None,
               accepted: dict[str, list[SampledToken]] | None = None) -> list[Request]:
        """Advance computed counts, append sampled tokens, apply token-level stops.
        `accepted`: per verify, the drafted tokens the target accepted, committed before
        its own sampled token.

        Returns the requests that received tokens this step (finished ones included);
        each one's `num_new_tokens` says how many."""
        touched: list[Request] = []
        accepted = accepted or {}
        for chunk in out.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted between schedule and update
            if chunk.draft:
                self._commit_verify(req, chunk, accepted.get(chunk.request_id, []),
                                    sampled[chunk.request_id], now)
                touched.append(req)
                continue
            decoding = (self.draft_policy is not None and chunk.num_tokens == 1
                        and chunk.start_pos >= req.num_prompt_tokens)
            req.num_computed_tokens += chunk.num_tokens
            if chunk.score_targets is not None and prompt_scores:
                self._record_surprisal(req, chunk, prompt_scores.get(chunk.request_id))
            self._publish(req)
            self._free_outside_window(req)
            if (chunk.score_targets is not None and prompt_scores
                    and req.prompt_logprobs is not None
                    and len(req.prompt_logprobs) == chunk.start_pos + 1):
                self._record_prompt(req, chunk, prompt_scores[chunk.request_id])
            if not chunk.sample:
                continue
            s = sampled[chunk.request_id]
            req.num_new_tokens = 0
            self._append(req, s, now)
            touched.append(req)
            status = self._check_stop(req, s.token_id)
            if status is not None:
                self.finish(req.request_id, status)
            if decoding:
                self.draft_policy.commit(req, 0, 0, 1)
        return touched

    def _commit_verify(self, req: Request, chunk: ScheduledChunk, accepted: list[SampledToken],
                       final: SampledToken, now: float) -> None:
        """Commit a verify's accepted drafted tokens and the target's own next token, one
        at a time with the usual stops; blocks past the committed tokens go back to the
        pool (the rejected positions' KV is rewritten when they are computed again)."""
        req.num_computed_tokens += 1 + len(accepted)
        req.num_new_tokens = 0
        status = None
        for s in [*accepted, final]:
            self._append(req, s, now)
            status = self._check_stop(req, s.token_id)
            if status is not None:
                break
        self.draft_policy.commit(req, len(chunk.draft), len(accepted), req.num_new_tokens)
        self._publish(req)
        if status is not None:
            self.finish(req.request_id, status)
        else:
            self.kv.truncate(req.request_id, req.num_tokens)
            self._free_outside_window(req)

    def _free_outside_window(self, req: Request) -> None:
        """Give back the request's blocks that no later query reads: the next query sits at
        p = num_computed_tokens and every layer attends p - horizon + 1 .. p, so a block
        whose last position is below p - horizon + 1 is dead. Its table entry becomes
        EVICTED (the pool's reference counting keeps a shared, published block for the
        others and the prefix cache). The sink block goes too: no layer attends it."""
        if self.attention_horizon is None:
            return
        rid = req.request_id
        dead = (req.num_computed_tokens - self.attention_horizon + 1) // self.kv.block_size
        table = self.kv.block_table(rid)
        # entries below the mark were freed already (unless the table was rebuilt since:
        # a recompute after preemption)
        mark = self._window_mark.get(rid, 0)
        if mark > len(table) or (mark and table[mark - 1] != EVICTED):
            mark = 0
        for i in range(mark, min(dead, len(table))):
            if table[i] != EVICTED:
                self.kv.evict(rid, i)
                self.num_window_freed_blocks += 1
        self._window_mark[rid] = max(mark, min(dead, len(table)))

    def _evicted_in_window(self, request_id: str, start: int) -> bool:
        """Whether a block that a chunk starting at `start` reads is gone (blocks wholly
        before every layer's window may be)."""
        first = 0
        if self.attention_horizon is not None:
            first = max(0, start - self.attention_horizon + 1) // self.kv.block_size
        return any(b == EVICTED for b in self.kv.block_table(request_id)[first:])

    def _publish(self, req: Request) -> None:
        """Offer the request's newly computed full blocks to the prefix cache. Only KV
        computed from committed tokens is final (a verify's rejected drafts lie past
        them). Under a block policy only the prompt's blocks are offered: a decode that
        attended a subset of its blocks wrote KV that a dense engine would not."""
        limit = min(req.num_computed_tokens, req.num_tokens)
        if self.block_policy is not None:
            limit = min(limit, req.num_prompt_tokens)
        self.kv.publish(req.request_id, req.token_ids, limit, req.prompt_surprisal)

    @staticmethod
    def _record_surprisal(req: Request, chunk: ScheduledChunk, scores: PromptScores | None
                          ) -> None:
        """Keep the surprisal of the prompt positions the chunk scored, while the request
        knows every one before them (published blocks carry it)."""
        if scores is not None and len(req.prompt_surprisal) == chunk.start_pos + 1:
            req.prompt_surprisal.extend(-lp for lp in scores.logprobs)

    @staticmethod
    def _record_prompt(req: Request, chunk: ScheduledChunk, scores: PromptScores) -> None:
        top = scores.top or [{}] * len(scores.logprobs)
        req.prompt_logprobs.extend(TokenLogprob(t, lp, alt) for t, lp, alt in
                                   zip(chunk.score_targets, scores.logprobs, top))

    @staticmethod
    def _append(req: Request, s: SampledToken, now: float) -> None:
        req.num_new_tokens += 1
        req.token_ids.append(s.token_id)
        req.entropies.append(s.entropy)
        req.temperatures.append(s.temperature)
        req.tempered_entropies.append(s.tempered_entropy)
        if req.logprobs is not None:
            req.logprobs.append(TokenLogprob(s.token_id, s.logprob, s.top_logprobs or {}))
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.token_times.append(now)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.params
        if not p.ignore_eos and token in self.eos_token_ids:
            req.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if token in p.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
