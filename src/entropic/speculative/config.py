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
    draft_dtype: str = "auto"  # as LLM(dtype=...): "auto" picks for this CPU
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


def add_speculative_args(p) -> None:
    """`--speculative-*` options of `entropic generate`, `chat` and `serve`."""
    p.add_argument("--speculative-method", choices=METHODS, default=None,
                   help="speculative decoding: ngram (prompt lookup) or draft_model "
                        "(default: off)")
    p.add_argument("--speculative-num-tokens", type=int, default=8,
                   help="most tokens drafted per request and step (default 8)")
    p.add_argument("--speculative-lookup-min", type=int, default=2,
                   help="shortest suffix match prompt lookup drafts from (default 2)")
    p.add_argument("--speculative-lookup-max", type=int, default=5,
                   help="longest suffix match prompt lookup tries first (default 5)")
    p.add_argument("--speculative-model", default=None,
                   help="draft_model: a smaller local model with the same tokenizer")
    p.add_argument("--speculative-quantization", choices=("int8", "int4"), default=None,
                   help="draft_model: weight-only quantized draft")
    p.add_argument("--speculative-gate", choices=GATES, default="entropy",
                   help="entropy (default): draft where the expected accepted tokens pay "
                        "for the verify rows; fixed: always draft the most tokens")
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                   help="no drafting when this many requests decode at once")


def speculative_from_args(args) -> SpeculativeConfig | None:
    """The SpeculativeConfig the `--speculative-*` options ask for (None: off)."""
    if args.speculative_method is None:
        return None
    return SpeculativeConfig(
        method=args.speculative_method, num_speculative_tokens=args.speculative_num_tokens,
        prompt_lookup_min=args.speculative_lookup_min,
        prompt_lookup_max=args.speculative_lookup_max, model=args.speculative_model,
        draft_quantization=args.speculative_quantization, gate=args.speculative_gate,
        disable_by_batch_size=args.speculative_disable_by_batch_size)
