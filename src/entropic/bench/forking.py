"""Benchmark helpers: decode the same prefilled prompt under several engines.

Prefill is dense in every KV-block pruning configuration, and an 8k-token prefill takes
~45 s on this CPU, so the pruning benchmark prefills each prompt once and copies its KV
blocks into a fresh engine per configuration (`PrefilledPrompt.start_in`). Only the decode
steps then differ between configurations, which is what the benchmark measures.

`TeacherForcer` is a sampler-chain element that forces given continuation tokens and keeps
the model's log-distribution at each step (for perplexity and KL against dense).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from entropic.engine.engine import LLMEngine
from entropic.engine.request import RequestStatus
from entropic.engine.scheduler import SampledToken
from entropic.sampling.sampler import SamplingBatch
from entropic.sampling_params import SamplingParams


class TeacherForcer:
    """Forces request `rid`'s k-th output token to targets[rid][k]; records log p_k."""

    def __init__(self, keep_distributions: bool = False) -> None:
        self.targets: dict[str, list[int]] = {}
        self.keep = keep_distributions
        self.logps: dict[str, list[torch.Tensor]] = {}

    def apply(self, logits: torch.Tensor, temperatures: torch.Tensor,
              batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        forced = False
        for i, rid in enumerate(batch.request_ids):
            tgt = self.targets.get(rid)
            if tgt is None:
                continue
            if not forced:  # the sampler's logits are not ours to overwrite
                logits, forced = logits.clone(), True
            k = batch.num_output_tokens[i]
            if self.keep:
                self.logps.setdefault(rid, []).append(
                    torch.log_softmax(logits[i].float(), -1).clone())
            logits[i] = float("-inf")
            logits[i, tgt[k]] = 0.0
        return logits, temperatures

    def accept(self, token_ids: torch.Tensor, batch: SamplingBatch) -> None:
        pass

    def release(self, request_ids: Sequence[str]) -> None:
        pass


@dataclass
class PrefilledPrompt:
    """A prompt's KV after a dense prefill, and the first token sampled from it."""

    prompt: list[int]
    kv: torch.Tensor  # [layers, len(prompt), 2, kv_heads, head_dim]
    first: SampledToken
    prompt_surprisal: list[float] = field(default_factory=list)  # positions 1..len-1

    @classmethod
    def run(cls, engine: LLMEngine, prompt: list[int], params: SamplingParams,
            rid: str = "prefill") -> "PrefilledPrompt":
        """Prefill `prompt` on `engine` (dense), keep its KV, abort the request."""
        engine.add_request(rid, prompt, params)
        req = engine.scheduler.requests[rid]
        while req.num_output_tokens == 0:
            engine.step()
        slots = _slots(engine.kv.block_table(rid), len(prompt), engine.config.block_size)
        kv = engine.runner.kv.kv[:, slots].clone()
        lp = req.logprobs[0].logprob if req.logprobs else -float("nan")
        first = SampledToken(req.token_ids[-1], req.entropies[0], req.temperatures[0], lp,
                             tempered_entropy=req.tempered_entropies[0])
        surprisal = ([-e.logprob for e in req.prompt_logprobs[1:]]
                     if req.prompt_logprobs else [])
        engine.abort_request(rid)
        return cls(list(prompt), kv, first, surprisal)

    def start_in(self, engine: LLMEngine, rid: str, params: SamplingParams) -> None:
        """Add the request to `engine` as if it had just been prefilled there."""
        sched = engine.scheduler
        engine.add_request(rid, self.prompt, params)
        req = sched.requests[rid]
        if not engine.kv.allocate(rid, len(self.prompt)):
            raise RuntimeError(f"{rid}: not enough KV blocks for a {len(self.prompt)}-token prompt")
        slots = _slots(engine.kv.block_table(rid), len(self.prompt), engine.config.block_size)
        engine.runner.kv.kv[:, slots] = self.kv
        bs = engine.config.block_size  # the full blocks' key bounds, where the cache keeps them
        engine.runner.kv.update_key_bounds(engine.kv.block_table(rid)[:len(self.prompt) // bs])
        sched.waiting.remove(req)
        sched.running.append(req)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = len(self.prompt)
        now = time.perf_counter()
        req.metrics.first_scheduled_time = now
        sched._append(req, self.first, now)
        if engine.observer is not None:
            engine.observer.observe(rid, self.first.entropy)
        if engine.block_policy is not None:
            n = len(self.prompt)
            engine.block_policy.observe(req, range(1, n), self.prompt_surprisal, None, None)
            engine.block_policy.observe(req, [n], [-self.first.logprob], None, None)


def _slots(table: list[int], n: int, block_size: int) -> torch.Tensor:
    return torch.tensor([table[p // block_size] * block_size + p % block_size
                         for p in range(n)], dtype=torch.long)
