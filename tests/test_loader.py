"""Checkpoint loading: the bundled GGUF against transformers, HF directories, synthetic GGUFs, errors."""
from __future__ import annotations

import copy
import json
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

from entropic.config import ModelConfig
from entropic.model.gguf_loader import read_gguf_tensors, unpermute_rope
from entropic.model.hf_loader import read_hf_dir
from entropic.model.loader import Checkpoint, default_model_path, expected_shapes, load_checkpoint

# ---------------------------------------------------------------- the bundled SmolLM2 GGUF


@pytest.fixture(scope="module")
def ckpt() -> Checkpoint:
    return load_checkpoint()


@pytest.fixture(scope="module")
def hf_model():
    """transformers' own reading of the same GGUF: the reference for names and un-permutation."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32,
        local_files_only=True,
    )


@pytest.mark.model
def test_default_model_config(ckpt):
    c = ckpt.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.max_position, c.rope_theta) == (49152, 8192, 1e5)
    assert c.tie_word_embeddings and not c.attention_bias
    assert 2 in c.eos_token_ids and c.bos_token_id == 1
    assert ckpt.source == default_model_path() and os.path.isabs(ckpt.source)
    assert "lm_head.weight" not in ckpt.tensors
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in ckpt.tensors.values())


@pytest.mark.model
def test_weights_match_transformers(ckpt, hf_model):
    ref = hf_model.state_dict()
    assert set(ckpt.tensors) == set(ref) - {"lm_head.weight"}  # tied: lm_head is the embedding
    for name, t in ckpt.tensors.items():
        assert t.shape == ref[name].shape, name
        assert torch.equal(t, ref[name]), name  # same dequantization, same un-permutation


def test_unpermute_inverts_converter_permute():
    n_head, head_dim, n_in = 3, 8, 5
    w = torch.randn(n_head * head_dim, n_in)
    # convert_hf_to_gguf.py's permute
    permuted = w.reshape(n_head, 2, head_dim // 2, n_in).swapaxes(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_rope(permuted, n_head), w)
    b = torch.randn(n_head * head_dim)
    assert torch.equal(unpermute_rope(b.reshape(n_head, 2, -1).swapaxes(1, 2).reshape(-1), n_head), b)


# ---------------------------------------------------------------- Hugging Face directories


def _save_hf(hf_model, folder, **kwargs) -> None:
    """save_pretrained refuses a GGUF-quantized model: rebuild it plain, on the same tensors."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    cfg = copy.deepcopy(hf_model.config)
    del cfg.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(cfg)
    plain.load_state_dict(hf_model.state_dict(), assign=True)
    plain.save_pretrained(folder, **kwargs)
    path = default_model_path()
    PreTrainedTokenizerFast.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True
    ).save_pretrained(folder)


@pytest.mark.model
@pytest.mark.parametrize("shard", [None, "50MB"])
def test_hf_dir_round_trip(ckpt, hf_model, tmp_path, shard):
    _save_hf(hf_model, tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert os.path.isfile(tmp_path / ("model.safetensors.index.json" if shard else "model.safetensors"))
    loaded = load_checkpoint(tmp_path)
    assert loaded.config == ckpt.config
    assert loaded.source == str(tmp_path)
    assert set(loaded.tensors) == set(ckpt.tensors)
    for name, t in ckpt.tensors.items():
        assert torch.equal(loaded.tensors[name], t), name
    text = "Hello, world! 123"
    assert loaded.tokenizer.encode(text) == ckpt.tokenizer.encode(text)
    assert loaded.tokenizer.eos_token_ids == (2,)


def _tiny_hf_dir(folder, **overrides) -> dict:
    """A 1-layer Qwen2-style directory (biases, untied head) with no tokenizer: weights only."""
    from safetensors.torch import save_file

    cfg = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 4096, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
           "vocab_size": 50, "tie_word_embeddings": False, "bos_token_id": None,
           "eos_token_id": 7, "sliding_window": 1024, "use_sliding_window": False, **overrides}
    config = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position=4096,
                         attention_bias=True)
    tensors = {n: torch.randn(shape, dtype=torch.bfloat16) for n, shape in expected_shapes(config).items()}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [8, 7]}))
    return tensors


