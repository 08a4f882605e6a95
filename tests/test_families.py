"""Every supported family against transformers, fp32, on tiny random checkpoints.

Each checkpoint is built at test time from transformers' own config class (2 layers, hidden
64, vocabulary 256), saved as a Hugging Face directory with a word-level tokenizer, and run
through the real engine: prompts longer than the sliding windows, chunked (16 tokens a step)
and mixed with decode rows. Our logits at every sampled step must match transformers' on
the same tokens, and every greedy token must be transformers' argmax.
"""
from __future__ import annotations

import json

import pytest
import torch

from entropic.sampling_params import SamplingParams
from engine_probe import run_capturing_logits as capture

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
# name -> (transformers config class, its arguments); windows of 8-12 < the longest prompt
FAMILIES = {
    "llama-llama3-rope": ("LlamaConfig", dict(rope_parameters=LLAMA3_ROPE)),
    "llama-linear-rope-tied": ("LlamaConfig", dict(
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    "phi3": ("Phi3Config", dict(sliding_window=12)),
    "gemma3": ("Gemma3TextConfig", dict(
        head_dim=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=24, final_logit_softcapping=5.0)),
}
PROMPT_LENGTHS = (3, 11, 29, 40)
STEPS = 8
REL_TOL = 1e-4  # max |logit difference| over the largest |reference logit|
NEAR_TIE = 1e-3  # a reference top-2 margin under which argmax is float rounding order


def save_word_tokenizer(folder) -> None:
    """A word-level tokenizer "t0".."t255" (t1 BOS, t2 EOS): enough for LLM() to load."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="t1", eos_token="t2",
                            pad_token="t0", unk_token="t3").save_pretrained(folder)


def build_family(name: str, folder):
    """A random tiny checkpoint of family `name` saved in `folder`; returns the HF model."""
    import transformers

    cls, kwargs = FAMILIES[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, cls)(**COMMON, **kwargs)).eval()
    with torch.no_grad():  # norms and biases away from their 1 / 0 initialisation
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
            elif n.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(folder)
    save_word_tokenizer(folder)
    return model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices gain nothing from threads, and a busy machine's thread switches cost
    them 40x (2 s instead of 0.05 s a run)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, build_family(request.param, folder)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def run_capturing_logits(llm, prompts, steps=STEPS):
    """Drive the engine step by step; each request's logits at every sampled token."""
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    logits = capture(llm, prompts, params, prefix="r")
    return [torch.stack(logits[f"r{i}"]) for i in range(len(prompts))]


def compare_with_reference(hf_model, prompts, ours) -> float:
    """Worst relative logit difference; asserts the greedy tokens are the reference's."""
    worst = 0.0
    for p, got in zip(prompts, ours):
        gen = got.argmax(-1).tolist()
        with torch.no_grad():
            ref = hf_model(torch.tensor([p + gen[:-1]])).logits[0, len(p) - 1:].float()
        assert got.shape == ref.shape
        worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
        top2 = ref.topk(2, -1).values
        decided = (top2[:, 0] - top2[:, 1]) >= NEAR_TIE
        assert torch.equal(ref.argmax(-1)[decided], got.argmax(-1)[decided]), "greedy tokens differ"
    return worst


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_logits_and_greedy_match_transformers(family, prompts, kernels):
    from entropic import LLM

    name, folder, hf_model = family
    llm = LLM(str(folder), dtype="float32", kernels=kernels, max_num_batched_tokens=16,
              kv_cache_gib=0.01)
    assert llm.engine.model.config.name == name.split("-")[0]
    worst = compare_with_reference(hf_model, prompts, run_capturing_logits(llm, prompts))
    assert worst <= REL_TOL, f"{name} ({kernels}): max relative logit difference {worst:.2e}"


def test_sliding_window_changes_the_reference(tmp_path, prompts):
    """The prompts are long enough that a window matters: without it transformers' own
    logits move (so the parity above really checks the window)."""
    model = build_family("mistral", tmp_path)
    ids = torch.tensor([prompts[-1]])
    with torch.no_grad():
        windowed = model(ids).logits
        model.config.sliding_window = None
        full = model(ids).logits
    assert (windowed - full).abs().max() > 1e-2


def test_bf16_native_close_to_fp32_reference(tmp_path, prompts):
    """bf16 with native kernels, head_dim 64: entropic's prefill kernel on the full layer,
    SDPA on the sliding one; close to the fp32 reference, same argmax nearly everywhere."""
    from entropic import LLM

    FAMILIES["gemma3-hd64"] = ("Gemma3TextConfig", dict(
        head_dim=64, sliding_window=8, layer_types=["sliding_attention", "full_attention"]))
    try:
        hf_model = build_family("gemma3-hd64", tmp_path)
    finally:
        del FAMILIES["gemma3-hd64"]
    llm = LLM(str(tmp_path), dtype="bfloat16", kernels="native", max_num_batched_tokens=16,
              kv_cache_gib=0.01)
    ours = run_capturing_logits(llm, prompts, steps=4)
    for p, got in zip(prompts, ours):
        gen = got.argmax(-1).tolist()
        with torch.no_grad():
            ref = hf_model(torch.tensor([p + gen[:-1]])).logits[0, len(p) - 1:]
        assert ((got - ref).abs().max() / ref.abs().max()).item() < 5e-2


# ---------------------------------------------------------------- configs and errors


def _config(tmp_path, cfg: dict):
    from entropic.model.hf_loader import config_from_hf

    return config_from_hf(cfg, {}, str(tmp_path))


BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 12,
        "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 4096}


def test_transformers4_configs(tmp_path):
    """Configs written before layer_types and rope_parameters follow each family's rule."""
    qwen = _config(tmp_path, {**BASE, "architectures": ["Qwen2ForCausalLM"],
                              "use_sliding_window": True, "sliding_window": 512,
                              "max_window_layers": 9, "rope_theta": 1e6})
    assert qwen.sliding_window == 512 and qwen.sliding_layers == (9, 10, 11)
    unused = _config(tmp_path, {**BASE, "architectures": ["Qwen2ForCausalLM"],
                                "use_sliding_window": False, "sliding_window": 512})
    assert unused.sliding_window is None and unused.sliding_layers == ()
    gemma = _config(tmp_path, {**BASE, "architectures": ["Gemma3ForCausalLM"],
                               "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 512,
                               "sliding_window_pattern": 6, "rope_theta": 1e6,
                               "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 256,
                               "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert gemma.sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
    assert (gemma.rope_theta, gemma.local_rope_theta) == (1e6, 1e4)
    assert gemma.rope_scaling.kind == "linear" and gemma.rope_scaling.factor == 8.0
    assert gemma.query_scale == 256 ** -0.5 and gemma.tie_word_embeddings
    mistral = _config(tmp_path, {**BASE, "architectures": ["MistralForCausalLM"],
                                 "sliding_window": 4096})
    assert mistral.sliding_layers == ()  # a window as long as the context is no window


@pytest.mark.parametrize("change, match", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "'longrope'"),
    ({"partial_rotary_factor": 0.5}, "partial rotary"),
    ({"hidden_act": "gelu"}, "activation 'gelu'"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"architectures": ["Gemma2ForCausalLM"]}, "Gemma2ForCausalLM.*supported: LlamaForCausalLM"),
])
def test_unsupported_configs_are_clear_errors(tmp_path, change, match):
    with pytest.raises(ValueError, match=match):
        _config(tmp_path, {**BASE, "architectures": ["Phi3ForCausalLM"], **change})


def test_llama_keeps_its_own_layer(tmp_path):
    """Plain families without a window run Llama's layer function; the others the general one."""
    from entropic.model.llama import LlamaModel
    from entropic.model.loader import load_checkpoint

    build_family("llama-llama3-rope", tmp_path / "llama")
    build_family("qwen3", tmp_path / "qwen3")
    for sub, plain in (("llama", True), ("qwen3", False)):
        ck = load_checkpoint(tmp_path / sub)
        assert LlamaModel(ck.config, ck.tensors, torch.float32, kernels="torch").plain_layers == plain
    assert json.loads((tmp_path / "qwen3" / "config.json").read_text())["architectures"] == [
        "Qwen3ForCausalLM"]


def test_gemma3_multimodal_checkpoint_loads_text_only(tmp_path, prompts):
    """Gemma3ForConditionalGeneration (the 4B+ checkpoints): its language model alone, the
    vision tower skipped; logits as transformers' on text."""
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig,
                              SiglipVisionConfig)

    from entropic import LLM

    torch.manual_seed(0)
    text = Gemma3TextConfig(**COMMON, head_dim=32, sliding_window=8,
                            rope_scaling={"rope_type": "linear", "factor": 8.0})
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    model = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=255,
        boi_token_index=253, eoi_token_index=254)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(tmp_path)
    save_word_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", kernels="torch", max_num_batched_tokens=16,
              kv_cache_gib=0.01)
    c = llm.engine.model.config
    assert c.name == "gemma3" and c.rope_scaling.kind == "linear" and c.sliding_layers == (0, 1)
    worst = compare_with_reference(lambda ids: model(input_ids=ids), prompts,
                                   run_capturing_logits(llm, prompts))
    assert worst <= REL_TOL
