"""What the benchmark scripts share: the machine they ran on, the options most of them take,
and how they write their JSON. Every table names its CPU and its load (the CPU changes
between machines, and a loaded machine moves absolute times), so this is one function."""
from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

# the /proc/cpuinfo flags that decide which kernels are fast here
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile",
             "amx_bf16", "amx_int8")


def _cpuinfo(key: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's processor string."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """Those of ISA_FLAGS this CPU has."""
    have = set((_cpuinfo("flags") or "").split())
    return [f for f in ISA_FLAGS if f in have]


def describe(threads: int | None = None) -> dict:
    """The machine, for a benchmark's JSON and its printed header: CPU, ISA flags, core
    count, torch version and threads, the native kernels' level if loaded, load average."""
    import torch

    from entropic import kernels

    return {"cpu": cpu_name(), "flags": cpu_flags(), "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "threads": threads if threads is not None else torch.get_num_threads(),
            "isa": kernels.isa() if kernels.is_loaded() else None,
            "load_avg": [round(x, 2) for x in os.getloadavg()]}


def header(info: dict) -> str:
    """One line naming the machine of `describe`."""
    isa = f", native level {info['isa']}" if info.get("isa") else ""
    return (f"{info['cpu']} ({' '.join(info['flags']) or 'no vector flags'}), "
            f"{info['cpus']} CPUs{isa}, {info['threads']} torch thread(s), "
            f"load {info['load_avg'][0]:.1f}")


def add_common_args(ap: argparse.ArgumentParser, *, threads: int | None = 2, out: str,
                    model: bool | str = True, quick: str | None = "a small, fast run",
                    out_help: str = "JSON file to write",
                    threads_choices: tuple[int, ...] | None = None) -> None:
    """--threads (None: torch's default), --out (JSON; a script that writes a folder says
    so in `out_help`), and where asked --model (GGUF file or HF directory; default the
    embedded model; a string: its help text) and --quick."""
    ap.add_argument("--threads", type=int, default=threads, choices=threads_choices,
                    help="torch CPU threads" + (" (default: torch's)" if threads is None else ""))
    ap.add_argument("--out", default=out, help=out_help)
    if model:
        ap.add_argument("--model", default=None, help=model if isinstance(model, str) else
                        "local GGUF file or HF directory (default: the embedded model)")
    if quick is not None:
        ap.add_argument("--quick", action="store_true", help=quick)


def write_json(path: str | Path, result: dict) -> Path:
    """Write `result` as indented JSON (parents created) and say where."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=1, default=float))
    print("wrote", p)
    return p
