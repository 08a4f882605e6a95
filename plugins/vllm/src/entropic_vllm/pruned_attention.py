"""vLLM's CPU attention with entropic's query-aware block selection in front (docs/vllm.md).

Installed by `entropic_vllm.pruning.PruningLogitsProcessor` over vLLM's `CPU_ATTN` backend.
Nothing changes for rows of requests that did not opt in, for prefill rows, or in a step
without an opted-in decode: the metadata is vLLM's own and the kernel is vLLM's
`cpu_attention_with_kv_cache`.

For an opted-in decode row (one query token) whose budget binds:
- the builder (once per step) asks entropic's `EntropicBlockPruner.bound_budget` for the
  budget, max(min_blocks, ceil(rho(H_t) * live)) blocks, from the request's entropy;
- each layer scores the row's blocks by entropic's bound, sum_i max(q_i min_i, q_i max_i)
  over the elementwise minimum and maximum of the block's keys, largest over all the
  layer's query heads (vLLM's kernel takes one block table per sequence, shared by every
  head: the choice is per layer, where entropic's kernel chooses per KV head), and keeps
  the blocks entropic's `choose_blocks` keeps: the first `sink_blocks`, the last
  `recent_blocks` (the partial last block among them) and the highest-bound others;
- the row's block table is compacted to the kept blocks, in order, and its sequence
  length shortened to what they hold; vLLM's scheduler metadata (its work split, which
  depends on the lengths) is rebuilt for them, and vLLM's kernel runs as usual. Positions
  are already in the keys (RoPE before the cache), so a compacted table attends exactly
  the kept tokens. Skipped blocks are neither read nor multiplied.

Key bounds are kept per layer and physical block, computed from the KV cache when a block
is first scored and recomputed when a step has written into that block since (the
builder counts writes per block from the slot mapping). The key layout inside a block is
the kernel's (dim-major for the vector ISAs, tiled for AMX): it is learnt once by a probe
write through vLLM's own `cpu_attn_reshape_and_cache`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Callable

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend,
                                                 CPUAttentionBackendImpl,
                                                 CPUAttentionMetadata,
                                                 CPUAttentionMetadataBuilder)

from entropic.model.attention import choose_blocks
from entropic_vllm.pruning import SHARED, PruningStats
from entropic_vllm.scheduler import cost_model


class BlockWrites:
    """A generation number per physical KV block, bumped in each step that writes a slot of
    it. A key bound computed at generation g stays valid while the block's number is g.
    Counting starts with the first bound (`active`): until then there is nothing to void."""

    def __init__(self) -> None:
        self.gen = torch.zeros(0, dtype=torch.int64)
        self.active = False

    def _grow(self, n: int) -> None:
        if n > self.gen.numel():
            self.gen = torch.cat((self.gen, torch.zeros(n - self.gen.numel(),
                                                        dtype=torch.int64)))

    def record(self, slot_mapping: torch.Tensor, block_size: int) -> None:
        if not self.active or slot_mapping.numel() == 0:
            return
        ids = torch.unique(slot_mapping[slot_mapping >= 0] // block_size)
        if ids.numel():
            self._grow(int(ids.max()) + 1)
            self.gen[ids] += 1

    def generation(self, num_blocks: int) -> torch.Tensor:
        self.active = True
        self._grow(num_blocks)
        return self.gen


@functools.lru_cache(maxsize=None)
def key_layout(isa: str, dtype: torch.dtype, block_size: int, head_dim: int) -> torch.Tensor:
    """[head_dim * block_size] int64: where, in one (block, KV head) key region of vLLM's CPU
    cache, dim j of the block's token t sits, at index j * block_size + t. Learnt by writing
    keys that encode their dim, then their token, through vLLM's `cpu_attn_reshape_and_cache`."""
    def probe(code: torch.Tensor) -> torch.Tensor:
        cache = torch.zeros(1, 1, 2 * block_size, head_dim, dtype=dtype)
        kc, vc = cache.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(code.to(dtype)[:, None], torch.zeros_like(code)[:, None]
                                       .to(dtype), kc, vc,
                                       torch.arange(block_size, dtype=torch.long), isa)
        return kc.reshape(-1).float().round().long()
    tok = torch.arange(block_size)[:, None].expand(block_size, head_dim).float()
    dim = torch.arange(head_dim)[None, :].expand(block_size, head_dim).float()
    where = probe(dim) * block_size + probe(tok)  # the (dim, token) each position holds
    if not torch.equal(torch.sort(where).values, torch.arange(block_size * head_dim)):
        raise RuntimeError(f"entropic pruning: cannot read the key layout of vLLM's CPU cache "
                           f"(isa {isa}, {dtype}, block {block_size}, head dim {head_dim})")
    return torch.argsort(where)


