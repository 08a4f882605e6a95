"""Read a Hugging Face model directory (config.json + safetensors) into float32 tensors."""
from __future__ import annotations

import json
import os

import torch

from entropic.config import ModelConfig

# HF architecture class -> our family name (ModelConfig.name).
SUPPORTED_HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def eos_ids_from_dir(folder: str, cfg: dict | None = None) -> tuple[int, ...]:
    """EOS ids declared by config.json and generation_config.json, in order, deduplicated."""
    cfg = _read_json(os.path.join(folder, "config.json")) if cfg is None else cfg
    ids = _ids(cfg.get("eos_token_id"))
    gen_path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(gen_path):
        ids += _ids(_read_json(gen_path).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def _rope_theta(cfg: dict, path: str) -> float:
    # transformers 5 writes `rope_parameters`; 4.x wrote `rope_theta` and `rope_scaling`.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        # llama3/yarn/linear change the frequencies; ignoring them would give wrong logits.
        raise ValueError(f"{path}: RoPE scaling type {rope_type!r} is not supported")
    return float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)


def config_from_hf(cfg: dict, tensors: dict[str, torch.Tensor], folder: str) -> ModelConfig:
    """Build a ModelConfig from a parsed config.json (and the tensors, for bias and vocab)."""
    path = os.path.join(folder, "config.json")
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_HF_ARCHS), None)
    if arch is None:
        raise ValueError(f"{path}: unsupported architecture {archs or cfg.get('model_type')!r} "
                         f"(supported: {', '.join(SUPPORTED_HF_ARCHS)})")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{path}: activation {act!r} is not supported (only silu)")
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        layers, ffn = int(cfg["num_hidden_layers"]), int(cfg["intermediate_size"])
    except KeyError as e:
        raise ValueError(f"{path}: missing key {e.args[0]!r}") from None
    max_pos = int(cfg.get("max_position_embeddings") or 2048)
    # A sliding window at least as long as the sequence is plain causal attention, so cap the
    # context at the window (Mistral v0.1) instead of implementing the window.
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if window:
        max_pos = min(max_pos, int(window))
    embed = tensors.get("model.embed_tokens.weight")
    bos = cfg.get("bos_token_id")
    return ModelConfig(
        vocab_size=int(embed.shape[0]) if embed is not None else int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        max_position=max_pos,
        rope_theta=_rope_theta(cfg, path),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids_from_dir(folder, cfg),
        name=SUPPORTED_HF_ARCHS[arch],
    )


def _weight_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no weight_map")
        files = [os.path.join(folder, f) for f in dict.fromkeys(weight_map.values())]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{index}: shard files missing: {missing[:3]}")
        return files
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(
        f"{folder}: no safetensors weights (expected model.safetensors or "
        "model.safetensors.index.json; .bin checkpoints are not supported)"
    )


def read_hf_dir(folder: str, *, progress: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face model directory: (ModelConfig, HF-named float32 tensors).

    With tied embeddings any saved `lm_head.weight` is dropped (it equals the embedding).
    """
    from safetensors.torch import load_file

    folder = os.fspath(folder)
    cfg = _read_json(os.path.join(folder, "config.json"))
    files = _weight_files(folder)
    if progress:
        from tqdm import tqdm
        files = tqdm(files, desc="Loading weights", unit="file")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            shard = load_file(file, device="cpu")
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise ValueError(f"{file}: cannot read safetensors ({e})") from e
        for name, t in shard.items():
            if not name.endswith("rotary_emb.inv_freq"):  # old saves carry the RoPE buffer
                tensors[name] = t.to(torch.float32)
    config = config_from_hf(cfg, tensors, folder)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return config, tensors
