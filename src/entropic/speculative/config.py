"""Validated configuration of speculative decoding (vLLM's parameter names where they exist)."""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
GATES = ("entropy", "fixed")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to draft and when.

    - method: "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence
      of the sequence's last n tokens, n from prompt_lookup_max down to prompt_lookup_min) or
      "draft_model" (greedy drafts of `model`, a smaller model with the same tokenizer).
    - num_speculative_tokens: the most tokens drafted per request and step.
    - gate: "entropy" (default) drafts only where the expected accepted tokens pay for the
      measured cost of the verify rows, estimated online per entropy bin and match-length
      bin; "fixed" always drafts num_speculative_tokens where a draft exists (the control
      of the benchmarks, like plain prompt lookup elsewhere).
    - disable_by_batch_size: no drafting when this many or more requests decode in a step
      (None: the gate's cost rule alone decides).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 8
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None  # draft_model: local GGUF file or Hugging Face directory
    draft_dtype: str = "bfloat16"
    draft_quantization: str | None = None
    gate: str = "entropy"
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if self.gate not in GATES:
            raise ValueError(f"speculative gate must be one of {GATES}, got {self.gate!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 64:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 64], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 32:
                raise ValueError(f"{name} must be an integer in [1, 32], got {v!r}")
        if lo > hi:
            raise ValueError(f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs model= (a local GGUF file "
                             "or Hugging Face directory of a smaller model, same tokenizer)")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative model= is used by method 'draft_model' only")
        b = self.disable_by_batch_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"disable_by_batch_size must be a positive integer or None, got {b!r}")
