"""Drafts from a smaller model with the same tokenizer (`method="draft_model"`).

The draft model keeps its own paged KV cache. For each request it remembers which tokens
its cache holds; a draft first brings the cache up to the target's committed tokens (only
the positions after their common prefix are computed again), then decodes greedily. The
draft model's own distributions are never used for acceptance: the target samples, and a
drafted token is kept while it matches (the point-mass rule), so outputs do not depend on
the drafter at all.
"""
from __future__ import annotations

import torch

from entropic.engine.block_pool import BlockPool
from entropic.engine.kv_manager import KVCacheManager
from entropic.engine.model_runner import ModelRunner
from entropic.engine.scheduler import ScheduledChunk, SchedulerOutput
from entropic.sampling.sampler import Sampler
from entropic.sampling_params import SamplingParams
from entropic.speculative.config import SpeculativeConfig
from entropic.speculative.ngram import NgramProposer

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
_PROBE = "Speculative drafts need the same tokenizer: <|im_start|>user\nhello, world 123"


class DraftModelProposer:
    """Greedy drafts of a draft model over its own KV cache."""

    def __init__(self, model, num_blocks: int, block_size: int = 16) -> None:
        self.runner = ModelRunner(model, num_blocks, block_size, Sampler(
            native=model.backend.native))
        self.kv = KVCacheManager(BlockPool(num_blocks), block_size)
        self.max_len = model.config.max_position
        self._cached: dict[str, list[int]] = {}  # tokens whose KV the draft cache holds
        self._step = 0

    def propose(self, request_id: str, tokens: list[int], k: int) -> tuple[list[int], int]:
        held = self._cached.get(request_id, [])
        common = 0
        for a, b in zip(held, tokens):
            if a != b:
                break
            common += 1
        common = min(common, len(tokens) - 1)  # the last token is always fed: it samples
        k = min(k, self.max_len - len(tokens))
        if k <= 0 or not self.kv.allocate(request_id, len(tokens) + k - 1):
            self.release(request_id)  # no room in the draft cache: no draft this time
            return [], 0
        draft: list[int] = []
        feed, start = tokens[common:], common
        with torch.inference_mode():
            while len(draft) < k:
                self._step += 1
                chunk = ScheduledChunk(request_id, feed, start,
                                       list(self.kv.block_table(request_id)), True, _GREEDY, 0)
                out = self.runner.execute(SchedulerOutput(self._step, [chunk]))
                start += len(feed)
                feed = [out.sampled[request_id].token_id]
                draft.append(feed[0])
        # the cache holds every token fed: the committed ones, then all drafts but the last
        self._cached[request_id] = tokens + draft[:-1]
        return draft, 0

    def release(self, request_id: str) -> None:
        self._cached.pop(request_id, None)
        self.kv.free(request_id)


def make_proposer(config: SpeculativeConfig, tokenizer, device: str = "cpu"):
    """The drafter `config` asks for: prompt lookup, or a draft model loaded from a local
    checkpoint and checked to tokenize like the target."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    from entropic.config import EngineConfig, choose_dtype
    from entropic.model.llama import LlamaModel
    from entropic.model.loader import load_checkpoint

    ckpt = load_checkpoint(config.model, keep_int4=config.draft_quantization == "int4")
    if ckpt.tokenizer.encode(_PROBE) != tokenizer.encode(_PROBE):
        raise ValueError(f"speculative model {config.model!r}: its tokenizer does not match "
                         f"the target model's (a draft must use the same token ids)")
    dtype, _ = choose_dtype(config.draft_dtype, device, config.draft_quantization)
    net = LlamaModel(ckpt.config, ckpt.tensors, dtype, device,
                     quantization=config.draft_quantization)
    del ckpt.tensors
    blocks = EngineConfig(kv_cache_gib=0.25).resolve_num_blocks(net.config, dtype)
    return DraftModelProposer(net, blocks)
