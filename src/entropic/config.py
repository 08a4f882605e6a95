"""Validated configuration dataclasses, built once and passed on (never mutated by owners)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a user-facing dtype name to a torch dtype, with a clear error."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype: unsupported {dtype}; use one of bfloat16, float32, float16")
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(
            f"dtype: unsupported {dtype!r}; use one of bfloat16, float32, float16"
        ) from None


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2)."""

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
