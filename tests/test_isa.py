"""The ISA levels of the native kernels: which are built and chosen, forcing a lower one, the
levels agreeing with each other, and each level's code using only its own instructions."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from entropic import kernels
from entropic.kernels.backend import TORCH, select_backend

kernels.load()
E = torch.ops.entropic
LEVELS = kernels.isa_levels()
FP32_LEVELS = [lv for lv in LEVELS if lv in ("avx512", "avx2")]  # fp32 FMA vector levels
VECTOR_LEVELS = [lv for lv in LEVELS if lv != "generic"]


def test_levels_follow_the_cpu_and_the_best_is_chosen():
    assert LEVELS[-1] == "generic" and set(LEVELS) <= set(kernels.ISA_LEVELS)
    assert list(LEVELS) == sorted(LEVELS, key=kernels.ISA_LEVELS.index)  # best first
    assert tuple(LEVELS[:-1]) == kernels.cpu_levels()  # every level this CPU runs is built
    if not os.environ.get("ENTROPIC_ISA"):
        assert kernels.isa() == LEVELS[0]
    flags = "flags : fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512dq"
    if kernels.cpu_levels(flags):  # an x86-64 machine: the levels follow the flags
        assert kernels.cpu_levels(flags) == ("avx512", "avx2")
        assert kernels.cpu_levels(flags + " avx512_bf16") == ("avx512bf16", "avx512", "avx2")
        assert kernels.cpu_levels(flags + " avx512_bf16 amx_tile amx_bf16") == (
            "amx", "avx512bf16", "avx512", "avx2")
        assert kernels.cpu_levels(flags + " amx_tile amx_bf16") == ("avx512", "avx2")
        assert kernels.cpu_levels("flags : fpu sse2 avx") == ()
        assert kernels.cpu_levels("flags : fpu sse2 avx avx2 fma") == ()  # no F16C


def test_a_lower_level_can_be_forced_and_bad_ones_are_refused():
    best = kernels.isa()
    for lv in LEVELS:
        with kernels.forced_isa(lv):
            assert kernels.isa() == lv
            assert E.int4_linear_supported() == E.prefill_attention_supported() == (
                lv != "generic")
        assert kernels.isa() == best
    with pytest.raises(ValueError, match="must be one of"):
        kernels.set_isa("sse9")
    missing = [lv for lv in kernels.ISA_LEVELS if lv not in LEVELS]
    for lv in missing:
        with pytest.raises(ValueError, match="runs only"):
            kernels.set_isa(lv)
    assert kernels.isa() == best


def test_entropic_isa_forces_the_level_at_load():
    lowest = VECTOR_LEVELS[-1] if VECTOR_LEVELS else "generic"
    code = ("from entropic import kernels\n"
            "print(kernels.isa())\n")
    env = dict(os.environ, ENTROPIC_ISA=lowest)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == lowest
    env["ENTROPIC_ISA"] = "avx1024"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0 and "ENTROPIC_ISA must be one of" in out.stderr


def test_the_generic_level_refuses_the_quantized_and_prefill_kernels_clearly():
    with kernels.forced_isa("generic"):
        backend = select_backend("native", "cpu", torch.bfloat16, 64)
        assert backend.native and backend.isa == "generic"
        assert not backend.quantized_linear and not backend.prefill_attention
        with pytest.raises(RuntimeError, match="generic level has no quantized linears"):
            E.int8_linear(torch.zeros(1, 64, dtype=torch.bfloat16),
                          torch.zeros(4 * 64, dtype=torch.uint8), torch.ones(4))
        with pytest.raises(RuntimeError, match="generic level has no prefill attention"):
            E.prefill_attention(torch.zeros(1, 1, 64, dtype=torch.bfloat16),
                                torch.zeros(1, 2, 1, 64, dtype=torch.bfloat16),
                                torch.zeros(1, dtype=torch.long), 0, 0.1)


def _is_intel() -> bool:
    try:
        return "GenuineIntel" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _outputs(level: str) -> dict[str, torch.Tensor]:
    """Every kernel's output on fixed inputs at `level`."""
    from entropic.model.linear import NativeInt4Linear, NativeInt8Linear
    from entropic.model.llama import RotaryEmbedding
    from entropic.model.quant import quantize_int4
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 608, generator=g) * 2).bfloat16()
    w = (torch.rand(608, generator=g) + 0.5).bfloat16()
    cache = torch.randn(600, 2, 3, 64, generator=g).bfloat16()
    q = torch.randn(150, 9, 64, generator=g).bfloat16()
    slots = torch.randperm(600, generator=g)[:200]
    dslots = torch.stack([torch.randperm(600, generator=g)[:130] for _ in range(5)])
    lengths = torch.tensor([130, 1, 17, 64, 100])
    rope = RotaryEmbedding(64, 4096, 1e5, torch.bfloat16, "cpu")
    cos, sin = rope.tables(torch.arange(7) * 300)
    qkv = torch.randn(7, 15 * 64, generator=g).bfloat16()
    logits = torch.randn(3, 5000 + 7, generator=g) * 4
    out = {}
    with kernels.forced_isa(level):
        for dt in (torch.bfloat16, torch.float32):
            name = str(dt).removeprefix("torch.")
            out[f"rms_norm {name}"] = E.rms_norm(x.to(dt), w.to(dt), 1e-5)
            out[f"silu_mul {name}"] = E.silu_mul(x.to(dt))
            rot, c = qkv.to(dt).clone(), torch.zeros(50, 2, 3, 64, dtype=dt)
            E.rope_kv_(rot, cos.to(dt), sin.to(dt), c, torch.arange(7) * 7, 9, 3)
            out[f"rope_kv {name}"] = torch.cat((rot.flatten().float(), c.flatten().float()))
            out[f"decode attention {name}"] = E.paged_decode_attention(
                q[:5].to(dt), cache.to(dt), dslots, lengths, 0.125, None)
        out["logit_stats"] = torch.cat([t.double() for t in E.logit_stats(logits)])
        out["tempered_entropy"] = E.tempered_entropy(logits, torch.tensor([0, 2]),
                                                     logits.amax(-1), torch.tensor([0.5, 2.0]))
        if level != "generic":
            blocks = quantize_int4(torch.randn(66, 608, generator=g) * 0.05)
            out["int4_linear"] = NativeInt4Linear(blocks)(x)
            out["int8_linear"] = NativeInt8Linear(torch.randn(66, 608, generator=g) * 0.05)(x)
            out["prefill_attention"] = E.prefill_attention(q, cache, slots, 50, 0.125)
            out["prefill_attention float32"] = E.prefill_attention(q.float(), cache.float(),
                                                                   slots, 50, 0.125)
    return out


