"""Weight-only int4 / int8: the GGUF's Q4 codes decoded exactly, the kernels computing what
the formats stand for, and the quantized model staying close to the fp32 reference."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from entropic.kernels import isa as native_isa
from entropic.model.linear import Int4Linear, Int8Linear, check_quantization
from entropic.model.quant import Int4Blocks, int4_from_gguf, quantize_int4, quantize_int8
from entropic.sampling_params import SamplingParams


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_gguf_q4_codes_decode_to_what_gguf_py_dequantizes(qtype):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((24, 96)) * rng.uniform(0.01, 2, (24, 1))).astype(np.float32)
    t = GGMLQuantizationType[qtype]
    raw = quantize(w, t)
    blocks = int4_from_gguf(raw, w.shape, qtype)
    assert blocks.q.dtype == torch.uint8 and int(blocks.q.max()) <= 15
    expected = torch.from_numpy(dequantize(raw, t).astype(np.float32))
    assert torch.equal(blocks.dequantize(), expected)


def test_model_q4_blocks_match_the_dequantized_checkpoint():
    from entropic.model.gguf_loader import read_gguf_tensors
    from entropic.model.loader import default_model_path

    _, plain = read_gguf_tensors(default_model_path())
    _, blocks = read_gguf_tensors(default_model_path(), keep_int4=True)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
             "model.layers.29.mlp.down_proj.weight"]
    for n in names:  # q and k are un-permuted row-wise; the codes must follow the rows
        assert isinstance(blocks[n], Int4Blocks)
        assert torch.equal(blocks[n].dequantize(), plain[n]), n
    assert not isinstance(blocks["model.embed_tokens.weight"], Int4Blocks)  # Q8_0 stays float
    assert torch.equal(blocks["model.embed_tokens.weight"], plain["model.embed_tokens.weight"])


def test_quantize_int4_rounds_each_weight_to_its_nearest_level():
    w = torch.randn(16, 64) * torch.rand(16, 1)
    b = quantize_int4(w)
    err = (b.dequantize() - w).abs().view(16, 2, 32)
    assert bool((err <= b.scale[..., None] / 2 + 1e-6).all())
    assert int(b.q.min()) == 0 and int(b.q.max()) == 15
    with pytest.raises(ValueError, match="multiple of the group size 32"):
        quantize_int4(torch.randn(4, 40))


def test_quantize_int8_is_symmetric_per_channel():
    w = torch.randn(8, 32)
    w[3] = 0  # an all-zero row must not divide by zero
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert torch.equal(q[3], torch.zeros(32, dtype=torch.int8))
    assert bool(((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-6).all())


def _rel_err(y, ref):
    return float((y.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_int4_linear_computes_its_dequantized_weight(rows):
    torch.manual_seed(0)
    b = quantize_int4(torch.randn(96, 128))
    bias = torch.randn(96).bfloat16()
    lin = Int4Linear(b, bias)
    x = torch.randn(rows, 128).bfloat16()
    # the kernel's weight: scale and zero rounded to bf16, the codes exact
    s = lin.scales_zeros[..., 0].T.float()
    z = lin.scales_zeros[..., 1].T.float() - 8 * s
    w = (b.q.view(96, 4, 32).float() * s[..., None] + z[..., None]).view(96, 128)
    ref = x.float() @ w.T + bias.float()
    assert _rel_err(lin(x), ref) < 1e-2


def test_int4_linear_takes_any_output_width():
    """The kernel packs outputs in sixteens; other widths are padded and sliced back."""
    torch.manual_seed(3)
    w = torch.randn(40, 64)
    b = quantize_int4(w)
    bias = torch.randn(40).bfloat16()
    y = Int4Linear(b, bias)(torch.randn(5, 64).bfloat16())
    assert y.shape == (5, 40)
    x = torch.randn(5, 64).bfloat16()
    ref = x.float() @ b.dequantize().T + bias.float()
    assert _rel_err(Int4Linear(b, bias)(x), ref) < 1e-2


@pytest.mark.parametrize("rows", [1, 64])
def test_int8_linear_computes_its_dequantized_weight(rows):
    torch.manual_seed(1)
    w = torch.randn(80, 64)
    lin = Int8Linear(w)
    x = torch.randn(rows, 64).bfloat16()
    ref = x.float() @ (lin.weight.float() * lin.scale.float()[:, None]).T
    assert _rel_err(lin(x), ref) < 1e-2
    assert _rel_err(lin(x), F.linear(x.float(), w)) < 2e-2  # and close to the float weight


def test_quantized_kernels_are_batch_invariant():
    """A row's result must not depend on the rows sharing its call (requests share steps)."""
    torch.manual_seed(2)
    x = torch.randn(37, 576).bfloat16()
    for lin in (Int4Linear(quantize_int4(torch.randn(960, 576))), Int8Linear(torch.randn(960, 576))):
        full = lin(x)
        for lo, hi in ((0, 1), (5, 6), (3, 20), (36, 37)):
            assert torch.equal(lin(x[lo:hi].clone()), full[lo:hi])


