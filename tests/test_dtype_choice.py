"""dtype="auto": the format chosen for the CPU, and why, and where it is recorded."""
from __future__ import annotations

import pytest
import torch

from entropic import LLM
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
