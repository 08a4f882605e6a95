"""What entropic scheduling does to latency under saturation, without a model or a clock.

    python benchmarks/scheduling_tail.py               # rates 2, 3, 4 per second, 40 seeds
    python benchmarks/scheduling_tail.py --quick       # rate 3, 6 seeds

The ablation's regime (a) measures E2E p99 over ~300 requests on a host whose speed drifts
between runs, and its A/A row moved by -38 % to +6 % by itself: too noisy to tell two
scheduling rules apart. Here the real `Scheduler` and `EntropicPolicy` run the regime's request
mix (benchmarks/traces/regime_a_mix.json: 102 requests, each prompt length and the entropy of
each output token as the engine sampled them) on the replica simulator of
`entropic.bench.replicas`: a step lasts `base + per_flop * (its linear + attention FLOPs)`
under the engine's cost model, defaults chosen so that the mix at 3 requests/s takes
~41 s as in the ablation (34-48 s measured). Poisson arrivals, a shuffled order per seed; every
policy serves the same arrivals. Memory never binds here (regime (a) preempted for memory
in at most one run in three): this isolates what the order does; `--blocks 400` gives it
the ablation's cache, where memory binds.

Policies: FCFS; the current rule with each aging rule of `--rules` (K:W: a request is aged
once K later arrivals were admitted while it waited, or after W steps unserved; K "off": by
steps alone, the engine's default); and, as the control, the rule before 2026-12-06
(W = 128 by steps, aged requests displaced running ones, a paused request ranked by its
own priority), re-created here. Per seed: E2E mean and p99, TTFT mean, and each against
FCFS on the same arrivals; the table gives medians over seeds. Writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from entropic.bench import replicas as sim
from entropic.bench.machine import add_common_args, describe, header, write_json
from entropic.control.scheduling import EntropicPolicy, EntropicSchedulingConfig
from entropic.engine.cost import CostModel
from entropic.engine.request import RequestStatus

ROOT = Path(__file__).resolve().parents[1]
MIX = ROOT / "benchmarks" / "traces" / "regime_a_mix.json"
# the embedded default model's shape (SmolLM2-135M, bf16 KV): the cost model prices steps
SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
             num_heads=9, num_kv_heads=3, head_dim=64, max_position=8192)


class PreviousRule(EntropicPolicy):
    """The rule before 2026-12-06: paused requests ranked by their own priority, and an
    aged request may displace a running one (not aged, or aged less) past its residency."""

    def order(self, running, waiting, step):
        everyone = list(running) + list(waiting)
        aged = sorted((r for r in everyone if self.aged(r, step)),
                      key=lambda r: (-self.age(r, step), r.seq_no))
        rest = sorted((r for r in everyone if not self.aged(r, step)),
                      key=lambda r: (-self.priority(r), r.status is not RequestStatus.RUNNING,
                                     r.seq_no))
        return aged + rest

    def displace(self, waiting, victim, step):
        if victim.num_output_tokens == victim.outputs_at_admission:
            return False
        if step - victim.admitted_step < self.config.min_residency:
            return False
        if self.aged(waiting, step):
            return not self.aged(victim, step) or self.age(waiting, step) > self.age(victim,
                                                                                     step)
        if self.aged(victim, step):
            return False
        return self.priority(waiting) > self.config.displace_margin * self.priority(victim)


def load_mix(base: float, per_flop: float) -> sim.Trace:
    from entropic.config import ModelConfig

    d = json.loads(MIX.read_text())
    reqs = tuple(sim.TraceRequest(f"q{i}", 0.0, r["prompt_len"], tuple(r["entropies"]))
                 for i, r in enumerate(d["requests"]))
    return sim.Trace(reqs, CostModel(ModelConfig(**SHAPE), 2),
                     sim.StepTime(base, per_flop, per_flop), max_num_seqs=16,
                     max_num_batched_tokens=512, block_size=16)


def arrivals(trace: sim.Trace, rate: float, seed: int) -> list[sim.TraceRequest]:
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(trace.requests))
    times = np.cumsum(rng.exponential(1.0 / rate, len(order)))
    return [sim.TraceRequest(f"s{seed}r{j}", float(t), trace.requests[k].prompt_len,
                             trace.requests[k].entropies)
            for j, (k, t) in enumerate(zip(order, times))]


def figures(res: sim.SimResult) -> dict:
    e2e = sorted(res.finish[k] - res.arrival[k] for k in res.finish)
    ttft = [res.first_token[k] - res.arrival[k] for k in res.finish]
    return {"e2e_mean": statistics.mean(e2e), "e2e_p99": e2e[int(0.99 * len(e2e))],
            "e2e_max": e2e[-1], "ttft_mean": statistics.mean(ttft),
            "makespan": max(res.finish.values()), "displacements": res.displacements}


def run(trace: sim.Trace, rate: float, seeds: int, rules: list[sim.AgingRule],
        blocks: int | None) -> dict:
    labels = [rule.label for rule in rules]
    policies = ["fcfs", "previous rule (W 128)"] + labels
    per_seed: dict[str, list[dict]] = {p: [] for p in policies}
    for seed in range(seeds):
        work = arrivals(trace, rate, seed)
        per_seed["fcfs"].append(figures(sim.simulate(trace, work, 1, "fifo",
                                                     num_blocks=blocks)))
        per_seed["previous rule (W 128)"].append(figures(sim.simulate(
            trace, work, 1, "per_replica", EntropicSchedulingConfig(max_wait=128),
            policy_class=PreviousRule, num_blocks=blocks)))
        for label, rule in zip(labels, rules):
            per_seed[label].append(figures(sim.simulate(
                trace, work, 1, "per_replica", rule.config(), num_blocks=blocks)))
    out = {}
    for p, rows in per_seed.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        for k in ("e2e_mean", "e2e_p99", "ttft_mean"):
            med[f"{k}_vs_fcfs"] = statistics.median(
                r[k] / f[k] for r, f in zip(rows, per_seed["fcfs"]))
        out[p] = {"median": med, "per_seed": rows}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, threads=None, model=False,
                    out=str(ROOT / "results" / "scheduling_tail.json"))
    ap.add_argument("--rates", default=None, help="requests per second, comma-separated "
                    "(default 2,3,4; 3 with --quick)")
    ap.add_argument("--seeds", type=int, default=None, help="default 40 (6 with --quick)")
    ap.add_argument("--rules", default="off:32,off:16,off:64,off:128,4:1024,2:1024,1:1024",
                    help="aging rules to run, K:W or K:W:T (max_bypass:max_wait"
                    "[:max_wait_total]; K off: no bypass bound; with T, W counts only the "
                    "steps a request's context fit in the pool), comma-separated; the "
                    "default's first is the engine's default")
    ap.add_argument("--blocks", type=int, default=None,
                    help="KV blocks of 16 tokens (the ablation's regime (a): 400); default: "
                    "memory never binds")
    ap.add_argument("--step-base", type=float, default=0.03, help="seconds per step")
    ap.add_argument("--step-per-flop", type=float, default=4.7e-12,
                    help="seconds per FLOP of a step's chunks")
    a = ap.parse_args(argv)
    rates = [float(x) for x in (a.rates or ("3" if a.quick else "2,3,4")).split(",")]
    seeds = a.seeds or (6 if a.quick else 40)
    try:
        rules = sim.aging_rules(a.rules)
    except ValueError as e:
        ap.error(f"--rules: {e}")
    if (seeds < 1 or any(r <= 0 for r in rates) or a.step_base < 0 or a.step_per_flop <= 0
            or (a.blocks is not None and a.blocks < 1)):
        ap.error("--seeds and --blocks must be >= 1, --rates and --step-per-flop > 0, "
                 "--step-base >= 0")
    trace = load_mix(a.step_base, a.step_per_flop)
    result = {"machine": describe(), "mix": str(MIX.relative_to(ROOT)), "seeds": seeds,
              "blocks": a.blocks,
              "step": {"base": a.step_base, "per_flop": a.step_per_flop}, "rates": {}}
    print(header(result["machine"]))
    mem = f"{a.blocks} KV blocks" if a.blocks else "memory never binds"
    print(f"{len(trace.requests)} requests, {seeds} seeds, 16 slots, 512 tokens a step, {mem}; "
          f"medians over seeds (x FCFS: median of per-seed ratios)\n")
    print("| rate/s | policy | E2E mean s | E2E p99 s | TTFT mean s | makespan s | "
          "displacements | E2E mean x FCFS | E2E p99 x FCFS | TTFT mean x FCFS |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rate in rates:
        res = run(trace, rate, seeds, rules, a.blocks)
        result["rates"][str(rate)] = res
        for p, v in res.items():
            m = v["median"]
            print(f"| {rate:g} | {p} | {m['e2e_mean']:.2f} | {m['e2e_p99']:.2f} | "
                  f"{m['ttft_mean']:.2f} | {m['makespan']:.1f} | {m['displacements']:.0f} | "
                  f"{m['e2e_mean_vs_fcfs']:.3f} | {m['e2e_p99_vs_fcfs']:.3f} | "
                  f"{m['ttft_mean_vs_fcfs']:.3f} |")
    print()
    write_json(a.out, result)


if __name__ == "__main__":
    main()