class KeyBounds:
    """One layer's key bounds: per physical block and KV head, the elementwise minimum and
    maximum of the block's keys ([blocks, KV heads, 2, head_dim], fp32)."""

    def __init__(self) -> None:
        self.bounds: torch.Tensor | None = None
        self.gen: torch.Tensor | None = None  # generation each bound was computed at (-1: none)

    def refresh(self, key_cache: torch.Tensor, blocks: torch.Tensor, writes: BlockWrites,
                layout: torch.Tensor) -> None:
        """Compute the bounds of those of `blocks` that have none or a stale one."""
        num_blocks, kv_heads, bs, d = key_cache.shape
        if self.bounds is None or self.bounds.shape[0] < num_blocks:
            self.bounds = torch.zeros(num_blocks, kv_heads, 2, d, dtype=torch.float32)
            self.gen = torch.full((num_blocks,), -1, dtype=torch.int64)
        gen = writes.generation(num_blocks)[:num_blocks]
        stale = blocks[self.gen[blocks] != gen[blocks]]
        if stale.numel() == 0:
            return
        keys = key_cache[stale].reshape(-1, kv_heads, bs * d)[..., layout].float()
        keys = keys.view(-1, kv_heads, d, bs)
        self.bounds[stale] = torch.stack((keys.amin(-1), keys.amax(-1)), dim=2)
        self.gen[stale] = gen[stale]


@dataclass
class DecodePlan:
    """The builder's decision for one step: the decode rows that prune, their budgets (in
    blocks, sink and recent among them), and how to rebuild vLLM's scheduler metadata."""

    block_size: int  # the KV manager's, in which the budgets count
    rows: torch.Tensor  # [p] int64 batch rows
    keep: torch.Tensor  # [p] int64
    sink: torch.Tensor  # [p] int64
    recent: torch.Tensor  # [p] int64
    writes: BlockWrites
    schedule: Callable[[torch.Tensor], torch.Tensor]  # seq_lens -> scheduler metadata
    stats: PruningStats


@dataclass
class PrunedCPUAttentionMetadata(CPUAttentionMetadata):
    plan: DecodePlan | None = None


