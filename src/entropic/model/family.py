"""Model families: what each supported architecture changes in the Llama decoder.

Every family we run is a Llama decoder (pre-norm, GQA, RoPE, gated MLP) with a few
differences. A `Family` names those differences once; the loaders read a checkpoint's
numbers into a `ModelConfig` whose `name` is the family's, and the model chooses its ops
from `config.family` once, at load (docs/design.md, "Model families").

Per-checkpoint differences (q/k/v bias, tied head, sliding window and which layers use it,
RoPE scaling) are numbers in the `ModelConfig`, not family traits.
"""
from __future__ import annotations

from dataclasses import dataclass

ACTIVATIONS = ("silu", "gelu_tanh")
# How a config without `layer_types` places its sliding window on the layers:
#   "all"     every layer (Mistral, Phi-3)
#   "qwen"    layers from max_window_layers on, if use_sliding_window (Qwen2, Qwen3)
#   "pattern" all but every sliding_window_pattern-th layer (Gemma 3, pattern 6)
WINDOW_RULES = ("all", "qwen", "pattern")


@dataclass(frozen=True)
class Family:
    """The fixed traits of one architecture (Hugging Face class names in `hf_architectures`,
    the llama.cpp name in `gguf_architecture`)."""

    name: str
    hf_architectures: tuple[str, ...]
    gguf_architecture: str | None = None
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # RMSNorm on the attention and MLP outputs too (Gemma 3)
    norm_plus_one: bool = False  # HF checkpoints store w and scale by (1 + w) (Gemma)
    activation: str = "silu"  # the gate's activation: SwiGLU ("silu") or GeGLU ("gelu_tanh")
    scaled_embedding: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    fused_projections: bool = False  # checkpoint has qkv_proj and gate_up_proj (Phi-3)
    window_rule: str = "all"
    local_rope: bool = False  # sliding layers have their own RoPE base (Gemma 3)

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"family {self.name}: activation must be one of {ACTIVATIONS}")
        if self.window_rule not in WINDOW_RULES:
            raise ValueError(f"family {self.name}: window_rule must be one of {WINDOW_RULES}")

    @property
    def plain(self) -> bool:
        """Whether the layer is exactly Llama's (the fast path; q/k/v bias allowed)."""
        return not (self.qk_norm or self.sandwich_norms or self.activation != "silu")


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", ("LlamaForCausalLM",), "llama"),
    Family("mistral", ("MistralForCausalLM",)),  # llama.cpp writes Mistral GGUFs as "llama"
    Family("qwen2", ("Qwen2ForCausalLM",), "qwen2", window_rule="qwen"),
    Family("qwen3", ("Qwen3ForCausalLM",), "qwen3", qk_norm=True, window_rule="qwen"),
    Family("phi3", ("Phi3ForCausalLM",), fused_projections=True),
    Family("gemma3", ("Gemma3ForCausalLM",), "gemma3", qk_norm=True, sandwich_norms=True,
           norm_plus_one=True, activation="gelu_tanh", scaled_embedding=True,
           window_rule="pattern", local_rope=True),
)}

HF_ARCHITECTURES: dict[str, Family] = {a: f for f in FAMILIES.values()
                                       for a in f.hf_architectures}
GGUF_ARCHITECTURES: dict[str, Family] = {f.gguf_architecture: f for f in FAMILIES.values()
                                         if f.gguf_architecture}


def family(name: str) -> Family:
    """The family called `name`, with a clear error for an unknown one."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r} (known: {', '.join(FAMILIES)})") from None
