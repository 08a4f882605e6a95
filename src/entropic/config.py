"""Validated configuration dataclasses, built once and passed on (never mutated by owners)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from entropic.model.family import Family, family

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a user-facing dtype name to a torch dtype, with a clear error ("auto" is
    resolved by `choose_dtype`, which knows the device)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype: unsupported {dtype}; use one of auto, bfloat16, float32, "
                             f"float16")
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(
            f"dtype: unsupported {dtype!r}; use one of auto, bfloat16, float32, float16"
        ) from None


# CPU flags that mean bf16 arithmetic in hardware (oneDNN's bf16 matmuls run on them;
# without them it emulates bf16 through fp32 at a fraction of fp32's speed)
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def choose_dtype(dtype: str | torch.dtype, device: str, quantization: str | None,
                 cpu_flags: str | None = None) -> tuple[torch.dtype, str]:
    """The weight/activation dtype to load with, and why. `dtype="auto"` (the default)
    picks, among the formats within the fidelity bounds of docs/performance.md, the fastest
    for this device: bfloat16 on a CPU with bf16 arithmetic (avx512_bf16 or amx_bf16) and
    off the CPU; float32 on a CPU without it, where bf16 is emulated (on an AVX-512 Xeon
    without bf16: 2.2x slower at 16 requests, 2.6x slower on a 2k prefill; docs/performance.md);
    bfloat16 whenever int4/int8 is asked for (their kernels take bf16 activations). Any other
    value is taken as given. `cpu_flags` (a /proc/cpuinfo flags line) is for tests.
    ENTROPIC_ISA forcing a native level below avx512bf16 counts as a CPU without bf16."""
    if not (isinstance(dtype, str) and dtype.lower() == "auto"):
        chosen = resolve_dtype(dtype)
        return chosen, f"{dtype_name(chosen)}: as asked"
    if quantization is not None:
        return torch.bfloat16, (f"bfloat16: quantization={quantization!r} runs its kernels on "
                                f"bf16 activations")
    if torch.device(device).type != "cpu":
        return torch.bfloat16, f"bfloat16: the default off the CPU ({device})"
    from entropic import kernels

    flags = set((cpu_flags if cpu_flags is not None else kernels.cpu_flags_line()).split())
    hardware = [f for f in BF16_CPU_FLAGS if f in flags]
    forced = os.environ.get("ENTROPIC_ISA")
    if hardware and forced not in (None, "", "amx", "avx512bf16"):
        return torch.float32, (f"float32: ENTROPIC_ISA={forced} forces kernels without bf16 "
                               f"arithmetic")
    if hardware:
        return torch.bfloat16, (f"bfloat16: this CPU computes bf16 in hardware "
                                f"({', '.join(hardware)})")
    return torch.float32, ("float32: this CPU has no bf16 arithmetic (no avx512_bf16 or "
                           "amx_bf16), where bf16 is emulated and slower than fp32")


QUANTIZATIONS = ("auto", "int4", "int8")

# quantization="auto", per native kernel level: the largest max_num_seqs at which a
# checkpoint's own 4-bit weights on entropic's int4 kernels were measured to decode at least
# as fast as the float format dtype="auto" picks there, at every batch size up to it
# (docs/performance.md, "quantization='auto'"). A level without a measurement is absent, and
# auto keeps the float path there.
INT4_AUTO_MAX_SEQS = {
    "amx": 2,  # Sapphire Rapids, 2026-12-06: 2.6x bf16 at 1 and 2.4x at 2 requests, 1.1x at
    # 4 (rounds 0.9-1.5x: not clearly faster), 0.74x at 8
    "avx512bf16": 1,  # AMD EPYC, 2026-12-03: 2.6x bf16 at 1 request, 0.6x at 16
    # Xeon without bf16, 2026-12-03: 4.3x fp32 at 1 request, 0.87x at 16; forced on Sapphire
    # Rapids (--emulate-isa avx512), 2026-12-06: 3.3x at 2, 2.2x at 4, 1.3x at 8, every round
    "avx512": 8,
    # (the batch > 1 figures of 2026-12-06 let ours' prefix cache serve the repeated prompts'
    # prefills, which hid int4's slower prefill: avx512's 8 is not yet re-measured without it)
    # A real AVX2 EPYC, 2026-12-07, in alternation with the cache off (benchmarks/
    # peers_alternating.py, 4 rounds, 64 new tokens): int4 2.8x fp32 at 2, 1.5x at 4 (every
    # round), 0.91x at 8 (rounds 0.84-1.06); with the fused decode stack and the 4-column
    # int4 tile (same CPU, later that day): 1.32x at 8 (every round 1.30-1.49x), 1.03x at 16
    # (rounds 0.91-1.17x: level)
    "avx2": 8,
}


def choose_quantization(quantization: str | None, *, dtype: str | torch.dtype, device: str,
                        kernels: str | None, max_num_seqs: int,
                        level: str | None = None) -> tuple[str | None, str]:
    """The quantization to load with, and why. `quantization="auto"` picks int4 (the
    checkpoint's own 4-bit weights on entropic's int4 kernels) where that was measured to
    pay: on a CPU whose native kernel level has a measured `INT4_AUTO_MAX_SEQS` at least
    `max_num_seqs` (a small-batch engine: at larger batches the float kernels win), with
    bf16 activations allowed (dtype auto or bfloat16) and entropic's kernels; else None (the
    float path). Whether the checkpoint holds 4-bit weights is known only after reading it:
    `confirm_int4` settles that. `level` (an ISA level) is for tests; by default the native
    kernels' own (`entropic.kernels.isa()`, which loads them). Other values are taken as
    given, or refused with the accepted ones."""
    if quantization is None:
        return None, "none: as asked"
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None, 'auto', 'int8' or 'int4', got "
                         f"{quantization!r}")
    if quantization != "auto":
        return quantization, f"{quantization}: as asked"
    if torch.device(device).type != "cpu":
        return None, f"none: quantization='auto' picks int4 on the CPU only, not on {device}"
    if not (isinstance(dtype, str) and dtype.lower() == "auto") and \
            resolve_dtype(dtype) != torch.bfloat16:
        return None, (f"none: int4 runs on bf16 activations and dtype="
                      f"{dtype_name(resolve_dtype(dtype))} was asked")
    if kernels == "torch":
        return None, "none: int4 pays on entropic's native kernels only, and kernels='torch'"
    if level is None:
        from entropic import kernels as native

        try:
            level = native.isa()
        except native.KernelBuildError as e:
            return None, f"none: the native kernels could not be built ({e})"
    limit = INT4_AUTO_MAX_SEQS.get(level)
    if limit is None:
        return None, (f"none: int4 was not measured against the float path at the {level} "
                      f"kernel level")
    if max_num_seqs > limit:
        return None, (f"none: int4 decodes faster than floats at the {level} level only up "
                      f"to {limit} running request(s) (docs/performance.md), and max_num_seqs "
                      f"is {max_num_seqs}")
    return "int4", (f"int4: the checkpoint's 4-bit weights decode faster than floats at "
                    f"the {level} level up to {limit} running request(s), and max_num_seqs is "
                    f"{max_num_seqs}")


def confirm_int4(chosen: str | None, reason: str, asked: str | None,
                 tensors: dict) -> tuple[str | None, str]:
    """`choose_quantization`'s answer once the checkpoint is read: an automatic int4 stands
    only if every projection weight is stored in 4 bits (GGUF Q4_0 / Q4_1); rounding float
    weights to 4 bits is a fidelity change that only an explicit quantization='int4' makes."""
    if asked != "auto" or chosen != "int4":
        return chosen, reason
    from entropic.model.quant import Int4Blocks

    proj = [t for n, t in tensors.items() if n.endswith("_proj.weight")]
    if not proj or not all(isinstance(t, Int4Blocks) for t in proj):
        return None, ("none: the checkpoint's projections are not all stored in 4 bits, and "
                      "quantization='auto' does not round weights")
    return chosen, reason


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency scaling (`rope_type` in a Hugging Face config): "linear" divides
    every frequency by `factor`; "llama3" divides the low frequencies by `factor`, keeps the
    high ones and interpolates between (Llama 3.1); "freq_factors" divides frequency i by
    `freq_factors[i]` (llama.cpp's `rope_freqs` tensor, how its GGUFs store llama3's)."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position: int = 8192  # llama3 only
    freq_factors: tuple[float, ...] = ()  # freq_factors only, one per frequency

    KINDS = ("linear", "llama3", "freq_factors")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"RoPE scaling type {self.kind!r} is not supported "
                             f"(supported: {', '.join(self.KINDS)}, or none)")
        if not self.factor > 0:
            raise ValueError(f"RoPE scaling factor must be positive, got {self.factor}")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError("llama3 RoPE scaling needs high_freq_factor > low_freq_factor")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder. `name` is its family (`entropic.model.family`:
    llama, mistral, qwen2, qwen3, phi3, gemma3), whose fixed traits `family` returns; the
    fields below are one checkpoint's numbers."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 puts a bias on q, k and v
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "llama"
    rope_scaling: RopeScaling | None = None
    # Layers in `sliding_layers` attend to the last `sliding_window` positions only (their
    # own included); the others to the whole context.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None  # RoPE base of the sliding layers, if their own
    query_scale: float | None = None  # attention scale; None: 1 / sqrt(head_dim)
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, f) <= 0:
                raise ValueError(f"model config: {f} must be positive, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        family(self.name)  # a clear error for an unknown family
        if self.sliding_layers:
            if not self.sliding_window or self.sliding_window <= 0:
                raise ValueError("model config: sliding_layers need a positive sliding_window")
            if not all(0 <= i < self.num_layers for i in self.sliding_layers):
                raise ValueError(f"model config: sliding_layers {self.sliding_layers} out of "
                                 f"range for {self.num_layers} layers")

    @property
    def family(self) -> Family:
        """The fixed traits of this model's architecture."""
        return family(self.name)

    @property
    def attention_horizon(self) -> int | None:
        """How far back any layer attends: the sliding window if every layer has one (the
        KV of positions farther back is never read again), None if some layer attends the
        whole context (Gemma 3's global layers)."""
        if len(set(self.sliding_layers)) == self.num_layers:
            return self.sliding_window
        return None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, at 2 bytes (bf16) per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits. KV capacity is given in blocks or in GiB (blocks wins if both)."""

    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int | None = None
    kv_cache_gib: float = 1.0
    max_model_len: int | None = None  # None: the model's own context length
    # share the KV of full blocks between requests with the same prefix
    # (docs/prefix_caching.md)
    enable_prefix_caching: bool = True
    # give back a request's blocks older than every layer's sliding window (only on models
    # whose every layer has one: Mistral, Phi-3; docs/windows.md)
    free_outside_window: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.num_kv_blocks is None and not self.kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be positive, got {self.kv_cache_gib}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool, "
                            f"got {self.enable_prefix_caching!r}")
        if not isinstance(self.free_outside_window, bool):
            raise TypeError(f"free_outside_window must be a bool, "
                            f"got {self.free_outside_window!r}")

    def resolve_num_blocks(self, model: ModelConfig, dtype: torch.dtype) -> int:
        """Number of KV blocks: given directly, or derived from the GiB budget."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        elem = torch.empty((), dtype=dtype).element_size()
        per_block = 2 * model.num_layers * model.num_kv_heads * model.head_dim * elem * self.block_size
        blocks = int(self.kv_cache_gib * (1 << 30) // per_block)
        if blocks <= 0:
            raise ValueError(f"kv_cache_gib={self.kv_cache_gib} is too small for one KV block")
        return blocks
