"""Prefill (time to first token) on the real model at each native ISA level, side by side.

    python benchmarks/prefill_speed.py [--lengths 512 2041 4096] [--rounds 3] [--threads 2]
        [--levels amx avx512bf16] [--model PATH] [--out results/prefill_speed.json]
    python benchmarks/prefill_speed.py --against-sdpa [--dtype auto] [--chunk 512]

The default model in bf16 with native kernels, prefix caching off, one request of N prompt
tokens (ShareGPT text, repeated to length) and max_tokens=1, so the time is the prompt's
forward pass plus one sampled token. The levels take turns within each round (the kernels'
level is process-wide: `kernels.forced_isa`), and each figure is the median over rounds with
its ratio to the first level. The levels differ only in prefill attention (amx: the products
on AMX-BF16 tiles), so the ratio is that kernel's share of a prefill. Also the share of
prefill attention in the forward at each length (the op timed alone at the model's shapes
and scaled by the layer count), measured at each level.

--against-sdpa: at the best level, the model in --dtype (default auto: what LLM() picks on
this CPU) with prefill chunks on entropic's prefill attention against the same model with
torch's SDPA for them (the model's `native_prefill` switched between turns), --chunk tokens
per step (default: the whole prompt in one step).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from entropic import LLM, SamplingParams, kernels
from entropic.bench.datasets import chat_prompt_ids
from entropic.bench.machine import add_common_args, describe, header, write_json


def prompt_of(llm: LLM, n: int) -> list[int]:
    ids: list[int] = []
    for p in chat_prompt_ids(llm.tokenizer, 64):
        ids += p
        if len(ids) >= n:
            break
    while len(ids) < n:
        ids += ids
    return ids[:n]


def attention_ms(shape: tuple[int, int, int], n: int, start: int = 0, repeats: int = 3) -> float:
    """One layer's prefill attention of n new tokens after `start` cached ones, at
    (heads, kv_heads, head_dim), median ms."""
    heads, kvh, d = shape
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(start + n, 2, kvh, d, generator=g).bfloat16()
    q = torch.randn(n, heads, d, generator=g).bfloat16()
    slots = torch.arange(start + n)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.ops.entropic.prefill_attention(q, cache, slots, start, d ** -0.5)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def kernel_rows(levels: list[str], shape: tuple[int, int, int], rounds: int) -> list[dict]:
    """The op alone: new tokens after cached ones, levels alternating within each round."""
    rows = []
    for start, n in ((0, 512), (512, 128), (0, 2048), (2048, 256), (0, 4096)):
        t: dict[str, list[float]] = {lv: [] for lv in levels}
        for r in range(rounds):
            for lv in (levels if r % 2 == 0 else levels[::-1]):
                with kernels.forced_isa(lv):
                    t[lv].append(attention_ms(shape, n, start))
        row = {"cached": start, "new": n, **{lv: statistics.median(t[lv]) for lv in levels}}
        rows.append(row)
        base = row[levels[0]]
        print(f"| {start} + {n} | " + " | ".join(
            f"{row[lv]:.1f} ms ({row[lv] / base:.2f}x)" for lv in levels) + " |", flush=True)
    return rows


def against_sdpa(a) -> None:
    """Entropic's prefill attention against SDPA in the same model, alternating."""
    llm = LLM(model=a.model, dtype=a.dtype, enable_prefix_caching=False,
              max_model_len=max(a.lengths) + 16, max_num_batched_tokens=a.chunk or max(a.lengths))
    model = llm.engine.model
    if not model.native_prefill:
        raise SystemExit(f"entropic's prefill attention does not run for this model here "
                         f"(level {kernels.isa()}, {llm.dtype_reason})")
    start = describe(a.threads)
    print(f"{header(start)}; dtype {llm.dtype_reason}; level {kernels.isa()}; "
          f"{a.chunk or 'whole-prompt'} tokens per step")
    print("| prompt tokens | native s | SDPA s | SDPA / native (median of rounds) |")
    print("|---|---:|---:|---:|")
    params = SamplingParams(temperature=0, max_tokens=1)
    rows = []
    for n in a.lengths:
        ids = prompt_of(llm, n)
        times: dict[str, list[float]] = {"native": [], "sdpa": []}
        for r in range(a.rounds + 1):  # round 0: warm-up of both
            for path in (("native", "sdpa") if r % 2 == 0 else ("sdpa", "native")):
                model.native_prefill = path == "native"
                t = time.perf_counter()
                llm.generate([ids], params, use_tqdm=False)
                if r:
                    times[path].append(time.perf_counter() - t)
        model.native_prefill = True
        ratios = [s / n_ for s, n_ in zip(times["sdpa"], times["native"])]
        row = {"tokens": n, **{p: statistics.median(v) for p, v in times.items()},
               "rounds": times, "ratio": statistics.median(ratios)}
        rows.append(row)
        print(f"| {n} | {row['native']:.2f} | {row['sdpa']:.2f} | {row['ratio']:.2f}x |",
              flush=True)
    write_json(a.out, {"machine": start, "load_avg_end": describe(a.threads)["load_avg"],
                       "mode": "against_sdpa", "dtype_reason": llm.dtype_reason,
                       "level": kernels.isa(), "chunk": a.chunk, "rows": rows})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2041, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--against-sdpa", action="store_true",
                    help="entropic's prefill attention against SDPA, same model, alternating")
    ap.add_argument("--dtype", default="auto", help="--against-sdpa: the model's dtype")
    ap.add_argument("--chunk", type=int, default=None,
                    help="--against-sdpa: tokens per step (default: the whole prompt)")
    ap.add_argument("--levels", nargs="+", default=None,
                    help="native ISA levels to compare (default: amx and avx512bf16 where run)")
    add_common_args(ap, out="results/prefill_speed.json", quick=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    kernels.load()
    if a.against_sdpa:
        against_sdpa(a)
        return
    levels = a.levels or [lv for lv in ("amx", "avx512bf16") if lv in kernels.isa_levels()]
    missing = [lv for lv in levels if lv not in kernels.isa_levels()]
    if missing or len(levels) < 1:
        raise SystemExit(f"levels {missing or levels} not run here (this CPU: "
                         f"{kernels.isa_levels()})")
    llm = LLM(model=a.model, dtype="bfloat16", enable_prefix_caching=False,
              max_model_len=max(a.lengths) + 16)
    cfg = llm.engine.model.config
    layers, shape = cfg.num_layers, (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    start = describe(a.threads)
    print(f"{header(start)}; levels compared: {' '.join(levels)}")
    print("One layer's prefill attention alone (cached + new tokens), ms and x the first level:")
    print("| tokens | " + " | ".join(levels) + " |")
    print("|---|" + "---|" * len(levels))
    kernel = kernel_rows(levels, shape, max(a.rounds, 5))
    print("The whole prefill (one request, max_tokens=1), s; x = first level's time / this "
          "one's; attention = the op's share:")
    print("| prompt tokens | " + " | ".join(levels) + " |")
    print("|---|" + "---|" * len(levels))
    params = SamplingParams(temperature=0, max_tokens=1)
    rows = []
    for n in a.lengths:
        ids = prompt_of(llm, n)
        with kernels.forced_isa(levels[0]):
            llm.generate([ids], params, use_tqdm=False)  # warm-up
        times: dict[str, list[float]] = {lv: [] for lv in levels}
        attn: dict[str, list[float]] = {lv: [] for lv in levels}
        for r in range(a.rounds):
            order = levels if r % 2 == 0 else levels[::-1]
            for lv in order:
                with kernels.forced_isa(lv):
                    t = time.perf_counter()
                    llm.generate([ids], params, use_tqdm=False)
                    times[lv].append(time.perf_counter() - t)
                    attn[lv].append(attention_ms(shape, n) * layers / 1e3)
        row = {"tokens": n}
        for lv in levels:
            row[lv] = {"ttft_s": statistics.median(times[lv]), "rounds": times[lv],
                       "attention_s": statistics.median(attn[lv])}
        rows.append(row)
        base = row[levels[0]]["ttft_s"]
        cells = " | ".join(
            f"{row[lv]['ttft_s']:.2f} s ({base / row[lv]['ttft_s']:.2f}x; attention "
            f"{row[lv]['attention_s'] / row[lv]['ttft_s']:.0%})" for lv in levels)
        print(f"| {n} | {cells} |", flush=True)
    write_json(a.out, {"machine": start, "load_avg_end": describe(a.threads)["load_avg"],
                       "levels": levels, "kernel": kernel, "rows": rows})


if __name__ == "__main__":
    main()
