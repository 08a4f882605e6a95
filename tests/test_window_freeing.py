"""Blocks before every layer's sliding window go back to the pool: never a block a window
still reads, never a leak, the same tokens, the prefix cache and preemption intact; on a
real (tiny, random) Mistral checkpoint the logits are those of the engine that keeps them."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from entropic.config import EngineConfig, ModelConfig
from entropic.engine.block_pool import cdiv
from entropic.engine.request import Request
from entropic.sampling_params import SamplingParams
from fakes import make_scheduler

BS = 4


def _run(specs, num_blocks, horizon, budget, prefix_caching, max_seqs=4):
    """Run the requests (prompt, output length) to the end with a model-free runner that
    checks every window's slots; returns (tokens per request, most blocks any running
    request held after a step, the scheduler)."""
    sched, pool, runner = make_scheduler(num_blocks, BS, max_seqs, budget,
                                         prefix_caching=prefix_caching, horizon=horizon)
    shared = [7, 8, 9, 10, 11, 12, 13, 14]  # a common prefix: the prefix cache shares it
    for i, (n_prompt, n_out) in enumerate(specs):
        prompt = (shared + [(i * 7 + j) % 50 for j in range(n_prompt)])[:max(1, n_prompt)]
        sched.add(Request(f"q{i}", prompt, SamplingParams(max_tokens=n_out, temperature=0,
                                                           ignore_eos=True), float(i)))
    tokens, peak = {}, 0
    for _ in range(50_000):
        if not sched.num_unfinished:
            break
        out = sched.schedule()
        for r in sched.update(out, runner.execute(out), 0.0):
            if r.status.finished:
                tokens[r.request_id] = r.output_token_ids
        assert pool.num_used == len({b for r in sched.requests
                                     for b in sched.kv.block_table(r) if b >= 0})
        for r in sched.running:
            held = sched.kv.num_blocks_held(r.request_id)
            peak = max(peak, held)
            if horizon is not None:
                assert held <= cdiv(horizon, BS) + 1 + cdiv(budget, BS)
    assert not sched.num_unfinished
    assert pool.num_free == num_blocks  # nothing leaked
    return tokens, peak, sched


@settings(max_examples=80, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 40)), min_size=1, max_size=6),
       horizon=st.integers(1, 24), extra=st.integers(0, 12), budget=st.sampled_from([3, 8, 64]),
       prefix_caching=st.booleans())
def test_freeing_outside_the_window_never_frees_a_read_block_nor_leaks(
        specs, horizon, extra, budget, prefix_caching):
    need = max(cdiv(p + 8 + o, BS) for p, o in specs)  # every request fits alone
    tokens, _, sched = _run(specs, need + extra, horizon, budget, prefix_caching)
    kept, _, _ = _run(specs, need + extra, None, budget, prefix_caching)
    assert tokens == kept


def test_a_long_generation_holds_a_windows_worth_of_blocks():
    specs = [(20, 300)]
    tokens, peak, sched = _run(specs, 100, 16, 64, False)
    kept, peak_kept, _ = _run(specs, 100, None, 64, False)
    assert tokens == kept
    assert peak_kept == cdiv(320, BS) and peak <= cdiv(16, BS) + 1
    assert sched.num_window_freed_blocks >= cdiv(320, BS) - (cdiv(16, BS) + 1)


def test_preempted_request_recomputes_after_its_blocks_were_freed():
    """Too few blocks for three requests at once even with freeing: preemption frees a
    table with freed entries, the recompute builds a new one (and frees again)."""
    specs = [(12, 80)] * 3
    tokens, _, sched = _run(specs, 5, 8, 8, True, max_seqs=3)
    kept, _, _ = _run(specs, 80, None, 8, True, max_seqs=3)
    assert tokens == kept and sched.num_recomputes > 0 and sched.num_window_freed_blocks > 0


def test_attention_horizon_is_the_window_only_when_every_layer_has_one():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=3, num_heads=2,
                num_kv_heads=1, head_dim=4, max_position=64)
    assert ModelConfig(**base).attention_horizon is None
    assert ModelConfig(**base, sliding_window=8, sliding_layers=(0, 1)).attention_horizon is None
    assert ModelConfig(**base, sliding_window=8, sliding_layers=(0, 1, 2)).attention_horizon == 8
    with pytest.raises(TypeError, match="free_outside_window"):
        EngineConfig(free_outside_window="yes")


# ---- a real forward: a tiny random Mistral, every layer windowed -------------------------
@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    from test_families import build_family
    folder = tmp_path_factory.mktemp("mistral")
    build_family("mistral", folder)  # sliding_window 8 on both layers
    return str(folder)


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_freeing_gives_the_logits_of_the_engine_that_keeps_every_block(mistral, kernels):
    from types import SimpleNamespace

    from engine_probe import run_capturing_logits

    from entropic import LLM
    from entropic.engine.engine import LLMEngine
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(mistral, dtype="float32", kernels=kernels, block_size=4, num_kv_blocks=64,
                  max_num_batched_tokens=16)  # chunked prefill past the window too
        eng = llm.engine
        assert eng.config.free_outside_window and eng.scheduler.attention_horizon == 8
        keeper = LLMEngine(eng.model, eng.tokenizer,
                           replace(eng.config, free_outside_window=False))
        prompts = [[1] + [(7 * i + j) % 250 + 3 for j in range(n)] for i, n in
                   enumerate((5, 37, 60))]
        sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        freed = run_capturing_logits(llm, prompts, sp)
        kept = run_capturing_logits(SimpleNamespace(engine=keeper), prompts, sp)
        assert eng.scheduler.num_window_freed_blocks > 20
        assert keeper.scheduler.num_window_freed_blocks == 0
        assert eng.pool.num_free == keeper.pool.num_free == 64
        for rid in kept:
            assert torch.equal(torch.stack(freed[rid]), torch.stack(kept[rid]))
    finally:
        torch.set_num_threads(old)
