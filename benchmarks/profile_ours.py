"""Where our decode time goes: torch profiler op table and a py-spy phase split.

    python3 benchmarks/profile_ours.py --scenario decode      # 1 request, 128 new tokens
    python3 benchmarks/profile_ours.py --scenario batch64     # 64 requests at once, 128 each
    python3 benchmarks/profile_ours.py --scenario decode --no-profiler   # plain run (for py-spy)
    py-spy record --nonblocking --format raw -r 100 -o stacks.txt -- python3 benchmarks/profile_ours.py \
        --scenario decode --no-profiler
    python3 benchmarks/profile_ours.py --phases stacks.txt    # phase split of those stacks

Same workload as benchmarks/peers.py (ShareGPT first turns, chat-templated; greedy, EOS
ignored), the dtype LLM() picks for this CPU (--dtype), --threads torch threads. The
profiler figures: wall time of the profiled call, the main thread's self time in each op
(key_averages, sorted), and "time outside torch ops" = wall - sum of self times of every op
recorded on the main thread (Python, the scheduler, tensor construction in Python, and the
profiler's own overhead, which inflates it a little).
"""
from __future__ import annotations

import argparse
import collections
import time

from entropic.bench.machine import add_common_args, describe, header, write_json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = [  # first match from the innermost frame outwards wins
    ("sampler", ("sampler.py",)),
    ("attention", ("attention.py",)),
    ("model forward (other)", ("llama.py", "linear.py")),
    ("runner.prepare (metadata)", ("prepare", "_add_decode_groups", "_slot_table", "_prefill_chunks")),
    ("runner.execute (rest)", ("model_runner.py",)),
    ("scheduler", ("scheduler.py", "kv_manager.py", "block_pool.py", "policy.py")),
    ("detokenize/outputs", ("detokenizer.py", "_output", "outputs.py")),
    ("engine (rest)", ("engine.py", "llm.py")),
]


def phases(path: str) -> None:
    """Split py-spy raw (collapsed) stacks into engine phases, from the innermost frame out."""
    counts: collections.Counter = collections.Counter()
    inner: collections.Counter = collections.Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        n = int(n)
        frames = stack.split(";")
        if not any("generate" in f and "llm.py" in f for f in frames):
            counts["outside LLM.generate (import, load)"] += n
            continue
        total += n
        inner[frames[-1]] += n
        label = "other"
        for f in reversed(frames):
            hit = next((name for name, keys in PHASES if any(k in f for k in keys)), None)
            if hit:
                label = hit
                break
        counts[label] += n
    print(f"{total} samples inside LLM.generate")
    for k, v in counts.most_common():
        if k.startswith("outside"):
            continue
        print(f"  {k:32s} {100 * v / total:5.1f} %")
    print("innermost Python frames (the line that was running, torch op time included):")
    for k, v in inner.most_common(12):
        print(f"  {100 * v / total:5.1f} %  {k}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", choices=("decode", "batch64"), default="decode")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--no-profiler", action="store_true")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--quantization", choices=("int8", "int4"), default=None)
    ap.add_argument("--kernels", choices=("native", "torch"), default="native")
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="auto: what LLM() picks for this CPU (default)")
    ap.add_argument("--phases", help="py-spy raw output to split into phases, then exit")
    add_common_args(ap, out="results/profile_ours.json", quick=None)
    a = ap.parse_args()
    if a.phases:
        phases(a.phases)
        return
    import torch

    torch.set_num_threads(a.threads)
    from entropic import LLM, SamplingParams
    from entropic.bench.datasets import chat_prompt_ids

    llm = LLM(model=a.model, dtype=a.dtype, quantization=a.quantization, kernels=a.kernels, max_num_seqs=64,
              max_num_batched_tokens=2048, kv_cache_gib=1.0,
              enable_prefix_caching=False)  # the warm-up sends the profiled prompts too
    prompts = chat_prompt_ids(llm.get_tokenizer(), 64, 512)
    work = prompts[:1] if a.scenario == "decode" else prompts
    sp = SamplingParams(max_tokens=a.new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(work[:2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    machine = describe(a.threads)
    print(header(machine))
    result = {"machine": machine, "scenario": a.scenario, "new_tokens": a.new_tokens,
              "requests": len(work), "dtype": llm.engine.stats.dtype,
              "quantization": a.quantization, "kernels": a.kernels}
    if a.no_profiler:
        t0 = time.perf_counter()
        llm.generate(work, sp)
        wall = time.perf_counter() - t0
        print(f"{a.scenario}: {len(work) * a.new_tokens / wall:.1f} tok/s, wall {wall:.2f} s")
        write_json(a.out, {**result, "profiler": False, "wall_s": wall,
                           "tok_s": len(work) * a.new_tokens / wall})
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        llm.generate(work, sp)
        wall = time.perf_counter() - t0
    ev = prof.key_averages()
    self_total = sum(e.self_cpu_time_total for e in ev) / 1e6
    print(f"{a.scenario}: wall {wall:.2f} s under the profiler, {len(work) * a.new_tokens / wall:.1f} tok/s, "
          f"{llm.engine.stats.steps} engine steps so far")
    print(f"self time in torch ops {self_total:.2f} s ({100 * self_total / wall:.1f} % of wall); "
          f"outside torch ops {wall - self_total:.2f} s ({100 * (1 - self_total / wall):.1f} %)")
    print(f"{'op':40s} {'self s':>8s} {'% wall':>7s} {'calls':>8s}")
    ops = []
    for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[: a.top]:
        s = e.self_cpu_time_total / 1e6
        ops.append({"op": e.key, "self_s": s, "calls": e.count})
        print(f"{e.key[:40]:40s} {s:8.3f} {100 * s / wall:6.1f}% {e.count:8d}")
    write_json(a.out, {**result, "profiler": True, "wall_s": wall,
                       "tok_s": len(work) * a.new_tokens / wall,
                       "self_s_in_torch_ops": self_total, "top_ops": ops})


if __name__ == "__main__":
    main()
