"""entropic's native CPU kernels against the torch formulas they replace, and in the engine.

Every kernel test runs at each ISA level this CPU runs (`isa` fixture: the lower levels
forced), against the same references; test_isa.py checks the levels themselves."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from entropic import kernels
from entropic.model.attention import PrefillSparsity, sparse_prefill_keep
from entropic.model.llama import RotaryEmbedding, rms_norm

kernels.load()
E = torch.ops.entropic
DTYPES = (torch.bfloat16, torch.float32)
LEVELS = kernels.isa_levels()
VECTOR_LEVELS = [lv for lv in LEVELS if lv != "generic"]  # with int4/int8 and prefill


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(params=LEVELS)
def isa(request):
    """Each level this CPU runs, forced for the test."""
    with kernels.forced_isa(request.param):
        yield request.param


@pytest.fixture(params=VECTOR_LEVELS)
def vector_isa(request):
    """Each level with the int4/int8 linears and prefill attention."""
    with kernels.forced_isa(request.param):
        yield request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", (1, 7, 64))
def test_rms_norm_matches_the_torch_formula(isa, dtype, rows):
    g = _gen(rows)
    # magnitudes from 2^-6 to 2^6 per row: the rounding of the normalised value matters
    x = (torch.randn(rows, 576, generator=g)
         * torch.exp2(torch.randint(-6, 7, (rows, 1), generator=g).float())).to(dtype)
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    got, want = E.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5)
    if dtype == torch.bfloat16:  # rounded to bf16 where the formula rounds: bit-identical
        assert torch.equal(got, want)
    else:  # fp32: the sum of squares is added in another order
        torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
    # a strided view (rows of a wider buffer) is read in place
    wide = torch.cat((x, x), dim=1)
    assert torch.equal(E.rms_norm(wide[:, :576], w, 1e-5), got)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(isa, dtype):
    gu = (torch.randn(33, 2 * 1536, generator=_gen(1)) * 4).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    got, want = E.silu_mul(gu), F.silu(gate) * up
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:  # exp may differ from torch's vectorised one by an ulp
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", (1, 5, 40))
def test_rope_kv_matches_rotation_and_cache_write(isa, dtype, rows):
    H, KVH, D = 9, 3, 64
    g = _gen(rows)
    rope = RotaryEmbedding(D, 8192, 1e5, dtype, "cpu")
    qkv = torch.randn(rows, (H + 2 * KVH) * D, generator=g).to(dtype)
    positions = torch.randint(0, 8192, (rows,), generator=g)
    slots = torch.randperm(100, generator=g)[:rows]
    cos, sin = rope.tables(positions)
    want = qkv.clone()
    RotaryEmbedding.apply_(want[:, :(H + KVH) * D].view(rows, H + KVH, D), cos, sin)
    want_cache = torch.zeros(100, 2, KVH, D, dtype=dtype)
    want_cache.index_copy_(0, slots, want[:, H * D:].view(rows, 2, KVH, D))
    got, cache = qkv.clone(), torch.zeros_like(want_cache)
    E.rope_kv_(got, cos, sin, cache, slots, H, KVH)
    assert torch.equal(got, want)  # the same roundings in the same order: bit-identical
    assert torch.equal(cache, want_cache)


def _reference_attention(q, cache, slots, lengths, scale):
    """Masked softmax attention in fp64 over the gathered context: out [n, H*D], mass [n, ctx]."""
    n, H, D = q.shape
    kvh = cache.shape[2]
    ctx = cache[slots].double()  # [n, ctx, 2, KVH, D]
    k = ctx[:, :, 0].transpose(1, 2).repeat_interleave(H // kvh, 1)
    v = ctx[:, :, 1].transpose(1, 2).repeat_interleave(H // kvh, 1)
    scores = (q.double()[:, :, None] @ k.transpose(-1, -2)) * scale  # [n, H, 1, ctx]
    valid = (torch.arange(slots.shape[1]) < lengths[:, None])[:, None, None, :]
    p = scores.masked_fill(~valid, -math.inf).softmax(-1)
    return (p @ v).reshape(n, H * D), p.sum(dim=(1, 2))


def _decode_inputs(g, n, H, KVH, D, ctx, S, dtype):
    """q [n, H, D], a cache of S slots, and each row's ctx distinct random slots."""
    cache = torch.randn(S, 2, KVH, D, generator=g).to(dtype)
    q = torch.randn(n, H, D, generator=g).to(dtype)
    slots = torch.stack([torch.randperm(S, generator=g)[:ctx] for _ in range(n)])
    return q, cache, slots


