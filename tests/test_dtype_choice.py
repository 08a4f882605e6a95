"""dtype="auto": the format chosen for the CPU, and why, and where it is recorded."""
from __future__ import annotations

import pytest
import torch

from entropic import LLM, SamplingParams
from entropic.config import choose_dtype

NO_BF16 = "flags : fpu sse2 avx avx2 fma avx512f avx512bw avx512vl avx512dq avx512_vnni"


@pytest.mark.parametrize("flags, want", [
    (NO_BF16, torch.float32),  # an AVX-512 Xeon before Sapphire Rapids
    ("flags : fpu sse2 avx avx2 fma", torch.float32),  # an AVX2 laptop
    (NO_BF16 + " avx512_bf16", torch.bfloat16),  # Zen 4 / Cooper Lake
    (NO_BF16 + " amx_bf16 amx_tile", torch.bfloat16),  # AMX alone counts
])
def test_auto_follows_the_cpus_bf16_arithmetic(flags, want, monkeypatch):
    monkeypatch.delenv("ENTROPIC_ISA", raising=False)
    dtype, reason = choose_dtype("auto", "cpu", None, cpu_flags=flags)
    assert dtype == want and reason.startswith(str(want).removeprefix("torch.") + ":")
    if want == torch.float32:
        assert "no bf16 arithmetic" in reason
    else:
        assert "avx512_bf16" in reason or "amx_bf16" in reason


def test_auto_with_quantization_forced_isa_and_explicit_values(monkeypatch):
    monkeypatch.delenv("ENTROPIC_ISA", raising=False)
    # int4/int8 kernels take bf16 activations, whatever the CPU
    assert choose_dtype("auto", "cpu", "int4", cpu_flags=NO_BF16)[0] == torch.bfloat16
    assert choose_dtype("AUTO", "cpu", None, cpu_flags=NO_BF16)[0] == torch.float32
    # a forced lower native level stands for a CPU without bf16
    monkeypatch.setenv("ENTROPIC_ISA", "avx512")
    dtype, reason = choose_dtype("auto", "cpu", None, cpu_flags=NO_BF16 + " avx512_bf16")
    assert dtype == torch.float32 and "ENTROPIC_ISA=avx512" in reason
    assert choose_dtype("bfloat16", "cpu", None, cpu_flags=NO_BF16) == (
        torch.bfloat16, "bfloat16: as asked")
    assert choose_dtype(torch.float32, "cpu", None)[0] == torch.float32
    with pytest.raises(ValueError, match="dtype: unsupported 'int3'; use one of auto"):
        choose_dtype("int3", "cpu", None)


@pytest.mark.model
def test_the_default_llm_records_its_choice(monkeypatch):
    monkeypatch.delenv("ENTROPIC_ISA", raising=False)
    want, reason = choose_dtype("auto", "cpu", None)
    llm = LLM(kv_cache_gib=0.05)
    assert llm.engine.model.dtype == want and llm.dtype_reason == reason
    stats = llm.engine.stats
    assert stats.dtype == str(want).removeprefix("torch.") and stats.dtype_reason == reason
    assert stats.isa == llm.engine.model.isa


def test_quantization_auto_picks_int4_only_where_it_was_measured_to_pay():
    from entropic.config import INT4_AUTO_MAX_SEQS, choose_quantization

    level, limit = next(iter(INT4_AUTO_MAX_SEQS.items()))
    kw = {"dtype": "auto", "device": "cpu", "kernels": None, "level": level}
    chosen, reason = choose_quantization("auto", max_num_seqs=limit, **kw)
    assert chosen == "int4" and level in reason
    chosen, reason = choose_quantization("auto", max_num_seqs=limit + 1, **kw)
    assert chosen is None and f"max_num_seqs is {limit + 1}" in reason
    # a level nobody measured, float activations, torch's kernels, another device: floats
    assert choose_quantization("auto", max_num_seqs=1, **{**kw, "level": "generic"})[0] is None
    chosen, reason = choose_quantization("auto", max_num_seqs=1, **{**kw, "dtype": "float32"})
    assert chosen is None and "float32" in reason
    assert choose_quantization("auto", max_num_seqs=1, **{**kw, "kernels": "torch"})[0] is None
    assert choose_quantization("auto", max_num_seqs=1, **{**kw, "device": "cuda"})[0] is None
    assert choose_quantization("auto", max_num_seqs=1, **{**kw, "dtype": "bf16"})[0] == "int4"
    # explicit values are taken as given, bad ones refused with the accepted ones
    assert choose_quantization("int8", max_num_seqs=64, **kw) == ("int8", "int8: as asked")
    assert choose_quantization(None, max_num_seqs=1, **kw) == (None, "none: as asked")
    with pytest.raises(ValueError, match="quantization must be None, 'auto', 'int8' or 'int4'"):
        choose_quantization("q4", max_num_seqs=1, **kw)


def test_quantization_auto_never_rounds_float_weights_to_4_bits():
    from entropic.config import confirm_int4
    from entropic.model.quant import quantize_int4

    w = torch.randn(64, 64)
    floats = {"model.layers.0.self_attn.q_proj.weight": w}
    mixed = {**floats, "model.layers.0.self_attn.k_proj.weight": quantize_int4(w)}
    four = {"model.layers.0.self_attn.k_proj.weight": quantize_int4(w)}
    for tensors in (floats, mixed):
        chosen, reason = confirm_int4("int4", "int4: ...", "auto", tensors)
        assert chosen is None and "not all stored in 4 bits" in reason
    assert confirm_int4("int4", "int4: ...", "auto", four) == ("int4", "int4: ...")
    # an explicit int4 quantizes whatever it gets
    assert confirm_int4("int4", "int4: as asked", "int4", floats) == ("int4", "int4: as asked")


@pytest.mark.model
def test_the_default_quantization_follows_the_engines_batch_size(monkeypatch):
    from entropic.config import choose_quantization

    monkeypatch.delenv("ENTROPIC_ISA", raising=False)
    for seqs in (1, 64):
        want, reason = choose_quantization("auto", dtype="auto", device="cpu", kernels=None,
                                           max_num_seqs=seqs)
        llm = LLM(kv_cache_gib=0.05, max_num_seqs=seqs)  # the embedded model is Q4_1
        assert llm.quantization == want and llm.quantization_reason == reason
        assert llm.engine.model.quantization == want
        assert llm.engine.stats.quantization == want
        assert llm.engine.stats.quantization_reason == reason
        out = llm.generate("Hi", SamplingParams(max_tokens=3, temperature=0))
        assert len(out[0].token_ids) == 3
    assert choose_quantization("auto", dtype="auto", device="cpu", kernels=None,
                               max_num_seqs=64)[0] is None  # no CPU measured int4 faster at 64


@pytest.mark.model
def test_entropic_generate_sizes_its_engine_for_one_request(monkeypatch, capsys):
    """The CLI serves one conversation at a time, so quantization="auto" may pick int4."""
    from entropic.cli import main
    from entropic.config import choose_quantization

    monkeypatch.delenv("ENTROPIC_ISA", raising=False)
    _, reason = choose_quantization("auto", dtype="auto", device="cpu", kernels=None,
                                    max_num_seqs=1)
    assert main(["generate", "Say hi.", "--max-tokens", "2", "--temperature", "0"]) == 0
    assert f"quantization {reason};" in capsys.readouterr().err
