"""Our own Llama-family forward (Llama, SmolLM2, Mistral, Qwen2) over a paged KV cache.

GQA, RoPE (HF "rotate half" layout), RMSNorm, SwiGLU, optional tied embeddings and q/k/v
bias. Q, K and V projections are fused into one matrix, gate and up into another.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from entropic.config import ModelConfig
from entropic.model.attention import AttentionMetadata, KVCache, paged_attention


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, as the reference implementation does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RotaryEmbedding:
    """cos/sin tables for all positions, built once (fp32, cast to the model dtype)."""

    def __init__(self, head_dim: int, max_position: int, theta: float, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                                 device=device).float() / head_dim))
        t = torch.arange(max_position, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D]; cos, sin: [T, 1, D]."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


class LlamaModel:
    """Weights as plain tensors and a functional forward; no nn.Module machinery needed."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        c = config

        def take(name: str) -> torch.Tensor:
            try:
                t = tensors[name]
            except KeyError:
                raise ValueError(f"checkpoint is missing tensor {name!r}") from None
            return t.to(device=self.device, dtype=dtype).contiguous()

        self.embed = take("model.embed_tokens.weight")
        if self.embed.shape != (c.vocab_size, c.hidden_size):
            raise ValueError(f"embed_tokens has shape {tuple(self.embed.shape)}, expected "
                             f"{(c.vocab_size, c.hidden_size)}")
        self.lm_head = self.embed if c.tie_word_embeddings else take("lm_head.weight")
        self.norm = take("model.norm.weight")
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], 0)
            bias = None
            if c.attention_bias:
                bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"], 0)
            self.layers.append({
                "in_norm": take(p + "input_layernorm.weight"),
                "post_norm": take(p + "post_attention_layernorm.weight"),
                "qkv": qkv.contiguous(),
                "qkv_bias": bias,
                "o": take(p + "self_attn.o_proj.weight"),
                "gate_up": torch.cat([take(p + "mlp.gate_proj.weight"),
                                      take(p + "mlp.up_proj.weight")], 0).contiguous(),
                "down": take(p + "mlp.down_proj.weight"),
            })
        self.rope = RotaryEmbedding(c.head_dim, c.max_position, c.rope_theta, dtype, self.device)
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim

    @property
    def num_parameters(self) -> int:
        n = self.embed.numel() + self.norm.numel()
        if self.lm_head is not self.embed:
            n += self.lm_head.numel()
        for layer in self.layers:
            n += sum(t.numel() for t in layer.values() if t is not None)
        return n

    def make_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                       self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache, logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]. Returns fp32 logits for the rows in logits_indices."""
        c = self.config
        T = input_ids.shape[0]
        x = F.embedding(input_ids, self.embed)
        cos = self.rope.cos[positions].unsqueeze(1)
        sin = self.rope.sin[positions].unsqueeze(1)
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w["in_norm"], c.rms_norm_eps)
            qkv = F.linear(h, w["qkv"], w["qkv_bias"])
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.rope.apply(q.view(T, c.num_heads, c.head_dim), cos, sin)
            k = self.rope.apply(k.view(T, c.num_kv_heads, c.head_dim), cos, sin)
            v = v.reshape(T, c.num_kv_heads, c.head_dim)
            a = paged_attention(q, k, v, kv.k[i], kv.v[i], meta, self.scale)
            x = x + F.linear(a.view(T, self.q_size), w["o"])
            h = rms_norm(x, w["post_norm"], c.rms_norm_eps)
            gate, up = F.linear(h, w["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w["down"])
        x = rms_norm(x[logits_indices], self.norm, c.rms_norm_eps)
        return F.linear(x, self.lm_head).float()