def test_bad_quantization_requests_are_refused_clearly():
    with pytest.raises(ValueError, match="quantization must be None, 'int8' or 'int4'"):
        check_quantization("int3", torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="needs dtype='bfloat16'.*float32"):
        check_quantization("int4", torch.float32, "cpu")
    with pytest.raises(ValueError, match="CPU only"):
        check_quantization("int8", torch.bfloat16, "cuda")
    from entropic import LLM
    with pytest.raises(ValueError, match="quantization"):
        LLM(quantization="q4", dtype="bfloat16")  # refused before any weight is read


def _kernel_variants() -> list[str]:
    """native at the best level, at the lowest level with vectors and at generic (forced),
    and torch."""
    from entropic import kernels
    levels = kernels.isa_levels()
    lower = [lv for lv in levels[1:] if lv != "generic"][-1:] + ["generic"]
    return ["native"] + [f"native@{lv}" for lv in lower] + ["torch"]


@pytest.mark.model
@pytest.mark.parametrize("variant", _kernel_variants())
def test_int4_model_stays_close_to_fp32_and_is_batch_invariant(llm_fp32, chat_prompts, variant):
    from entropic import kernels as native
    from entropic.bench.parity import sequence_logits

    kernels, _, level = variant.partition("@")
    # the fp32 reference at the level it was built for (its prefill attention is native)
    refs = [sequence_logits(llm_fp32.engine.model, p) for p in chat_prompts[:4]]
    with native.forced_isa(level or native.isa()):
        _int4_model_check(refs, chat_prompts, kernels, level)


def _int4_model_check(refs, chat_prompts, kernels, level):
    from entropic import LLM
    from entropic.bench.parity import Divergence, sequence_logits
    from entropic.model.linear import NativeInt4Linear, NativeInt8Linear

    llm = LLM(quantization="int4", kernels=kernels, max_num_batched_tokens=256,
              kv_cache_gib=0.25)
    model = llm.engine.model
    # entropic's own int4/int8 kernels at every level that has them (AVX2 or better)
    ours = kernels == "native" and level != "generic"
    assert model.isa == (None if kernels == "torch" else level or native_isa())
    assert model.quant_kernel == ("entropic" if ours else "torch")
    assert model.native_prefill == ours
    assert isinstance(model.layers[0].qkv, NativeInt4Linear if ours else Int4Linear)
    assert isinstance(model.lm_head, NativeInt8Linear if ours else Int8Linear)
    div_int4, div_bf16 = Divergence(), Divergence()
    bf16 = LLM(dtype="bfloat16", max_num_batched_tokens=256, kv_cache_gib=0.25)
    for p, ref in zip(chat_prompts[:4], refs):
        div_int4.add(ref, sequence_logits(model, p))
        div_bf16.add(ref, sequence_logits(bf16.engine.model, p))
    q, b = div_int4.summary(), div_bf16.summary()
    # Measured (benchmarks/weight_formats.py): int4 KL ~0.003, bf16 ~0.0016, top-1 ~0.97 / 0.98.
    assert q["top1_agreement"] > 0.93 and q["mean_kl"] < 0.02, q
    assert q["mean_kl"] < 10 * b["mean_kl"] + 1e-3, (q, b)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [llm.generate([p], greedy)[0].token_ids for p in chat_prompts[:3]]
    together = [o.token_ids for o in llm.generate(chat_prompts[:3], greedy)]
    if kernels == "native":
        assert alone == together
    # kernels="torch" is not asserted: its decode attention (SDPA over padded groups) is not
    # batch invariant on CPUs with avx512_bf16 (seen on an AMD EPYC, 2026-12-03)