@pytest.mark.skipif(len(LEVELS) < 2, reason="one level only: nothing to compare")
def test_levels_agree_where_their_arithmetic_is_the_same():
    """avx512 and avx2 compute the same fp32 operations in the same order: the same bits
    for every kernel. avx512bf16's int4 linear and prefill attention are VDPBF16PS chains
    that the fp32 levels reproduce step by step (the same bits where VDPBF16PS rounds each
    step as Intel documents); its int8 linear and bf16 decode attention sum differently
    (close). The layer ops round as torch does at every level: the same bits everywhere."""
    outs = {lv: _outputs(lv) for lv in LEVELS}
    for a in FP32_LEVELS:
        for b in FP32_LEVELS:
            for k, v in outs[a].items():
                assert torch.equal(v, outs[b][k]), (a, b, k)
    for lv in LEVELS:
        for k in ("rms_norm bfloat16", "silu_mul bfloat16", "rope_kv bfloat16",
                  "rope_kv float32"):
            assert torch.equal(outs[lv][k], outs[LEVELS[0]][k]), (lv, k)
    for lv in VECTOR_LEVELS:  # float32 models: the same fp32 FMAs at every level
        k = "prefill_attention float32"
        assert torch.equal(outs[lv][k], outs[VECTOR_LEVELS[0]][k]), lv
    if "avx512bf16" in LEVELS and FP32_LEVELS:
        bf, fp = outs["avx512bf16"], outs[FP32_LEVELS[0]]
        for k in ("int4_linear", "prefill_attention"):
            if _is_intel():
                assert torch.equal(bf[k], fp[k]), k
            torch.testing.assert_close(bf[k].double(), fp[k].double(), rtol=2 ** -7, atol=1e-6)
        torch.testing.assert_close(bf["int8_linear"].double(), fp["int8_linear"].double(),
                                   rtol=2 ** -7, atol=2 ** -7 * fp["int8_linear"].abs().max())
    if "amx" in LEVELS:
        # the same code as avx512bf16 but for prefill attention's products (AMX tiles), whose
        # rounding differs from VDPBF16PS's: bf16 rounding apart, and not always the same bits
        amx, bf = outs["amx"], outs["avx512bf16"]
        for k, v in amx.items():
            if k != "prefill_attention":
                assert torch.equal(v, bf[k]), k
        torch.testing.assert_close(amx["prefill_attention"].double(),
                                   bf["prefill_attention"].double(), rtol=2 ** -6, atol=1e-4)
    for lv in LEVELS:  # the rest: fp32 rounding apart
        for k, v in outs[lv].items():
            torch.testing.assert_close(v.double(), outs[LEVELS[0]][k].double(),
                                       rtol=1e-2, atol=1e-2 * (1 + v.abs().max().item()))


