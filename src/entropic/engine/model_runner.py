"""Model runner: turns a SchedulerOutput into tensors, runs the model, samples.

The runner never touches queues; the scheduler never touches tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from entropic.engine.scheduler import SampledToken, SchedulerOutput, ScheduledChunk
from entropic.model.attention import AttentionMetadata, KVCache, PrefillChunk
from entropic.model.llama import LlamaModel
from entropic.sampling.sampler import Sampler, SamplingBatch


@dataclass
class ModelOutput:
    """Per sampled request: token, entropy, logprobs. `logits` kept only on request."""

    sampled: dict[str, SampledToken]
    num_tokens: int
    logits: torch.Tensor | None = None  # [S, V] fp32, rows in the order of sampled requests


class ModelRunner:
    """Owns the model weights, the KV cache tensors and the sampler."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int,
                 sampler: Sampler | None = None) -> None:
        self.model = model
        self.block_size = block_size
        self.kv: KVCache = model.make_kv_cache(num_blocks, block_size)
        self.sampler = sampler or Sampler()
        self.device = model.device
        self.keep_logits = False  # tests read raw logits through this switch

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(self, out: SchedulerOutput) -> tuple[list[ScheduledChunk], torch.Tensor,
                                                        torch.Tensor, AttentionMetadata,
                                                        torch.Tensor]:
        """Order rows (decodes first), build input ids, positions and attention metadata."""
        decodes = [c for c in out.chunks if c.num_tokens == 1 and c.start_pos > 0]
        prefills = [c for c in out.chunks if not (c.num_tokens == 1 and c.start_pos > 0)]
        chunks = decodes + prefills
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for c in chunks:
            ids.extend(c.token_ids)
            pos.extend(range(c.start_pos, c.start_pos + c.num_tokens))
            slots.extend(self._slots(c.block_table, c.start_pos, c.start_pos + c.num_tokens))
        dev = self.device
        decode_slots = decode_mask = None
        if decodes:
            ctx = [c.start_pos + 1 for c in decodes]
            max_ctx = max(ctx)
            rows = [self._slots(c.block_table, 0, n) + [0] * (max_ctx - n)
                    for c, n in zip(decodes, ctx)]
            decode_slots = torch.tensor(rows, dtype=torch.long, device=dev)
            lens = torch.tensor(ctx, device=dev)
            decode_mask = (torch.arange(max_ctx, device=dev)[None, :] < lens[:, None])
            decode_mask = decode_mask[:, None, None, :]
        pre: list[PrefillChunk] = []
        offset = len(decodes)
        for c in prefills:
            ctx_slots = None
            if c.start_pos > 0:
                ctx_slots = torch.tensor(self._slots(c.block_table, 0, c.start_pos + c.num_tokens),
                                         dtype=torch.long, device=dev)
            pre.append(PrefillChunk(offset, c.num_tokens, c.start_pos, ctx_slots))
            offset += c.num_tokens
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decode=len(decodes), decode_slots=decode_slots, decode_mask=decode_mask,
            prefills=pre,
        )
        # logits only for rows that sample: the last token of their chunk
        ends, idx = [], 0
        for c in chunks:
            idx += c.num_tokens
            if c.sample:
                ends.append(idx - 1)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        logits_idx = torch.tensor(ends, dtype=torch.long, device=dev)
        return chunks, input_ids, positions, meta, logits_idx

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        self.sampler.release(out.finished_ids)
        if out.is_empty:
            return ModelOutput({}, 0)
        chunks, input_ids, positions, meta, logits_idx = self.prepare(out)
        logits = self.model.forward(input_ids, positions, meta, self.kv, logits_idx)
        samplers = [c for c in chunks if c.sample]
        sampled: dict[str, SampledToken] = {}
        if samplers:
            batch = SamplingBatch([c.request_id for c in samplers], [c.params for c in samplers],
                                  [c.num_output_tokens for c in samplers])
            s = self.sampler(logits, batch)
            toks = s.token_ids.tolist()
            ents = s.entropies.tolist()
            temps = s.temperatures.tolist()
            lps = s.logprobs.tolist() if s.logprobs is not None else None
            tids = s.top_ids.tolist() if s.top_ids is not None else None
            tlps = s.top_logprobs.tolist() if s.top_logprobs is not None else None
            for i, c in enumerate(samplers):
                st = SampledToken(toks[i], ents[i], temps[i])
                n = c.params.logprobs
                if n is not None:
                    st.logprob = lps[i]
                    st.top_logprobs = dict(zip(tids[i][:n], tlps[i][:n])) if n else {}
                sampled[c.request_id] = st
        return ModelOutput(sampled, int(input_ids.shape[0]),
                           logits if self.keep_logits else None)