def _check_decode_attention(q, cache, slots, lengths, scale):
    """paged_decode_attention (with mass) against the fp64 reference; (out, mass, tol)."""
    mass = torch.zeros(slots.shape)
    out = E.paged_decode_attention(q, cache, slots, lengths, scale, mass)
    want, want_mass = _reference_attention(q, cache, slots, lengths, scale)
    tol = (dict(rtol=1e-2, atol=1e-2) if q.dtype == torch.bfloat16
           else dict(rtol=1e-5, atol=1e-5))
    torch.testing.assert_close(out.double(), want, **tol)
    torch.testing.assert_close(mass.double(), want_mass, rtol=1e-5, atol=1e-5)
    return out, mass, tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", (64, 40))  # 40: not a multiple of 16 (the generic path)
def test_paged_decode_attention_matches_softmax_attention(isa, dtype, head_dim):
    n, ctx = 6, 150
    q, cache, slots = _decode_inputs(_gen(head_dim), n, 9, 3, head_dim, ctx, 1000, dtype)
    lengths = torch.tensor([ctx, 1, 17, 100, 149, 64])
    out, mass, tol = _check_decode_attention(q, cache, slots, lengths, 0.125)
    assert mass[:, lengths.min():].sum() > 0 and torch.all(mass[1, 1:] == 0)
    # no lengths: every row attends its whole ctx; padding slots past a length are never read
    full = E.paged_decode_attention(q, cache, slots, None, 0.125, None)
    torch.testing.assert_close(full.double(), _reference_attention(
        q, cache, slots, torch.full((n,), ctx), 0.125)[0], **tol)
    bad = slots.clone()
    bad[1, 1:] = 10 ** 9  # beyond row 1's length: must be ignored
    assert torch.equal(E.paged_decode_attention(q, cache, bad, lengths, 0.125, None)[1], out[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,KVH,D", [(8, 8, 32), (8, 4, 128), (16, 2, 64), (10, 2, 256),
                                     (28, 4, 128)])  # query heads a KV head: 1, 2, 8, 5, 7
def test_paged_decode_attention_other_shapes(isa, dtype, H, KVH, D):
    ctx = 70
    q, cache, slots = _decode_inputs(_gen(H * D), 3, H, KVH, D, ctx, 300, dtype)
    _check_decode_attention(q, cache, slots, torch.tensor([ctx, 9, 33]), 0.1)


def test_paged_decode_attention_rows_do_not_depend_on_each_other(isa):
    # 12 rows: whole rows are work items, each thread fetching its next row ahead (up to 256
    # slots: rows up to 400 long are partly fetched ahead); alone, a row is split by KV head
    g = _gen(3)
    n, ctx = 12, 400
    cache = torch.randn(2000, 2, 3, 64, generator=g).bfloat16()
    q = torch.randn(n, 9, 64, generator=g).bfloat16()
    slots = torch.randint(0, 2000, (n, ctx), generator=g)
    lengths = torch.randint(1, ctx + 1, (n,), generator=g)
    lengths[:3] = torch.tensor([ctx, 1, 257])
    for r in range(n):
        slots[r, lengths[r]:] = 10 ** 9  # past a row's length: never read, nor fetched ahead
    batch = E.paged_decode_attention(q, cache, slots, lengths, 0.125, None)
    torch.testing.assert_close(batch.double(), _reference_attention(
        q, cache, slots.clamp(max=1999), lengths, 0.125)[0], rtol=1e-2, atol=1e-2)
    for r in range(n):
        alone = E.paged_decode_attention(q[r:r + 1], cache, slots[r:r + 1, :lengths[r]], None,
                                         0.125, None)
        assert torch.equal(alone[0], batch[r])


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_attention_long_rows_in_chunks(isa, dtype):
    # rows of more than 512 slots are computed in chunks, each KV head's chunks merged: the
    # fp64 reference's numbers, and the same bits alone (chunks spread over the threads) as
    # in a batch of 12 (a thread computes a whole row)
    g = _gen(5)
    n, ctx = 12, 1700
    q, cache, slots = _decode_inputs(g, n, 9, 3, 64, ctx, 4000, dtype)
    lengths = torch.randint(1, ctx + 1, (n,), generator=g)
    lengths[:5] = torch.tensor([ctx, 512, 513, 1025, 1])
    batch = E.paged_decode_attention(q, cache, slots, lengths, 0.125, None)
    tol = (dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16
           else dict(rtol=1e-5, atol=1e-5))
    torch.testing.assert_close(batch.double(), _reference_attention(
        q, cache, slots, lengths, 0.125)[0], **tol)
    for r in range(n):
        alone = E.paged_decode_attention(q[r:r + 1], cache, slots[r:r + 1, :lengths[r]], None,
                                         0.125, None)
        assert torch.equal(alone[0], batch[r])


