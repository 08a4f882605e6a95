"""Paged attention over a block-structured KV cache.

The batch is a flat run of tokens: first the decode rows (one new token each), then the
prefill chunks (several new tokens each). New K/V are written into their cache slots, then
- decode rows attend in groups of similar context length (taken in order of length and
  split so that padding stays small), each group to its contexts gathered through the block
  table and padded to the group's longest;
- each prefill chunk attends causally to its cached prefix plus itself.
All of this is described by an explicit `AttentionMetadata`, never by globals.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class DecodeGroup:
    """Decode rows [start, end) in order of context length, padded to `ctx` positions."""

    start: int
    end: int
    ctx: int
    slots: torch.Tensor  # [(end - start) * ctx] context slots, row after row; padding: any slot
    mask: torch.Tensor | None  # [end - start, 1, 1, ctx] bool, True = attend; None: no padding
    # [end - start, ctx] fp32: if given, each layer adds the attention probabilities of
    # every head at each position (softmax is then computed explicitly, not by SDPA)
    mass: torch.Tensor | None = None
    lengths: torch.Tensor | None = None  # [end - start] int64 context lengths; None: all ctx
    # Query-aware selection (`QueryAwareSelection`): row r attends keep[r] of its blocks, chosen
    # in each layer for each KV head by their key-score bound; None: every row is dense.
    keep: torch.Tensor | None = None  # [end - start] int64
    selection: "QueryAwareSelection | None" = None
    # [end - start, ctx] int64: the sequence position each gathered slot holds, where some
    # row attends selected blocks only (explicit pruning); None: column j holds position j.
    # Windowed layers read it to keep exactly the positions inside their window.
    positions: torch.Tensor | None = None


@dataclass(frozen=True)
class QueryAwareSelection:
    """How decode rows with a block budget choose their blocks inside attention: the first
    `sink` and last `recent` blocks of the row's context always, the others by the bound
    `sum_i max(q_i min_i, q_i max_i)` of their keys (largest over the query heads of a KV
    head); the bound rows of block b sit at cache row `bounds_offset + b`."""

    block_size: int
    bounds_offset: int
    sink: int
    recent: int


# Block-sparse prefill: query positions per tile and keys per block (the native kernel's)
SPARSE_PREFILL_QUERIES = 16
SPARSE_PREFILL_KEYS = 64


@dataclass(frozen=True)
class PrefillSparsity:
    """Block-sparse prefill (`entropic.prefill_attention_sparse`): each tile of 16 query
    positions attends, per KV head, a block of 64 keys only where the block's score clears
    -`delta`, or where it is one of the first `sink` blocks or one of the `recent` blocks
    ending with the tile's first position's own. A block's score: the largest over the
    tile's rows (positions x the KV head's query heads) of bound - the row's best bound,
    where a row's bound for a block is scale * sum_i max(q_i min_i, q_i max_i) over the
    elementwise minimum and maximum of the block's keys (no key of the block scores
    higher). So a block is skipped only where, for every row, its best key scores at least
    `delta` below the row's best block's bound. A NaN score keeps its block."""

    delta: float
    sink: int
    recent: int


@dataclass
class PrefillChunk:
    """A run of `q_len` new tokens at positions [start, start + q_len) of one sequence."""

    token_offset: int  # index of its first token in the flat batch
    q_len: int
    start: int  # tokens of this sequence already in the cache
    slots: torch.Tensor  # [start + q_len] cache slots of the context: cached prefix, then itself
    mask: torch.Tensor | None = None  # [q_len, start + q_len] bool causal mask; None if start == 0
    sparsity: PrefillSparsity | None = None  # None: dense
    # Counted by the layers that ran it sparse: (query position, key) pairs attended, summed
    # over KV heads and layers, and how many layers those were.
    attended_pairs: int = 0
    sparse_layers: int = 0


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step (built once per step, shared by all layers)."""

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    num_decode: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    # Decode rows stay where the scheduler put them (a row's numbers can depend on its place
    # in the batch's matmuls); attention takes them in order of length and puts them back.
    decode_order: torch.Tensor | None = None  # [num_decode] rows by length; None: in order
    decode_restore: torch.Tensor | None = None  # inverse permutation of decode_order


