"""Paged attention over a block-structured KV cache.

The batch is a flat run of tokens: first the decode rows (one new token each), then the
prefill chunks (several new tokens each). New K/V are written into their cache slots, then
- decode rows attend, all together, to their context gathered through the block table;
- each prefill chunk attends causally to its cached prefix plus itself.
All of this is described by an explicit `AttentionMetadata`, never by globals.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """A run of `q_len` new tokens at positions [start, start + q_len) of one sequence."""

    token_offset: int  # index of its first token in the flat batch
    q_len: int
    start: int  # tokens of this sequence already in the cache
    slots: torch.Tensor | None  # [start + q_len] cache slots of the whole context; None if start == 0


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step (built once per step, shared by all layers)."""

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    num_decode: int
    decode_slots: torch.Tensor | None  # [D, max_ctx] context slots of each decode row (padded)
    decode_mask: torch.Tensor | None  # [D, 1, 1, max_ctx] bool, True = attend
    prefills: list[PrefillChunk]


class KVCache:
    """Per-layer K and V storage: [num_blocks * block_size, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] (new tokens). Returns [T, H, D]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    num_heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    rep = num_heads // kv_heads
    out = torch.empty_like(q)
    d = meta.num_decode
    if d:
        # Group the query heads that share a KV head, so K/V need no repeat: [D, KVH, rep, D].
        qd = q[:d].view(d, kv_heads, rep, head_dim)
        kd = k_cache[meta.decode_slots].transpose(1, 2)  # [D, KVH, ctx, D]
        vd = v_cache[meta.decode_slots].transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[:d] = od.reshape(d, num_heads, head_dim)
    for p in meta.prefills:
        sl = slice(p.token_offset, p.token_offset + p.q_len)
        qp = q[sl].transpose(0, 1)  # [H, q, D]
        if p.slots is None:
            kp, vp = k[sl], v[sl]
            mask, causal = None, True
        else:
            kp, vp = k_cache[p.slots], v_cache[p.slots]
            ctx = p.start + p.q_len
            pos_q = torch.arange(p.start, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= pos_q[:, None]
            causal = False
        kp = kp.transpose(0, 1).repeat_interleave(rep, dim=0)  # [H, ctx, D]
        vp = vp.transpose(0, 1).repeat_interleave(rep, dim=0)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=causal,
                                            scale=scale)
        out[sl] = op.transpose(0, 1)
    return out
