"""Query-aware block selection ("bound" pruning): the key-score bound, the kernel's choice per
layer and KV head against masked dense attention at every ISA level, the KV cache's bound
rows, the no-regret gate, and the real model (a budget that never binds is bit-identical
to dense)."""
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from entropic import kernels
from entropic.config import ModelConfig
from entropic.control.pruning import EntropicBlockPruner, PruningConfig
from entropic.engine.block_policy import BlockBudget
from entropic.engine.cost import CostModel
from entropic.engine.engine import LLMEngine
from entropic.engine.request import Request
from entropic.model.attention import (DecodeGroup, KVCache, PrefillSparsity,
                                      QueryAwareSelection, _decode_group, bound_selection,
                                      lazy_zeros)
from entropic.sampling_params import SamplingParams

LEVELS = kernels.isa_levels()


def _cache(num_blocks, bs, kvh, d, dtype, seed=0):
    """A KV cache with random keys and values and the key bounds of every block."""
    g = torch.Generator().manual_seed(seed)
    kv = KVCache(1, num_blocks, bs, kvh, d, dtype, key_bounds=True)
    kv.kv[0, :num_blocks * bs] = torch.randn(num_blocks * bs, 2, kvh, d, generator=g).to(dtype)
    kv.update_key_bounds(list(range(num_blocks)))
    return kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 1000, 2, 3, 64), (1, 7), (0, 5)])
def test_the_kv_pool_starts_zeroed_aligned_and_writable(dtype, shape):
    t = lazy_zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert torch.equal(t, torch.zeros(shape, dtype=dtype))
    if t.numel():
        assert t.data_ptr() % 64 == 0
        t.view(-1)[-1] = 1.5  # writable, to the last element
        assert t.view(-1)[-1].item() == 1.5 and t.sum().item() == 1.5
    kv = KVCache(2, 4, 16, 3, 64, dtype, key_bounds=True)
    assert kv.kv.data_ptr() % 64 == 0 and not kv.kv.any()


def test_bound_rows_hold_each_blocks_key_minimum_and_maximum():
    kv = _cache(5, 4, 2, 8, torch.float32)
    keys = kv.kv[0, :20, 0].view(5, 4, 2, 8)
    bounds = kv.kv[0, kv.bounds_offset:]
    assert torch.equal(bounds[:, 0], keys.amin(1)) and torch.equal(bounds[:, 1], keys.amax(1))


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_the_bound_is_at_least_every_keys_score(seed):
    torch.manual_seed(seed)
    bs, kvh, rep, d, nb = 4, 2, 3, 16, 6
    kv = _cache(nb, bs, kvh, d, torch.float32, seed)
    q = torch.randn(1, kvh, rep, d)
    slots = torch.arange(nb * bs)[None]
    sel = QueryAwareSelection(bs, kv.bounds_offset, 0, 1)
    # keep all but one candidate: the ranking is visible in which one is dropped
    chosen = bound_selection(q, kv.kv[0], slots, torch.tensor([nb * bs]), torch.tensor([nb - 1]),
                             sel)
    keys = kv.kv[0, :nb * bs, 0].view(nb, bs, kvh, d)
    score = torch.einsum("grd,nbgd->gnbr", q[0].double(), keys.double()).amax(dim=(2, 3))
    bmin, bmax = kv.kv[0, kv.bounds_offset:, 0].double(), kv.kv[0, kv.bounds_offset:, 1].double()
    bound = torch.maximum(q[0, :, :, None].double() * bmin.permute(1, 0, 2)[:, None],
                          q[0, :, :, None].double() * bmax.permute(1, 0, 2)[:, None]).sum(-1)
    # bound: [kvh, rep, nb], an upper bound of q.k over each block's keys, for every head
    exact = torch.einsum("grd,nbgd->grnb", q[0].double(), keys.double()).amax(-1)
    assert (bound >= exact - 1e-9).all()
    assert (bound.amax(1) >= score - 1e-9).all()
    # the score ranks blocks by their largest bound over the heads
    rel = bound[:, :, :nb - 1].amax(1)  # [kvh, nb - 1]
    for g in range(kvh):
        dropped = (~chosen[0, g, :nb - 1]).nonzero().flatten().tolist()
        assert len(dropped) == 1  # the last block (recent) is always in
        assert rel[g, dropped[0]] <= rel[g].min() + 1e-5


