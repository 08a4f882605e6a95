"""Read a Hugging Face model directory (config.json + safetensors) into float32 tensors."""
from __future__ import annotations

import json
import os

import torch

from entropic.config import ModelConfig, RopeScaling
from entropic.model.family import HF_ARCHITECTURES, Family

# HF architecture class -> our family (ModelConfig.name); see entropic.model.family.
SUPPORTED_HF_ARCHS = {arch: fam.name for arch, fam in HF_ARCHITECTURES.items()}
# Multimodal checkpoints whose language model is a family we run, loaded text-only: the
# decoder's config is their text_config and its weights sit under one of these prefixes (old
# and new transformers layouts); the vision tower and projector are skipped.
TEXT_ONLY_HF_ARCHS = {
    "Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM",
                                       ("language_model.model.", "model.language_model.")),
}
# config.json activation names -> ours
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


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


def _rope(cfg: dict, path: str, layer_type: str) -> tuple[float, RopeScaling | None]:
    """(base, scaling) of the RoPE that layers of `layer_type` use.

    transformers 5 writes `rope_parameters` (per layer type where they differ, as Gemma 3's);
    4.x wrote `rope_theta` and `rope_scaling`, and Gemma 3 `rope_local_base_freq` for its
    sliding layers. Scalings we do not implement are an error: ignoring one would give
    wrong logits."""
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    elif any(isinstance(v, dict) for v in params.values()):
        params = params.get("full_attention") or {}
    local = layer_type == "sliding_attention"
    legacy = {} if local else (cfg.get("rope_scaling") or {})
    if local:  # Gemma 3's sliding layers: 10000 unless the config says otherwise
        theta = params.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0
    else:
        theta = params.get("rope_theta") or cfg.get("rope_theta") or 10000.0
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{path}: partial rotary embeddings (partial_rotary_factor {partial}) "
                         "are not supported")
    kind = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    if kind == "default":
        return float(theta), None
    src = params if params.get("rope_type") not in (None, "default") else legacy
    if kind not in RopeScaling.KINDS:
        raise ValueError(f"{path}: RoPE scaling type {kind!r} is not supported (supported: "
                         f"{', '.join(RopeScaling.KINDS)}, or none)")
    try:
        if kind == "linear":
            return float(theta), RopeScaling("linear", float(src["factor"]))
        return float(theta), RopeScaling(
            "llama3", float(src["factor"]), float(src["low_freq_factor"]),
            float(src["high_freq_factor"]), int(src["original_max_position_embeddings"]))
    except KeyError as e:
        raise ValueError(f"{path}: {kind} RoPE scaling lacks {e.args[0]!r}") from None


def _sliding_layers(cfg: dict, fam: Family, num_layers: int, max_pos: int,
                    path: str) -> tuple[int | None, tuple[int, ...]]:
    """(window, the layers that use it). `layer_types` decides where a config has it (what
    transformers 5 writes); older configs follow the family's rule. A window that covers the
    whole context is plain causal attention and is dropped."""
    window = cfg.get("sliding_window")
    if fam.window_rule == "qwen" and not cfg.get("use_sliding_window", False):
        window = None  # Qwen configs carry a window they do not use
    types = cfg.get("layer_types")
    if types is not None:
        if (not isinstance(types, list) or len(types) != num_layers
                or not set(types) <= {"full_attention", "sliding_attention"}):
            raise ValueError(f"{path}: layer_types must list full_attention or "
                             f"sliding_attention for each of the {num_layers} layers")
        layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
    elif not window:
        layers = []
    elif fam.window_rule == "all":
        layers = list(range(num_layers))
    elif fam.window_rule == "qwen":
        layers = list(range(int(cfg.get("max_window_layers") or 0), num_layers))
    else:
        every = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        layers = [i for i in range(num_layers) if (i + 1) % every]
    if not layers:
        return None, ()
    if not window or int(window) <= 0:
        raise ValueError(f"{path}: sliding_attention layers need a positive sliding_window")
    window = int(window)
    if window >= max_pos and not fam.local_rope:
        return None, ()  # every position sees its whole context anyway
    return window, tuple(layers)


