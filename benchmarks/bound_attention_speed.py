"""Decode attention with query-aware block selection against dense, one layer, the kernel alone.

    python benchmarks/bound_attention_speed.py [--threads 1] [--rounds 5] [--out results/bound_attention_speed.json]

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head_dim 64, bf16), a paged cache
of 16-token blocks scattered at random, rows of 1k-8k positions: `paged_decode_attention`
dense, with a budget of every block (the selection path that keeps all), and with budgets of
a half and a quarter of the blocks (sink and 2 recent included). The configurations are timed
in turn within each round (20 calls each), and the median over rounds is reported with its
ratio to dense. Random keys, so the choice itself is not what is measured here (quality is
docs/pruning.md's teacher-forced protocol); the cost of scoring the bound rows, choosing and
attending is.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from entropic import kernels
from entropic.bench.machine import add_common_args, describe, header, write_json
from entropic.model.attention import KVCache

BS, KVH, REP, D = 16, 3, 3, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    add_common_args(ap, threads=1, out="results/bound_attention_speed.json", model=False,
                    quick=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    kernels.load()
    torch.manual_seed(0)
    pool = 2048
    kv = KVCache(1, pool, BS, KVH, D, torch.bfloat16, key_bounds=True)
    kv.kv[0, :pool * BS] = torch.randn(pool * BS, 2, KVH, D).to(torch.bfloat16)
    kv.update_key_bounds(list(range(pool)))
    cache = kv.kv[0]
    rows_out = []
    machine = describe(a.threads)
    print(header(machine))
    print("| rows | context | dense ms | all kept ms (x) | half kept ms (x) | quarter kept ms (x) |")
    print("|---|---|---|---|---|---|")
    for rows, length in ((1, 1024), (1, 4096), (1, 8000), (4, 1024), (4, 4096), (4, 8000)):
        nb = -(-length // BS)
        slots = torch.zeros(rows, length, dtype=torch.long)
        for r in range(rows):
            blocks = torch.randperm(pool)[:nb]
            pos = torch.arange(length)
            slots[r] = blocks[pos // BS] * BS + pos % BS
        q = torch.randn(rows, KVH * REP, D).to(torch.bfloat16)
        configs = {"dense": None, "all": nb, "half": nb // 2, "quarter": nb // 4}

        def run(keep):
            if keep is None:
                return torch.ops.entropic.paged_decode_attention(q, cache, slots, None, 0.125,
                                                                 None)
            return torch.ops.entropic.paged_decode_attention(
                q, cache, slots, None, 0.125, None, torch.full((rows,), keep), BS,
                kv.bounds_offset, 1, 2)

        times: dict[str, list[float]] = {k: [] for k in configs}
        for keep in configs.values():
            run(keep)
        for _ in range(a.rounds):
            for name, keep in configs.items():
                t0 = time.perf_counter()
                for _ in range(20):
                    run(keep)
                times[name].append((time.perf_counter() - t0) / 20 * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"rows": rows, "context": length, "ms": med,
               "x_dense": {k: med[k] / med["dense"] for k in med}}
        rows_out.append(row)
        print(f"| {rows} | {length} | {med['dense']:.2f} | " + " | ".join(
            f"{med[k]:.2f} ({med[k] / med['dense']:.2f}x)" for k in ("all", "half", "quarter"))
            + " |")
    write_json(a.out, {"machine": machine, "isa": kernels.isa(), "threads": a.threads,
                       "rows": rows_out})


if __name__ == "__main__":
    main()
