"""Our own Llama-family forward over a paged KV cache: Llama, SmolLM2, Mistral, Qwen2,
Qwen3, Phi-3 and Gemma 3 (what each family changes: `entropic.model.family`).

GQA, RoPE (HF "rotate half" layout, optionally scaled), RMSNorm, SwiGLU or GeGLU, optional
tied embeddings, q/k/v bias, q/k norms, sandwich norms and sliding-window layers. Q, K and V
projections are fused into one matrix, gate and up into another.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from entropic.config import ModelConfig, RopeScaling
from entropic.kernels.backend import select_backend
from entropic.model.attention import AttentionMetadata, KVCache, paged_attention, window_metadata
from entropic.model.linear import (Int8Linear, Linear, NativeInt4Linear, NativeInt8Linear,
                                   check_quantization, make_linear)
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
                 device: torch.device | str, scaling: RopeScaling | None = None) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                                 device=device).float() / head_dim))
        if scaling is not None:
            inv_freq = scaled_frequencies(inv_freq, scaling)
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


def scaled_frequencies(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """RoPE frequencies under a scaling. "linear" divides them all by the factor (position
    interpolation), "freq_factors" each by its own. "llama3" (Llama 3.1): wavelengths longer than original_max_position /
    low_freq_factor are divided by the factor, shorter than original_max_position /
    high_freq_factor kept, and those between interpolated linearly in
    original_max_position / wavelength."""
    if s.kind == "linear":
        return inv_freq / s.factor
    if s.kind == "freq_factors":
        if len(s.freq_factors) != inv_freq.numel():
            raise ValueError(f"RoPE has {inv_freq.numel()} frequencies, rope_freqs "
                             f"{len(s.freq_factors)} factors")
        return inv_freq / torch.tensor(s.freq_factors, dtype=inv_freq.dtype,
                                       device=inv_freq.device)
    wavelen = 2 * math.pi / inv_freq
    ratio = s.original_max_position / wavelen  # periods over the original context
    smooth = ((ratio - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).clamp(0, 1)
    return (1 - smooth) * inv_freq / s.factor + smooth * inv_freq


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
    """One decoder layer's weights: norms as tensors, projections as prepared `Linear`s.
    The optional norms are those of families that have them (`Family.qk_norm`,
    `Family.sandwich_norms`); `window` is the layer's sliding window (None: full context)
    and `rope` the index of its RoPE tables in `LlamaModel.ropes`."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor  # before the MLP
    qkv: Linear  # q, k, v fused (with Qwen2's bias)
    o: Linear
    gate_up: Linear  # gate and up fused
    down: Linear
    q_norm: torch.Tensor | None = None  # over each head, before RoPE
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # on the attention output, before the residual
    mlp_out_norm: torch.Tensor | None = None  # on the MLP output, before the residual
    window: int | None = None
    rope: int = 0


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
        self.backend = select_backend(kernels, device, dtype, config.head_dim)
        # the ISA level the native kernels run at (entropic.kernels.isa()), None with torch's
        self.isa = self.backend.isa
        # decided once: prefill chunks on entropic's prefill attention (bf16 or fp32), or SDPA
        self.native_prefill = self.backend.prefill_attention
        # weight-only int4/int8: entropic's kernels at every ISA level that has them (AVX2 or
        # better), else torch's
        self.quant_kernel = None
        if quantization is not None:
            self.quant_kernel = "entropic" if self.backend.quantized_linear else "torch"
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
        self.family = fam = c.family
        self.layers = [self._decoder_layer(take, i, packed_linears) for i in range(c.num_layers)]
        del self._raw  # the checkpoint's tensors are not kept past construction
        self.ropes = [RotaryEmbedding(c.head_dim, c.max_position, c.rope_theta, dtype,
                                      self.device, c.rope_scaling)]
        if c.local_rope_theta is not None:
            self.ropes.append(RotaryEmbedding(c.head_dim, c.max_position, c.local_rope_theta,
                                              dtype, self.device))
        self.rope = self.ropes[0]
        self.scale = c.query_scale if c.query_scale is not None else 1.0 / math.sqrt(c.head_dim)
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        # chosen once: the layer function and the few per-family ops
        self.windows = sorted({w.window for w in self.layers if w.window is not None})
        self.plain_layers = fam.plain and not self.windows  # Llama's own layer, `_layer`
        self.embed_scale = (torch.tensor(math.sqrt(c.hidden_size), dtype=dtype, device=self.device)
                            if fam.scaled_embedding else None)
        native_ops = self.backend.native
        # a pure decode step's layers in one native call where every layer can take it;
        # `fused_decode` switches it (tests and benchmarks/decode_stack.py compare the loop)
        self._stack = self._decode_stack() if native_ops and self.plain_layers else None
        self.fused_decode = self._stack is not None
        self._norm = torch.ops.entropic.rms_norm if native_ops else rms_norm
        if fam.activation == "silu":
            self._act_mul = torch.ops.entropic.silu_mul if native_ops else _silu_mul
        else:
            self._act_mul = _gelu_tanh_mul

    def _decoder_layer(self, take, index: int, packed: bool) -> DecoderLayer:
        """One layer's weights, q/k/v and gate/up fused into single matrices."""
        prefix, c, fam = f"model.layers.{index}.", self.config, self.config.family

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

        def norm(name: str) -> torch.Tensor:
            return take(prefix + name + ".weight")

        sliding = index in c.sliding_layers
        layer = DecoderLayer(
            in_norm=norm("input_layernorm"),
            # Gemma's post_attention_layernorm is on the attention output (sandwich), its
            # pre-MLP norm is pre_feedforward_layernorm
            post_norm=norm("pre_feedforward_layernorm" if fam.sandwich_norms
                           else "post_attention_layernorm"),
            qkv=linear(*(f"self_attn.{n}_proj" for n in "qkv"), bias=c.attention_bias),
            o=linear("self_attn.o_proj"),
            gate_up=linear("mlp.gate_proj", "mlp.up_proj"),
            down=linear("mlp.down_proj"),
            window=c.sliding_window if sliding else None,
            rope=1 if sliding and c.local_rope_theta is not None else 0,
        )
        if fam.qk_norm:
            layer.q_norm, layer.k_norm = norm("self_attn.q_norm"), norm("self_attn.k_norm")
        if fam.sandwich_norms:
            layer.attn_out_norm = norm("post_attention_layernorm")
            layer.mlp_out_norm = norm("post_feedforward_layernorm")
        return layer

    def _decode_stack(self) -> list[torch.Tensor] | None:
        """The weights `entropic.decode_layers_` takes (14 a layer), if every projection is
        entropic's int4 linear without bias; else None."""
        stack = []
        for w in self.layers:
            linears = (w.qkv, w.o, w.gate_up, w.down)
            if not all(type(p) is NativeInt4Linear and p.bias is None for p in linears):
                return None
            stack += [w.in_norm, w.post_norm]
            for p in linears:
                stack += [p.weight, p.scale, p.offsets]
        return stack

    def _fused_group(self, meta: AttentionMetadata, rows: int):
        """The decode group if this step can run as one `decode_layers_` call: decode rows
        only, in one group in batch order (rows with a block budget select in each layer, as
        the layer loop's attention does)."""
        if (not self.fused_decode or self._stack is None or meta.prefills
                or meta.num_decode != rows
                or len(meta.decode_groups) != 1 or meta.decode_order is not None):
            return None
        g = meta.decode_groups[0]
        return g if g.start == 0 and g.end == rows else None

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
        if self.embed_scale is not None:
            x *= self.embed_scale
        if self.plain_layers:
            rope = self.rope.tables(positions)
            g = self._fused_group(meta, x.shape[0])
            if g is not None:
                c = self.config
                sel = g.selection
                extra = () if sel is None else (g.keep, sel.block_size, sel.bounds_offset,
                                                 sel.sink, sel.recent)
                torch.ops.entropic.decode_layers_(
                    x, self._stack, kv.kv, meta.slot_mapping, rope[0], rope[1],
                    g.slots.view(g.end, g.ctx), g.lengths, g.mass, self.scale, c.rms_norm_eps,
                    c.num_heads, c.num_kv_heads, *extra)
            else:
                for i, layer in enumerate(self.layers):
                    x = self._layer(layer, x, rope, meta, kv.kv[i])
        else:
            # built once per step for all layers: each RoPE's tables, each window's metadata
            ropes = [r.tables(positions) for r in self.ropes]
            metas = {None: meta} | {w: window_metadata(meta, w) for w in self.windows}
            for i, layer in enumerate(self.layers):
                x = self._layer_general(layer, x, ropes[layer.rope], metas[layer.window],
                                        kv.kv[i])
        x = x[logits_indices]
        if self.backend.native:
            x = torch.ops.entropic.rms_norm(x, self.norm, self.config.rms_norm_eps)
        else:
            x = rms_norm(x, self.norm, self.config.rms_norm_eps)
        logits = self.lm_head(x).float()
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits

    def _layer(self, w: DecoderLayer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """One decoder layer; updates x (the residual stream, [T, hidden]) in place."""
        c = self.config
        T = x.shape[0]
        if self.backend.native:
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

    def _layer_general(self, w: DecoderLayer, x: torch.Tensor,
                       rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                       kv_cache: torch.Tensor) -> torch.Tensor:
        """One decoder layer of any family (q/k norms, sandwich norms, GeGLU, a sliding
        window); updates x in place. `meta` is already this layer's window's."""
        c, eps, norm = self.config, self.config.rms_norm_eps, self._norm
        T = x.shape[0]
        native = self.backend.native
        qkv = w.qkv(norm(x, w.in_norm, eps))
        if w.q_norm is not None:  # per head, in place in the qkv buffer, before RoPE
            q = qkv[:, :self.q_size].view(T, c.num_heads, c.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, c.num_kv_heads, c.head_dim)
            q.copy_(rms_norm(q, w.q_norm, eps))
            k.copy_(rms_norm(k, w.k_norm, eps))
        if native:
            torch.ops.entropic.rope_kv_(qkv, rope[0], rope[1], kv_cache, meta.slot_mapping,
                                        c.num_heads, c.num_kv_heads)
        else:
            qk = qkv[:, :self.q_size + self.kv_size].view(T, c.num_heads + c.num_kv_heads,
                                                          c.head_dim)
            self.rope.apply_(qk, *rope)
        q = qkv[:, :self.q_size].view(T, c.num_heads, c.head_dim)
        new_kv = qkv[:, self.q_size:].view(T, 2, c.num_kv_heads, c.head_dim)
        # entropic's prefill kernel is causal over the whole prefix: windowed layers use SDPA
        h = w.o(paged_attention(q, new_kv, kv_cache, meta, self.scale, native=native,
                                native_prefill=self.native_prefill and w.window is None))
        x += h if w.attn_out_norm is None else norm(h, w.attn_out_norm, eps)
        h = w.down(self._act_mul(w.gate_up(norm(x, w.post_norm, eps))))
        x += h if w.mlp_out_norm is None else norm(h, w.mlp_out_norm, eps)
        return x


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def _gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh approximation of GELU (Gemma's gelu_pytorch_tanh)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)