def prune_rows(query: torch.Tensor, key_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, query_start_loc: torch.Tensor, plan: DecodePlan,
               bounds: KeyBounds, layout: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's selection for the plan's rows: (block table, sequence lengths) with
    those rows compacted to their kept blocks (new tensors; vLLM's are left as they are),
    and the number of blocks each row kept. query [tokens, heads, D]; key_cache [blocks,
    KV heads, block_size, D] (vLLM's view of the keys)."""
    bs = key_cache.shape[2]
    rows = plan.rows
    seq = seq_lens[rows].long()
    nb = (seq + bs - 1) // bs
    nb_max = int(nb.max())
    table = block_table[rows, :nb_max].long()  # [p, nb_max]; past a row's nb: anything
    idx = torch.arange(nb_max)
    lo = torch.minimum(plan.sink, nb)
    hi = torch.maximum(lo, nb - plan.recent)
    candidate = (idx >= lo[:, None]) & (idx < hi[:, None])  # the blocks that compete
    bounds.refresh(key_cache, torch.unique(table[candidate]), plan.writes, layout)
    kv_heads, d = key_cache.shape[1], key_cache.shape[3]
    q = query[query_start_loc[rows].long()].float()  # [p, heads, D]
    q = q.view(len(rows), kv_heads, -1, d)[:, None]  # [p, 1, KVH, rep, D]
    b = bounds.bounds[table]  # [p, nb_max, KVH, 2, D]
    lo_k, hi_k = b[:, :, :, None, 0], b[:, :, :, None, 1]
    score = torch.maximum(q * lo_k, q * hi_k).sum(-1).amax(dim=(2, 3))  # [p, nb_max]
    # entropic's rule; the non-candidates' scores (no bound computed) are never read
    chosen = choose_blocks(score[:, None], nb, plan.keep, plan.sink, plan.recent)[:, 0]
    # kept blocks first, in their order (the last block, partial, last among them)
    order = torch.sort((~chosen).to(torch.uint8), dim=1, stable=True).indices
    kept = chosen.sum(1)
    new_table = block_table.clone()
    new_table[rows, :nb_max] = table.gather(1, order).to(block_table.dtype)
    new_seq = seq_lens.clone()
    new_seq[rows] = ((kept - 1) * bs + seq - (nb - 1) * bs).to(seq_lens.dtype)
    st = plan.stats
    st.layer_rows += len(rows)
    st.blocks_live += int(nb.sum())
    st.blocks_attended += int(kept.sum())
    return new_table, new_seq, kept


class PruningMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata, plus the step's `DecodePlan` where an opted-in decode prunes."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.writes = BlockWrites()
        self.cost = cost_model(vllm_config, vllm_config.model_config.dtype.itemsize
                               if self.kv_cache_dtype == "auto" else 1)
        # a window, fp8 keys, cross or encoder attention: always dense
        self.prunable = (self.window_size == -1 and self.kv_cache_dtype == "auto"
                         and not self.is_cross_attention and not self.is_encoder_only_attention)
        SHARED.backend_built = True

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        cam = common_attn_metadata
        self.writes.record(cam.slot_mapping, self.block_size)
        plan = self._plan(cam, meta) if SHARED.rows and self.prunable else None
        return PrunedCPUAttentionMetadata(
            **{f.name: getattr(meta, f.name) for f in fields(CPUAttentionMetadata)}, plan=plan)

    def _plan(self, cam, meta: CPUAttentionMetadata) -> DecodePlan | None:
        n, bs = cam.num_reqs, self.block_size
        qsl = cam.query_start_loc_cpu[:n + 1]
        qlen = (qsl[1:] - qsl[:-1]).tolist()
        seq = cam.seq_lens[:n].tolist()
        decode_rows = sum(1 for x in qlen if x == 1)
        picked: list[tuple[int, int, int, int]] = []
        for i, st in SHARED.rows.items():
            if i >= n or qlen[i] != 1:
                continue
            SHARED.stats.decodes += 1
            live = -(-seq[i] // bs)
            budget = st.pruner(bs, self.cost).bound_budget(st.entropy_now(), live, decode_rows)
            if budget is not None:
                picked.append((i, budget.blocks, budget.sink, budget.recent))
        if not picked:
            return None
        SHARED.stats.pruned_decodes += len(picked)
        rows, keep, sink, recent = (torch.tensor(c, dtype=torch.int64) for c in zip(*picked))
        schedule = functools.partial(
            ops.cpu_attn_get_scheduler_metadata, num_reqs=n, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype,
            query_start_loc=meta.query_start_loc, causal=meta.causal,
            sliding_window_size=self.window_size, isa=self.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=meta.dynamic_causal,
            kv_cache_dtype=self.kv_cache_dtype)
        return DecodePlan(bs, rows, keep, sink, recent, self.writes,
                          lambda lens: schedule(seq_lens=lens), SHARED.stats)


class PruningAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention; where the step's metadata carries a plan, over the kept blocks."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.key_bounds = KeyBounds()
        self.prunable = (self.attn_type == AttentionType.DECODER and self.sliding_window == -1
                         and self.alibi_slopes is None and not self.is_fp8_kv_cache)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        plan = getattr(attn_metadata, "plan", None)
        # (a kernel block smaller than the manager's would split the budget's blocks: dense)
        if plan is not None and self.prunable and kv_cache.shape[2] == plan.block_size:
            num_blocks, kv_heads, bs, _ = kv_cache.shape
            key_cache = kv_cache.view(num_blocks, kv_heads, 2 * bs, -1)[:, :, :bs]
            layout = key_layout(layer.isa, kv_cache.dtype, bs, key_cache.shape[-1])
            table, lens, _ = prune_rows(query, key_cache, attn_metadata.block_table,
                                        attn_metadata.seq_lens, attn_metadata.query_start_loc,
                                        plan, self.key_bounds, layout)
            attn_metadata = PrunedCPUAttentionMetadata(
                **{f.name: getattr(attn_metadata, f.name) for f in fields(CPUAttentionMetadata)
                   if f.name not in ("block_table", "seq_lens", "scheduler_metadata")},
                block_table=table, seq_lens=lens, scheduler_metadata=plan.schedule(lens))
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                               output_scale, output_block_scale)


class PruningAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU_ATTN backend with entropic's block selection for opted-in decodes."""

    @staticmethod
    def get_impl_cls() -> type[PruningAttentionImpl]:
        return PruningAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[PruningMetadataBuilder]:
        return PruningMetadataBuilder
