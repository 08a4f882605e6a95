"""Entropic KV-block pruning: selection invariants, attention over chosen blocks, eviction."""
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from entropic.control.pruning import EntropicBlockPruner, PruningConfig
from entropic.engine.block_pool import BlockPool
from entropic.engine.kv_manager import EVICTED, KVCacheManager
from entropic.engine.request import Request, RequestStatus
from entropic.engine.scheduler import SampledToken, Scheduler
from entropic.model.attention import DecodeGroup, _decode_group
from entropic.sampling_params import SamplingParams
from fakes import PrunedFakeRunner, next_token


def _req(rid="r", entropy=None, n_prompt=4, computed=None):
    r = Request(rid, list(range(n_prompt)), SamplingParams(max_tokens=1000, temperature=0), 0.0)
    if entropy is not None:
        r.entropies.append(entropy)
    r.num_computed_tokens = n_prompt if computed is None else computed
    r.status = RequestStatus.RUNNING
    return r


@pytest.mark.parametrize("kw, field", [
    ({"score": "x"}, "score"), ({"min_keep_fraction": 0.0}, "min_keep_fraction"),
    ({"h_low": 2.0, "h_high": 1.0}, "h_low"), ({"recent_blocks": 0}, "recent_blocks"),
    ({"min_blocks": 0}, "min_blocks"), ({"refresh_interval": 0}, "refresh_interval"),
    ({"mass_decay": 1.0}, "mass_decay"), ({"hybrid_weight": 2.0}, "hybrid_weight"),
])
def test_bad_config_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        PruningConfig(**kw)


def test_keep_fraction_is_dense_when_uncertain_and_sparse_when_certain():
    cfg = PruningConfig(min_keep_fraction=0.2, h_low=1.0, h_high=3.0)
    assert cfg.keep_fraction(0.0) == cfg.keep_fraction(1.0) == pytest.approx(0.2)
    assert cfg.keep_fraction(2.0) == pytest.approx(0.6)
    assert cfg.keep_fraction(5.0) == 1.0
    hs = [i / 10 for i in range(60)]
    fr = [cfg.keep_fraction(h) for h in hs]
    assert fr == sorted(fr)  # theta rises (fewer blocks kept) as entropy falls
    fixed = PruningConfig(min_keep_fraction=0.4, adaptive=False)
    assert {fixed.keep_fraction(h) for h in hs} == {0.4}


@settings(max_examples=300, deadline=None)
@given(num=st.integers(1, 60), entropy=st.floats(0, 6), sink=st.integers(0, 3),
       recent=st.integers(1, 4), min_blocks=st.integers(1, 8), rho=st.floats(0.05, 1.0),
       evicted=st.sets(st.integers(0, 59), max_size=30), seed=st.integers(0, 10_000),
       score=st.sampled_from(["mass", "surprisal", "hybrid"]))
def test_selection_keeps_sink_recent_and_budget(num, entropy, sink, recent, min_blocks, rho,
                                                evicted, seed, score):
    cfg = PruningConfig(score=score, sink_blocks=sink, recent_blocks=recent,
                        min_blocks=min_blocks, min_keep_fraction=rho, refresh_interval=1000)
    pruner = EntropicBlockPruner(cfg, block_size=4)
    req = _req(entropy=entropy)
    g = torch.Generator().manual_seed(seed)
    live = [i for i in range(num) if i not in evicted or i >= num - recent or i < sink]
    shares = torch.rand(len(live), generator=g)
    pruner.observe(req, list(range(num * 4)), torch.rand(num * 4, generator=g).tolist(),
                   live, (shares / shares.sum()).tolist())
    chosen = pruner.select(req, live, num).attend
    budget = max(min_blocks, math.ceil(cfg.keep_fraction(entropy) * len(live) - 1e-9))
    if chosen is None:
        assert budget >= len(live)
        return
    assert chosen == sorted(set(chosen)) and set(chosen) <= set(live)
    assert chosen[-1] == num - 1
    protected = (set(range(min(sink, num))) | set(range(max(0, num - recent), num))) & set(live)
    assert protected <= set(chosen)
    assert len(chosen) == max(budget, len(protected))
    # the kept unprotected blocks are the highest-scored ones
    rest = [i for i in live if i not in protected]
    sc = dict(zip(rest, pruner.scores(req.request_id, rest)))
    kept = [sc[i] for i in chosen if i in sc]
    dropped = [sc[i] for i in rest if i not in chosen]
    if kept and dropped:
        assert min(kept) >= max(dropped)


def test_lower_entropy_attends_fewer_blocks():
    cfg = PruningConfig(score="mass", min_keep_fraction=0.25, h_low=0.5, h_high=3.0,
                        refresh_interval=1000)
    sizes = []
    for h in (4.0, 2.5, 1.5, 0.2):
        pruner = EntropicBlockPruner(cfg, 16)
        req = _req(entropy=h)
        pruner.observe(req, [], [], list(range(40)), [1 / 40] * 40)
        chosen = pruner.select(req, list(range(40)), 40).attend
        sizes.append(40 if chosen is None else len(chosen))
    assert sizes[0] == 40 and sizes == sorted(sizes, reverse=True) and sizes[-1] == 10


