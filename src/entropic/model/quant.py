"""Weight-only quantized formats: 4-bit groups (as GGUF's Q4_0/Q4_1) and 8-bit channels.

`Int4Blocks` holds a [N, K] weight as 4-bit codes with one scale and one offset per group
of `group_size` inputs: w = scale * q + offset, q in 0..15. GGUF Q4_1 blocks are exactly
this (scale d, offset m) and Q4_0 blocks are the case offset = -8 d, so a Q4 file's
projections load without requantization. Any other weight is rounded to nearest into the
same form (`quantize_int4`). Int8 is symmetric per output channel (`quantize_int8`).
The linear layers that run these formats are in `entropic.model.linear`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QUANTIZATIONS = ("int8", "int4")
INT4_GROUP = 32  # GGUF's Q4 block; also the group used when quantizing float weights


@dataclass
class Int4Blocks:
    """A [N, K] weight as 4-bit codes: w[n, k] = scale[n, k // g] * q[n, k] + offset[n, k // g]."""

    q: torch.Tensor  # [N, K] uint8, values 0..15
    scale: torch.Tensor  # [N, K // group_size] float32
    offset: torch.Tensor  # [N, K // group_size] float32
    group_size: int = INT4_GROUP

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these codes stand for."""
        n, k = self.q.shape
        groups = self.q.view(n, k // self.group_size, self.group_size).float()
        w = groups * self.scale[..., None] + self.offset[..., None]
        return w.view(n, k)

    def permute_rows(self, fn) -> Int4Blocks:
        """The same weight with its output rows reordered by `fn` (a function on [N, ...])."""
        return Int4Blocks(fn(self.q), fn(self.scale), fn(self.offset), self.group_size)

    def pack_group_pairs(self) -> torch.Tensor:
        """The codes two groups per 32 bytes, the layout of `entropic.int4_linear`: byte j
        of a pair holds element j of the even group (low nibble) and of the odd group (high
        nibble); an odd last group is paired with zeros. uint8 [N, 32 * ceil(groups / 2)]."""
        if self.group_size != 32:
            raise ValueError(f"the native int4 kernel needs groups of 32, got {self.group_size}")
        n, k = self.q.shape
        g = self.q.view(n, k // 32, 32)
        if g.shape[1] % 2:
            g = torch.cat((g, torch.zeros(n, 1, 32, dtype=g.dtype)), dim=1)
        g = g.view(n, -1, 2, 32)
        return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, -1).contiguous()

    @staticmethod
    def cat(parts: list[Int4Blocks]) -> Int4Blocks:
        """Stack weights along the output dimension (fused QKV, gate/up)."""
        groups = {p.group_size for p in parts}
        if len(groups) != 1:
            raise ValueError(f"cannot fuse 4-bit weights with group sizes {sorted(groups)}")
        return Int4Blocks(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.offset for p in parts]), groups.pop())


def q4_fields(blocks: torch.Tensor, q4_type: str
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """GGUF Q4_0 / Q4_1 blocks (uint8 [B, 18 or 20]) -> (d float32 [B], m float32 [B] or
    None for Q4_0, codes uint8 [B, 32]). A Q4_1 block is fp16 d, fp16 m, then 16 bytes whose
    low nibbles are elements 0..15 and high nibbles elements 16..31 (value d * q + m); Q4_0
    has no m (value d * (q - 8))."""
    d = blocks[:, 0:2].contiguous().view(torch.float16)[:, 0].float()
    m = blocks[:, 2:4].contiguous().view(torch.float16)[:, 0].float() if q4_type == "Q4_1" else None
    qs = blocks[:, 2 if m is None else 4:]
    return d, m, torch.cat((qs & 0x0F, qs >> 4), dim=1)


def int4_from_gguf(raw: np.ndarray, shape: tuple[int, int], q4_type: str) -> Int4Blocks:
    """Decode GGUF Q4_0 or Q4_1 rows (`raw`: uint8 [N, bytes per row]) into Int4Blocks
    (`q4_fields`; Q4_0's offset is -8 d)."""
    n, k = shape
    blocks = torch.from_numpy(np.array(raw)).view(n * (k // 32), -1)  # a writable copy
    d, m, codes = q4_fields(blocks, q4_type)
    if m is None:
        m = -8.0 * d
    return Int4Blocks(codes.reshape(n, k), d.view(n, k // 32), m.view(n, k // 32), 32)


def quantize_int4(w: torch.Tensor, group_size: int = INT4_GROUP) -> Int4Blocks:
    """Round a float [N, K] weight to nearest into 4-bit groups with scale and offset
    (the group's minimum), as Q4_1 does."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"4-bit quantization needs in_features ({k}) to be a multiple of "
                         f"the group size {group_size}")
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    return Int4Blocks(q.reshape(n, k), scale, lo, group_size)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q int8 [N, K], scale float32 [N]), w ~ q * scale."""
    w = w.float()
    scale = w.abs().amax(dim=1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale
