"""Shared fixtures: the real default model, loaded once per test session."""
from __future__ import annotations

import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def llm_fp32():
    from entropic import LLM
    return LLM(dtype="float32", max_num_batched_tokens=512, kv_cache_gib=0.5)


@pytest.fixture(scope="session")
def llm_bf16():
    from entropic import LLM
    return LLM(dtype="bfloat16", max_num_batched_tokens=256, kv_cache_gib=0.25)


@pytest.fixture(scope="session")
def hf_reference():
    """transformers' LlamaForCausalLM on the same GGUF, fp32: the reference implementation."""
    from transformers import AutoModelForCausalLM

    from entropic.model.loader import default_model_path
    import os
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                 gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def chat_prompts(llm_fp32):
    """Chat-templated ShareGPT first turns, token ids, of varied lengths (<= 160 tokens)."""
    from entropic.bench.datasets import load_sharegpt_prompts
    tok = llm_fp32.tokenizer
    out = []
    for rec in load_sharegpt_prompts(200):
        ids = tok.apply_chat_template([{"role": "user", "content": rec["prompt"]}])
        if len(ids) <= 160:
            out.append(ids)
        if len(out) == 24:
            break
    return out