# Mnemonics that exist only with EVEX (AVX-512) encodings, and registers only AVX-512 has.
_AVX512_ONLY = re.compile(
    r"%zmm|%k[0-7]\b|%[xy]mm(1[6-9]|2\d|3[01])\b|\{|\bvpternlog|\bvmovdq[au](8|16|32|64)\b"
    r"|\bv\w+(32x4|64x2|32x8|64x4)\b|\bvperm[ti]2|\bvpro[lr]|\bvpmov(?!mskb|zx|sx)\w+"
    r"|\bvrndscale|\bvscalef|\bvgetexp|\bvfixupimm|\bvrange|\bvreduce|\bvrcp14|\bvrsqrt14"
    r"|\bvcompress|\bvexpand|\bvpconflict|\bvplzcnt|\bvcvt\w*u(dq|qq)|\bvcvtu\w+|\bkmov")
_BF16_ONLY = re.compile(r"\bvdpbf16ps|\bvcvtne2ps2bf16|\bvcvtneps2bf16")
_AMX_ONLY = re.compile(r"\btdpbf16ps|\bldtilecfg|\btileloadd|\btilestored|\btilezero")


def _disassembly(level: str) -> str:
    obj = kernels.build_dir() / f"level_{level}.o"
    assert obj.exists(), obj
    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils, installed with the compiler) is needed"
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(obj)], capture_output=True,
                          text=True, check=True).stdout
    # instructions only (symbol names may contain anything)
    return "\n".join(ln.split(":", 1)[1] for ln in text.splitlines()
                     if re.match(r"^\s+[0-9a-f]+:", ln))


@pytest.mark.parametrize("level", [lv for lv in LEVELS if lv != "amx"])
def test_each_level_uses_only_its_own_instructions(level):
    """The lower levels' object code (compiled on this CPU, which has more) holds no
    instruction of a level above: avx512bf16 no AMX, avx512 no AVX512-BF16, avx2 no AVX-512
    at all, generic (on x86-64) no AVX. amx's prefill attention runs on tiles."""
    code = _disassembly(level)
    assert len(code) > 1000
    assert not _AMX_ONLY.search(code)
    if level == "avx512bf16":
        assert "vdpbf16ps" in code
        if "amx" in LEVELS:
            assert "tdpbf16ps" in _disassembly("amx")
        return
    assert not _BF16_ONLY.search(code)
    if level == "avx512":
        assert "%zmm" in code
    if level in ("avx2", "generic"):
        found = _AVX512_ONLY.search(code)
        assert found is None, found.group(0)
    if level == "avx2":
        assert "%ymm" in code and "vfmadd" in code
    if level == "generic" and kernels.cpu_levels():
        assert "%ymm" not in code


def test_the_backend_records_its_level_and_what_it_runs():
    for lv in VECTOR_LEVELS:
        with kernels.forced_isa(lv):
            b = select_backend(None, "cpu", torch.bfloat16, 64)
            assert (b.name, b.isa, b.prefill_attention, b.quantized_linear) == (
                "native", lv, True, True)
            assert select_backend(None, "cpu", torch.float32, 64).prefill_attention
            assert not select_backend(None, "cpu", torch.bfloat16, 80).prefill_attention
    assert select_backend("torch", "cpu", torch.float16, 64) == TORCH and not TORCH.native
    with pytest.raises(ValueError, match="support float32 and bfloat16"):
        select_backend("native", "cpu", torch.float16, 64)


def test_a_build_killed_midway_leaves_no_lock_that_hangs_the_next_load(tmp_path):
    """torch's build lock is a plain file; a build killed midway leaves it behind. Under
    entropic's OS lock (released by the OS when its holder dies) that file is stale and
    goes, so the next load builds instead of waiting for ever."""
    (tmp_path / "lock").write_text("")
    with kernels._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
