"""The engine loop: one step is schedule(), execute(), update()."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Protocol, Sequence

import torch

from entropic.config import EngineConfig, ModelConfig, dtype_name
from entropic.engine.block_policy import KVBlockPolicy, decode_context_length
from entropic.engine.block_pool import BlockPool
from entropic.engine.cost import ChunkWork, CostModel, dense_work
from entropic.engine.detokenizer import IncrementalDetokenizer
from entropic.engine.kv_manager import EVICTED, KVCacheManager
from entropic.engine.model_runner import ModelOutput, ModelRunner, verify_rows
from entropic.engine.policy import SchedulingPolicy
from entropic.engine.prefix_snapshot import PrefixSnapshot, export_prefix, import_prefix
from entropic.engine.request import Request, RequestStatus
from entropic.engine.scheduler import DraftPolicy, ScheduledChunk, Scheduler, SchedulerOutput
from entropic.kernels.backend import TORCH
from entropic.model.llama import LlamaModel
from entropic.outputs import Cost, EntropicReading, RequestOutput
from entropic.sampling.sampler import LogitsProcessor, Sampler
from entropic.sampling_params import SamplingParams

log = logging.getLogger("entropic.engine")

# bytes per weight of the quantized formats (codes and their scales), for the cost model
WEIGHT_BYTES = {"int4": 0.625, "int8": 1.0}


def budget_work(c: ScheduledChunk, block_size: int) -> ChunkWork:
    """A decode under query-aware selection: it reads one bound row (the bytes of one KV
    position, and about one position's attention FLOPs to score it) per candidate block
    outside the protected ones, and attends the positions of `blocks` blocks, the last of
    them partial."""
    b = c.attend_budget
    live = (c.start_pos // block_size + 1 if c.attend_blocks is None
            else len(c.attend_blocks))
    if b.blocks >= live:
        n = (c.start_pos + 1 if c.attend_blocks is None
             else decode_context_length(c.attend_blocks, c.start_pos, block_size))
        return ChunkWork(c.request_id, 1, c.sample, n, n)
    scored = max(0, live - min(b.sink, live) - b.recent)
    n = (b.blocks - 1) * block_size + c.start_pos % block_size + 1
    return ChunkWork(c.request_id, 1, c.sample, n + scored, n + scored)


class TokenObserver(Protocol):
    """Hook: sees each sampled token's entropy, reports per-request readings.

    The entropic clock (entropic.control.clock.EntropicClock) is one."""

    tau_total: float

    def observe(self, request_id: str, entropy: float) -> float: ...

    def reading(self, request_id: str, cost: Cost) -> EntropicReading | None: ...

    def release(self, request_ids: Sequence[str]) -> None: ...


@dataclass
class EngineStats:
    """Counters since the engine started."""

    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    computed_tokens: int = 0
    preemptions: int = 0  # pauses (KV kept resident) and recomputes (KV dropped)
    pauses: int = 0
    recomputes: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0  # requests the engine failed alone (finish_reason "error")
    cost: Cost = field(default_factory=Cost)
    tau: float = 0.0  # engine-wide entropic time, when a clock observes the engine
    # decode steps under a block policy: blocks they could attend (live) and did attend
    decode_blocks_live: int = 0
    decode_blocks_attended: int = 0
    # block-sparse prefill chunks: (query position, key) pairs per layer and KV head,
    # dense and attended
    prefill_pairs_dense: int = 0
    prefill_pairs_attended: int = 0
    blocks_evicted: int = 0
    # blocks given back because they lay before every layer's sliding window
    blocks_freed_outside_window: int = 0
    # prefix cache, in tokens: of the tokens of admitted requests looked up (queries),
    # those found computed already (hits); vLLM counts the same
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # how the model was loaded: its dtype, the native kernels' ISA level (None on torch's
    # ops), both from the model; why that dtype, set by the LLM that chose it; the
    # weight quantization (None: floats) and why, likewise
    dtype: str = ""
    dtype_reason: str = ""
    isa: str | None = None
    quantization: str | None = None
    quantization_reason: str = ""

    @property
    def pruned_fraction(self) -> float:
        """Share of the live KV blocks that decode steps skipped."""
        live = self.decode_blocks_live
        return 1.0 - self.decode_blocks_attended / live if live else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0

    @property
    def tau_per_tflop(self) -> float:
        return self.tau / (self.cost.flops / 1e12) if self.cost.flops else 0.0

    @property
    def tau_per_second(self) -> float:
        return self.tau / self.cost.seconds if self.cost.seconds else 0.0


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Hooks (all default to a plain engine): `policy` orders queues and picks preemption
    victims; `processors` are sampler-chain elements; `observer` sees every token's entropy;
    `block_policy` chooses the KV blocks each decode attends and may evict blocks;
    `speculator` (entropic.speculative.Speculator) drafts tokens that decode steps verify.
    """

    def __init__(self, model: LlamaModel, tokenizer, config: EngineConfig,
                 policy: SchedulingPolicy | None = None,
                 processors: Sequence[LogitsProcessor] = (),
                 observer: TokenObserver | None = None,
                 block_policy: KVBlockPolicy | None = None,
                 speculator: DraftPolicy | None = None) -> None:
        self.model = model
        self.model_config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.config = config
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_position, mc.max_position)
        self.num_blocks = config.resolve_num_blocks(mc, model.dtype)
        self.pool = BlockPool(self.num_blocks)
        # what besides the tokens decides a block's KV: one engine has one model and dtype
        # (and no LoRA); named anyway, so that hashes never mean two things
        backend = getattr(model, "backend", TORCH)  # a test's stand-in model: torch's
        salt = f"{mc!r}|{dtype_name(model.dtype)}|{backend.name}"
        self.kv = KVCacheManager(self.pool, config.block_size, config.enable_prefix_caching,
                                 salt)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, mc.eos_token_ids, policy, block_policy,
                                   speculator,
                                   mc.attention_horizon if config.free_outside_window else None)
        self.block_policy = block_policy
        self.speculator = speculator
        self.runner = ModelRunner(
            model, self.num_blocks, config.block_size,
            Sampler(processors, native=backend.native),
            key_bounds=block_policy is not None and block_policy.wants_key_bounds)
        self.stats = EngineStats(dtype=dtype_name(model.dtype), isa=getattr(model, "isa", None))
        self.observer = observer
        self.cost_model = CostModel(mc, torch.empty((), dtype=model.dtype).element_size(),
                                    WEIGHT_BYTES.get(getattr(model, "quantization", None)))
        if block_policy is not None:
            block_policy.bind(self.cost_model)
        if hasattr(policy, "bind"):  # a policy that prices requests, on this engine's terms
            policy.bind(self.cost_model, self.num_blocks, config.block_size,
                        config.max_num_seqs, config.max_num_batched_tokens)
        self._detok: dict[str, IncrementalDetokenizer] = {}

    # ---- requests ---------------------------------------------------------------------
    def validate(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        """Check a request before it enters the engine; return its prompt token ids."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise ValueError(f"prompt: token id {t!r} is not an integer in [0, {vocab})")
        else:
            raise TypeError(f"prompt must be a string or a list of token ids, "
                            f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt: must not be empty (no tokens)")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens does not fit the context length "
                             f"{self.max_model_len} (at least one token must be generated)")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{len(ids) + params.max_tokens} exceeds the context length {self.max_model_len}")
        need = self.kv.blocks_needed(len(ids) + params.max_tokens)
        if need > self.num_blocks:
            raise ValueError(
                f"max_tokens: the request may need {need} KV blocks but the whole cache has "
                f"{self.num_blocks}; lower max_tokens or raise num_kv_blocks / kv_cache_gib")
        return ids

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        ids = self.validate(prompt, params)
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        now = time.perf_counter() if arrival_time is None else arrival_time
        req = Request(request_id, ids, params, now, prompt if isinstance(prompt, str) else None)
        self.scheduler.add(req)
        self._detok[request_id] = IncrementalDetokenizer(
            self.tokenizer, ids, params.skip_special_tokens, params.stop,
            params.include_stop_str_in_output)
        self.stats.prompt_tokens += len(ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort at any time; the request's blocks return to the pool."""
        req = self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
        if req is None:
            return None
        self.stats.aborted += 1
        req.metrics.finished_time = time.perf_counter()
        det = self._detok.pop(request_id)
        out = self._output(req, det.text, [], "")
        self._release([request_id])
        return out

    # ---- the prefix cache between engines ------------------------------------------------
    def export_prefix(self, token_ids: Sequence[int]) -> PrefixSnapshot:
        """A copy of the cached full blocks that begin `token_ids` (keys, KV, the surprisal
        of their positions where known), for `import_prefix` on an engine of the same
        model, dtype, kernels and block size (docs/prefix_caching.md)."""
        return export_prefix(self, token_ids)

    def import_prefix(self, snapshot: PrefixSnapshot) -> int:
        """Publish a snapshot's blocks in this engine's prefix cache (as cached free
        blocks), so that a request added next with that prefix starts on them. Returns the
        blocks written; raises, changing nothing, on a mismatch or too few free blocks.
        Call it between steps."""
        return import_prefix(self, snapshot)

    def _release(self, request_ids: list[str]) -> None:
        """The one release path of finished requests: every hook forgets them."""
        self.runner.sampler.release(request_ids)
        if self.observer is not None:
            self.observer.release(request_ids)
        if self.block_policy is not None:
            self.block_policy.release(request_ids)
        if self.speculator is not None:
            self.speculator.release(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for every request that got a token.

        A request whose own work raises (its chunk in the model runner or sampler, its
        block observation, its detokenization) finishes with finish_reason "error" and
        its blocks freed; the other requests of the step go on. An exception in the
        scheduler itself is an engine bug and propagates."""
        began = time.perf_counter()
        sched: SchedulerOutput = self.scheduler.schedule()
        if sched.is_empty:
            return []
        now = time.perf_counter()
        for c in sched.chunks:
            m = self.scheduler.requests[c.request_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        result, failed = self._execute(sched)
        outputs = [self._fail(rid, e) for rid, e in failed.items()]
        if failed:
            sched.chunks = [c for c in sched.chunks if c.request_id not in failed]
        done = time.perf_counter()
        self._account(sched, done - now, result.prefill_pairs)
        pure_decode = all(c.is_decode or c.draft for c in sched.chunks)
        touched = self.scheduler.update(sched, result.sampled, done, result.prompt_scores,
                                        result.accepted)
        if self.block_policy is not None:
            outputs += self._observe_blocks(sched, result)
        self.stats.steps += 1
        self.stats.computed_tokens += result.num_tokens
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.pauses = self.scheduler.num_pauses
        self.stats.recomputes = self.scheduler.num_recomputes
        self.stats.prefix_cache_queries = self.scheduler.num_cache_queries
        self.stats.prefix_cache_hits = self.scheduler.num_cache_hits
        for req in touched:
            if req.request_id not in self._detok:
                continue  # failed above, after update handed it a token
            try:
                outputs.append(self._emit(req, done))
            except Exception as e:
                outputs.append(self._fail(req.request_id, e, req))
        if self.observer is not None:
            self.stats.tau = self.observer.tau_total
        if self.speculator is not None and pure_decode:
            # the whole step, drafting and emitting included: what one more drafted row
            # really costs, and what the step's tokens really took
            self.speculator.observe_step(
                result.num_tokens, time.perf_counter() - began,
                any(not (c.params.greedy and c.params.thermostat is None) for c in sched.chunks))
        return outputs

    def _execute(self, sched: SchedulerOutput) -> tuple[ModelOutput, dict[str, Exception]]:
        """Run the step's chunks. If the batch raises, run each chunk alone, so that only
        the requests whose own chunk raises are lost. Re-running a chunk rewrites the same
        KV slots with the same values; scheduler state is untouched until update()."""
        try:
            return self.runner.execute(sched), {}
        except Exception as batch_error:
            if len(sched.chunks) == 1:
                return ModelOutput({}, 0), {sched.chunks[0].request_id: batch_error}
            log.warning("step %d failed with %s; running its %d requests one by one",
                        sched.step, type(batch_error).__name__, len(sched.chunks))
        merged, failed = ModelOutput({}, 0), {}
        for c in sched.chunks:
            try:
                r = self.runner.execute(SchedulerOutput(step=sched.step, chunks=[c]))
            except Exception as e:
                failed[c.request_id] = e
                continue
            merged.sampled.update(r.sampled)
            merged.num_tokens += r.num_tokens
            merged.prompt_scores.update(r.prompt_scores)
            merged.block_mass.update(r.block_mass)
            merged.accepted.update(r.accepted)
            merged.prefill_pairs.update(r.prefill_pairs)
        return merged, failed

    def _emit(self, req: Request, done: float) -> RequestOutput:
        """Observe, detokenize and apply stop strings to the tokens `req` just got, one at
        a time: a stop string in a verify's committed run ends the request there, and the
        tokens after it are taken back."""
        n = req.num_new_tokens
        det = self._detok[req.request_id]
        deltas = []
        for j in range(req.num_tokens - n, req.num_tokens):
            self.stats.generated_tokens += 1
            if self.observer is not None:
                self.observer.observe(req.request_id, req.entropies[j - req.num_prompt_tokens])
            delta, stop_str = det.add(req.token_ids[j:j + 1])
            deltas.append(delta)
            if stop_str is not None and not req.status.finished:
                req.stop_reason = stop_str
                self._take_back(req, req.num_tokens - j - 1)
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
                break
        new = req.token_ids[req.num_tokens - len(deltas):]
        delta = "".join(deltas)
        if req.status.finished:
            req.metrics.finished_time = done
            self.stats.finished += 1
            del self._detok[req.request_id]
        out = self._output(req, det.text, new, delta)
        if req.status.finished:
            self._release([req.request_id])
        return out

    @staticmethod
    def _take_back(req: Request, n: int) -> None:
        """Drop the last n committed tokens (they came after a stop string)."""
        if n <= 0:
            return
        del req.token_ids[-n:], req.entropies[-n:], req.temperatures[-n:]
        del req.tempered_entropies[-n:]
        del req.metrics.token_times[-n:]
        if req.logprobs is not None:
            del req.logprobs[-n:]
        req.num_new_tokens -= n

    def _fail(self, request_id: str, error: Exception, req: Request | None = None
              ) -> RequestOutput:
        """Finish one request with finish_reason "error" (blocks freed, state released)."""
        log.error("request %s failed: %s: %s", request_id, type(error).__name__, error,
                  exc_info=error)
        req = self.scheduler.finish(request_id, RequestStatus.FINISHED_ERROR) or req
        req.status = RequestStatus.FINISHED_ERROR
        req.error = f"{type(error).__name__}: {error}"
        req.metrics.finished_time = time.perf_counter()
        self.stats.failed += 1
        det = self._detok.pop(request_id, None)
        text = det.text if det is not None else ""
        try:
            out = self._output(req, text, [], "")
        except Exception:  # e.g. the observer's reading is what failed: report without it
            out = RequestOutput(request_id, req.prompt, req.prompt_token_ids, text,
                                req.output_token_ids, finish_reason=req.status.value,
                                finished=True, metrics=req.metrics, error=req.error)
        try:
            self._release([request_id])
        except Exception:
            log.exception("releasing the hooks' state of failed request %s", request_id)
        return out

    def _observe_blocks(self, sched: SchedulerOutput, result: ModelOutput
                        ) -> list[RequestOutput]:
        """Feed the block policy each chunk's token surprisals and attention mass; fail the
        requests whose observation raises (their outputs are returned)."""
        failed = []
        for c in sched.chunks:
            req = self.scheduler.requests.get(c.request_id)
            if req is None:
                continue  # finished or aborted: the policy has released it
            try:
                self._observe_chunk(c, req, result)
            except Exception as e:
                failed.append(self._fail(c.request_id, e, req))
        self.stats.blocks_evicted = self.scheduler.num_evicted_blocks
        self.stats.blocks_freed_outside_window = self.scheduler.num_window_freed_blocks
        return failed

    def _observe_chunk(self, c: ScheduledChunk, req: Request, result: ModelOutput) -> None:
        """One chunk's surprisals (prompt scores, sampled token) and attention mass."""
        positions, surprisal = [], []
        if c.cached_surprisal:  # positions a prefix-cache hit spared computing
            positions += range(1, 1 + len(c.cached_surprisal))
            surprisal += c.cached_surprisal
        ps = result.prompt_scores.get(c.request_id)
        if ps is not None:
            positions += range(c.start_pos + 1, c.start_pos + 1 + len(ps.logprobs))
            surprisal += [-lp for lp in ps.logprobs]
        if c.draft:  # the committed tokens only, at the positions after the verified one
            committed = [*result.accepted.get(c.request_id, []),
                         result.sampled[c.request_id]][:req.num_new_tokens]
            positions += range(c.start_pos + 1, c.start_pos + 1 + len(committed))
            surprisal += [-st.logprob for st in committed]
            self.block_policy.observe(req, positions, surprisal, None, None)
            return
        st = result.sampled.get(c.request_id)
        if st is not None and st.logprob is not None:
            positions.append(c.start_pos + c.num_tokens)
            surprisal.append(-st.logprob)
        mass = result.block_mass.get(c.request_id)
        attended = None
        if mass is not None:
            attended = (c.attend_blocks if c.attend_blocks is not None
                        else list(range(len(mass))))
        self.block_policy.observe(req, positions, surprisal, attended, mass)

    def _work(self, c: ScheduledChunk, prefill_pairs: int | None = None) -> ChunkWork:
        """What a chunk computed: dense causal attention, a decode over chosen blocks, or a
        block-sparse prefill chunk's `prefill_pairs`."""
        bs = self.config.block_size
        if c.prefill_sparsity is not None and prefill_pairs is not None:
            dense = dense_work(c.request_id, c.start_pos, c.num_tokens, c.sample,
                               len(c.score_targets or ()))
            self.stats.prefill_pairs_dense += dense.attended_pairs
            self.stats.prefill_pairs_attended += prefill_pairs
            return replace(dense, attended_pairs=prefill_pairs)
        if self.block_policy is not None and c.is_decode:
            num = c.start_pos // bs + 1
            self.stats.decode_blocks_live += sum(b != EVICTED for b in c.block_table[:num])
            live = num if c.attend_blocks is None else len(c.attend_blocks)
            self.stats.decode_blocks_attended += (live if c.attend_budget is None
                                                  else min(live, c.attend_budget.blocks))
        if c.draft:  # every verify row ran the lm_head; rows past the first are "scored"
            if c.attend_budget is not None:
                rows = [budget_work(r, bs) for r in verify_rows(c, bs)]
                return ChunkWork(c.request_id, c.num_tokens, True,
                                 sum(w.attended_pairs for w in rows),
                                 rows[-1].kv_positions_read, len(c.draft))
            if c.attend_blocks is None:
                return dense_work(c.request_id, c.start_pos, c.num_tokens, True, len(c.draft))
            ctx = [decode_context_length(r.attend_blocks, r.start_pos, bs)
                   for r in verify_rows(c, bs)]
            return ChunkWork(c.request_id, c.num_tokens, True, sum(ctx), ctx[-1],
                             len(c.draft))
        if c.attend_budget is not None:
            return budget_work(c, bs)
        if c.attend_blocks is None:
            return dense_work(c.request_id, c.start_pos, c.num_tokens, c.sample,
                              len(c.score_targets or ()))
        n = decode_context_length(c.attend_blocks, c.start_pos, bs)
        return ChunkWork(c.request_id, 1, c.sample, n, n)

    def _account(self, sched: SchedulerOutput, seconds: float,
                 prefill_pairs: dict[str, int]) -> None:
        """Charge each request the cost of what it computed this step: the positions its
        attention actually read (fewer when a decode attends chosen blocks only, or a
        block-sparse prefill chunk skipped some: `prefill_pairs`, from the runner)."""
        work = [self._work(c, prefill_pairs.get(c.request_id)) for c in sched.chunks]
        for rid, cost in self.cost_model.step_costs(work, seconds).items():
            self.scheduler.requests[rid].cost.add(cost)
            self.stats.cost.add(cost)

    def _output(self, req: Request, text: str, new: list[int],
                delta: str) -> RequestOutput:
        finished = req.status.finished
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            text=text,
            token_ids=req.output_token_ids,
            entropies=list(req.entropies),
            temperatures=list(req.temperatures),
            tempered_entropies=list(req.tempered_entropies),
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            prompt_logprobs=(list(req.prompt_logprobs) if req.prompt_logprobs is not None
                             and len(req.prompt_logprobs) == req.num_prompt_tokens else None),
            finish_reason=req.status.value if finished else None,
            stop_reason=req.stop_reason,
            finished=finished,
            text_delta=delta,
            new_token_ids=list(new),
            metrics=req.metrics,
            cost=replace(req.cost),
            entropic=(self.observer.reading(req.request_id, req.cost)
                      if self.observer is not None else None),
            error=req.error,
            speculation=(replace(r) if self.speculator is not None
                         and (r := self.speculator.reading(req.request_id)) is not None
                         else None),
        )

    @torch.inference_mode()
    def run_until_done(self) -> list[RequestOutput]:
        """Step until no request is left; return the final output of each."""
        finals = []
        while self.has_unfinished_requests():
            finals.extend(o for o in self.step() if o.finished)
        return finals
