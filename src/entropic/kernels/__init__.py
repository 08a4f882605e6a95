"""Native CPU kernels, one C++ file per job (each says what its ops compute):
`layer_ops.cpp` (RMSNorm, RoPE with the KV write, SiLU*up), `decode_attention.cpp` (paged decode
attention reading the KV cache in place), `prefill_attention.cpp` (causal flash-style prefill
attention, AVX512-BF16), `quant_linear.cpp` (weight-only int4/int8 linear, AVX512-BF16),
`logit_stats.cpp` (the sampler's per-row max, log-normaliser, entropy and argmax);
`common.h` holds their shared helpers.

They are compiled on first use with the machine's C++ compiler (torch.utils.cpp_extension,
~1 minute) for this machine's instruction set (`-march=native`), and the build is cached
under `~/.cache/entropic/kernels/` (or `$ENTROPIC_KERNELS_DIR`) in a folder keyed by the
source, the torch version and the CPU's flags, so a cache shared between different CPUs
never runs code built for another one. `LLM(kernels="torch")` runs the plain PyTorch ops
instead (no compiler needed).
"""
from __future__ import annotations

import hashlib
import os
import platform
import threading
from pathlib import Path

import torch

HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.cpp"))
HEADERS = sorted(HERE.glob("*.h"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]
KERNEL_CHOICES = ("native", "torch")

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


def build_dir() -> Path:
    """The cache folder for these sources, torch version, compiler flags and CPU."""
    texts = [p.read_text() for p in SOURCES + HEADERS]
    key = hashlib.sha256("\n".join(
        [*texts, torch.__version__, " ".join(FLAGS), _cpu_flags()]).encode()).hexdigest()[:16]
    root = os.environ.get("ENTROPIC_KERNELS_DIR") or Path.home() / ".cache" / "entropic" / "kernels"
    return Path(root) / key


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
            cpp_extension.load(name="entropic_cpu_kernels", sources=[str(p) for p in SOURCES],
                               extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                               build_directory=str(out), is_python_module=False, verbose=False)
        except (RuntimeError, OSError, ImportError) as e:
            raise KernelBuildError(
                f"could not build entropic's native CPU kernels in {out} ({e}); they need a "
                f"C++ compiler (g++) and ninja. Pass kernels='torch' to run the plain PyTorch "
                f"ops instead") from e
        _loaded = True


def check_kernels(kernels: str, device: torch.device | str) -> None:
    """Raise ValueError unless `kernels` names a choice that can run on `device`."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
    if kernels == "native" and torch.device(device).type != "cpu":
        raise ValueError(f"kernels='native' are CPU kernels; on {device} use kernels='torch'")


def default_kernels(device: torch.device | str) -> str:
    """'native' on the CPU, 'torch' elsewhere."""
    return "native" if torch.device(device).type == "cpu" else "torch"