def _masked_reference(q, cache, slots, lengths, chosen, bs, scale):
    """Attention of each row over its chosen blocks only, as masked dense SDPA (fp64)."""
    n, ctx = slots.shape
    kvh, d = cache.shape[2], cache.shape[3]
    rep = q.shape[1] // kvh
    ctxkv = cache[slots.view(-1)].view(n, ctx, 2, kvh, d).double()
    mask = chosen.repeat_interleave(bs, dim=-1)[..., :ctx]
    mask &= torch.arange(ctx) < lengths[:, None, None]
    out = F.scaled_dot_product_attention(
        q.view(n, kvh, rep, d).double(), ctxkv[:, :, 0].transpose(1, 2),
        ctxkv[:, :, 1].transpose(1, 2), attn_mask=mask[:, :, None], scale=scale)
    return out.reshape(n, -1)


def _problem(dtype, seed=1):
    torch.manual_seed(seed)
    bs, kvh, rep, d, nb = 16, 3, 3, 64, 24
    kv = _cache(nb, bs, kvh, d, dtype, seed)
    # rows read the blocks in a scattered order, with different lengths and budgets
    perm = torch.randperm(nb)
    lengths = torch.tensor([300, 17, 384, 200, 129])
    n, ctx = len(lengths), int(lengths.max())
    slots = torch.zeros(n, ctx, dtype=torch.long)
    for r in range(n):
        blocks = perm.roll(5 * r)
        pos = torch.arange(ctx)
        slots[r] = blocks[pos // bs] * bs + pos % bs
    keep = torch.tensor([5, 1, 24, 3, 8])  # row 2 is dense (24 >= its 24 blocks)
    q = torch.randn(n, kvh * rep, d).to(dtype)
    sel = QueryAwareSelection(bs, kv.bounds_offset, 1, 2)
    return q, kv, slots, lengths, keep, sel


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_attends_the_bound_chosen_blocks_like_masked_dense_attention(level, dtype):
    q, kv, slots, lengths, keep, sel = _problem(dtype)
    n, ctx = slots.shape
    scale = 0.125
    chosen = bound_selection(q.view(n, 3, 3, 64), kv.kv[0], slots, lengths, keep, sel)
    nb = (lengths + 15) // 16
    for r in range(n):  # sink, recent and the budget, exactly
        per_head = chosen[r, :, :nb[r]].sum(-1)
        assert (per_head == min(int(keep[r]), int(nb[r]))).all() or int(keep[r]) < 3
        assert chosen[r, :, 0].all() and chosen[r, :, nb[r] - 2:nb[r]].all()
    ref = _masked_reference(q, kv.kv[0], slots, lengths, chosen, 16, scale)
    with kernels.forced_isa(level):
        out = torch.ops.entropic.paged_decode_attention(
            q, kv.kv[0], slots, lengths, scale, None, keep, sel.block_size, sel.bounds_offset,
            sel.sink, sel.recent)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(out.double(), ref, atol=tol, rtol=tol)
    # a row's selection differs from dense attention where the budget binds
    dense = _masked_reference(q, kv.kv[0], slots, lengths, torch.ones_like(chosen), 16, scale)
    assert torch.allclose(ref[2], dense[2]) and not torch.allclose(ref[0], dense[0], atol=1e-3)


@pytest.mark.parametrize("level", LEVELS)
def test_long_selected_rows_in_chunks_alone_and_in_a_batch(level):
    # rows attending more than 512 slots after selection are computed in chunks: the masked
    # reference's numbers, and the same bits alone (chunks over the threads) as in a batch
    # of 9 (a thread computes a whole row)
    torch.manual_seed(3)
    bs, nb = 16, 90
    kv = _cache(nb, bs, 3, 64, torch.bfloat16, seed=3)
    lengths = torch.tensor([1440, 1000, 700, 1201, 530, 1440, 900, 17, 1300])
    keep = torch.tensor([60, 40, 90, 75, 20, 36, 50, 1, 33])  # row 2 dense
    n, ctx = len(lengths), int(lengths.max())
    slots = torch.stack([torch.randperm(nb)[torch.arange(ctx) // bs] * bs + torch.arange(ctx) % bs
                         for _ in range(n)])
    q = torch.randn(n, 9, 64).bfloat16()
    sel = QueryAwareSelection(bs, kv.bounds_offset, 1, 2)
    chosen = bound_selection(q.view(n, 3, 3, 64), kv.kv[0], slots, lengths, keep, sel)
    ref = _masked_reference(q, kv.kv[0], slots, lengths, chosen, bs, 0.125)

    def run(rows):
        return torch.ops.entropic.paged_decode_attention(
            q[rows], kv.kv[0], slots[rows], lengths[rows], 0.125, None, keep[rows], bs,
            sel.bounds_offset, sel.sink, sel.recent)

    with kernels.forced_isa(level):
        batch = run(slice(None))
        assert torch.allclose(batch.double(), ref, atol=2e-2, rtol=2e-2)
        for r in range(n):
            assert torch.equal(run(slice(r, r + 1))[0], batch[r])


def test_torch_path_selects_like_the_kernel():
    q, kv, slots, lengths, keep, sel = _problem(torch.float32)
    n, ctx = slots.shape
    g = DecodeGroup(0, n, ctx, slots.reshape(-1), None, None, lengths, keep, sel)
    out = _decode_group(q, kv.kv[0], g, scale=0.125)
    native = torch.ops.entropic.paged_decode_attention(
        q, kv.kv[0], slots, lengths, 0.125, None, keep, 16, sel.bounds_offset, 1, 2)
    assert torch.allclose(out, native, atol=1e-5)


def test_kernel_refuses_a_budget_without_bound_rows():
    q, kv, slots, lengths, keep, sel = _problem(torch.float32)
    plain = kv.kv[0, :kv.bounds_offset].contiguous()  # no bound rows after the slots
    with pytest.raises(RuntimeError, match="bound row"):
        torch.ops.entropic.paged_decode_attention(q, plain, slots, lengths, 0.125, None, keep,
                                                  16, kv.bounds_offset, 1, 2)


def _smollm_cost():
    c = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                    rope_theta=1e5, max_position=8192, tie_word_embeddings=True,
                    bos_token_id=1, eos_token_ids=(2,))
    return CostModel(c, 2)


def test_the_gate_prunes_only_where_attention_is_a_real_share():
    pruner = EntropicBlockPruner(PruningConfig(score="bound"), 16)
    pruner.bind(_smollm_cost())
    req = Request("r", list(range(8)), SamplingParams(max_tokens=10), 0.0)
    req.entropies.append(0.1)  # certain: the sparsest budget
    blocks = lambda n, rows: pruner.select(req, list(range(n)), n, rows).budget
    assert blocks(64, 1) is None  # 1k tokens alone: ~8 % of the bytes, dense
    assert blocks(256, 1) == BlockBudget(64, 1, 2)  # 4k: ~26 %, a quarter kept
    assert blocks(64, 16) == BlockBudget(16, 1, 2)  # 1k beside 15 other rows: ~55 %
    never = EntropicBlockPruner(PruningConfig(score="bound", min_attention_share=1.0), 16)
    never.bind(_smollm_cost())
    assert never.select(req, list(range(512)), 512, 64).budget is None


def test_prefill_is_sparse_only_where_its_attention_is_a_real_share():
    """The gate priced for prefill (FLOPs): SmolLM2's first 512-token chunk spends ~8 % of
    its FLOPs in attention, a chunk after 1.5k cached tokens ~36 %, after 4k ~60 %."""
    cost = _smollm_cost()
    assert 0.05 < cost.prefill_attention_share(0, 512) < 0.1
    assert 0.3 < cost.prefill_attention_share(1536, 512) < 0.4
    assert 0.5 < cost.prefill_attention_share(4096, 512) < 0.7
    req = Request("r", list(range(8)), SamplingParams(max_tokens=10), 0.0)
    pruner = EntropicBlockPruner(PruningConfig(), 16)
    pruner.bind(cost)
    assert pruner.prefill_sparsity(req, 0, 512) is None
    assert pruner.prefill_sparsity(req, 1536, 512) is None
    # sink: 1 block of 16 -> 1 block of 64 keys; recent: 2 of 16 -> the tile's own + 1
    assert pruner.prefill_sparsity(req, 4096, 512) == PrefillSparsity(4.0, 1, 2)
    wide = EntropicBlockPruner(PruningConfig(sink_blocks=5, recent_blocks=9,
                                             prefill_delta=1.5), 16)
    wide.bind(cost)
    assert wide.prefill_sparsity(req, 4096, 512) == PrefillSparsity(1.5, 2, 4)
    ungated = EntropicBlockPruner(PruningConfig(min_prefill_attention_share=0.0), 16)
    ungated.bind(cost)
    assert ungated.prefill_sparsity(req, 0, 512) == PrefillSparsity(4.0, 1, 2)
    off = EntropicBlockPruner(PruningConfig(prefill_delta=None, min_prefill_attention_share=0.0),
                              16)
    assert off.prefill_sparsity(req, 4096, 512) is None


@pytest.mark.parametrize("bad", [-0.5, math.inf, math.nan, True, "3"])
def test_bad_prefill_delta_names_the_field(bad):
    with pytest.raises(ValueError, match="prefill_delta"):
        PruningConfig(prefill_delta=bad)


@pytest.mark.model
def test_sparse_prefill_skips_pairs_and_charges_only_what_it_attended(llm_fp32, chat_prompts):
    """A 2k-token prompt, pruning on with the prefill gate open: prefill chunks run
    block-sparse; the cost model charges the attended pairs the kernel counted, the linear
    work is unchanged, and no KV block is left behind."""
    prompt = [t for p in chat_prompts for t in p][:2048]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    eng = llm_fp32.engine
    runs = {}
    for name, cfg in (("dense", PruningConfig(prefill_delta=None)),
                      ("sparse", PruningConfig(min_prefill_attention_share=0.0))):
        e = LLMEngine(eng.model, eng.tokenizer, replace(eng.config, enable_prefix_caching=False),
                      block_policy=EntropicBlockPruner(cfg, 16))
        e.add_request("x", prompt, sp)
        (out,) = e.run_until_done()
        assert len(out.token_ids) == 4
        assert e.kv.pool.num_free == e.kv.pool.num_blocks
        runs[name] = e.stats
    d, s = runs["dense"], runs["sparse"]
    assert d.prefill_pairs_dense == 0 and d.prefill_pairs_attended == 0
    assert 0 < s.prefill_pairs_attended < 0.9 * s.prefill_pairs_dense
    skipped = s.prefill_pairs_dense - s.prefill_pairs_attended
    per_pair = eng.model.config.num_layers * 4 * 9 * 64
    assert d.cost.flops_attention - s.cost.flops_attention == pytest.approx(skipped * per_pair,
                                                                            rel=1e-6)
    assert s.cost.flops_linear == d.cost.flops_linear


def test_bound_pruning_refuses_eviction_clearly():
    with pytest.raises(ValueError, match="evict"):
        PruningConfig(score="bound", evict=True)


@pytest.mark.model
def test_a_budget_that_never_binds_is_bit_identical_to_dense(llm_fp32, chat_prompts):
    prompt = [t for p in chat_prompts[:6] for t in p][:500]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    eng = llm_fp32.engine
    runs = {}
    for name, cfg in (("dense", None),
                      ("bound", PruningConfig(score="bound", min_keep_fraction=1.0,
                                              min_attention_share=0.0, prefill_delta=None))):
        pruner = EntropicBlockPruner(cfg, 16) if cfg else None
        e = LLMEngine(eng.model, eng.tokenizer, eng.config, block_policy=pruner)
        e.add_request("x", prompt, sp)
        (runs[name],) = e.run_until_done()
    assert runs["bound"].token_ids == runs["dense"].token_ids
    assert runs["bound"].entropies == runs["dense"].entropies


@pytest.mark.model
def test_bound_pruning_reads_fewer_bytes_and_stays_close(llm_fp32):
    """A 900-token act of a play, its next 16 tokens forced: at a 30 % budget the decode
    reads under half the KV bytes, and the next-token distributions stay close to dense."""
    from entropic.bench.datasets import load_longdocs
    from entropic.bench.forking import TeacherForcer
    ids = llm_fp32.tokenizer.encode(load_longdocs("play")[0]["text"])
    prompt, target = ids[:900], ids[900:916]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    eng = llm_fp32.engine
    runs = {}
    for name, cfg in (("dense", None),
                      ("bound", PruningConfig(score="bound", min_keep_fraction=0.3, h_high=50.0,
                                              min_attention_share=0.0))):
        forcer = TeacherForcer(keep_distributions=True)
        forcer.targets = {"x": target}
        pruner = EntropicBlockPruner(cfg, 16) if cfg else None
        e = LLMEngine(eng.model, eng.tokenizer, eng.config, processors=[forcer],
                      block_policy=pruner)
        e.add_request("x", prompt, sp)
        e.run_until_done()
        runs[name] = torch.stack(forcer.logps["x"][1:])  # the decode steps
        runs[name + "_stats"] = e.stats
    d, b = runs["dense_stats"], runs["bound_stats"]
    assert 0.5 < b.pruned_fraction < 0.8
    assert b.cost.kv_bytes_read < 0.5 * d.cost.kv_bytes_read
    assert b.cost.flops_linear == d.cost.flops_linear
    pd, pb = runs["dense"], runs["bound"]
    kl = (pd.exp() * (pd - pb)).sum(-1)
    assert float(kl.mean()) < 0.05
    assert (pd.argmax(-1) == pb.argmax(-1)).float().mean() >= 0.8
