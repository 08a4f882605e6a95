"""N replicas, one global pi queue against N per-replica pi queues, on a recorded trace.

    python benchmarks/replicas.py                       # benchmarks/traces/replica_trace.json
    python benchmarks/replicas.py --trace tests/data/replica_trace_quick.json --quick

A simulation (entropic.bench.replicas), not a measurement: each replica is entropic's own
scheduler with its own policy; tokens carry the entropies recorded by the real engine
(benchmarks/record_replica_trace.py) and a step lasts what the step-time law fitted on the
recorded steps gives. Deterministic: reruns print the same table, and there is no timing
noise to average over.

For N = 1, 2, 4, 8 replicas the workload is N superposed copies of the trace's arrivals
(each replica equally loaded), at two loads given as fractions of one replica's capacity
(requests per second it completes when every request is there at once, FIFO). Modes:
global (one pi queue with aging feeding all replicas), per_replica (vLLM's data-parallel
routing, a pi queue per replica), fifo (vLLM's routing, FCFS per replica), global_fifo (one
FCFS queue: the gap that pooling alone makes, without pi). Reported: TTFT
and E2E mean and p99 (s), tau per second, the longest wait between two services (steps)
against the aging threshold W and the bound W + Q * (P + M); and the gap per_replica /
global.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from entropic.bench.machine import add_common_args, describe, write_json
from entropic.bench.replicas import MODES, load_trace, simulate, summarize, workload
from entropic.control.scheduling import EntropicSchedulingConfig

ROOT = Path(__file__).resolve().parents[1]
GAP = ("ttft_mean", "ttft_p99", "e2e_mean", "e2e_p99", "tau_per_s")


def capacity(trace) -> float:
    """Requests per second one replica completes with all of them there at once (FIFO)."""
    reqs = [r.__class__(r.id, 0.0, r.prompt_len, r.entropies) for r in trace.requests]
    s = summarize(simulate(trace, reqs, 1, "fifo"))
    return len(reqs) / s["makespan"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, threads=1, out=str(ROOT / "results/replicas.json"), model=False,
                    quick="N = 1, 2 only")
    ap.add_argument("--trace", default=str(ROOT / "benchmarks/traces/replica_trace.json"))
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--loads", type=float, nargs="+", default=[0.7, 1.5],
                    help="arrival rate per replica, as a fraction of one replica's capacity")
    ap.add_argument("--copies", type=int, default=2,
                    help="copies of the trace per replica (longer runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-scale", type=float, default=1.0,
                    help="multiply the step-time law's per-step base (sensitivity: a "
                         "quieter machine has a smaller base against the per-token cost)")
    args = ap.parse_args()
    if args.quick:
        args.replicas = [1, 2]
    trace = load_trace(args.trace)
    if args.base_scale != 1.0:
        trace = dataclasses.replace(trace, step_time=dataclasses.replace(
            trace.step_time, base=trace.step_time.base * args.base_scale))
    cfg = EntropicSchedulingConfig()
    cap = capacity(trace)
    print(f"trace {args.trace}: {len(trace.requests)} requests; {trace.step_time}; "
          f"one replica's capacity "
          f"{cap:.3f} req/s; max_num_seqs {trace.max_num_seqs}; K = {cfg.max_bypass}, "
          f"W = {cfg.max_wait}, "
          f"R = {cfg.min_residency}\n")
    cols = ["ttft_mean", "ttft_p99", "e2e_mean", "e2e_p99", "tau_per_s", "max_wait_steps",
            "wait_bound_steps", "displacements", "utilisation"]
    print("| load | N | mode | TTFT mean | TTFT p99 | E2E mean | E2E p99 | tau/s | "
          "max wait (steps) | bound | displacements | utilisation |")
    print("|---" * 12 + "|")
    rows, gaps = [], []
    for load in args.loads:
        for n in args.replicas:
            w = workload(trace, n * args.copies, rate=load * cap / args.copies,
                         seed=args.seed)
            res = {m: summarize(simulate(trace, w, n, m, cfg)) for m in MODES}
            for m, s in res.items():
                s["load"] = load
                rows.append(s)
                bound = s["wait_bound_steps"] if m in ("global", "per_replica") else "-"
                print(f"| {load} | {n} | {m} | " + " | ".join(
                    f"{s[c]:.2f}" for c in cols[:5]) + f" | {s['max_wait_steps']} | {bound} | "
                    f"{s['displacements']} | {s['utilisation']:.2f} |", flush=True)
            for num, den in (("per_replica", "global"), ("fifo", "global_fifo")):
                gap = {c: res[num][c] / res[den][c] for c in GAP}
                gap.update(load=load, replicas=n, ratio=f"{num} / {den}")
                gaps.append(gap)
    print("\nGap: per-replica queues (vLLM routing) / one global queue, pi and FIFO:\n")
    print("| load | N | ratio | " + " | ".join(GAP) + " |\n" + "|---" * (len(GAP) + 3) + "|")
    for g in gaps:
        print(f"| {g['load']} | {g['replicas']} | {g['ratio']} | "
              + " | ".join(f"{g[c]:.3f}" for c in GAP) + " |")
    write_json(args.out, {"meta": {"command": " ".join(sys.argv), "machine": describe(),
                                   "trace": args.trace, "capacity_req_s": cap,
                                   "step_time": dataclasses.asdict(trace.step_time),
                                   "copies": args.copies, "seed": args.seed,
                                   "max_wait": cfg.max_wait, "max_bypass": cfg.max_bypass,
                                   "min_residency": cfg.min_residency},
                          "rows": rows, "gaps": gaps})


if __name__ == "__main__":
    main()
