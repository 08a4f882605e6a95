"""Native CPU kernels, one C++ file per job (each says what its ops compute):
`layer_ops.cpp` (RMSNorm, RoPE with the KV write, SiLU*up), `decode_attention.cpp` (paged decode
attention reading the KV cache in place), `prefill_attention.cpp` (causal flash-style prefill
attention), `quant_linear.cpp` (weight-only int4/int8 linear), `logit_stats.cpp` (the sampler's
per-row max, log-normaliser, entropy and argmax). Those files check arguments and split the
work between threads; the math is in `*_math.h`, compiled once per ISA level (`isa.h`):

    amx          avx512bf16, with prefill attention's products on AMX-BF16 tiles
    avx512bf16   AVX-512 with bf16 dot products (VDPBF16PS)
    avx512       AVX-512 F/BW/VL/DQ, fp32 FMA
    avx2         AVX2 + FMA (+ F16C), fp32 FMA
    generic      plain C++; no int4/int8 linear and no prefill attention (torch's run instead)

Each level is its own translation unit (`level_<name>.cpp`) compiled for exactly its
instruction set over a baseline build, so one build holds every level this CPU runs. The best
one is used unless `ENTROPIC_ISA` (or `set_isa`, `forced_isa`) names a lower one; `isa()` says
which is in use. The levels compute the same numbers where their arithmetic allows
(`*_math.h` say where they differ).

They are compiled on first use with the machine's C++ compiler (torch.utils.cpp_extension,
~1-2 minutes; the levels need GCC), and the build is cached under `~/.cache/entropic/kernels/`
(or `$ENTROPIC_KERNELS_DIR`) in a folder keyed by the source, the torch version, the flags and
the CPU's flags, so a cache shared between different CPUs never runs code built for another
one. `LLM(kernels="torch")` runs the plain PyTorch ops instead (no compiler needed); a model
holds its choice as a `backend.KernelBackend`.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.cpp"))
HEADERS = sorted(HERE.glob("*.h"))
BASE_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]
KERNEL_CHOICES = ("native", "torch")
ISA_LEVELS = ("amx", "avx512bf16", "avx512", "avx2", "generic")  # best first
# /proc/cpuinfo flags each level needs (x86-64)
_LEVEL_CPU_FLAGS = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx512bf16": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                   "avx512_bf16"},
    "amx": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
            "amx_tile", "amx_bf16"},
}

_lock = threading.Lock()
_loaded = False


class KernelBuildError(RuntimeError):
    """The native kernels could not be compiled or loaded."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags_line() -> str:
    """This CPU's /proc/cpuinfo flags line (or the platform's processor name)."""
    return _cpu_flags()


