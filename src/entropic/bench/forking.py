"""Benchmark helpers: decode the same prefilled prompt under several engines.

Prefill is dense in every KV-block pruning configuration, and an 8k-token prefill takes
~45 s on this CPU, so the pruning benchmark prefills each prompt once and moves its KV
blocks into a fresh engine per configuration through the prefix cache
(`LLMEngine.export_prefix` / `import_prefix`, `PrefilledPrompt.start_in`). Each engine then
computes only the prompt's tail (at least its last token, whose logits give the first
token; dense in every configuration) and decodes: the decode steps are what differ between
configurations, which is what the benchmark measures.

`TeacherForcer` is a sampler-chain element that forces given continuation tokens and keeps
the model's log-distribution at each step (for perplexity and KL against dense).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from entropic.engine.engine import LLMEngine
from entropic.engine.prefix_snapshot import PrefixSnapshot
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
    """A prompt's KV after a dense prefill, as a prefix-cache snapshot
    (`LLMEngine.export_prefix`): its full blocks, with the surprisal of their positions
    when the prefill scored the prompt (`prompt_logprobs`)."""

    prompt: list[int]
    snapshot: PrefixSnapshot

    @classmethod
    def run(cls, engine: LLMEngine, prompt: list[int], params: SamplingParams,
            rid: str = "prefill") -> "PrefilledPrompt":
        """Prefill `prompt` on `engine` (dense, prefix caching on), export its cached
        blocks, abort the request. Give `params` prompt_logprobs for the blocks to carry
        prompt surprisal: without it a surprisal-ranking engine cannot start on them and
        computes the whole prompt."""
        if not engine.config.enable_prefix_caching:
            raise ValueError("PrefilledPrompt needs an engine with prefix caching on")
        engine.add_request(rid, prompt, params)
        out = None
        while out is None and engine.has_unfinished_requests():
            out = next((o for o in engine.step() if o.request_id == rid), None)
        if out is None or out.error:
            raise RuntimeError(f"prefill of {rid!r} failed: {out and out.error}")
        snapshot = engine.export_prefix(prompt)
        engine.abort_request(rid)
        return cls(list(prompt), snapshot)

    @property
    def num_cached_blocks(self) -> int:
        """The prompt's blocks a request starts on in every engine: those a request whose
        block policy ranks blocks by prompt surprisal can use (one short of the scored
        blocks: the next one's first score is needed; docs/prefix_caching.md), which is
        fewer than a plain request could (its last token, whose logits give the first
        token, always computed)."""
        bs = self.snapshot.block_size
        return max(0, min(self.snapshot.num_blocks - 1, (len(self.prompt) - 1) // bs))

    def start_in(self, engine: LLMEngine, rid: str, params: SamplingParams) -> None:
        """Add the request to `engine` on the prefilled blocks: they are imported into its
        prefix cache, and the request's admission finds `num_cached_blocks` of them, in
        every configuration: each then computes the same tail of the prompt (densely, as
        any prefill) and samples the first token from the same numbers (in an engine that
        has not cached more of this prompt already). A surprisal-ranking engine gets the
        block after them too, for its first score."""
        policy = engine.block_policy
        scored = policy is not None and policy.wants_prompt_surprisal
        n = self.num_cached_blocks
        engine.import_prefix(self.snapshot.head(n + 1 if scored else n))
        engine.add_request(rid, self.prompt, params)