def test_kernels_reject_bad_input_with_clear_errors():
    cache = torch.zeros(10, 2, 3, 64, dtype=torch.bfloat16)
    q = torch.zeros(2, 9, 64, dtype=torch.bfloat16)
    slots = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match="slot 10 out of range"):
        E.paged_decode_attention(q, cache, torch.full((2, 4), 10), None, 0.1, None)
    with pytest.raises(RuntimeError, match="length 5 of row 0 out of range"):
        E.paged_decode_attention(q, cache, slots, torch.tensor([5, 1]), 0.1, None)
    with pytest.raises(RuntimeError, match="kv_cache must be"):
        E.paged_decode_attention(q, cache.float(), slots, None, 0.1, None)
    with pytest.raises(RuntimeError, match="must be float32 or bfloat16"):
        E.rms_norm(torch.zeros(2, 4, dtype=torch.float16), torch.ones(4, dtype=torch.float16), 1e-5)
    with pytest.raises(RuntimeError, match="weight must be"):
        E.rms_norm(torch.zeros(2, 4), torch.ones(5), 1e-5)
    qkv = torch.zeros(1, 15 * 64, dtype=torch.bfloat16)
    tab = torch.zeros(1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="slot -1 out of range"):
        E.rope_kv_(qkv, tab, tab, cache, torch.tensor([-1]), 9, 3)


def test_kernel_choice_is_validated():
    from entropic import LLM
    with pytest.raises(ValueError, match="kernels must be one of"):
        LLM(kernels="fast")
    with pytest.raises(ValueError, match="kernels='native' are CPU kernels"):
        kernels.check_kernels("native", "cuda")
    assert kernels.default_kernels("cpu") == "native"
    assert kernels.default_kernels("cuda") == "torch"


def test_build_folder_is_keyed_by_cpu_and_source(monkeypatch, tmp_path):
    monkeypatch.setenv("ENTROPIC_KERNELS_DIR", str(tmp_path))
    a = kernels.build_dir()
    assert a.parent == tmp_path
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: "flags : another cpu")
    assert kernels.build_dir() != a


@pytest.mark.model
def test_native_and_torch_kernels_agree_on_the_real_model(llm_fp32, chat_prompts):
    """The same fp32 model with kernels="torch": logits of mixed prefill/decode steps agree
    to fp32 rounding, and greedy continuations are the same."""
    from entropic import LLM, SamplingParams

    ref = LLM(dtype="float32", kernels="torch", max_num_batched_tokens=512, kv_cache_gib=0.25)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5)
    prompts = chat_prompts[:6]
    ours, theirs = llm_fp32.generate(prompts, params), ref.generate(prompts, params)
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids
        lp = [abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)]
        ent = [abs(x - y) for x, y in zip(a.entropies, b.entropies)]
        assert max(lp) < 1e-3 and max(ent) < 1e-3