_ALIGN = 64  # bytes: a cache line, so that rows of 64 or 128 bytes never straddle two


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(shape, dtype) whose pages the OS zeroes when first touched. On the CPU the
    memory comes from calloc (numpy's zeros), which maps a large block without writing it:
    a KV pool of ~1 GB is ready in microseconds instead of ~0.3 s, and pages never used cost
    no resident memory. 64-byte aligned."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.zeros(nbytes + _ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape)


class KVCache:
    """K and V of every layer in one tensor: [num_layers, num_blocks * block_size, 2, kv_heads,
    head_dim]. K and V of a slot sit side by side, so one copy writes both and one gather
    reads both.

    With `key_bounds`, each layer's tensor has one more row per block after the slots, at
    `bounds_offset + block`: the elementwise minimum of the block's keys where a slot holds
    K, and their maximum where it holds V (query-aware block selection reads them; they
    cost 1 / block_size more memory). They are set when a block is full
    (`update_key_bounds`); a block's last, partial block is always attended."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 key_bounds: bool = False) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.bounds_offset = num_blocks * block_size if key_bounds else None
        rows = num_blocks * block_size + (num_blocks if key_bounds else 0)
        shape = (num_layers, rows, 2, num_kv_heads, head_dim)
        self.kv = lazy_zeros(shape, dtype, device)

    def update_key_bounds(self, blocks: list[int]) -> None:
        """Recompute the key bounds of these (full) blocks in every layer."""
        if self.bounds_offset is None or not blocks:
            return
        bs, off = self.block_size, self.bounds_offset
        ids = torch.tensor(blocks, dtype=torch.long, device=self.kv.device)
        slots = (ids[:, None] * bs + torch.arange(bs, device=self.kv.device)).view(-1)
        keys = self.kv.index_select(1, slots)[:, :, 0]  # [layers, n * bs, kv_heads, d]
        keys = keys.view(keys.shape[0], len(blocks), bs, *keys.shape[2:])
        bounds = torch.stack((keys.amin(2), keys.amax(2)), dim=2)  # [layers, n, 2, kvh, d]
        self.kv.index_copy_(1, ids + off, bounds)



def window_metadata(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """The same step for layers that see only the last `window` positions (their own
    included: a query at p attends to keys at p - window + 1 .. p).

    Decode rows gather just their window's slots, so both decode paths (SDPA and
    `entropic.paged_decode_attention`) serve it unchanged; a prefill chunk drops the prefix
    before its first query's window and masks the band. Windowed rows collect no attention
    mass (`DecodeGroup.mass`): the block pruner sees full-attention layers only.

    Pruning never reaches outside a window. A row that attends selected blocks only keeps
    those of its selected positions inside its window (`DecodeGroup.positions`), never the
    sink or any other block older than the window. Query-aware selection (`keep`) stays on a
    group whose every row's context fits the window (there a windowed layer is a full one);
    a group where some row's context is longer attends each row's whole window in windowed
    layers: a window is already short, and the bound selection ranks blocks of a
    block-aligned context, which a window that starts inside a block is not."""
    groups = [_window_decode_group(g, window) for g in meta.decode_groups]
    prefills = [_window_prefill(p, window) for p in meta.prefills]
    return AttentionMetadata(meta.slot_mapping, meta.num_decode, groups, prefills,
                             meta.decode_order, meta.decode_restore)


def _window_decode_group(g: DecodeGroup, window: int) -> DecodeGroup:
    if g.positions is None and g.ctx <= window:
        return g if g.mass is None else replace(g, mass=None)
    n = g.end - g.start
    dev = g.slots.device
    lengths = (g.lengths if g.lengths is not None
               else torch.full((n,), g.ctx, dtype=torch.long, device=dev))
    if g.positions is None:
        kept = lengths.clamp(max=window)
    else:
        # a row's positions ascend, so those inside its window are the last of the row
        query = g.positions.gather(1, (lengths - 1)[:, None])  # the new token's position
        valid = torch.arange(g.ctx, device=dev) < lengths[:, None]
        kept = ((g.positions > query - window) & valid).sum(1)
        if bool((kept == lengths).all()):  # every selected position is inside the window
            return replace(g, mass=None, positions=None)
    ctx = int(kept.max())
    # row r keeps its columns lengths[r] - kept[r] .. lengths[r] - 1; its padding columns
    # (masked) read any column of the row
    cols = ((lengths - kept)[:, None] + torch.arange(ctx, device=dev)).clamp_(max=g.ctx - 1)
    slots = g.slots.view(n, g.ctx).gather(1, cols)
    lens = mask = None
    if int(kept.min()) < ctx:
        lens = kept
        mask = (torch.arange(ctx, device=dev) < kept[:, None])[:, None, None, :]
    return DecodeGroup(g.start, g.end, ctx, slots.reshape(-1), mask, None, lens)


def _window_prefill(p: PrefillChunk, window: int) -> PrefillChunk:
    end = p.start + p.q_len
    if end <= window:  # no query is farther than the window from any of its keys
        return p
    first = max(0, p.start - window + 1)  # the first query's first key
    dev = p.slots.device
    q_pos = torch.arange(p.start, end, device=dev)[:, None]
    k_pos = torch.arange(first, end, device=dev)
    mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
    return PrefillChunk(p.token_offset, p.q_len, p.start - first, p.slots[first:], mask)


def paged_attention(q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, native: bool = False,
                    native_prefill: bool = False) -> torch.Tensor:
    """q: [T, H, D]; kv: [T, 2, KVH, D] new keys and values; kv_cache: [slots, 2, KVH, D] of
    this layer. Returns [T, H * D]. `native`: the new K/V are already in the cache
    (`entropic.rope_kv_`) and decode rows run `entropic.paged_decode_attention`;
    `native_prefill` (with `native`, where the model's `KernelBackend.prefill_attention`
    says so): prefill chunks run `entropic.prefill_attention`, else the SDPA path below."""
    if not native:
        kv_cache.index_copy_(0, meta.slot_mapping, kv)
    parts = []
    if meta.num_decode:
        parts.append(_decode_rows(q[:meta.num_decode], kv_cache, meta, scale, native))
    for p in meta.prefills:
        qc = q[p.token_offset:p.token_offset + p.q_len]
        sp = p.sparsity
        if native and native_prefill and sp is None:
            parts.append(torch.ops.entropic.prefill_attention(qc, kv_cache, p.slots, p.start,
                                                              scale))
        elif native and native_prefill:
            out, pairs = torch.ops.entropic.prefill_attention_sparse(
                qc, kv_cache, p.slots, p.start, scale, sp.delta, sp.sink, sp.recent)
            p.attended_pairs += pairs
            p.sparse_layers += 1
            parts.append(out)
        else:
            parts.append(_prefill_chunk(q, kv, kv_cache, p, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def sparse_prefill_keep(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                        start: int, scale: float, sp: PrefillSparsity
                        ) -> tuple[torch.Tensor, int]:
    """The blocks each tile of a sparse prefill chunk attends (`PrefillSparsity`), computed
    with torch in float64: keep [tiles, kv_heads, blocks] bool (blocks of 64 keys; a tile
    never attends a block past its last position), and the (query position, key) pairs
    that makes, summed over KV heads. q: [q_len, heads, head_dim] of the chunk at
    positions start..; kv_cache: [slots, 2, kv_heads, head_dim]; slots: [start + q_len]."""
    T, H, D = q.shape
    KVH = kv_cache.shape[2]
    rep = H // KVH
    nk = start + T
    B, Q = SPARSE_PREFILL_KEYS, SPARSE_PREFILL_QUERIES
    nb, nt = math.ceil(nk / B), math.ceil(T / Q)
    keys = kv_cache.index_select(0, slots)[:, 0].double()  # [nk, KVH, D]
    pad = nb * B - nk
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    kb = F.pad(keys, (0, 0, 0, 0, 0, pad)).view(nb, B, KVH, D)
    valid = (torch.arange(nb * B) < nk).view(nb, B, 1, 1)
    lo = torch.where(valid, kb, inf).amin(1)  # [nb, KVH, D]
    hi = torch.where(valid, kb, -inf).amax(1)
    # (amin / amax keep NaNs, as the kernel's boxes do)
    center, radius = (hi + lo) / 2, (hi - lo) / 2
    qd = q.double().view(T, KVH, rep, D)
    # bound[t, g, r, b] = scale * (q . c + |q| . r)
    bound = (torch.einsum("tgrd,bgd->tgrb", qd, center)
             + torch.einsum("tgrd,bgd->tgrb", qd.abs(), radius)) * scale
    pos = start + torch.arange(T)
    allowed = torch.arange(nb)[None, :] <= (pos // B)[:, None]  # [T, nb]
    bound = bound.masked_fill(~allowed[:, None, None, :], float("-inf"))
    best = bound.amax(-1, keepdim=True)
    rel = bound - best  # NaN where the row saw a NaN bound
    rel = torch.where(allowed[:, None, None, :] & torch.isnan(best), torch.nan, rel)
    keep = torch.zeros(nt, KVH, nb, dtype=torch.bool)
    pairs = 0
    for t in range(nt):
        i0, i1 = t * Q, min(T, (t + 1) * Q)
        last = (start + i1 - 1) // B + 1
        score = rel[i0:i1, :, :, :last]
        nan = torch.isnan(score).any(0).any(1)  # [KVH, last]
        score = score.nan_to_num(nan=float("-inf")).amax(0).amax(1)
        first_recent = (start + i0) // B - (sp.recent - 1)
        b = torch.arange(last)
        k = (b < sp.sink) | (b >= first_recent) | nan | (score >= -sp.delta)
        keep[t, :, :last] = k
        # keys of block b up to each position of the tile
        n = (pos[i0:i1, None] - b[None, :] * B + 1).clamp(0, B)  # [rows, last]
        pairs += int((n[:, None, :] * k[None]).sum())
    return keep, pairs


def _decode_rows(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, native: bool = False) -> torch.Tensor:
    """All decode rows, group by group; returns [num_decode, H * D] in batch order."""
    if meta.decode_order is not None:
        q = q.index_select(0, meta.decode_order)
    if native:
        parts = []
        for g in meta.decode_groups:
            sel = g.selection
            extra = () if sel is None else (g.keep, sel.block_size, sel.bounds_offset, sel.sink,
                                             sel.recent)
            parts.append(torch.ops.entropic.paged_decode_attention(
                q[g.start:g.end], kv_cache, g.slots.view(g.end - g.start, g.ctx), g.lengths,
                scale, g.mass, *extra))
    else:
        parts = [_decode_group(q, kv_cache, g, scale) for g in meta.decode_groups]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    if meta.decode_restore is not None:
        out = out.index_select(0, meta.decode_restore)
    return out


def _decode_group(q: torch.Tensor, kv_cache: torch.Tensor, g: DecodeGroup,
                  scale: float) -> torch.Tensor:
    """One new token per row against its whole context; returns [rows, H * D]."""
    n, (num_heads, head_dim), kv_heads = g.end - g.start, q.shape[1:], kv_cache.shape[2]
    # Group the query heads that share a KV head, so K/V need no repeat: [n, KVH, rep, D].
    qd = q[g.start:g.end].view(n, kv_heads, num_heads // kv_heads, head_dim)
    # index_select on the flat slot list: a plain row copy (2-D advanced indexing is ~10x slower)
    ctx = kv_cache.index_select(0, g.slots).view(n, g.ctx, 2, kv_heads, head_dim)
    kd = ctx[:, :, 0].transpose(1, 2)  # [n, KVH, ctx, D], strided: SDPA reads it in place
    vd = ctx[:, :, 1].transpose(1, 2)
    if g.selection is not None:  # the chosen blocks as a mask: the same result, no saving
        lengths = g.lengths if g.lengths is not None else torch.full(
            (n,), g.ctx, dtype=torch.long, device=q.device)
        chosen = bound_selection(qd, kv_cache, g.slots.view(n, g.ctx), lengths, g.keep,
                                 g.selection)
        bs = g.selection.block_size
        mask = chosen.repeat_interleave(bs, dim=-1)[..., :g.ctx]
        mask &= torch.arange(g.ctx, device=q.device) < lengths[:, None, None]
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask[:, :, None], scale=scale)
    elif g.mass is None:
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=scale)
    else:
        scores = torch.matmul(qd, kd.transpose(-1, -2)).float().mul_(scale)  # [n, KVH, rep, ctx]
        if g.mask is not None:
            scores.masked_fill_(~g.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        g.mass += probs.sum(dim=(1, 2))
        od = torch.matmul(probs.to(vd.dtype), vd)
    return od.reshape(n, num_heads * head_dim)


def bound_selection(qd: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                    lengths: torch.Tensor, keep: torch.Tensor, sel: QueryAwareSelection
                    ) -> torch.Tensor:
    """The blocks each decode row attends under query-aware selection, as the native kernel
    chooses them (a block's score: its largest bound over the KV head's query heads): qd [n, KVH, rep, D], slots [n, ctx] (block-aligned), lengths and keep [n].
    Returns [n, KVH, blocks] bool (blocks = ceil(ctx / block_size))."""
    n, kv_heads = qd.shape[:2]
    bs = sel.block_size
    nb_max = -(-slots.shape[1] // bs)
    nb = (lengths + bs - 1) // bs  # [n] blocks of each row
    ids = slots[:, ::bs] // bs  # [n, nb_max] block ids (padding: any)
    bounds = kv_cache.index_select(0, (ids + sel.bounds_offset).view(-1)).float()
    bounds = bounds.view(n, nb_max, 2, kv_heads, -1).permute(0, 3, 1, 2, 4)  # [n, KVH, nb, 2, D]
    q = qd.float()[:, :, :, None, :]  # [n, KVH, rep, 1, D]
    bound = torch.maximum(q * bounds[:, :, None, :, 0], q * bounds[:, :, None, :, 1]).sum(-1)
    return choose_blocks(bound.amax(2), nb, keep, sel.sink, sel.recent)


def choose_blocks(score: torch.Tensor, nb: torch.Tensor, keep: torch.Tensor,
                  sink: int | torch.Tensor, recent: int | torch.Tensor) -> torch.Tensor:
    """Query-aware selection's rule, given the blocks' scores: score [n, G, nb_max] (G
    groups, e.g. KV heads, choosing independently), nb [n] blocks of each row, keep [n] the
    budget, sink and recent (ints, or [n] tensors) the protected blocks. Row r keeps its
    first `sink` and last `recent` blocks and, of the others, the keep[r] - protected with
    the highest score (the earlier block first among equals); every block where keep[r] >=
    nb[r]. Returns [n, G, nb_max] bool (False past a row's nb)."""
    nb_max = score.shape[-1]
    idx = torch.arange(nb_max, device=score.device)
    lo = torch.minimum(torch.as_tensor(sink, device=nb.device).expand_as(nb), nb)
    hi = torch.maximum(lo, nb - torch.as_tensor(recent, device=nb.device))
    candidate = (idx >= lo[:, None]) & (idx < hi[:, None])  # [n, nb]
    protected = (idx < nb[:, None]) & ~candidate
    want = torch.clamp(keep - lo - (nb - hi), min=0)
    score = score.masked_fill(~candidate[:, None], float("-inf"))  # [n, G, nb]
    # rank by score, higher first, earlier block first among equals (a stable sort)
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, idx.expand_as(order))
    chosen = candidate[:, None] & (rank < want[:, None, None])
    dense = keep >= nb
    chosen |= protected[:, None] | (dense[:, None, None] & (idx < nb[:, None])[:, None])
    return chosen


