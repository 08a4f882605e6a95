"""Thrown-away work of the scheduler under KV-memory pressure, without a model.

    python benchmarks/scheduling_work.py            # regime (b)'s shape, several arrival gaps
    python benchmarks/scheduling_work.py --quick    # one arrival gap

The scheduler decides what is computed; the model only decides which tokens come out. So the
work a scheduling policy throws away (preemptions by recompute) can be counted exactly, and
deterministically, with a stand-in for the model: this script drives the real `Scheduler`
(FCFS, and entropic scheduling with its real priority and aging) with a runner that returns a
fixed token and a pseudo-random entropy for every sampled row, and counts the tokens each
policy computes against the ideal (every prompt and output position once). It also clocks
each request in work done: the engine's cost model prices every step (FLOPs of its chunks), and
a request's time to first token and completion are the FLOPs computed until then. That is the
latency a compute-bound engine would show (each step's time proportional to its FLOPs), so
policies can be compared on mean completion, e.g. aging rules (--rules) against the
priority order they override.

The default shape is the ablation's regime (b) (docs/ablation.md): 8 documents of 4,160,
6,200 and 8,000 tokens in turn, 128 output tokens each (EOS ignored), 1,024 KV blocks of 16
tokens (a pool for 2-3 of them), 8 slots, 512 tokens a step; a document arrives every
--gap steps. Timing is not measured here (that is the ablation's job); the counts are.
Writes results/scheduling_work.json and prints Markdown.
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

from entropic.bench.machine import add_common_args, describe, header, write_json
from entropic.bench.replicas import AgingRule, aging_rules
from entropic.config import ModelConfig
from entropic.control.clock import EntropicClock
from entropic.control.scheduling import EntropicPolicy, EntropicSchedulingConfig
from entropic.engine.block_pool import BlockPool
from entropic.engine.cost import CostModel, dense_work
from entropic.engine.kv_manager import KVCacheManager
from entropic.engine.request import Request
from entropic.engine.scheduler import SampledToken, Scheduler
from entropic.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
# the embedded default model's shape (SmolLM2-135M): the priority's cost terms need one
DEFAULT_SHAPE = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                            num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                            max_position=8192)


def run(policy_name: str, contexts: list[int], n: int, gap: int, out_tokens: int,
        num_blocks: int, block_size: int, max_num_seqs: int, budget: int, seed: int,
        rule: AgingRule | None = None) -> dict:
    clock, policy, config = None, None, None
    cost = CostModel(DEFAULT_SHAPE, 2)
    if policy_name == "entropic":
        clock = EntropicClock()
        config = rule.config() if rule else EntropicSchedulingConfig()
        policy = EntropicPolicy(clock, config)
        policy.bind(cost, num_blocks, block_size, max_num_seqs, budget)
    sched = Scheduler(KVCacheManager(BlockPool(num_blocks), block_size), max_num_seqs,
                      budget, max(contexts) + out_tokens + 1, (), policy)
    rng = random.Random(seed)
    reqs = [Request(f"d{k}", [rng.randrange(1000) for _ in range(contexts[k % len(contexts)])],
                    SamplingParams(max_tokens=out_tokens, temperature=0, ignore_eos=True),
                    float(k)) for k in range(n)]
    computed = step = added = 0
    flops = 0.0  # the work clock: FLOPs computed so far
    arrived, first, done = {}, {}, {}
    while added < n or sched.num_unfinished:
        while added < n and step >= added * gap:
            sched.add(reqs[added])
            arrived[reqs[added].request_id] = flops
            added += 1
        step += 1
        out = sched.schedule()
        flops += sum(cost.chunk_cost(dense_work(c.request_id, c.start_pos, len(c.token_ids),
                                                c.sample)).flops for c in out.chunks)
        sampled = {}
        for c in out.chunks:
            if c.sample:
                sampled[c.request_id] = SampledToken(token_id=1, entropy=rng.uniform(0.0, 4.0))
                first.setdefault(c.request_id, flops)
                if clock is not None:
                    clock.observe(c.request_id, sampled[c.request_id].entropy)
        sched.update(out, sampled, 0.0)
        computed += out.num_batched_tokens
        for r in reqs:
            if r.request_id not in done and r.num_output_tokens >= out_tokens:
                done[r.request_id] = flops
    ideal = sum(len(r.token_ids) - 1 for r in reqs)
    ids = [r.request_id for r in reqs]
    aging = [config.max_bypass, config.max_wait, config.max_wait_total] if config else None
    return {"policy": policy_name, "aging": aging, "gap": gap,
            "computed_tokens": computed, "ideal_tokens": ideal, "work_ratio": computed / ideal,
            "recomputes": sched.num_recomputes, "pauses": sched.num_pauses,
            "steps": sched.step_count, "makespan_tflops": flops / 1e12,
            "mean_ttft_tflops": sum(first[i] - arrived[i] for i in ids) / n / 1e12,
            "mean_e2e_tflops": sum(done[i] - arrived[i] for i in ids) / n / 1e12}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, threads=None, out=str(ROOT / "results" / "scheduling_work.json"),
                    model=False, quick="one arrival gap (3 steps)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4160, 6200, 8000])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--kv-blocks", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rules", default="off:32,4:1024,off:1000000",
                    help="entropic scheduling's aging rules, K:W or K:W:T (max_bypass:max_wait"
                    "[:max_wait_total]; K off: no bypass bound; with T, W counts only the "
                    "steps a request's context fit in the pool), comma-separated, one run each")
    args = ap.parse_args()
    try:
        rules = aging_rules(args.rules)
    except ValueError as e:
        ap.error(f"--rules: {e}")
    for name in ("requests", "max_tokens", "kv_blocks", "block_size", "max_num_seqs", "budget"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    capacity = args.kv_blocks * args.block_size
    for c in args.contexts:
        if c < 1 or c + args.max_tokens > capacity:
            ap.error(f"--contexts: {c} tokens plus --max-tokens {args.max_tokens} must fit "
                     f"the pool of {capacity} tokens (--kv-blocks x --block-size); the "
                     f"engine would reject such a request, the scheduler alone never admits it")
    machine = describe(args.threads)
    gaps = [3] if args.quick else [1, 3, 8]
    common = (args.contexts, args.requests)
    rest = (args.max_tokens, args.kv_blocks, args.block_size, args.max_num_seqs, args.budget,
            args.seed)
    rows = []
    for g in gaps:
        rows.append(run("fcfs", *common, g, *rest))
        rows += [run("entropic", *common, g, *rest, rule=rule) for rule in rules]
    print(header(machine) + " (the counts do not depend on it)")
    print(f"{args.requests} requests of {args.contexts} tokens in turn, {args.max_tokens} "
          f"output tokens, {args.kv_blocks} blocks of {args.block_size}, "
          f"{args.max_num_seqs} slots, {args.budget} tokens/step; times in TFLOPs of work "
          f"done since the request arrived\n")
    print("| arrival gap (steps) | policy | aging | computed / ideal tokens | recomputes "
          "| pauses | steps | makespan | mean TTFT | mean E2E |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        aging = AgingRule(*r["aging"]).label if r["aging"] else "-"
        print(f"| {r['gap']} | {r['policy']} | {aging} | {r['work_ratio']:.3f} "
              f"| {r['recomputes']} | {r['pauses']} | {r['steps']} | {r['makespan_tflops']:.2f} "
              f"| {r['mean_ttft_tflops']:.2f} | {r['mean_e2e_tflops']:.2f} |")
    write_json(args.out, {"machine": machine, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