def config_from_hf(cfg: dict, tensors: dict[str, torch.Tensor], folder: str) -> ModelConfig:
    """Build a ModelConfig from a parsed config.json (and the tensors, for bias and vocab)."""
    path = os.path.join(folder, "config.json")
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"{path}: unsupported architecture {archs or cfg.get('model_type')!r} "
                         f"(supported: {', '.join([*HF_ARCHITECTURES, *TEXT_ONLY_HF_ARCHS])})")
    fam = HF_ARCHITECTURES[arch]
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or fam.activation
    if _ACTIVATIONS.get(act) != fam.activation:
        raise ValueError(f"{path}: activation {act!r} is not supported for {arch}")
    for key in ("attn_logit_softcapping", "use_bidirectional_attention", "mlp_bias"):
        if cfg.get(key):
            raise ValueError(f"{path}: {key}={cfg[key]!r} is not supported")
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        layers, ffn = int(cfg["num_hidden_layers"]), int(cfg["intermediate_size"])
    except KeyError as e:
        raise ValueError(f"{path}: missing key {e.args[0]!r}") from None
    max_pos = int(cfg.get("max_position_embeddings") or 2048)
    window, sliding = _sliding_layers(cfg, fam, layers, max_pos, path)
    theta, scaling = _rope(cfg, path, "full_attention")
    local_theta = None
    if fam.local_rope:
        local_theta, local_scaling = _rope(cfg, path, "sliding_attention")
        if local_scaling is not None:
            raise ValueError(f"{path}: RoPE scaling on the sliding layers is not supported")
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    query_scale = None
    if cfg.get("query_pre_attn_scalar") is not None:
        query_scale = float(cfg["query_pre_attn_scalar"]) ** -0.5
    embed = tensors.get("model.embed_tokens.weight")
    bos = cfg.get("bos_token_id")
    softcap = cfg.get("final_logit_softcapping")
    return ModelConfig(
        vocab_size=int(embed.shape[0]) if embed is not None else int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        max_position=max_pos,
        rope_theta=theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        # absent from some configs: then a checkpoint without lm_head is tied
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", "lm_head.weight" not in tensors)),
        attention_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids_from_dir(folder, cfg),
        name=fam.name,
        rope_scaling=scaling,
        sliding_window=window,
        sliding_layers=sliding,
        local_rope_theta=local_theta,
        query_scale=query_scale,
        final_logit_softcap=None if softcap is None else float(softcap),
    )


def _split_fused(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Phi-3 stores q, k, v as one qkv_proj and gate, up as one gate_up_proj: split them
    into the Llama names (the model fuses them again, as it does for every family)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        qkv = tensors.pop(p + "self_attn.qkv_proj.weight", None)
        if qkv is not None:
            for n, t in zip("qkv", qkv.split([q, kv, kv])):
                tensors[p + f"self_attn.{n}_proj.weight"] = t.contiguous()
        gate_up = tensors.pop(p + "mlp.gate_up_proj.weight", None)
        if gate_up is not None:
            gate, up = gate_up.chunk(2)
            tensors[p + "mlp.gate_proj.weight"] = gate.contiguous()
            tensors[p + "mlp.up_proj.weight"] = up.contiguous()


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


def _text_only(cfg: dict):
    """For a multimodal checkpoint in TEXT_ONLY_HF_ARCHS: rewrite `cfg` in place as its
    language model's and return the tensor renaming (None: not loaded); else the identity."""
    archs = cfg.get("architectures") or []
    wrapper = next((a for a in archs if a in TEXT_ONLY_HF_ARCHS), None)
    if wrapper is None or any(a in HF_ARCHITECTURES for a in archs):
        return lambda name: name
    text_arch, prefixes = TEXT_ONLY_HF_ARCHS[wrapper]
    text = cfg.get("text_config") or {}
    tied = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings"))
    cfg.clear()
    cfg.update(text, architectures=[text_arch])
    if tied is not None:
        cfg["tie_word_embeddings"] = tied

    def rename(name: str) -> str | None:
        for prefix in prefixes:
            if name.startswith(prefix):
                return "model." + name[len(prefix):]
        return "lm_head.weight" if name.endswith("lm_head.weight") else None

    return rename


def read_hf_dir(folder: str, *, progress: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face model directory: (ModelConfig, HF-named float32 tensors).

    With tied embeddings any saved `lm_head.weight` is dropped (it equals the embedding).
    Fused projections (Phi-3) come back split into the Llama names, and Gemma's norm
    weights w as 1 + w, so every family's tensors have the same meaning. Multimodal
    checkpoints in TEXT_ONLY_HF_ARCHS load as their language model alone.
    """
    from safetensors.torch import load_file

    folder = os.fspath(folder)
    cfg = _read_json(os.path.join(folder, "config.json"))
    rename = _text_only(cfg)
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
            name = rename(name)
            if name is not None and not name.endswith("rotary_emb.inv_freq"):
                tensors[name] = t.to(torch.float32)  # (old saves carry the RoPE buffer)
    config = config_from_hf(cfg, tensors, folder)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    if config.family.fused_projections:
        _split_fused(config, tensors)
    if config.family.norm_plus_one:  # Gemma computes x * (1 + w): store 1 + w once
        for name, t in tensors.items():
            if name.endswith("norm.weight"):
                t.add_(1.0)
    return config, tensors