def test_hf_dir_qwen2_config(tmp_path):
    saved = _tiny_hf_dir(tmp_path)
    config, tensors = read_hf_dir(tmp_path)
    assert config.name == "qwen2" and config.attention_bias and not config.tie_word_embeddings
    assert (config.head_dim, config.rope_theta, config.max_position) == (8, 1e6, 4096)
    assert config.eos_token_ids == (7, 8) and config.bos_token_id is None
    assert set(tensors) == set(saved)
    assert all(t.dtype == torch.float32 and torch.equal(t, saved[n].float()) for n, t in tensors.items())


def test_hf_dir_config_variants(tmp_path):
    _tiny_hf_dir(tmp_path, rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                 use_sliding_window=True)
    config, _ = read_hf_dir(tmp_path)
    assert config.rope_theta == 5e5 and config.max_position == 4096
    assert config.sliding_window == 1024 and config.sliding_layers == (0,)  # max_window_layers 0
    _tiny_hf_dir(tmp_path, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="llama3 RoPE scaling lacks 'low_freq_factor'"):
        read_hf_dir(tmp_path)
    _tiny_hf_dir(tmp_path, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="'yarn' is not supported.*linear, llama3"):
        read_hf_dir(tmp_path)


def test_hf_dir_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as e:
        load_checkpoint(tmp_path)
    assert str(tmp_path) in str(e.value)
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM", "Gemma3ForCausalLM"):
        assert arch in str(e.value)  # the message lists what does load


# ---------------------------------------------------------------- synthetic GGUFs

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 128, 2
HEAD_DIM = HIDDEN // HEADS
Q_DIM, KV_DIM = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
# GGUF stem -> (HF module, shape, stored type). Rows are whole Q8_0 blocks (32) everywhere.
LAYER = {
    "attn_q": ("self_attn.q_proj", (Q_DIM, HIDDEN), Q.F16),
    "attn_k": ("self_attn.k_proj", (KV_DIM, HIDDEN), Q.BF16),
    "attn_v": ("self_attn.v_proj", (KV_DIM, HIDDEN), Q.Q8_0),
    "attn_output": ("self_attn.o_proj", (HIDDEN, Q_DIM), Q.F32),
    "ffn_gate": ("mlp.gate_proj", (FFN, HIDDEN), Q.Q8_0),
    "ffn_up": ("mlp.up_proj", (FFN, HIDDEN), Q.F16),
    "ffn_down": ("mlp.down_proj", (HIDDEN, FFN), Q.BF16),
    "attn_norm": ("input_layernorm", (HIDDEN,), Q.F32),
    "ffn_norm": ("post_attention_layernorm", (HIDDEN,), Q.F32),
}
BIASES = {"attn_q": (Q_DIM,), "attn_k": (KV_DIM,), "attn_v": (KV_DIM,)}
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2}


def _gpt2_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: enough for a tokenizer transformers can build."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    # printable bytes spell themselves; the rest are shifted past 255, in byte order
    char = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return [char[b] for b in range(256)] + ["he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _add_tokenizer(w: GGUFWriter) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(_gpt2_tokens())
    w.add_token_types([1] * 257 + [3] * 3)  # 3: control (special) tokens
    w.add_token_merges(["h e"])
    w.add_add_bos_token(False)
    w.add_bos_token_id(258)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                        "<|im_end|>\n{% endfor %}{{ '<|im_start|>assistant\\n' }}")


