"""The projections' two bf16 paths side by side: entropic's PackedLinear (oneDNN weights
reordered once for batch size 1, cut where a shape's rows would stop being independent)
against plain F.linear, by row count, on the default model's projection shapes.

    python3 benchmarks/linear_paths.py             # ~1 min
    python3 benchmarks/linear_paths.py --quick

Both run in alternation within each round (the order flips every round); each figure is
the median over rounds of the per-call time (the best of a few back-to-back calls per
round). Also says, per shape and row count, whether F.linear gives every row the result it
gives that row alone (batch invariance, which PackedLinear keeps by construction).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from entropic.bench.machine import add_common_args, describe, header, write_json
from entropic.model.linear import PackedLinear

# SmolLM2-135M: q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536
SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536))


def per_call(f, calls: int) -> float:
    f()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, out="results/linear_paths.json", model=False,
                    quick="3 rounds, fewer row counts")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows_list = (1, 16, 1600) if a.quick else (1, 4, 16, 64, 256, 512, 1600)
    rounds = 3 if a.quick else a.rounds
    info = describe(a.threads)
    print(header(info))
    gen = torch.Generator().manual_seed(0)
    results = []
    print(f"{'shape':>12} {'rows':>5} {'packed us':>10} {'F.linear us':>12} "
          f"{'packed/F':>9} {'F.linear row-invariant':>23}")
    for out_f, in_f in SHAPES:
        w = torch.randn(out_f, in_f, generator=gen).to(torch.bfloat16)
        packed = PackedLinear(w)
        for m in rows_list:
            x = torch.randn(m, in_f, generator=gen).to(torch.bfloat16)
            calls = max(3, 2000 // m)
            tp, tf = [], []
            for r in range(rounds):
                pair = [("p", lambda: packed(x)), ("f", lambda: F.linear(x, w))]
                for name, f in (pair if r % 2 == 0 else pair[::-1]):
                    (tp if name == "p" else tf).append(per_call(f, calls))
            full = F.linear(x, w)
            invariant = all(torch.equal(F.linear(x[i:i + 1], w)[0], full[i])
                            for i in range(0, m, max(1, m // 16)))
            p, f = statistics.median(tp) * 1e6, statistics.median(tf) * 1e6
            results.append({"out": out_f, "in": in_f, "rows": m, "packed_us": p,
                            "f_linear_us": f, "packed_over_f": p / f,
                            "f_linear_row_invariant": invariant,
                            "packed_max_rows": packed.max_rows})
            print(f"{out_f:>5}x{in_f:<6} {m:>5} {p:>10.1f} {f:>12.1f} {p / f:>9.2f} "
                  f"{str(invariant):>23}")
    write_json(a.out, {"machine": info, "rounds": rounds, "results": results})


if __name__ == "__main__":
    main()
