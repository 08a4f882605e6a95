"""Read a llama.cpp GGUF file into Hugging Face-named float32 tensors and a ModelConfig.

The header is parsed here with `struct` over an mmap rather than with `gguf.GGUFReader`:
the reader builds a numpy view for every vocabulary string and merge, which costs about 2 s
on SmolLM2's 49k-token vocabulary, while walking the same bytes takes ~10 ms. Tensor data is
decoded by `gguf.quants.dequantize`, so every quantization type gguf-py knows works, save
Q4_0, Q4_1 and Q8_0, which are decoded here with torch (the same arithmetic, ~20x faster).
"""
from __future__ import annotations

import dataclasses
import functools
import mmap
import os
import struct
from collections.abc import Container
from dataclasses import dataclass
from math import prod

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from entropic.config import ModelConfig, RopeScaling
from entropic.model.family import GGUF_ARCHITECTURES, Family
from entropic.model.quant import Int4Blocks, int4_from_gguf, q4_fields

SUPPORTED_ARCHS = tuple(GGUF_ARCHITECTURES)
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32

# Fixed-size metadata value types (GGUF spec): id -> struct format. 8 is string, 9 is array.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f",
           7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")

# GGUF per-layer tensor stem -> Hugging Face Llama module path.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Families with sandwich norms (Gemma 3): ffn_norm is the pre-MLP norm, and the attention
# and MLP outputs have their own.
_SANDWICH_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# What llama.cpp fixes for Gemma 3 rather than writing it into the file: every 6th layer
# attends globally, the sliding layers rotate with base 10000.
_GEMMA3_PATTERN, _GEMMA3_LOCAL_THETA = 6, 10000.0
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file. `shape` is in torch order (out, in)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute, from the start of the file
    nbytes: int


class _Cursor:
    """Bounds-checked little-endian reads over a buffer; any overrun is a ValueError."""

    def __init__(self, buf, path: str):
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def _need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ValueError(
                f"{self.path}: GGUF header is truncated or corrupt "
                f"(needs {n} bytes at offset {self.pos}, file has {self.size})"
            )

    def unpack(self, fmt: str):
        n = struct.calcsize(fmt)
        self._need(n)
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return values if len(values) > 1 else values[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        self._need(n)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.path}: GGUF string at offset {self.pos - n} is not UTF-8") from e

    def skip_strings(self, count: int) -> None:
        # a vocabulary is ~50k strings a parse: locals and one bounds check per string
        length, buf, pos, end = _U64.unpack_from, self.buf, self.pos, self.size - 8
        for _ in range(count):
            if pos > end:
                break
            pos += 8 + length(buf, pos)[0]
        else:
            if pos <= self.size:
                self.pos = pos
                return
        self.pos = min(pos, self.size)
        self._need(8)  # raises: the strings run past the end of the file

    def value(self, vtype: int, keep_strings: bool):
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF metadata value type {vtype}")
        etype, count = self.unpack("<IQ")
        if etype in _SCALAR:
            fmt = _SCALAR[etype]
            self._need(count * struct.calcsize(fmt))
            values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos))
            self.pos += count * struct.calcsize(fmt)
            return values
        if etype != _STRING:
            raise ValueError(f"{self.path}: unsupported GGUF array element type {etype}")
        if keep_strings:
            return [self.string() for _ in range(count)]
        self.skip_strings(count)
        return None


def _open(path: str):
    try:
        size = os.path.getsize(path)
        if size < 24:
            raise ValueError(f"{path}: not a GGUF file (only {size} bytes)")
        with open(path, "rb") as f:
            # Not closed explicitly: numpy views of tensor data keep the map alive until dropped.
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ValueError(f"{path}: cannot read GGUF file ({e})") from e


