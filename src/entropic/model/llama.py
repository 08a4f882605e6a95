"""Our own Llama-family forward (Llama, SmolLM2, Mistral, Qwen2) over a paged KV cache.

GQA, RoPE (HF "rotate half" layout), RMSNorm, SwiGLU, optional tied embeddings and q/k/v
bias. Q, K and V projections are fused into one matrix, gate and up into another.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from entropic import kernels as native
from entropic.config import ModelConfig
from entropic.model.attention import (AttentionMetadata, KVCache, native_prefill_supported,
                                      paged_attention)
from entropic.model.linear import (Int8Linear, Linear, NativeInt8Linear, check_quantization,
                                   make_linear, native_int4_available)
from entropic.model.quant import Int4Blocks


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, as the reference implementation does: the normalised
    activations are rounded to the model dtype before the weight multiplies them."""
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


class RotaryEmbedding:
    """cos/sin tables for all positions, built once (fp32, cast to the model dtype).

    HF rotates as x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1). We use
    the equal product roll(x) * sin_signed, roll(x) = cat(x2, x1) and sin_signed =
    cat(-sin1, sin2): a sign moves between exact factors, so every rounding is unchanged,
    and the rotation costs one copy instead of a negation and a concatenation."""

    def __init__(self, head_dim: int, max_position: int, theta: float, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                                 device=device).float() / head_dim))
        t = torch.arange(max_position, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype)
        sin = emb.sin().to(dtype)
        half = head_dim // 2
        self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin_signed for these positions, [T, 1, D]: once per step, for all layers."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    @staticmethod
    def apply_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
        """Rotate x [T, heads, D] in place (x may be a view into a larger buffer)."""
        rotated = x.roll(x.shape[-1] // 2, dims=-1).mul_(sin_signed)
        torch.add(x * cos, rotated, out=x)


def _take(tensors: dict[str, torch.Tensor], name: str, device: torch.device,
          dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor in the run dtype on the run device, with a clear error if missing."""
    try:
        t = tensors[name]
    except KeyError:
        raise ValueError(f"checkpoint is missing tensor {name!r}") from None
    if isinstance(t, Int4Blocks):
        t = t.dequantize()
    return t.to(device=device, dtype=dtype).contiguous()


@dataclass
class DecoderLayer:
    """One decoder layer's weights: norms as tensors, projections as prepared `Linear`s."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Linear  # q, k, v fused (with Qwen2's bias)
    o: Linear
    gate_up: Linear  # gate and up fused
    down: Linear

    @property
    def numel(self) -> int:
        return (self.in_norm.numel() + self.post_norm.numel() + self.qkv.numel + self.o.numel
                + self.gate_up.numel + self.down.numel)


class LlamaModel:
    """Weights as plain tensors and a functional forward; no nn.Module machinery needed.

    `packed_linears` (default) prepacks the projection weights for oneDNN where the device
    supports it (`entropic.model.linear`); False keeps plain `F.linear` everywhere.
    `quantization` "int4" runs the projections on 4-bit group weights (a checkpoint's Q4
    blocks as they are, other weights rounded to Q4_1-style groups) and "int8" on int8
    channel weights; both keep the lm_head in int8 per channel, and the embedding table,
    norms and activations in `dtype` (bf16).
    `kernels` "native" (the CPU default) runs RMSNorm, RoPE with the KV write, SiLU*up and
    decode attention on `entropic.kernels` (one call each instead of ~10 torch ops; decode
    attention reads the paged cache in place); "torch" keeps plain torch ops."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor | Int4Blocks],
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 packed_linears: bool = True, quantization: str | None = None,
                 kernels: str | None = None) -> None:
        check_quantization(quantization, dtype, device)
        kernels = native.default_kernels(device) if kernels is None else kernels
        native.check_kernels(kernels, device)
        if kernels == "native":
            if dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"kernels='native' support float32 and bfloat16, not "
                                 f"{str(dtype).removeprefix('torch.')}; use kernels='torch'")
            native.load()
        self.kernels = kernels
        # the ISA level the native kernels run at (entropic.kernels.isa()), None with torch's
        self.isa = native.isa() if kernels == "native" else None
        # decided once: prefill chunks on entropic's bf16 prefill attention, or on SDPA
        self.native_prefill = (kernels == "native"
                               and native_prefill_supported(dtype, config.head_dim))
        # weight-only int4/int8: entropic's kernels at every ISA level that has them (AVX2 or
        # better), else torch's
        self.quant_kernel = None
        if quantization is not None:
            self.quant_kernel = ("entropic" if kernels == "native" and native_int4_available()
                                 else "torch")
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.quantization = quantization
        c = config
        take = functools.partial(_take, tensors, device=self.device, dtype=dtype)
        self._raw = tensors
        self.embed = take("model.embed_tokens.weight")
        if self.embed.shape != (c.vocab_size, c.hidden_size):
            raise ValueError(f"embed_tokens has shape {tuple(self.embed.shape)}, expected "
                             f"{(c.vocab_size, c.hidden_size)}")
        self.tied = c.tie_word_embeddings
        # A tied lm_head gets its own (packed) copy: the lookup needs the plain table.
        head = self.embed if self.tied else take("lm_head.weight")
        if quantization:
            self.lm_head = (NativeInt8Linear(head) if self.quant_kernel == "entropic"
                            else Int8Linear(head))
        else:
            self.lm_head = make_linear(head, packed=packed_linears)
        self.norm = take("model.norm.weight")
        self.layers = [self._decoder_layer(take, f"model.layers.{i}.", packed_linears)
                       for i in range(c.num_layers)]
        del self._raw  # the checkpoint's tensors are not kept past construction
        self.rope = RotaryEmbedding(c.head_dim, c.max_position, c.rope_theta, dtype, self.device)
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim

    def _decoder_layer(self, take, prefix: str, packed: bool) -> DecoderLayer:
        """One layer's weights, q/k/v and gate/up fused into single matrices."""

        def linear(*names: str, bias: bool = False) -> Linear:
            b = torch.cat([take(prefix + n + ".bias") for n in names]) if bias else None
            raw = [self._raw.get(prefix + n + ".weight") for n in names]
            native_int4 = self.quant_kernel == "entropic"
            if self.quantization == "int4" and all(isinstance(r, Int4Blocks) for r in raw):
                return make_linear(Int4Blocks.cat(raw), b, quantization="int4",
                                   native_int4=native_int4)
            weight = torch.cat([take(prefix + n + ".weight") for n in names])
            return make_linear(weight, b, packed=packed, quantization=self.quantization,
                               native_int4=native_int4)

        return DecoderLayer(
            in_norm=take(prefix + "input_layernorm.weight"),
            post_norm=take(prefix + "post_attention_layernorm.weight"),
            qkv=linear(*(f"self_attn.{n}_proj" for n in "qkv"), bias=self.config.attention_bias),
            o=linear("self_attn.o_proj"),
            gate_up=linear("mlp.gate_proj", "mlp.up_proj"),
            down=linear("mlp.down_proj"),
        )

    @property
    def num_parameters(self) -> int:
        n = self.embed.numel() + self.norm.numel()
        if not self.tied:
            n += self.lm_head.numel
        return n + sum(layer.numel for layer in self.layers)

    def make_kv_cache(self, num_blocks: int, block_size: int, key_bounds: bool = False
                      ) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                       self.dtype, self.device, key_bounds=key_bounds)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache, logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]. Returns fp32 logits for the rows in logits_indices."""
        x = F.embedding(input_ids, self.embed)
        rope = self.rope.tables(positions)
        for i, layer in enumerate(self.layers):
            x = self._layer(layer, x, rope, meta, kv.kv[i])
        x = x[logits_indices]
        if self.kernels == "native":
            x = torch.ops.entropic.rms_norm(x, self.norm, self.config.rms_norm_eps)
        else:
            x = rms_norm(x, self.norm, self.config.rms_norm_eps)
        return self.lm_head(x).float()

    def _layer(self, w: DecoderLayer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """One decoder layer; updates x (the residual stream, [T, hidden]) in place."""
        c = self.config
        T = x.shape[0]
        if self.kernels == "native":
            ops = torch.ops.entropic
            qkv = w.qkv(ops.rms_norm(x, w.in_norm, c.rms_norm_eps))
            # q and k rotated in place, k and v written to their cache slots: one call
            ops.rope_kv_(qkv, rope[0], rope[1], kv_cache, meta.slot_mapping, c.num_heads,
                         c.num_kv_heads)
            q = qkv[:, :self.q_size].view(T, c.num_heads, c.head_dim)
            new_kv = qkv[:, self.q_size:].view(T, 2, c.num_kv_heads, c.head_dim)
            x += w.o(paged_attention(q, new_kv, kv_cache, meta, self.scale, native=True,
                                  native_prefill=self.native_prefill))
            x += w.down(ops.silu_mul(w.gate_up(ops.rms_norm(x, w.post_norm, c.rms_norm_eps))))
            return x
        qkv = w.qkv(rms_norm(x, w.in_norm, c.rms_norm_eps))
        # q and k are rotated together, in place in the qkv buffer; k and v then sit side by
        # side as [T, 2, KVH, D], exactly the cache's layout.
        qk = qkv[:, :self.q_size + self.kv_size].view(T, c.num_heads + c.num_kv_heads, c.head_dim)
        self.rope.apply_(qk, *rope)
        q = qkv[:, :self.q_size].view(T, c.num_heads, c.head_dim)
        new_kv = qkv[:, self.q_size:].view(T, 2, c.num_kv_heads, c.head_dim)
        x += w.o(paged_attention(q, new_kv, kv_cache, meta, self.scale))
        gate, up = w.gate_up(rms_norm(x, w.post_norm, c.rms_norm_eps)).chunk(2, dim=-1)
        x += w.down(F.silu(gate).mul_(up))
        return x
