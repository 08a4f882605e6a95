"""Moving cached prefix blocks between engines of the same model (docs/prefix_caching.md).

`export_prefix` copies the published blocks that begin a token sequence (their prefix-cache
keys, their KV, the surprisal of their positions where known) out of one engine;
`import_prefix` writes them into another engine's cache and publishes them under the same
keys, as cached free blocks: a request added next with that prefix starts on them exactly
as on blocks it had computed itself. Nothing here touches a request or the scheduler.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from entropic.config import dtype_name
from entropic.kernels.backend import TORCH


@dataclass(frozen=True)
class CacheIdentity:
    """What besides the tokens decides a block's KV: two engines may exchange blocks only
    if every field is equal. `weights` fingerprints the checkpoint (its norms and the
    embedding's first and last rows), which the model config alone does not name."""

    model: str  # the ModelConfig, as repr
    dtype: str
    kernels: str
    quantization: str | None
    weights: str

    @classmethod
    def of(cls, model) -> "CacheIdentity":
        return cls(repr(model.config), dtype_name(model.dtype),
                   getattr(model, "backend", TORCH).name, getattr(model, "quantization", None),
                   _weights_fingerprint(model))

    def mismatch(self, other: "CacheIdentity") -> list[str]:
        """The fields that differ, by name."""
        return [f for f in ("model", "dtype", "kernels", "quantization", "weights")
                if getattr(self, f) != getattr(other, f)]


def _weights_fingerprint(model) -> str:
    h = hashlib.sha256()
    tensors = [getattr(model, "embed", None), getattr(model, "norm", None)]
    for layer in getattr(model, "layers", ()):
        tensors += [getattr(layer, "in_norm", None), getattr(layer, "post_norm", None)]
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t[[0, -1]] if t.dim() > 1 else t
            h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class PrefixSnapshot:
    """The cached full blocks that begin a token sequence, taken out of one engine.

    `kv` holds their K and V ([layers, blocks * block_size, 2, kv_heads, head_dim], on
    the CPU); `surprisal[i]` the surprisal (-log p, nats) of block i's positions where it
    was computed with them (entry 0 of block 0 is None: token 0 has none), None where not."""

    identity: CacheIdentity
    block_size: int
    token_ids: tuple[int, ...]  # the blocks' tokens: num_blocks * block_size of them
    keys: tuple[bytes, ...]
    kv: torch.Tensor
    surprisal: tuple[tuple[float | None, ...] | None, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def head(self, num_blocks: int) -> "PrefixSnapshot":
        """The snapshot of its first `num_blocks` blocks."""
        n = max(0, min(num_blocks, self.num_blocks))
        return replace(self, token_ids=self.token_ids[:n * self.block_size],
                       keys=self.keys[:n], kv=self.kv[:, :n * self.block_size],
                       surprisal=self.surprisal[:n])


def _slots(blocks: Sequence[int], block_size: int) -> torch.Tensor:
    ids = torch.tensor(list(blocks), dtype=torch.long)
    return (ids[:, None] * block_size + torch.arange(block_size)).view(-1)


def _require_prefix_caching(engine) -> None:
    if not engine.kv.prefix_caching:
        raise ValueError("prefix caching is off in this engine (enable_prefix_caching=False): "
                         "it has no cached blocks to export or import")


def export_prefix(engine, token_ids: Sequence[int]) -> PrefixSnapshot:
    """The longest run of published blocks in `engine` that begins `token_ids` (full blocks
    only; none if its first block is not cached), copied out."""
    _require_prefix_caching(engine)
    bs = engine.config.block_size
    keys, blocks = [], []
    for key in engine.kv.prefix_hashes(list(token_ids)):
        b = engine.pool.lookup(key)
        if b is None:
            break
        keys.append(key)
        blocks.append(b)
    cache = engine.runner.kv.kv
    kv = (cache[:, _slots(blocks, bs).to(cache.device)].cpu() if blocks  # indexing copies
          else cache.new_empty((cache.shape[0], 0, *cache.shape[2:]), device="cpu"))
    return PrefixSnapshot(CacheIdentity.of(engine.model), bs,
                          tuple(token_ids[:len(blocks) * bs]), tuple(keys), kv,
                          tuple(engine.pool.scores(b) for b in blocks))


def _validate(engine, snap: PrefixSnapshot) -> None:
    if not isinstance(snap, PrefixSnapshot):
        raise TypeError(f"expected a PrefixSnapshot, got {type(snap).__name__}")
    _require_prefix_caching(engine)
    mine = CacheIdentity.of(engine.model)
    differ = snap.identity.mismatch(mine)
    if differ:
        detail = "; ".join(f"{f}: snapshot {getattr(snap.identity, f)!r:.80}, engine "
                           f"{getattr(mine, f)!r:.80}" for f in differ)
        raise ValueError(f"the snapshot's KV is of another model or numerics ({detail})")
    bs = engine.config.block_size
    if snap.block_size != bs:
        raise ValueError(f"the snapshot's block size is {snap.block_size}, this engine's {bs}")
    n = snap.num_blocks
    cache = engine.runner.kv.kv
    shape = (cache.shape[0], n * bs, *cache.shape[2:])
    if tuple(snap.kv.shape) != shape or snap.kv.dtype != cache.dtype:
        raise ValueError(f"the snapshot's KV is {tuple(snap.kv.shape)} {snap.kv.dtype}, "
                         f"expected {shape} {cache.dtype}")
    if len(snap.token_ids) != n * bs or len(snap.surprisal) != n or any(
            s is not None and len(s) != bs for s in snap.surprisal):
        raise ValueError(f"the snapshot's tokens or surprisal do not cover its {n} blocks")
    if engine.kv.prefix_hashes(list(snap.token_ids)) != list(snap.keys):
        raise ValueError("the snapshot's keys are not its tokens' keys in this engine")


def import_prefix(engine, snap: PrefixSnapshot) -> int:
    """Write the snapshot's blocks into `engine`'s cache and publish them under their keys,
    as cached free blocks (they count as free memory, evicted least recently used first,
    as any cached block). Blocks the engine has cached already are kept (given the
    snapshot's surprisal if they had none). Returns how many blocks were written.
    Raises (changing nothing) on a snapshot of another model, dtype, kernels or block
    size, or if the pool has too few free blocks for the missing ones."""
    _validate(engine, snap)
    pool, bs = engine.pool, snap.block_size
    present = [pool.lookup(k) for k in snap.keys]
    missing = [i for i, b in enumerate(present) if b is None]
    held = [b for b in present if b is not None]
    free = pool.num_free - sum(pool.is_free(b) for b in held)
    if len(missing) > free:
        raise RuntimeError(f"importing {snap.num_blocks} blocks needs {len(missing)} free KV "
                           f"blocks; {free} are free (besides those it finds cached)")
    pool.share(held)  # referenced, so that allocating the missing ones cannot evict them
    chain = list(present)
    try:
        new = pool.allocate(len(missing))
        for i, b in zip(missing, new):
            chain[i] = b
        if new:
            cache = engine.runner.kv
            src = torch.cat([torch.arange(i * bs, (i + 1) * bs) for i in missing])
            cache.kv[:, _slots(new, bs).to(cache.kv.device)] = snap.kv[:, src].to(cache.kv.device)
            cache.update_key_bounds(new)
        for key, b, scores in zip(snap.keys, chain, snap.surprisal):
            pool.publish(b, key, scores)  # a block cached already: its scores filled in
    finally:
        # tail first, as a finished request frees them: a prefix's head is evicted last
        pool.free([b for b in reversed(chain) if b is not None])
    return len(missing)
