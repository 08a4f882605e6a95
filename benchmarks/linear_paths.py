"""The projections' paths side by side: entropic's PackedLinear (oneDNN weights reordered
once, cut where a shape's rows would stop being independent) against plain F.linear, by row
count, on the default model's projection shapes; with --dtype float32 also the weights
packed with oneDNN's batch-size-1 hint (PackedLinear's fp32 layout before 2026-12-07; a lone
row padded to two where that layout needs it).

    python3 benchmarks/linear_paths.py             # ~1 min
    python3 benchmarks/linear_paths.py --quick
    python3 benchmarks/linear_paths.py --dtype float32

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
# ... and fused as the model runs them: qkv 960x576, gate_up 3072x576
FUSED = ((960, 576), (3072, 576))


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
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    torch.set_num_threads(a.threads)
    rows_list = (1, 16, 1600) if a.quick else (1, 4, 16, 64, 256, 512, 1600)
    rounds = 3 if a.quick else a.rounds
    info = describe(a.threads)
    print(header(info))
    gen = torch.Generator().manual_seed(0)
    results = []
    hint1 = dtype == torch.float32
    print(f"{'shape':>12} {'rows':>5} {'packed us':>10} {'F.linear us':>12} "
          f"{'packed/F':>9} {'F.linear row-invariant':>23}"
          + (f" {'hint-1 us':>10} {'packed/hint-1':>14}" if hint1 else ""))
    for out_f, in_f in SHAPES + FUSED:
        w = torch.randn(out_f, in_f, generator=gen).to(dtype)
        packed = PackedLinear(w)
        fns = {"p": lambda x: packed(x), "f": lambda x: F.linear(x, w)}
        if hint1:
            w1 = torch.ops.mkldnn._reorder_linear_weight(w, batch_size=1)

            def mm1(x, w1=w1):
                return torch.ops.mkldnn._linear_pointwise(x, w1, None, "none", [], "")
            # (row_invariance's probe, uncached: its cache holds PackedLinear's layout)
            probe = torch.randn(32, in_f, generator=gen) * torch.exp2(
                torch.randint(-8, 9, (32, in_f), generator=gen).float())
            many = mm1(probe)
            pad1 = any(not torch.equal(mm1(probe[r:r + 1].clone())[0], many[r])
                       for r in range(32))

            def packed_hint1(x, pad1=pad1):
                return mm1(torch.cat((x, x)))[:1] if pad1 and x.shape[0] == 1 else mm1(x)
            fns["h"] = packed_hint1
        for m in rows_list:
            x = torch.randn(m, in_f, generator=gen).to(dtype)
            calls = max(3, 2000 // m)
            times = {k: [] for k in fns}
            for r in range(rounds):
                order = list(fns) if r % 2 == 0 else list(fns)[::-1]
                for name in order:
                    times[name].append(per_call(lambda: fns[name](x), calls))
            full = F.linear(x, w)
            invariant = all(torch.equal(F.linear(x[i:i + 1], w)[0], full[i])
                            for i in range(0, m, max(1, m // 16)))
            t = {k: statistics.median(v) * 1e6 for k, v in times.items()}
            p, f = t["p"], t["f"]
            row = {"out": out_f, "in": in_f, "rows": m, "packed_us": p,
                   "f_linear_us": f, "packed_over_f": p / f,
                   "f_linear_row_invariant": invariant, "packed_max_rows": packed.max_rows}
            line = (f"{out_f:>5}x{in_f:<6} {m:>5} {p:>10.1f} {f:>12.1f} {p / f:>9.2f} "
                    f"{str(invariant):>23}")
            if hint1:
                row |= {"hint1_us": t["h"], "packed_over_hint1": p / t["h"]}
                line += f" {t['h']:>10.1f} {p / t['h']:>14.2f}"
            results.append(row)
            print(line)
    write_json(a.out, {"machine": info, "dtype": a.dtype, "rounds": rounds,
                       "results": results})


if __name__ == "__main__":
    main()