def _int16_groups(x):
    """x with each group of 32 rounded to int16 as the AVX2 quantized linears round it:
    scale max|x| / 32767 (fp32), codes round(x / scale), half to even; fp64 [rows, k]."""
    rows, k = x.shape
    xg = x.float().view(rows, k // 32, 32)
    d = xg.abs().amax(-1, keepdim=True) / 32767
    xq = torch.where(d > 0, torch.round(xg / d), torch.zeros_like(xg))
    return (xq.double() * d.double()).view(rows, k)


def _int16_reference(x, blocks):
    """What int4 computes with int16 activations (fp64 here): x rounded per group
    (_int16_groups) meets the codes times their scale; the offsets meet the exact group sums
    of x."""
    rows, k = x.shape
    n, groups = blocks.shape[0], k // 32
    xg = x.float().view(rows, groups, 32)
    xr = _int16_groups(x)
    codes = (blocks.q.view(n, groups, 32).double() * blocks.scale.double()[..., None]).view(n, k)
    return xr @ codes.T + xg.double().sum(-1) @ blocks.offset.double().T


@pytest.mark.parametrize("half", [False, True])  # fp32 scales, or fp16 ones (GGUF-like)
@pytest.mark.parametrize("shape", [(960, 576), (66, 608), (3, 1536)])  # N % 4, odd groups
def test_native_int4_linear_matches_dequantized_weights_and_is_batch_invariant(vector_isa,
                                                                            shape, half):
    from entropic.model.linear import NativeInt4Linear
    from entropic.model.quant import Int4Blocks, quantize_int4
    n, k = shape
    g = _gen(n)
    blocks = quantize_int4(torch.randn(n, k, generator=g) * 0.05)
    bias = torch.randn(n, generator=g).bfloat16()
    if half:  # scales and offsets exact in fp16, as a GGUF's Q4_0/Q4_1
        blocks = Int4Blocks(blocks.q, blocks.scale.half().float(), blocks.offset.half().float())
        if E.int4_run() != 4:  # only the avx2 level reads fp16 scales
            with pytest.raises(ValueError, match="half_scales=True needs the avx2 level"):
                NativeInt4Linear(blocks, bias=bias, half_scales=True)
            assert not NativeInt4Linear(blocks).half_scales
            return
    lin = NativeInt4Linear(blocks, bias=bias, half_scales=half)
    assert lin.scale.dtype == (torch.float16 if half else torch.float32)
    x = torch.randn(9, k, generator=g).bfloat16()
    x[3, :32] = 0  # a group of zeros (no scale to take at 8 bits)
    y = lin(x)
    want = x.double() @ blocks.dequantize().double().T + lin.bias.double()
    if E.quant_activations() == "int16":  # the codes meet x rounded per group
        want = _int16_reference(x, blocks) + lin.bias.double()
    # exact products, fp32 sums: the bf16 roundings of the product and of the bias add remain
    assert (y.double() - want).abs().max() <= 2 ** -7 * want.abs().max()
    for r in range(9):  # a row alone gives the same bits as inside any batch
        assert torch.equal(lin(x[r:r + 1])[0], y[r])
    assert torch.equal(lin(x[2:7]), y[2:7])
    bad = x.clone()
    bad[1, 40], bad[5, 3] = math.nan, math.inf  # reach every output of their rows, no other
    yb = lin(bad)
    assert yb[1].isnan().all() and not yb[5].isfinite().any()
    assert torch.equal(yb[[0, 2, 3, 4, 6, 7, 8]], y[[0, 2, 3, 4, 6, 7, 8]])


@pytest.mark.parametrize("shape", [(1000, 576), (66, 608)])
def test_native_int8_linear_matches_dequantized_weights_and_is_batch_invariant(vector_isa,
                                                                            shape):
    from entropic.model.linear import NativeInt8Linear
    from entropic.model.quant import quantize_int8
    n, k = shape
    g = _gen(k)
    w = torch.randn(n, k, generator=g) * 0.05
    lin = NativeInt8Linear(w)
    q, scale = quantize_int8(w)
    x = (torch.randn(6, k, generator=g) * 3).bfloat16()
    y = lin(x)
    xr = _int16_groups(x) if E.quant_activations() == "int16" else x.double()
    want = xr @ (q.double() * scale.double()[:, None]).T
    assert (y.double() - want).abs().max() <= 2 ** -8 * want.abs().max()
    for r in range(6):
        assert torch.equal(lin(x[r:r + 1])[0], y[r])
    bad = x.clone()
    bad[2, 7] = math.nan
    yb = lin(bad)
    assert yb[2].isnan().all() and torch.equal(yb[[0, 1, 3, 4, 5]], y[[0, 1, 3, 4, 5]])


def test_native_quantized_activations_are_what_the_level_says(vector_isa):
    """Groups of 32 holding one large value and 31 small ones: where the activations are
    rounded to int16 per group (step max / 32767), the small ones round to zero, so columns
    that weigh the large one by zero give exactly 0; multiplied as given, they do not."""
    from entropic.model.linear import NativeInt4Linear, NativeInt8Linear
    from entropic.model.quant import Int4Blocks
    g = _gen(5)
    n, k = 8, 64
    q = torch.randint(1, 16, (n, k), generator=g, dtype=torch.uint8)
    q[:, ::32] = 0
    blocks = Int4Blocks(q, torch.rand(n, k // 32, generator=g) + 0.5, torch.zeros(n, k // 32))
    w = torch.randn(n, k, generator=g)
    w[:, ::32] = 0
    x = torch.full((1, k), 0.01).bfloat16()
    x[0, ::32] = 1000.0  # the first of each group
    for lin in (NativeInt4Linear(blocks), NativeInt8Linear(w)):
        y = lin(x)[0]
        if E.quant_activations() == "int16":
            assert torch.equal(y.float(), torch.zeros(n)), y
        else:
            assert E.quant_activations() == "bf16"
            assert (y.float().abs() > 0).all(), y


def test_native_quantized_kernels_reject_bad_shapes(vector_isa):
    from entropic.model.linear import NativeInt4Linear
    from entropic.model.quant import quantize_int4
    lin = NativeInt4Linear(quantize_int4(torch.randn(16, 576, generator=_gen(3))))
    x = torch.zeros(1, 576, dtype=torch.bfloat16)
    half = lin.scale.half()
    if E.int4_run() == 4:  # fp16 scales need fp16 offsets (the offsets themselves)
        with pytest.raises(RuntimeError, match="offset must be a contiguous float16"):
            E.int4_linear(x, lin.weight, half, lin.offsets)
    else:
        with pytest.raises(RuntimeError, match="fp16 scales are read at the avx2 level only"):
            E.int4_linear(x, lin.weight, half, lin.offsets.half())
    # codes packed for the other layout
    other = (lin.weight.view(4, 9, 4, 32) if E.int4_run() == 4
             else lin.weight.view(4, 9, 4, 8, 4).transpose(2, 3).contiguous())
    with pytest.raises(RuntimeError, match="packed for another level"):
        E.int4_linear(x, other, lin.scale, lin.offsets)
    codes = torch.zeros(4, 9, 4, 32, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        E.int4_linear(torch.zeros(1, 100, dtype=torch.bfloat16), codes,
                      torch.zeros(16, 18), torch.zeros(16, 18))
    with pytest.raises(RuntimeError, match="codes must be contiguous uint8"):
        E.int4_linear(torch.zeros(1, 576, dtype=torch.bfloat16), codes[:2],
                      torch.zeros(4, 18, 4), torch.zeros(16, 18))
    with pytest.raises(RuntimeError, match="x must be a bfloat16"):
        E.int8_linear(torch.zeros(1, 576), codes, torch.zeros(16))


def _reference_prefill(q, cache, slots, start, scale):
    """fp64 causal softmax attention of q [T, H, D] at positions start.. over slots' keys."""
    T, H, D = q.shape
    ctx = cache[slots].double()  # [nk, 2, KVH, D]
    rep = H // cache.shape[2]
    k = ctx[:, 0].repeat_interleave(rep, dim=1).transpose(0, 1)  # [H, nk, D]
    v = ctx[:, 1].repeat_interleave(rep, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, T, nk]
    causal = torch.arange(len(slots))[None, :] <= (start + torch.arange(T))[:, None]
    p = scores.masked_fill(~causal, -math.inf).softmax(-1)
    return (p @ v).transpose(0, 1).reshape(T, H * D)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,start,H,KVH,D", [(1, 0, 9, 3, 64), (100, 0, 9, 3, 64),
                                              (77, 150, 9, 3, 64), (130, 3, 8, 2, 128)])
def test_prefill_attention_matches_causal_softmax_attention(vector_isa, dtype, T, start, H,
                                                            KVH, D):
    g = _gen(T + start)
    cache = torch.randn(1000, 2, KVH, D, generator=g).to(dtype)
    slots = torch.randperm(1000, generator=g)[:start + T]
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g).to(dtype)  # q is a strided view
    q = qkv[:, :H * D].view(T, H, D)
    out = E.prefill_attention(q, cache, slots, start, 1 / math.sqrt(D))
    want = _reference_prefill(q, cache, slots, start, 1 / math.sqrt(D))
    assert out.dtype == dtype and out.shape == (T, H * D)
    # bf16: bf16 probabilities in P.V and the bf16 output rounding, ~2^-8 relative; float32:
    # fp32 sums and exp (~1 ulp) only
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    assert (out.double() - want).abs().max() <= tol * want.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_does_not_depend_on_chunking(vector_isa, dtype):
    """Key blocks are aligned to position 0: a prompt's last rows give the same bits when
    prefilled alone after a cached prefix (chunked prefill) as inside the whole prompt."""
    g = _gen(11)
    cache = torch.randn(400, 2, 3, 64, generator=g).to(dtype)
    slots = torch.randperm(400, generator=g)[:200]
    q = torch.randn(200, 9, 64, generator=g).to(dtype)
    whole = E.prefill_attention(q, cache, slots, 0, 0.125)
    for cut in (1, 64, 137, 199):
        assert torch.equal(E.prefill_attention(q[cut:], cache, slots, cut, 0.125), whole[cut:])


def _structured_prefill(seed, nk, T, dtype, H=9, KVH=3, D=64, hot=0.3):
    """A cache whose key blocks of 64 are "hot" (aligned with the queries) at random, the
    rest small: scores concentrate, so a block-sparse prefill has blocks to skip."""
    g = _gen(seed)
    S = nk + 50
    cache = torch.randn(S, 2, KVH, D, generator=g) * 0.05
    v = torch.randn(KVH, D, generator=g)
    slots = torch.randperm(S, generator=g)[:nk]
    hot_keys = torch.zeros(nk, dtype=torch.bool)
    for b in range(0, nk, 64):
        hot_keys[b:b + 64] = bool(torch.rand((), generator=g) < hot)
    cache[slots[hot_keys], 0] += v
    q = v.repeat_interleave(H // KVH, 0)[None] * 0.6 + 0.3 * torch.randn(T, H, D, generator=g)
    return q.to(dtype), cache.to(dtype), slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,start", [(500, 0), (200, 700), (16, 1000), (77, 130)])
def test_sparse_prefill_attends_the_selected_blocks(vector_isa, dtype, T, start):
    """entropic.prefill_attention_sparse against torch: the same blocks (sparse_prefill_keep,
    fp64 bounds), the same pairs, and fp64 softmax attention restricted to them."""
    q, cache, slots = _structured_prefill(T + start, start + T, T, dtype)
    sp = PrefillSparsity(2.0, 1, 2)
    out, pairs = E.prefill_attention_sparse(q, cache, slots, start, 0.125, sp.delta, sp.sink,
                                            sp.recent)
    keep, want_pairs = sparse_prefill_keep(q, cache, slots, start, 0.125, sp)
    dense_pairs = 3 * (T * start + T * (T + 1) // 2)
    assert pairs == want_pairs < dense_pairs  # something was skipped, as torch chose
    # the reference: fp64 attention over the kept blocks only
    nk = start + T
    m = keep.repeat_interleave(16, 0)[:T].repeat_interleave(64, 2)[..., :nk]  # [T, KVH, nk]
    m = m.repeat_interleave(3, 1).transpose(0, 1)  # [H, T, nk]
    ctx = cache[slots].double()
    k = ctx[:, 0].repeat_interleave(3, dim=1).transpose(0, 1)
    v = ctx[:, 1].repeat_interleave(3, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * 0.125
    causal = torch.arange(nk)[None, :] <= (start + torch.arange(T))[:, None]
    p = scores.masked_fill(~(causal & m), -math.inf).softmax(-1)
    want = (p @ v).transpose(0, 1).reshape(T, 9 * 64)
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    assert (out.double() - want).abs().max() <= tol * want.abs().max()
    # the sink block and each tile's own block are always attended
    assert keep[:, :, 0].all()
    for t in range(keep.shape[0]):
        assert keep[t, :, (start + 16 * t) // 64].all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_prefill_with_a_threshold_that_never_binds_is_dense(vector_isa, dtype):
    q, cache, slots = _structured_prefill(5, 900, 200, dtype)
    dense = E.prefill_attention(q, cache, slots, 700, 0.125)
    out, pairs = E.prefill_attention_sparse(q, cache, slots, 700, 0.125, 1e30, 0, 1)
    assert torch.equal(out, dense) and pairs == 3 * (200 * 700 + 200 * 201 // 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_prefill_does_not_depend_on_chunking(vector_isa, dtype):
    """Tiles of 16 positions and blocks of 64 keys aligned to position 0: a chunk cut at a
    multiple of 16 gives the same bits (and pairs) as inside the whole prompt."""
    q, cache, slots = _structured_prefill(12, 600, 600, dtype)
    whole, pairs = E.prefill_attention_sparse(q, cache, slots, 0, 0.125, 2.0, 1, 2)
    parts = 0
    for a, b in ((0, 96), (96, 448), (448, 600)):
        out, n = E.prefill_attention_sparse(q[a:b], cache, slots[:b], a, 0.125, 2.0, 1, 2)
        assert torch.equal(out, whole[a:b])
        parts += n
    assert parts == pairs


def test_sparse_prefill_keeps_blocks_whose_keys_are_nan(vector_isa):
    """A NaN key makes its KV head's bounds NaN: every block of that head is kept, so its
    query heads get the dense kernel's numbers, while the other heads stay sparse."""
    q, cache, slots = _structured_prefill(3, 400, 100, torch.float32)
    _, clean = E.prefill_attention_sparse(q, cache, slots, 300, 0.125, 0.5, 1, 2)
    cache[slots[70], 0, 1, 5] = math.nan  # block 1, KV head 1
    out, pairs = E.prefill_attention_sparse(q, cache, slots, 300, 0.125, 0.5, 1, 2)
    dense = E.prefill_attention(q, cache, slots, 300, 0.125)
    assert torch.equal(out.view(100, 9, 64)[:, 3:6], dense.view(100, 9, 64)[:, 3:6])
    assert clean < pairs < 3 * (100 * 300 + 100 * 101 // 2)


def test_sparse_prefill_rejects_bad_parameters(vector_isa):
    q, cache, slots = _structured_prefill(3, 100, 100, torch.float32)
    with pytest.raises(RuntimeError, match="delta must be >= 0"):
        E.prefill_attention_sparse(q, cache, slots, 0, 0.125, -1.0, 1, 2)
    with pytest.raises(RuntimeError, match="recent >= 1"):
        E.prefill_attention_sparse(q, cache, slots, 0, 0.125, 1.0, 1, 0)
    with pytest.raises(RuntimeError, match="slot .* out of range"):
        E.prefill_attention_sparse(q, cache, slots + 1000, 0, 0.125, 1.0, 1, 2)


def test_prefill_attention_rejects_bad_input(vector_isa):
    cache = torch.zeros(10, 2, 3, 64, dtype=torch.bfloat16)
    q = torch.zeros(4, 9, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="slot 10 out of range"):
        E.prefill_attention(q, cache, torch.tensor([0, 1, 2, 10]), 0, 0.1)
    with pytest.raises(RuntimeError, match=r"slots must be a contiguous int64 \[start \+ q_len\]"):
        E.prefill_attention(q, cache, torch.arange(4), 2, 0.1)
    with pytest.raises(RuntimeError, match="q must be a bfloat16 or float32"):
        E.prefill_attention(q.half(), cache, torch.arange(4), 0, 0.1)
    with pytest.raises(RuntimeError, match="kv_cache must be .* of q's dtype"):
        E.prefill_attention(q.float(), cache, torch.arange(4), 0, 0.1)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        E.prefill_attention(torch.zeros(4, 9, 32, dtype=torch.bfloat16),
                            torch.zeros(10, 2, 3, 32, dtype=torch.bfloat16), torch.arange(4), 0,
                            0.1)


def test_logit_stats_match_torch(isa):
    from entropic.sampling.sampler import entropy_from_logits
    g = _gen(5)
    x = torch.randn(7, 49152 + 5, generator=g) * 4  # a tail after the 16-wide vectors
    x[1, 100:40000] = -math.inf  # masked tokens add nothing to the entropy
    x[2, 20] = x[2, 30000] = x[2].max() + 1  # a tie: the first index, as torch.argmax
    x[3, -1] = x[3].max() + 1  # the max in the tail
    mx, lse, ent, arg = E.logit_stats(x)
    assert torch.equal(arg, x.argmax(-1)) and arg[2] == 20
    assert torch.equal(mx, x.amax(-1))
    torch.testing.assert_close(lse, torch.logsumexp(x, -1), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ent, entropy_from_logits(x), rtol=1e-5, atol=1e-5)
    x[4, 9] = math.nan
    x[5] = -math.inf
    mx, lse, ent, arg = E.logit_stats(x)
    assert math.isnan(mx[4]) and mx[5] == -math.inf  # callers check the max
    with pytest.raises(RuntimeError, match="logits must be a float32"):
        E.logit_stats(x.bfloat16())


def test_tempered_entropy_matches_torch(isa):
    from entropic.sampling.sampler import entropy_from_logits
    g = _gen(7)
    x = torch.randn(6, 49152 + 7, generator=g) * 5
    x[1, 50:30000] = -math.inf
    mx = x.amax(-1)
    rows = torch.tensor([0, 1, 3, 3, 5])
    temps = torch.tensor([0.001, 0.7, 1.0, 5.0, 1000.0])
    h = E.tempered_entropy(x, rows, mx, temps)
    torch.testing.assert_close(h, entropy_from_logits(x[rows] / temps[:, None]),
                               rtol=1e-5, atol=1e-5)
    for bad_rows, bad_t, words in [(torch.tensor([6]), torch.tensor([1.0]), "out of range"),
                                   (torch.tensor([0]), torch.tensor([0.0]), "> 0"),
                                   (torch.tensor([0, 1]), torch.tensor([1.0]), "do not match")]:
        with pytest.raises(RuntimeError, match=words):
            E.tempered_entropy(x, bad_rows, mx, bad_t)


def test_native_thermostat_follows_the_torch_one(isa):
    """The thermostat's H^T from one native pass (reusing the sampler's row max) drives the
    same temperatures, to fp32 rounding, and the same seeded tokens as the torch ops."""
    from entropic import SamplingParams, ThermostatParams
    from entropic.control.thermostat import Thermostat
    from entropic.sampling.sampler import Sampler, SamplingBatch
    g = _gen(8)
    steps = [torch.randn(16, 49152, generator=g) * (1 + i % 4) for i in range(24)]
    th = ThermostatParams(target_entropy=2.5, eta=0.5, t_min=0.2, t_max=3.0)
    params = [SamplingParams(temperature=1.0, seed=i, thermostat=th if i % 3 else None)
              for i in range(16)]
    runs = []
    for native in (True, False):
        s = Sampler([Thermostat()], native=native)
        temps, toks = [], []
        for n, logits in enumerate(steps):
            out = s(logits.clone(), SamplingBatch([f"r{i}" for i in range(16)], params,
                                                  [n] * 16))
            temps.append(out.temperatures)
            toks.append(out.token_ids)
        runs.append((torch.stack(temps), torch.stack(toks)))
    (ta, ka), (tb, kb) = runs
    # 24 steps of feedback: the two entropies' fp32 roundings (torch's own exp/log differ
    # between its AVX2 and AVX-512 code) compound to ~3e-5 on an AVX2 CPU
    torch.testing.assert_close(ta, tb, rtol=1e-4, atol=1e-5)
    assert torch.equal(ka, kb)


@pytest.mark.parametrize("temperature", (0.0, 0.8))
def test_native_sampler_statistics_agree_with_torch(isa, temperature):
    from entropic import SamplingParams
    from entropic.sampling.sampler import Sampler, SamplingBatch
    g = _gen(6)
    logits = torch.randn(5, 3000, generator=g) * 3
    logits[0, :1000] = -math.inf
    params = [SamplingParams(temperature=temperature, seed=i, logprobs=3) for i in range(5)]
    outs = [Sampler(native=native)(logits.clone(), SamplingBatch(
        [f"r{i}" for i in range(5)], params, [0] * 5)) for native in (True, False)]
    a, b = outs
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.top_ids, b.top_ids)
    torch.testing.assert_close(a.entropies, b.entropies, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.top_logprobs, b.top_logprobs, rtol=1e-5, atol=1e-5)
    bad = logits.clone()
    bad[2, 5] = math.nan
    with pytest.raises(FloatingPointError, match="NaN"):
        Sampler(native=True)(bad, SamplingBatch(["x"] * 5, params, [0] * 5))


@pytest.mark.model
def test_bf16_prompt_scores_do_not_depend_on_prefill_chunking(vector_isa, llm_bf16,
                                                             chat_prompts):
    """bf16 on the native kernels (prefill attention included): a prompt prefilled alone in
    chunks of ~24 tokens scores every prompt token and continues greedily exactly as when
    prefilled whole, alone or beside two others. Attention's key blocks are aligned to
    position 0 and the linear layers keep a row's numbers for any row count, so nothing
    may differ. (Chunk sizes avoid a 1-token chunk: that one runs as a decode row.)"""
    from entropic import SamplingParams

    prompts = sorted(chat_prompts, key=len)[-3:]  # the longest: several chunks each
    assert min(len(p) for p in prompts) > 48 and sum(len(p) for p in prompts) <= 512
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)
    sched = llm_bf16.engine.scheduler
    old = sched.max_num_batched_tokens
    try:
        sched.max_num_batched_tokens = 512  # all three whole in one step
        together = llm_bf16.generate(prompts, params)
        alone = [llm_bf16.generate([p], params)[0] for p in prompts]
        chunked = []
        for p in prompts:
            sched.max_num_batched_tokens = next(b for b in range(24, 40) if len(p) % b != 1)
            chunked.append(llm_bf16.generate([p], params)[0])
    finally:
        sched.max_num_batched_tokens = old
    for t, a, c in zip(together, alone, chunked):
        scores = [[e.logprob for e in o.prompt_logprobs[1:]] for o in (t, a, c)]
        assert scores[0] == scores[1] == scores[2]
        assert t.token_ids == a.token_ids == c.token_ids