def write_tiny_gguf(path, arch="llama", *, tokenizer=False, drop=(), rope_freqs=None,
                    rope_scaling=None) -> dict:
    """A 2-layer model; returns {hf name: (exact expected tensor, unquantized original, type)}."""
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(5e4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_eos_token_id(259)
    if rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling))
        w.add_rope_scaling_factor(4.0)
    if tokenizer:
        _add_tokenizer(w)
    expected = {}

    def put(gguf_name, hf_name, shape, qtype=Q.F32, permute_heads=0):
        x = rng.standard_normal(shape, dtype=np.float32) * 0.5
        stored = x
        if permute_heads:  # what convert_hf_to_gguf does to llama Q/K
            stored = x.reshape(permute_heads, 2, -1, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)
        data = quantize(stored, qtype)
        if gguf_name not in drop:
            w.add_tensor(gguf_name, data, raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
        exact = torch.from_numpy(dequantize(data, qtype).reshape(shape).astype(np.float32))
        if permute_heads:
            exact = unpermute_rope(exact, permute_heads)
        expected[hf_name] = (exact, x, qtype)  # `exact`: what any correct reader must return

    put("token_embd.weight", "model.embed_tokens.weight", (260 if tokenizer else 96, HIDDEN), Q.Q8_0)
    put("output_norm.weight", "model.norm.weight", (HIDDEN,))
    heads = {"attn_q": HEADS, "attn_k": KV_HEADS} if arch == "llama" else {}
    layer = dict(LAYER)
    if arch in ("qwen3", "gemma3"):
        layer |= {"attn_q_norm": ("self_attn.q_norm", (HEAD_DIM,), Q.F32),
                  "attn_k_norm": ("self_attn.k_norm", (HEAD_DIM,), Q.F32)}
    if arch == "gemma3":  # sandwich norms; ffn_norm is the pre-MLP norm
        w.add_sliding_window(8)
        layer |= {"ffn_norm": ("pre_feedforward_layernorm", (HIDDEN,), Q.F32),
                  "post_attention_norm": ("post_attention_layernorm", (HIDDEN,), Q.F32),
                  "post_ffw_norm": ("post_feedforward_layernorm", (HIDDEN,), Q.F32)}
    for i in range(LAYERS):
        for stem, (module, shape, qtype) in layer.items():
            put(f"blk.{i}.{stem}.weight", f"model.layers.{i}.{module}.weight", shape, qtype,
                heads.get(stem, 0))
            if arch == "qwen2" and stem in BIASES:
                put(f"blk.{i}.{stem}.bias", f"model.layers.{i}.{module}.bias", BIASES[stem])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    _finish(w)
    return expected


def _finish(w: GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # gguf-py's inf * 0
def test_block_dequantization_is_gguf_py_to_the_bit(qtype):
    """The torch decoding of the simple block formats gives gguf-py's numbers, for every byte
    pattern: random blocks, so scales include subnormals, infinities and NaNs."""
    from entropic.model.gguf_loader import _dequantize_blocks

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(int(qtype)).integers(0, 256, (64, 6 * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)  # scales of the first blocks: inf, NaN, subnormal, -0
    for i, half in enumerate((0x7C00, 0x7E00, 0x0001, 0x8000)):
        blocks[i, 0:2] = (half & 0xFF, half >> 8)
    ref = torch.from_numpy(dequantize(raw, qtype).reshape(-1).astype(np.float32))
    got = _dequantize_blocks(torch.from_numpy(raw.copy()).reshape(-1), qtype)
    assert got.shape == ref.shape == (64 * 6 * block,)
    assert torch.isnan(ref).any() and torch.isinf(ref).any()
    torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_synthetic_gguf_values(tmp_path, arch):
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, arch)
    config, tensors = read_gguf_tensors(path, progress=True)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (2, 64, 4, 2)
    assert (config.head_dim, config.intermediate_size) == (16, 128)
    assert (config.vocab_size, config.max_position) == (96, 256)
    assert config.rope_theta == 5e4 and config.tie_word_embeddings and config.eos_token_ids == (259,)
    assert config.attention_bias == (arch == "qwen2") and config.name == arch
    if arch == "gemma3":  # llama.cpp's fixed pattern: all but every 6th layer windowed
        assert (config.sliding_window, config.sliding_layers) == (8, (0, 1))
        assert config.local_rope_theta == 1e4
    assert set(expected_shapes(config)) == set(tensors)
    assert set(tensors) == set(expected)
    for name, (exact, original, qtype) in expected.items():
        got = tensors[name]
        assert got.dtype == torch.float32 and got.shape == exact.shape, name
        assert torch.equal(got, exact), name
        # and close to the unquantized HF weight, i.e. Q/K really are back in HF order
        assert torch.allclose(got, torch.from_numpy(original), atol=TOLERANCE[qtype] * 4), (name, qtype)


def test_synthetic_gguf_with_tokenizer_loads_end_to_end(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tokenizer=True)
    ck = load_checkpoint(tmp_path)  # a directory holding exactly one .gguf
    assert ck.source == str(path) and ck.config.vocab_size == 260 == ck.tokenizer.vocab_size
    assert ck.tokenizer.eos_token_ids == (259,) and ck.tokenizer.bos_token_id == 258
    assert ck.tokenizer.convert_ids_to_tokens(ck.tokenizer.encode("he")) == ["he"]
    ids = ck.tokenizer.encode("the cat")
    assert ck.tokenizer.decode(ids) == "the cat"
    chat = ck.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ck.tokenizer.decode(chat, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------- errors name the path


def _raises(path, exc=(ValueError, FileNotFoundError), match=None):
    with pytest.raises(exc, match=match) as e:
        load_checkpoint(path)
    assert str(path) in str(e.value)
    return e.value


def test_error_unknown_path(tmp_path):
    _raises(tmp_path / "nope", FileNotFoundError, "does not exist")


def test_error_empty_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("no model here")
    _raises(tmp_path, FileNotFoundError, "nothing loadable")


def test_error_several_ggufs(tmp_path):
    write_tiny_gguf(tmp_path / "a.gguf")
    write_tiny_gguf(tmp_path / "b.gguf")
    _raises(tmp_path, ValueError, "several GGUF")


def test_error_file_without_gguf_suffix(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"\0" * 64)
    _raises(tmp_path / "model.bin", ValueError, "suffix")


def test_error_truncated_gguf(tmp_path):
    path = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as f:
        path.write_bytes(f.read(1 << 20))
    _raises(path, ValueError, "truncated")


def test_error_truncated_tensor_data(tmp_path):
    full = tmp_path / "full.gguf"
    write_tiny_gguf(full)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full.read_bytes()[:-100])
    _raises(cut, ValueError, "truncated")


@pytest.mark.parametrize("content", [os.urandom(4096), b"", b"GGUF" + os.urandom(4096)])
def test_error_not_gguf(tmp_path, content):
    path = tmp_path / "random.gguf"
    path.write_bytes(content)
    _raises(path, ValueError)


def test_error_unsupported_architecture(tmp_path):
    path = tmp_path / "falcon.gguf"
    write_tiny_gguf(path, "falcon")
    _raises(path, ValueError, "unsupported GGUF architecture 'falcon'")


def test_error_missing_tensor(tmp_path):
    path = tmp_path / "partial.gguf"
    write_tiny_gguf(path, drop=("blk.1.ffn_down.weight",))
    _raises(path, ValueError, "missing.*ffn|down_proj")


def test_error_rope_scaling(tmp_path):
    path = tmp_path / "yarn.gguf"
    write_tiny_gguf(path, rope_scaling="yarn")
    _raises(path, ValueError, "RoPE scaling \\(yarn\\) is not supported")


def test_gguf_rope_freqs_are_llama3_scaling(tmp_path):
    """llama.cpp stores Llama 3.1's scaling as a divisor per frequency (rope_freqs): loaded,
    it rotates as the llama3 rule computed from the HF config does."""
    from entropic.config import RopeScaling
    from entropic.model.llama import RotaryEmbedding, scaled_frequencies

    llama3 = RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    plain = RotaryEmbedding(HEAD_DIM, 256, 5e4, torch.float32, "cpu")
    ref = RotaryEmbedding(HEAD_DIM, 256, 5e4, torch.float32, "cpu", llama3)
    inv = 1.0 / (5e4 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    factors = (inv / scaled_frequencies(inv, llama3)).numpy()
    assert factors.min() == pytest.approx(1.0) and factors.max() == pytest.approx(8.0)
    write_tiny_gguf(tmp_path / "llama31.gguf", rope_freqs=factors)
    config, tensors = read_gguf_tensors(tmp_path / "llama31.gguf")
    assert config.rope_scaling.kind == "freq_factors" and "rope_freqs.weight" not in tensors
    got = RotaryEmbedding(HEAD_DIM, 256, 5e4, torch.float32, "cpu", config.rope_scaling)
    assert torch.allclose(got.cos, ref.cos, atol=1e-5)
    assert torch.allclose(got.sin_signed, ref.sin_signed, atol=1e-5)
    assert not torch.allclose(got.cos, plain.cos, atol=1e-2)


def test_error_no_tokenizer_metadata(tmp_path):
    path = tmp_path / "bare.gguf"
    write_tiny_gguf(path)
    _raises(path, ValueError, "tokenizer")


def test_error_unsupported_tensor_type(tmp_path):
    path = tmp_path / "q81.gguf"
    w = GGUFWriter(str(path), "llama")
    for add, value in [(w.add_block_count, 1), (w.add_context_length, 8), (w.add_embedding_length, 32),
                       (w.add_head_count, 1), (w.add_feed_forward_length, 32)]:
        add(value)
    # Q8_1 has a size in gguf-py but no dequantizer
    w.add_tensor("token_embd.weight", np.zeros((4, 40), np.uint8), raw_dtype=Q.Q8_1)
    _finish(w)
    with pytest.raises(ValueError, match="token_embd.weight.*Q8_1") as e:
        read_gguf_tensors(path)
    assert str(path) in str(e.value)
