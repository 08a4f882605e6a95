"""The kernel backend of a model: which implementation runs its per-layer ops, chosen once.

`native`: entropic's C++ CPU kernels (`entropic.kernels`) for RMSNorm, RoPE with the KV
write, SiLU*up, decode attention (and prefill attention and the int4/int8 linears where the
ISA level has them); `torch`: plain PyTorch ops on any device. The model, the model runner
and the engine ask this object what runs, never a name: it is the seam another device's
kernels would plug into.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from entropic import kernels as native


@dataclass(frozen=True)
class KernelBackend:
    name: str  # "native" or "torch"
    isa: str | None = None  # the native kernels' ISA level (entropic.kernels.isa())
    prefill_attention: bool = False  # prefill chunks on entropic's kernel, else SDPA
    quantized_linear: bool = False  # int4/int8 projections on entropic's kernels

    @property
    def native(self) -> bool:
        """The native kernels run the small ops, decode attention and the sampler's row
        statistics (each row read in place from the paged cache)."""
        return self.name == "native"


TORCH = KernelBackend("torch")


def select_backend(kernels: str | None, device: torch.device | str, dtype: torch.dtype,
                   head_dim: int) -> KernelBackend:
    """The backend for a model of `dtype` and `head_dim` on `device`: `kernels` as asked
    ("native" or "torch"), or the device's default (None: native on the CPU). Loads (and
    the first time builds) the native kernels; raises ValueError for a choice that cannot
    run there."""
    kernels = native.default_kernels(device) if kernels is None else kernels
    native.check_kernels(kernels, device)
    if kernels == "torch":
        return TORCH
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"kernels='native' support float32 and bfloat16, not "
                         f"{str(dtype).removeprefix('torch.')}; use kernels='torch'")
    native.load()
    ops = torch.ops.entropic
    return KernelBackend(
        "native", native.isa(),
        prefill_attention=head_dim % 64 == 0 and bool(ops.prefill_attention_supported()),
        quantized_linear=bool(ops.int4_linear_supported()))