def _parse(buf, path: str, string_arrays: Container[str]):
    """(metadata, tensor infos by GGUF name) from a mapped GGUF file."""
    cur = _Cursor(buf, path)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (bad magic bytes {bytes(buf[:4])!r})")
    cur.pos = 4
    version, n_tensors, n_kv = cur.unpack("<IQQ")
    if version not in _VERSIONS:
        raise ValueError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
    # Every kv pair and tensor entry takes well over 8 bytes: cheap sanity check on the counts.
    if (n_tensors + n_kv) * 8 > cur.size:
        raise ValueError(f"{path}: GGUF header is corrupt (claims {n_tensors} tensors, {n_kv} keys)")
    meta: dict = {}
    for _ in range(n_kv):
        key = cur.string()
        value = cur.value(cur.unpack("<I"), keep_strings=key in string_arrays)
        if value is not None:
            meta[key] = value
    entries = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        if n_dims > 8:
            raise ValueError(f"{path}: GGUF tensor {name!r} is corrupt ({n_dims} dimensions)")
        dims = cur.unpack(f"<{n_dims}Q") if n_dims else ()
        dims = (dims,) if isinstance(dims, int) else dims
        ggml_type, offset = cur.unpack("<IQ")
        entries.append((name, tuple(reversed(dims)), ggml_type, offset))  # ggml lists dims fastest first
    align = meta.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0:
        raise ValueError(f"{path}: GGUF header is corrupt (general.alignment = {align!r})")
    data_start = (cur.pos + align - 1) // align * align
    tensors = {}
    for name, shape, ggml_type, offset in entries:
        info = GGUFTensorInfo(name, shape, ggml_type, data_start + offset,
                              _nbytes(name, shape, ggml_type, path))
        if info.offset + info.nbytes > cur.size:
            raise ValueError(
                f"{path}: GGUF file is truncated (tensor {name!r} ends at byte "
                f"{info.offset + info.nbytes}, file has {cur.size})"
            )
        tensors[name] = info
    return meta, tensors


def _type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"unknown ggml type {ggml_type}"


def _nbytes(name: str, shape: tuple[int, ...], ggml_type: int, path: str) -> int:
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise ValueError(f"{path}: tensor {name!r} has {_type_name(ggml_type)}, "
                         "which gguf-py cannot size") from None
    if shape and shape[-1] % block:
        raise ValueError(f"{path}: tensor {name!r} row of {shape[-1]} is not a multiple of "
                         f"the {_type_name(ggml_type)} block size {block}")
    return prod(shape) // block * type_size


def read_gguf_metadata(path: str, string_arrays: Container[str] = ()):
    """Parse a GGUF header: (metadata dict, {gguf name: GGUFTensorInfo}).

    String arrays (the vocabulary, the merges) are skipped, and absent from the metadata,
    unless their key is listed in `string_arrays`. Raises ValueError naming the file when it
    is not a valid GGUF (bad magic, truncated, corrupt).
    """
    path = os.fspath(path)
    return _parse(_open(path), path, string_arrays)


def _hf_name(gguf_name: str, fam: Family | None = None) -> str | None:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    names = _SANDWICH_NAMES if fam is not None and fam.sandwich_norms else _LAYER_NAMES
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    return None


def unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's `permute` of a Q/K projection (weight or bias).

    llama.cpp interleaves each head's two rotary halves; HF keeps them as [first half,
    second half]. The converter does reshape(n_head, 2, d/2, ...).swapaxes(1, 2); this is
    the inverse.
    """
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _config(meta: dict, tensors: dict[str, GGUFTensorInfo], path: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r} "
                         f"(supported: {', '.join(SUPPORTED_ARCHS)})")

    def get(key: str, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings are not supported")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        # yarn scaling would silently give wrong logits if ignored.
        raise ValueError(f"{path}: RoPE scaling ({scaling}) is not supported "
                         "(supported: linear, rope_freqs, or none)")
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: GGUF has no token_embd.weight tensor")
    fam = GGUF_ARCHITECTURES[arch]
    layers = int(get("block_count"))
    window, sliding, local_theta = None, (), None
    if fam.local_rope:  # Gemma 3
        window = int(get("attention.sliding_window"))
        sliding = tuple(i for i in range(layers) if (i + 1) % _GEMMA3_PATTERN)
        local_theta = _GEMMA3_LOCAL_THETA
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position=int(get("context_length")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        name=fam.name,
        rope_scaling=(RopeScaling("linear", float(get("rope.scaling.factor")))
                      if scaling == "linear" else None),
        sliding_window=window,
        sliding_layers=sliding,
        local_rope_theta=local_theta,
    )


# Block formats decoded with torch here (gguf-py's numpy loop over row groups took ~2 s for
# SmolLM2's Q4_1 weights; torch's vectorized ops take ~0.1 s). The arithmetic is gguf-py's,
# op for op (fp16 scales widened to fp32, one multiply, then one add), so the numbers are the
# same to the bit (tests/test_loader.py: random blocks, and every tensor of the default model).
_Q4_TYPES = {GGMLQuantizationType.Q4_0: "Q4_0", GGMLQuantizationType.Q4_1: "Q4_1"}
_FAST_TYPES = {**_Q4_TYPES, GGMLQuantizationType.Q8_0: "Q8_0"}


def _dequantize_blocks(raw: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Q4_0 / Q4_1 / Q8_0 blocks (`raw`: uint8, a whole number of blocks) -> float32 [N]."""
    blocks = raw.view(-1, GGML_QUANT_SIZES[qtype][1])
    if qtype == GGMLQuantizationType.Q8_0:  # fp16 d, then 32 int8: d * q
        d = blocks[:, 0:2].contiguous().view(torch.float16).float()
        return (blocks[:, 2:].contiguous().view(torch.int8).float() * d).reshape(-1)
    d, m, codes = q4_fields(blocks, _FAST_TYPES[qtype])
    if m is not None:  # Q4_1: d * q + m
        return (d[:, None] * codes.float() + m[:, None]).reshape(-1)
    return (d[:, None] * (codes.to(torch.int8) - 8).float()).reshape(-1)  # Q4_0: d * (q - 8)


