"""Model runner: turns a SchedulerOutput into tensors, runs the model, samples.

The runner never touches queues; the scheduler never touches tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from entropic.engine.block_policy import decode_context_length
from entropic.engine.block_pool import cdiv
from entropic.engine.cost import dense_work
from entropic.engine.scheduler import (PromptScores, SampledToken, SchedulerOutput,
                                       ScheduledChunk)
from entropic.kernels.backend import TORCH
from entropic.model.attention import (AttentionMetadata, DecodeGroup, KVCache, PrefillChunk,
                                      QueryAwareSelection)
from entropic.model.llama import LlamaModel
from entropic.sampling.sampler import Sampler, SamplingBatch, score_tokens


# Fixed cost of one more decode group, in padded context positions: the group's extra
# gather and SDPA calls per layer cost about what attending ~160 more positions does.
DECODE_GROUP_OVERHEAD = 160


def verify_rows(c: ScheduledChunk, block_size: int) -> list[ScheduledChunk]:
    """A verify chunk as the decode rows it is made of: row j is the token at position
    start_pos + j against its context up to there, sampled as output token
    num_output_tokens + j. Each row is computed exactly as a lone decode at that position
    would be (the same kernels, the same numbers), so that the tokens it samples are the
    ones decoding without a draft would have sampled. Under a block policy every row
    attends the blocks chosen for the first one plus the blocks its own drafted positions
    reach."""
    rows = []
    for j, t in enumerate(c.token_ids):
        pos = c.start_pos + j
        attend = c.attend_blocks
        new_blocks = pos // block_size - c.start_pos // block_size
        if attend is not None:
            attend = attend + list(range(attend[-1] + 1, pos // block_size + 1))
        budget = c.attend_budget
        if budget is not None:  # the blocks its drafted positions reach come on top
            budget = replace(budget, blocks=budget.blocks + new_blocks)
        rows.append(replace(c, token_ids=[t], start_pos=pos, sample=True,
                            num_output_tokens=c.num_output_tokens + j, score_targets=None,
                            attend_blocks=attend, collect_attention=False, draft=[],
                            attend_budget=budget))
    return rows


def split_by_length(lengths: list[int], overhead: int) -> list[tuple[int, int]]:
    """Split ascending `lengths` into runs [start, end) that minimise the padded work
    sum(run size * run's longest) + overhead * number of runs (dynamic programming)."""
    n = len(lengths)
    best = [0] + [float("inf")] * n  # best[j]: cost of the first j lengths
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[j - 1]
        for i in range(j):
            cost = best[i] + (j - i) * longest + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    runs = []
    while n:
        runs.append((cut[n], n))
        n = cut[n]
    return runs[::-1]


@dataclass
class ModelOutput:
    """Per sampled request: token, entropy, logprobs. `logits` kept only on request."""

    sampled: dict[str, SampledToken]
    num_tokens: int
    logits: torch.Tensor | None = None  # [S, V] fp32, rows in the order of sampled requests
    prompt_scores: dict[str, PromptScores] = field(default_factory=dict)
    block_mass: dict[str, list[float]] = field(default_factory=dict)  # per attended block
    # per verify: the drafted tokens the target accepted, in order, before sampled[id]
    accepted: dict[str, list[SampledToken]] = field(default_factory=dict)
    # per block-sparse prefill chunk: the (query position, key) pairs it attended, per
    # layer and KV head on average (dense: q_len * start + q_len * (q_len + 1) / 2)
    prefill_pairs: dict[str, int] = field(default_factory=dict)


class ModelRunner:
    """Owns the model weights, the KV cache tensors and the sampler."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int,
                 sampler: Sampler | None = None, key_bounds: bool = False) -> None:
        self.model = model
        self.block_size = block_size
        self.kv: KVCache = model.make_kv_cache(num_blocks, block_size, key_bounds=key_bounds)
        self.sampler = sampler or Sampler()
        self.device = model.device
        self._block_offsets = torch.arange(block_size, dtype=torch.long, device=self.device)
        self.keep_logits = False  # tests read raw logits through this switch
        # decode rows on the native kernel (each row's own slots); a stand-in model: torch's
        self.native_decode = getattr(model, "backend", TORCH).native
        self.windows_in_model = bool(getattr(model, "windows", None))
        # windowed layers collect no attention mass: shares are over the full-attention ones
        cfg = model.config
        self.mass_layers = (cfg.num_layers - len(cfg.sliding_layers)) or cfg.num_layers

    def prepare(self, out: SchedulerOutput) -> tuple[list[ScheduledChunk], torch.Tensor,
                                                        torch.Tensor, AttentionMetadata,
                                                        torch.Tensor]:
        """Order rows (decodes first, a verify as its decode rows), build input ids,
        positions and attention metadata."""
        decodes, prefills = [], []
        for c in out.chunks:
            if c.draft:
                decodes += verify_rows(c, self.block_size)
            elif c.is_decode:
                decodes.append(c)
            else:
                prefills.append(c)
        chunks = decodes + prefills
        dev = self.device
        bs = self.block_size
        decode_slots = [c.block_table[c.start_pos // bs] * bs + c.start_pos % bs for c in decodes]
        pre, pre_slots = self._prefill_chunks(prefills, offset=len(decodes))
        slot_mapping = torch.tensor(decode_slots, dtype=torch.long, device=dev)
        meta = AttentionMetadata(
            slot_mapping=torch.cat([slot_mapping, *pre_slots]) if pre_slots else slot_mapping,
            num_decode=len(decodes), decode_groups=[], prefills=pre)
        self._add_decode_groups(meta, decodes)
        ids = [t for c in chunks for t in c.token_ids]
        pos = [p for c in chunks for p in range(c.start_pos, c.start_pos + c.num_tokens)]
        # logits only for rows that sample (the last token of their chunk), then for the
        # rows that score prompt tokens
        ends, scored, idx = [], [], 0
        for c in chunks:
            if c.score_targets:
                scored.extend(range(idx, idx + len(c.score_targets)))
            idx += c.num_tokens
            if c.sample:
                ends.append(idx - 1)
        ends += scored
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        logits_idx = torch.tensor(ends, dtype=torch.long, device=dev)
        return chunks, input_ids, positions, meta, logits_idx

    def _slot_table(self, block_tables: list[list[int]], length: int) -> torch.Tensor:
        """[rows, length] cache slots of positions 0..length-1 of each row (rows with fewer
        blocks are padded with block 0: callers mask those positions; so are blocks given
        back, EVICTED, which lie outside every window that reads the row)."""
        bs = self.block_size
        nb = cdiv(length, bs)
        padded = [[max(b, 0) for b in t[:nb]] + [0] * (nb - len(t[:nb])) for t in block_tables]
        blocks = torch.tensor(padded, dtype=torch.long, device=self.device)
        slots = blocks[:, :, None] * bs + self._block_offsets
        return slots.view(len(block_tables), nb * bs)[:, :length]

    def _decode_context(self, c: ScheduledChunk) -> tuple[list[int], int]:
        """The block ids a decode row reads, and how many KV positions."""
        if c.attend_blocks is None:
            return c.block_table, c.start_pos + 1
        return ([c.block_table[i] for i in c.attend_blocks],
                decode_context_length(c.attend_blocks, c.start_pos, self.block_size))

    def _add_decode_groups(self, meta: AttentionMetadata, decodes: list[ScheduledChunk]) -> None:
        """Split the decode rows, taken in order of context length, into groups padded to
        their longest; record the order (and its inverse) unless it is the batch order.
        A row that attends selected blocks only has them gathered, nothing else."""
        ctxs = [self._decode_context(c) for c in decodes]
        if self.native_decode and decodes:
            # The native kernel reads each row's own slots up to its own length: one group
            # in batch order, no sorting, no padding mask.
            lengths = [n for _, n in ctxs]
            ctx = max(lengths)
            slots = self._slot_table([b for b, _ in ctxs], ctx)
            lens = (None if min(lengths) == ctx
                    else torch.tensor(lengths, dtype=torch.long, device=self.device))
            mass = (torch.zeros(len(decodes), ctx, dtype=torch.float32, device=self.device)
                    if any(c.collect_attention for c in decodes) else None)
            keep, selection = self._budgets(decodes)
            meta.decode_groups.append(DecodeGroup(0, len(decodes), ctx, slots.reshape(-1),
                                                  None, mass, lens, keep, selection,
                                                  self._positions(decodes, ctx)))
            return
        order = sorted(range(len(decodes)), key=lambda r: ctxs[r][1])
        if order != list(range(len(decodes))):
            meta.decode_order = torch.tensor(order, dtype=torch.long, device=self.device)
            meta.decode_restore = torch.argsort(meta.decode_order)
        lengths = [ctxs[r][1] for r in order]
        for start, end in split_by_length(lengths, DECODE_GROUP_OVERHEAD):
            ctx = lengths[end - 1]
            slots = self._slot_table([ctxs[r][0] for r in order[start:end]], ctx)
            mask = mass = lens = None
            if lengths[start] < ctx:
                lens = torch.tensor(lengths[start:end], device=self.device)
                mask = (torch.arange(ctx, device=self.device) < lens[:, None])[:, None, None, :]
            if any(decodes[r].collect_attention for r in order[start:end]):
                mass = torch.zeros(end - start, ctx, dtype=torch.float32, device=self.device)
            rows = [decodes[r] for r in order[start:end]]
            keep, selection = self._budgets(rows)
            if selection is not None and lens is None:
                lens = torch.full((end - start,), ctx, dtype=torch.long, device=self.device)
            meta.decode_groups.append(DecodeGroup(start, end, ctx, slots.reshape(-1), mask, mass,
                                                  lens, keep, selection,
                                                  self._positions(rows, ctx)))

    def _positions(self, rows: list[ScheduledChunk], ctx: int) -> torch.Tensor | None:
        """[rows, ctx] the sequence position of each gathered context slot, if some row
        attends selected blocks only (windowed layers need them); None otherwise."""
        if self.windows_in_model and any(c.attend_blocks is not None for c in rows):
            # block indices instead of block ids in the slot table: positions
            return self._slot_table([c.attend_blocks if c.attend_blocks is not None
                                     else list(range(c.start_pos // self.block_size + 1))
                                     for c in rows], ctx)
        return None

    def _budgets(self, decodes: list[ScheduledChunk]
                 ) -> tuple[torch.Tensor | None, QueryAwareSelection | None]:
        """Per row, the blocks a query-aware selection keeps (a row without a budget keeps
        all of them), and the selection's parameters; (None, None) if no row has one."""
        budgets = [c.attend_budget for c in decodes if c.attend_budget is not None]
        if not budgets:
            return None, None
        b = budgets[0]
        if any((x.sink, x.recent) != (b.sink, b.recent) for x in budgets):
            raise RuntimeError("decode rows of one step ask for different protected blocks")
        if self.kv.bounds_offset is None:
            raise RuntimeError("a block budget needs a KV cache with key bounds "
                               "(the block policy must set wants_key_bounds)")
        keep = [c.attend_budget.blocks if c.attend_budget is not None else 1 << 40
                for c in decodes]
        return (torch.tensor(keep, dtype=torch.long, device=self.device),
                QueryAwareSelection(self.block_size, self.kv.bounds_offset, b.sink, b.recent))

    def _update_key_bounds(self, chunks: list[ScheduledChunk]) -> None:
        """Key bounds of the blocks this step filled (a block's bounds are read only once it
        is full and no longer the last of its sequence)."""
        bs = self.block_size
        full = {c.block_table[b] for c in chunks
                for b in range(c.start_pos // bs, (c.start_pos + c.num_tokens) // bs)}
        self.kv.update_key_bounds(sorted(full))

    def _block_mass(self, decodes: list[ScheduledChunk], meta: AttentionMetadata
                    ) -> dict[str, list[float]]:
        """Per decode row that asked: the attention mass share of each block it attended
        (summed over layers and heads, then divided by their number)."""
        if all(g.mass is None for g in meta.decode_groups):
            return {}
        order = (meta.decode_order.tolist() if meta.decode_order is not None
                 else list(range(len(decodes))))
        cfg = self.model.config
        bs = self.block_size
        out = {}
        for g in meta.decode_groups:
            if g.mass is None:
                continue
            nb = cdiv(g.ctx, bs)
            per_block = torch.nn.functional.pad(g.mass, (0, nb * bs - g.ctx)).view(
                -1, nb, bs).sum(-1).div_(self.mass_layers * cfg.num_heads).tolist()
            for k in range(g.start, g.end):
                c = decodes[order[k]]
                if c.collect_attention:
                    n = len(c.attend_blocks) if c.attend_blocks is not None \
                        else c.start_pos // bs + 1
                    out[c.request_id] = per_block[k - g.start][:n]
        return out

    def _prefill_chunks(self, prefills: list[ScheduledChunk], offset: int
                        ) -> tuple[list[PrefillChunk], list[torch.Tensor]]:
        """Attention metadata of each prefill chunk, and the cache slots of its new tokens."""
        chunks, new_slots = [], []
        for c in prefills:
            end = c.start_pos + c.num_tokens
            slots = self._slot_table([c.block_table], end)[0]
            new_slots.append(slots[c.start_pos:])
            mask = None
            if c.start_pos > 0:  # attend to the cached prefix too: causal mask by position
                pos_q = torch.arange(c.start_pos, end, device=self.device)
                mask = torch.arange(end, device=self.device) <= pos_q[:, None]
            chunks.append(PrefillChunk(offset, c.num_tokens, c.start_pos, slots, mask,
                                       c.prefill_sparsity))
            offset += c.num_tokens
        return chunks, new_slots

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        if out.is_empty:
            return ModelOutput({}, 0)
        chunks, input_ids, positions, meta, logits_idx = self.prepare(out)
        logits = self.model.forward(input_ids, positions, meta, self.kv, logits_idx)
        if self.kv.bounds_offset is not None:
            self._update_key_bounds(out.chunks)
        samplers = [c for c in chunks if c.sample]
        scores = self._score_prompts(chunks, logits[len(samplers):])
        logits = logits[:len(samplers)]
        sampled: dict[str, SampledToken] = {}
        accepted: dict[str, list[SampledToken]] = {}
        if samplers:
            # per row, the drafted token that must come out of it for the next row of its
            # verify to count (None: not a verify row, or a verify's last row)
            firsts = {c.request_id: c.start_pos for c in out.chunks if c.draft}
            draft_next = None
            if firsts:
                drafts = {c.request_id: c.draft for c in out.chunks if c.draft}
                draft_next = []
                for c in samplers:
                    d = drafts.get(c.request_id)
                    j = c.start_pos - firsts[c.request_id] if d is not None else -1
                    draft_next.append(d[j] if 0 <= j < len(d) else None)
            batch = SamplingBatch([c.request_id for c in samplers], [c.params for c in samplers],
                                  [c.num_output_tokens for c in samplers],
                                  draft_next=draft_next)
            s = self.sampler(logits, batch)
            toks = s.token_ids.tolist()
            ents = s.entropies.tolist()
            temps = s.temperatures.tolist()
            # NaN (not measured) -> None
            hts = [None if h != h else h for h in s.tempered_entropies.tolist()]
            lps = s.logprobs.tolist()
            tids = s.top_ids.tolist() if s.top_ids is not None else None
            tlps = s.top_logprobs.tolist() if s.top_logprobs is not None else None
            kept = batch.kept
            for i, c in enumerate(samplers):
                if kept is not None and not kept[i]:
                    continue
                st = SampledToken(toks[i], ents[i], temps[i], lps[i],
                                  tempered_entropy=hts[i])
                n = c.params.logprobs
                if n is not None:
                    st.top_logprobs = dict(zip(tids[i][:n], tlps[i][:n])) if n else {}
                prev = sampled.get(c.request_id)
                if prev is not None:  # an accepted drafted token: this row follows it
                    accepted.setdefault(c.request_id, []).append(prev)
                sampled[c.request_id] = st
        return ModelOutput(sampled, int(input_ids.shape[0]),
                           logits if self.keep_logits else None, scores,
                           self._block_mass(chunks[:meta.num_decode], meta), accepted,
                           self._prefill_pairs(chunks[meta.num_decode:], meta))

    def _prefill_pairs(self, prefills: list[ScheduledChunk], meta: AttentionMetadata
                       ) -> dict[str, int]:
        """Attended pairs of each block-sparse prefill chunk, per layer and KV head: the
        layers that ran it sparse counted theirs, the others (windowed) attended densely."""
        cfg = self.model.config
        out = {}
        for c, p in zip(prefills, meta.prefills):
            if p.sparsity is None:
                continue
            dense = dense_work(c.request_id, p.start, p.q_len, False).attended_pairs
            dense_layers = cfg.num_layers - p.sparse_layers
            total = p.attended_pairs + dense_layers * cfg.num_kv_heads * dense
            out[c.request_id] = round(total / (cfg.num_layers * cfg.num_kv_heads))
        return out

    def _score_prompts(self, chunks: list[ScheduledChunk], logits: torch.Tensor
                       ) -> dict[str, PromptScores]:
        """Teacher-forced log-probabilities of each chunk's score_targets (rows of `logits`
        in chunk order)."""
        wanted = [c for c in chunks if c.score_targets]
        if not wanted:
            return {}
        targets = torch.tensor([t for c in wanted for t in c.score_targets], device=self.device)
        n_top = max(c.params.prompt_logprobs or 0 for c in wanted)
        s = score_tokens(logits, targets, n_top)
        lps = s.logprobs.tolist()
        tids = s.top_ids.tolist() if n_top else None
        tlps = s.top_logprobs.tolist() if n_top else None
        out, i = {}, 0
        for c in wanted:
            j = i + len(c.score_targets)
            n = c.params.prompt_logprobs or 0
            top = [dict(zip(a[:n], b[:n])) for a, b in zip(tids[i:j], tlps[i:j])] if n else None
            out[c.request_id] = PromptScores(lps[i:j], top)
            i = j
        return out