def cpu_levels(flags_line: str | None = None) -> tuple[str, ...]:
    """The vector levels (amx, avx512bf16, avx512, avx2) this x86-64 CPU runs, by its flags
    (amx also needs the OS to grant the tile state, which Linux kernels with AMX do)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ()
    flags = set((flags_line if flags_line is not None else _cpu_flags()).split())
    return tuple(lv for lv in ISA_LEVELS[:-1] if _LEVEL_CPU_FLAGS[lv] <= flags)


def build_flags() -> list[str]:
    """Compiler flags: on x86-64 a baseline build (the generic level and the op files) with
    the levels this CPU runs added (each sets its own target); elsewhere the machine's own
    instruction set (-march=native) for the generic level."""
    levels = cpu_levels()
    if platform.machine().lower() in ("x86_64", "amd64") and Path("/proc/cpuinfo").exists():
        return BASE_FLAGS + ["-mtune=native"] + [f"-DENTROPIC_BUILD_{lv.upper()}" for lv in levels]
    return BASE_FLAGS + ["-march=native"]


def build_dir() -> Path:
    """The cache folder for these sources, torch version, compiler flags and CPU."""
    texts = [p.read_text() for p in SOURCES + HEADERS]
    # the sources' folder too: ninja's build file names them by absolute path, so two
    # checkouts sharing one folder would rebuild each other's kernels in turn
    key = hashlib.sha256("\n".join(
        [*texts, str(SOURCES[0].parent), torch.__version__, " ".join(build_flags()),
         _cpu_flags()]).encode()
    ).hexdigest()[:16]
    root = os.environ.get("ENTROPIC_KERNELS_DIR") or Path.home() / ".cache" / "entropic" / "kernels"
    return Path(root) / key


@contextlib.contextmanager
def _build_lock(out: Path) -> Iterator[None]:
    """One build at a time per cache folder, across processes, by an OS lock that dies with
    its holder. torch's own lock is a plain file that a build killed midway leaves behind,
    and every later load would wait on it for ever; while we hold ours, no other entropic
    process can be building here, so such a file is stale and goes."""
    with open(out / "entropic.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            (out / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def is_loaded() -> bool:
    """Whether load() has run in this process (the ops exist), without loading."""
    return _loaded


def load() -> None:
    """Compile (first time on this machine) and load the kernels; afterwards they are
    `torch.ops.entropic.*`. Raises KernelBuildError with the compiler's message on failure."""
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        from torch.utils import cpp_extension

        out = build_dir()
        out.mkdir(parents=True, exist_ok=True)
        try:
            with _build_lock(out):
                cpp_extension.load(name="entropic_cpu_kernels",
                                   sources=[str(p) for p in SOURCES],
                                   extra_cflags=build_flags(), extra_ldflags=["-fopenmp"],
                                   build_directory=str(out), is_python_module=False,
                                   verbose=False)
        except (RuntimeError, OSError, ImportError) as e:
            raise KernelBuildError(
                f"could not build entropic's native CPU kernels in {out} ({e}); they need a "
                f"C++ compiler (g++) and ninja. Pass kernels='torch' to run the plain PyTorch "
                f"ops instead") from e
        forced = os.environ.get("ENTROPIC_ISA")
        if forced:
            _set_isa(forced, "ENTROPIC_ISA")
        _loaded = True


def _set_isa(level: str, source: str) -> None:
    if level not in ISA_LEVELS:
        raise ValueError(f"{source} must be one of {ISA_LEVELS}, got {level!r}")
    available = tuple(torch.ops.entropic.isa_levels())
    if level not in available:
        raise ValueError(f"{source}={level!r}: this CPU (or build) runs only {available}")
    torch.ops.entropic.set_isa(level)


def isa() -> str:
    """The ISA level the native kernels run at (loads them): one of ISA_LEVELS."""
    load()
    return str(torch.ops.entropic.isa())


def isa_levels() -> tuple[str, ...]:
    """The levels this CPU and build can run, best first (generic always among them)."""
    load()
    return tuple(torch.ops.entropic.isa_levels())


def set_isa(level: str) -> None:
    """Run the native kernels at `level` from now on, process-wide (one of isa_levels()).
    Models decide once, when built, whether prefill attention and the quantized linears run
    natively (a level above generic), so set the level before building a model."""
    load()
    _set_isa(level, "level")


@contextlib.contextmanager
def forced_isa(level: str) -> Iterator[str]:
    """Run the kernels at `level` inside the block (tests, benchmarks), then as before."""
    old = isa()
    set_isa(level)
    try:
        yield level
    finally:
        torch.ops.entropic.set_isa(old)


def check_kernels(kernels: str, device: torch.device | str) -> None:
    """Raise ValueError unless `kernels` names a choice that can run on `device`."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
    if kernels == "native" and torch.device(device).type != "cpu":
        raise ValueError(f"kernels='native' are CPU kernels; on {device} use kernels='torch'")


def default_kernels(device: torch.device | str) -> str:
    """'native' on the CPU, 'torch' elsewhere."""
    return "native" if torch.device(device).type == "cpu" else "torch"