def _dequantize(buf, info: GGUFTensorInfo, path: str) -> torch.Tensor:
    raw = np.frombuffer(buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
    qtype = GGMLQuantizationType(info.ggml_type)  # a known type: _parse sized it
    if qtype in _FAST_TYPES:  # a copy of the bytes: torch wants a writable buffer
        return _dequantize_blocks(torch.from_numpy(raw.copy()), qtype).reshape(info.shape)
    rows = prod(info.shape[:-1]) if len(info.shape) > 1 else 1
    try:
        out = dequantize(raw.reshape(rows, info.nbytes // rows), qtype)
    except NotImplementedError:
        raise ValueError(f"{path}: tensor {info.name!r} has type {_type_name(info.ggml_type)}, "
                         "which gguf-py cannot dequantize") from None
    # F32 comes back as a read-only view of the map; everything else is a fresh array.
    out = np.array(out, dtype=np.float32, copy=not out.flags.writeable)
    return torch.from_numpy(out.reshape(info.shape))


def _int4_blocks(buf, info: GGUFTensorInfo) -> Int4Blocks:
    raw = np.frombuffer(buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
    n = info.shape[0]
    return int4_from_gguf(raw.reshape(n, info.nbytes // n), info.shape,
                          _Q4_TYPES[GGMLQuantizationType(info.ggml_type)])


def read_gguf_tensors(path: str, *, progress: bool = False, keep_int4: bool = False
                      ) -> tuple[ModelConfig, dict[str, torch.Tensor | Int4Blocks]]:
    """Read a GGUF file's architecture and weights: (ModelConfig, HF-named float32 tensors).

    Q and K projections are un-permuted back to the Hugging Face rotary layout for `llama`
    (the converter permutes no other family). Gemma's norm weights are stored as 1 + w
    already, the form our model uses. No tokenizer metadata is needed.
    `keep_int4=True` returns 2-D Q4_0 / Q4_1 tensors as their 4-bit codes (`Int4Blocks`)
    instead of dequantizing them.
    """
    path = os.fspath(path)
    buf = _open(path)
    meta, infos = _parse(buf, path, ())
    config = _config(meta, infos, path)
    freqs = infos.pop("rope_freqs.weight", None)
    if freqs is not None:  # Llama 3.1/3.2: llama3 scaling as a divisor per frequency
        if config.rope_scaling is not None:
            raise ValueError(f"{path}: both rope_freqs and a RoPE scaling type")
        factors = tuple(float(f) for f in _dequantize(buf, freqs, path).reshape(-1))
        config = dataclasses.replace(config, rope_scaling=RopeScaling("freq_factors",
                                                                      freq_factors=factors))
    fam = config.family
    unknown = [n for n in infos if _hf_name(n, fam) is None]
    if unknown:
        raise ValueError(f"{path}: unexpected GGUF tensors {unknown[:5]} for a {config.name} model")
    items = list(infos.values())
    if progress:
        from tqdm import tqdm
        items = tqdm(items, desc="Loading weights", unit="tensor")
    tensors = {}
    for info in items:
        blocks = keep_int4 and len(info.shape) == 2 and info.ggml_type in _Q4_TYPES
        w = _int4_blocks(buf, info) if blocks else _dequantize(buf, info, path)
        stem = info.name.rpartition(".")[0].rpartition(".")[2]
        if config.name == "llama" and stem in ("attn_q", "attn_k"):
            heads = config.num_heads if stem == "attn_q" else config.num_kv_heads
            w = (w.permute_rows(functools.partial(unpermute_rope, n_head=heads)) if blocks
                 else unpermute_rope(w, heads))
        tensors[_hf_name(info.name, fam)] = w
    return config, tensors