def test_refresh_and_first_decode_are_dense():
    cfg = PruningConfig(score="mass", min_keep_fraction=0.25, refresh_interval=4)
    pruner = EntropicBlockPruner(cfg, 16)
    req = _req(entropy=0.1)
    live = list(range(20))
    first = pruner.select(req, live, 20)  # nothing measured yet: dense measures it
    assert first.attend is None and first.collect_attention
    pruner.observe(req, [], [], live, [1 / 20] * 20)
    picks = []
    for _ in range(8):
        sel = pruner.select(req, live, 20)
        picks.append((sel.attend is None, sel.collect_attention))
        if sel.collect_attention:
            pruner.observe(req, [], [], live, [1 / 20] * 20)
    assert picks == [(False, False)] * 3 + [(True, True)] + [(False, False)] * 3 + [(True, True)]


def test_decode_over_chosen_blocks_equals_masked_full_attention():
    torch.manual_seed(0)
    bs, kvh, rep, d, nblocks = 4, 3, 3, 16, 10
    cache = torch.randn(nblocks * bs, 2, kvh, d)
    q = torch.randn(2, kvh * rep, d)
    ctx_len = 37  # last block (9) holds positions 36
    chosen = [[0, 3, 4, 9], [0, 1, 2, 5, 6, 7, 8, 9]]
    outs_ref, slots, lens = [], [], []
    for r, blocks in enumerate(chosen):
        pos = [b * bs + o for b in blocks for o in range(bs) if b * bs + o < ctx_len]
        slots.append(pos)
        lens.append(len(pos))
        k = cache[pos, 0].transpose(0, 1)  # [kvh, n, d]
        v = cache[pos, 1].transpose(0, 1)
        qr = q[r].view(kvh, rep, d)
        outs_ref.append(F.scaled_dot_product_attention(qr, k, v, scale=0.25).reshape(-1))
        # the same as attending the whole context with the other blocks masked out
        mask = torch.zeros(ctx_len, dtype=torch.bool)
        mask[pos] = True
        kf, vf = cache[:ctx_len, 0].transpose(0, 1), cache[:ctx_len, 1].transpose(0, 1)
        full = F.scaled_dot_product_attention(qr, kf, vf, attn_mask=mask, scale=0.25)
        assert torch.allclose(full.reshape(-1), outs_ref[-1], atol=1e-5)
    width = max(lens)
    flat = torch.tensor([s + [0] * (width - len(s)) for s in slots]).reshape(-1)
    mask = (torch.arange(width) < torch.tensor(lens)[:, None])[:, None, None, :]
    for mass in (None, torch.zeros(2, width)):
        g = DecodeGroup(0, 2, width, flat, mask, mass)
        out = _decode_group(q, cache, g, scale=0.25)
        assert torch.allclose(out, torch.stack(outs_ref), atol=1e-5)
    # the explicit path's mass: one unit per head, nothing on padding
    assert torch.allclose(mass.sum(-1), torch.full((2,), float(kvh * rep)), atol=1e-4)
    assert mass[0, lens[0]:].abs().sum() == 0


# ---- eviction with the scheduler and a model-free runner --------------------------------
def _run_pruned(num_blocks, specs, evict, max_num_seqs=8, budget=64):
    bs = 4
    pool = BlockPool(num_blocks)
    kv = KVCacheManager(pool, bs)
    pruner = EntropicBlockPruner(PruningConfig(score="mass", min_keep_fraction=0.25, min_blocks=2,
                                               recent_blocks=1, evict=evict), bs)
    sched = Scheduler(kv, max_num_seqs, budget, 10_000, (), None, pruner)
    runner = PrunedFakeRunner(bs)
    for i, (n_prompt, n_out) in enumerate(specs):
        sched.add(Request(f"q{i}", [(i + j) % 50 for j in range(n_prompt)],
                          SamplingParams(max_tokens=n_out, temperature=0), float(i)))
    done = 0
    for _ in range(20_000):
        if not sched.num_unfinished:
            break
        out = sched.schedule()
        sampled, mass = runner.execute(out)
        pruner.release(out.finished_ids)
        touched = sched.update(out, sampled, 0.0)
        for c in out.chunks:
            r = sched.requests.get(c.request_id)
            if r is not None and c.request_id in mass:
                pruner.observe(r, [], [], *mass[c.request_id])
        done += sum(r.status.finished for r in touched)
        assert pool.num_used == sum(kv.num_blocks_held(r) for r in sched.requests)
    assert not sched.num_unfinished and done == len(specs)
    assert pool.num_free == num_blocks  # nothing leaked
    return sched


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 40)), min_size=1, max_size=8),
       extra=st.integers(0, 20), evict=st.booleans())