@pytest.mark.model
def test_fused_decode_stack_gives_the_layer_loops_bits(chat_prompts):
    """`entropic.decode_layers_` (a pure decode step's layers in one call) against the
    Python layer loop: the same tokens and the same entropies to the bit, alone and in a
    batch of rows of different lengths, sampled with a seed."""
    from entropic import LLM, kernels as native
    if not torch.ops.entropic.int4_linear_supported():
        pytest.skip(f"the {native.isa()} level has no int4 kernel: nothing to fuse")
    llm = LLM(quantization="int4", max_num_batched_tokens=256, kv_cache_gib=0.25,
              enable_prefix_caching=False)
    model = llm.engine.model
    assert model.fused_decode
    fused_steps = []
    group = model._fused_group

    def spy(meta, rows):
        g = group(meta, rows)
        if g is not None:
            fused_steps.append(rows)
        return g
    model._fused_group = spy
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True)

    def run(prompts):
        return [(o.token_ids, o.entropies) for o in llm.generate(prompts, params)]

    prompts = [chat_prompts[0], chat_prompts[5], chat_prompts[9]]
    fused = run(prompts[:1]) + run(prompts)
    assert fused_steps and max(fused_steps) == 3
    model.fused_decode = False
    assert run(prompts[:1]) + run(prompts) == fused


@pytest.mark.model
def test_fused_decode_stack_selects_blocks_like_the_layer_loop(chat_prompts):
    """With a block budget (query-aware selection in each layer and KV head), the fused
    stack runs and gives the layer loop's tokens and entropies to the bit."""
    from entropic import LLM
    from entropic.control.pruning import EntropicBlockPruner, PruningConfig
    from entropic.engine.engine import LLMEngine
    if not torch.ops.entropic.int4_linear_supported():
        pytest.skip("this level has no int4 kernel: nothing to fuse")
    llm = LLM(quantization="int4", max_num_batched_tokens=256, kv_cache_gib=0.25,
              enable_prefix_caching=False)
    eng, model = llm.engine, llm.engine.model
    selected = []
    group = model._fused_group

    def spy(meta, rows):
        g = group(meta, rows)
        if g is not None and g.keep is not None:
            selected.append(rows)
        return g
    model._fused_group = spy
    long_prompt = [t for p in chat_prompts[:8] for t in p][:700]
    sp = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)

    def run():
        cfg = PruningConfig(score="bound", min_keep_fraction=0.3, h_high=50.0,
                            min_attention_share=0.0)
        e = LLMEngine(eng.model, eng.tokenizer, eng.config,
                      block_policy=EntropicBlockPruner(cfg, 16))
        for i, p in enumerate((long_prompt, long_prompt[:400])):
            e.add_request(f"r{i}", p, sp)
        return sorted((o.request_id, o.token_ids, o.entropies) for o in e.run_until_done())

    fused = run()
    assert selected and max(selected) == 2
    model.fused_decode = False
    assert run() == fused


def test_fused_decode_stack_refuses_mismatched_arguments_clearly():
    from entropic import kernels as native
    native.load()
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    kv = torch.zeros(2, 16, 2, 1, 64, dtype=torch.bfloat16)
    rope = torch.zeros(1, 64, dtype=torch.bfloat16)
    slots = torch.zeros(1, 1, dtype=torch.long)
    op = torch.ops.entropic.decode_layers_
    with pytest.raises(RuntimeError, match="13 weights for 2 layers, expected 14 a layer"):
        op(x, [x] * 13, kv, slots.view(1), rope, rope, slots, None, None, 0.125, 1e-5, 1, 1)
    with pytest.raises(RuntimeError, match=r"kv must be a contiguous \[layers"):
        op(x, [x] * 28, kv[0], slots.view(1), rope, rope, slots, None, None, 0.125, 1e-5, 1, 1)