def _prefill_chunk(q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor, p: PrefillChunk,
                   scale: float) -> torch.Tensor:
    """A causal run of new tokens, after its cached prefix; returns [q_len, H * D]."""
    num_heads, head_dim = q.shape[1:]
    sl = slice(p.token_offset, p.token_offset + p.q_len)
    ctx = kv[sl] if p.start == 0 else kv_cache.index_select(0, p.slots)
    # 4-D [1, heads, len, D] selects the flash kernel; 3-D inputs fall back to the math one,
    # which materialises every score (5x slower at 2k tokens). In fp32, as the math kernel
    # computes too (the bf16 flash kernel would round probabilities to bf16): the same
    # numbers up to summation order, and as fast as bf16 flash here.
    qp = q[sl].transpose(0, 1)[None].float()
    kp = ctx[:, 0].transpose(0, 1)[None].float()
    vp = ctx[:, 1].transpose(0, 1)[None].float()
    mask = p.mask
    if p.sparsity is not None:  # the blocks each tile keeps, per query head
        keep, pairs = sparse_prefill_keep(q[sl], kv_cache, p.slots, p.start, scale,
                                          p.sparsity)
        p.attended_pairs += pairs
        p.sparse_layers += 1
        nk = p.start + p.q_len
        rep = num_heads // kv_cache.shape[2]
        m = keep.repeat_interleave(SPARSE_PREFILL_QUERIES, 0)[:p.q_len]  # [T, KVH, nb]
        m = m.repeat_interleave(SPARSE_PREFILL_KEYS, 2)[..., :nk]  # [T, KVH, nk]
        m = m.repeat_interleave(rep, 1).transpose(0, 1)  # [H, T, nk]
        causal = torch.arange(nk) <= (p.start + torch.arange(p.q_len))[:, None]
        mask = (m & causal)[None]
    op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask,
                                        is_causal=mask is None, scale=scale, enable_gqa=True)
    return op[0].transpose(0, 1).reshape(p.q_len, num_heads * head_dim).to(q.dtype)