def test_eviction_never_leaks_or_double_frees(specs, extra, evict):
    need = max(-(-(p + o) // 4) for p, o in specs)
    _run_pruned(need + extra, specs, evict)  # the pool raises on a double free


def test_eviction_replaces_preemption_under_memory_pressure():
    specs = [(16, 48)] * 4  # 4 requests of up to 16 blocks each; 40 blocks in all
    plain = _run_pruned(40, specs, evict=False)
    pruned = _run_pruned(40, specs, evict=True)
    assert plain.num_preemptions > 0 and plain.num_evicted_blocks == 0
    assert pruned.num_evicted_blocks > 0 and pruned.num_preemptions < plain.num_preemptions


# ---- the real model ---------------------------------------------------------------------
@pytest.mark.model
def test_pruning_that_never_binds_is_bit_identical_to_dense(llm_fp32, chat_prompts):
    """All hooks active (selection, prompt surprisal rows, observation) but a budget that
    keeps every block: the same tokens and entropies as the dense engine, bit for bit."""
    from entropic.engine.engine import LLMEngine
    prompts = chat_prompts[:6]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    eng = llm_fp32.engine
    # both from scratch: the shared LLM's prefix cache may hold these prompts already, and
    # a surprisal-scoring pruner never looks the cache up
    plain = LLMEngine(eng.model, eng.tokenizer, replace(eng.config, enable_prefix_caching=False))
    for i, p in enumerate(prompts):
        plain.add_request(f"d{i}", p, sp)
    dense = sorted(plain.run_until_done(), key=lambda o: int(o.request_id[1:]))
    pruner = EntropicBlockPruner(PruningConfig(score="surprisal", min_keep_fraction=1.0,
                                               min_attention_share=0.0), 16)
    hooked = LLMEngine(eng.model, eng.tokenizer, eng.config, block_policy=pruner)
    for i, p in enumerate(prompts):
        hooked.add_request(f"h{i}", p, sp)
    outs = sorted(hooked.run_until_done(), key=lambda o: int(o.request_id[1:]))
    for d, o in zip(dense, outs):
        assert o.token_ids == d.token_ids and o.entropies == d.entropies
    assert hooked.stats.decode_blocks_live > 0 and hooked.stats.pruned_fraction == 0.0


@pytest.mark.model
def test_pruned_decode_reads_fewer_kv_bytes_and_stays_close(llm_fp32, chat_prompts):
    from entropic.engine.engine import LLMEngine
    long_prompt = [t for p in chat_prompts[:8] for t in p][:900]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    eng = llm_fp32.engine
    runs = {}
    for name, cfg in (("dense", None), ("pruned", PruningConfig(score="mass", min_keep_fraction=0.3,
                                                                h_high=50.0,
                                                                min_attention_share=0.0))):
        pruner = EntropicBlockPruner(cfg, 16) if cfg else None
        e = LLMEngine(eng.model, eng.tokenizer, eng.config, block_policy=pruner)
        e.add_request("x", long_prompt, sp)
        (runs[name],) = e.run_until_done()
        runs[name + "_stats"] = e.stats
    d, p = runs["dense_stats"], runs["pruned_stats"]
    assert 0.3 < p.pruned_fraction < 0.8
    assert p.cost.kv_bytes_read < 0.75 * d.cost.kv_bytes_read
    assert p.cost.flops_attention < d.cost.flops_attention
    assert p.cost.flops_linear == d.cost.flops_linear
    # the first decode is dense and greedy: the first tokens agree
    assert runs["pruned"].token_ids[:2] == runs["dense"].token_ids[:2]


@pytest.mark.model
def test_prefill_copied_into_another_engine_decodes_the_same(llm_fp32, chat_prompts):
    """The pruning benchmark prefills once and moves the KV blocks into each
    configuration's engine through the prefix cache (export/import): decoding from them
    must give what a full run gives, and the pool must be whole afterwards."""
    from entropic.bench.forking import PrefilledPrompt
    from entropic.engine.engine import LLMEngine
    eng = llm_fp32.engine
    prompt = chat_prompts[7]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    # a full run from scratch (the shared LLM's prefix cache may hold this prompt already)
    dense = LLMEngine(eng.model, eng.tokenizer, replace(eng.config, enable_prefix_caching=False))
    dense.add_request("full", prompt, sp)
    (full,) = dense.run_until_done()
    pre = PrefilledPrompt.run(LLMEngine(eng.model, eng.tokenizer, eng.config), prompt, sp)
    fresh = LLMEngine(eng.model, eng.tokenizer, eng.config)
    pre.start_in(fresh, "copy", sp)
    (out,) = fresh.run_until_done()
    assert out.token_ids == full.token_ids and out.entropies == full.entropies
    assert fresh.pool.num_free == fresh.num_blocks
