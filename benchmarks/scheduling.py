"""The macro control law alone: FCFS against entropic scheduling under a saturating load.

    python benchmarks/scheduling.py             # 96 requests, 3 repeats per policy
    python benchmarks/scheduling.py --quick     # 24 requests, 1 repeat

Workload: ShareGPT first turns (chat template), Poisson arrivals at --rate requests/s
(default: high enough to saturate 2 CPU cores), output length = the ShareGPT reference
reply's length in tokens, capped at --max-tokens, with ignore_eos so both policies do the
same work; greedy decoding. The engine is constrained: --max-num-seqs slots and
--kv-blocks KV blocks, so admission, slot allocation and preemption all bind.
Both policies get identical arrival times and requests; runs alternate fcfs/entropic.

Reported (median over repeats): mean, p50, p99 of TTFT, TPOT and end-to-end latency (from
the request's scheduled arrival), output tokens/s over the makespan, preemptions (pauses,
which keep the KV resident, and recomputes, which drop it), linear TFLOPs, engine tau
per TFLOP and per second (dtau/dC). Also a check of the E[dH] predictor used by the policy:
on the generated entropy traces, mean absolute error and rank correlation of candidate
predictors against the realised next-step dH+.
Writes results/scheduling.json and prints Markdown.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

from entropic import LLM, SamplingParams
from entropic.bench.datasets import load_sharegpt_prompts
from entropic.bench.loadgen import TimedRequest, replay
from entropic.bench.machine import add_common_args, describe, header, write_json

ROOT = Path(__file__).resolve().parents[1]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def run(llm: LLM, reqs: list[tuple[float, list[int], int]]) -> dict:
    """Replay arrivals (offsets in seconds) against the engine; return metrics."""
    load = [TimedRequest(f"b{i}", ids, SamplingParams(max_tokens=n, temperature=0,
                                                      ignore_eos=True), off)
            for i, (off, ids, n) in enumerate(reqs)]
    res = replay(llm.engine, load)
    finals = [res.outputs[r.request_id] for r in load]
    makespan = res.makespan
    ttft = [o.metrics.ttft for o in finals]
    tpot = [o.metrics.tpot for o in finals if o.metrics.tpot is not None]
    e2e = [o.metrics.e2e for o in finals]
    tflops = (res.stats["cost.flops_linear"] + res.stats["cost.flops_attention"]) / 1e12
    seconds = res.stats["cost.seconds"]
    tau = res.stats["tau"]
    out = {"output_tok_s": sum(len(o.token_ids) for o in finals) / makespan,
           "preemptions": res.stats["preemptions"], "pauses": res.stats["pauses"],
           "recomputes": res.stats["recomputes"],
           "linear_tflop": res.stats["cost.flops_linear"] / 1e12,
           "tau_per_tflop": tau / tflops, "tau_per_s": tau / seconds, "makespan": makespan}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        out[f"{name}_mean"] = statistics.fmean(xs)
        out[f"{name}_p50"] = pct(xs, 50)
        out[f"{name}_p99"] = pct(xs, 99)
    out["_entropies"] = [o.entropies for o in finals]
    return out


def predictor_check(traces: list[list[float]], window: int = 16, prior_w: float = 2.0) -> dict:
    """How well do candidate E[dH] predictors forecast the next step's dH+?"""
    drops_all = [max(0.0, a - b) for h in traces for a, b in zip(h, h[1:])]
    prior = statistics.fmean(drops_all)
    rows = []  # (realised, recent-mean, current H, constant)
    for h in traces:
        for t in range(2, len(h) - 1):
            hist = h[max(0, t - window + 1):t + 1]
            d = [max(0.0, a - b) for a, b in zip(hist, hist[1:])]
            recent = (sum(d) + prior_w * prior) / (len(d) + prior_w)
            rows.append((max(0.0, h[t] - h[t + 1]), recent, h[t], prior))

    def rank(xs):
        order = sorted(range(len(xs)), key=xs.__getitem__)
        r = [0.0] * len(xs)
        for i, j in enumerate(order):
            r[j] = float(i)
        return r

    def spearman(a, b):
        ra, rb = rank(a), rank(b)
        ma, mb = statistics.fmean(ra), statistics.fmean(rb)
        cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
        va = sum((x - ma) ** 2 for x in ra) ** 0.5
        vb = sum((y - mb) ** 2 for y in rb) ** 0.5
        return cov / (va * vb) if va and vb else 0.0

    real = [r[0] for r in rows]
    out = {}
    for k, name in ((1, "recent mean dH+ (tried first)"), (2, "kappa * H_t (policy)"), (3, "constant prior")):
        pred = [r[k] for r in rows]
        if k == 2:  # best linear scale for H_t, so the MAE comparison is fair
            scale = sum(p * y for p, y in zip(pred, real)) / max(1e-9, sum(p * p for p in pred))
            pred = [p * scale for p in pred]
        out[name] = {"mae": statistics.fmean(abs(p - y) for p, y in zip(pred, real)),
                     "spearman": spearman(pred, real) if k != 3 else 0.0}
    out["_n"] = len(rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--kv-blocks", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    add_common_args(ap, threads=None, out=str(ROOT / "results"),
                    out_help="folder for scheduling.json", quick="24 requests, 1 repeat")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.repeats = 24, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    kw = dict(max_num_seqs=args.max_num_seqs, num_kv_blocks=args.kv_blocks,
              max_num_batched_tokens=512,
              enable_prefix_caching=False)  # repeats replay the same requests
    llms = {"fcfs": LLM(model=args.model, **kw),
            "entropic": LLM(model=args.model, scheduling="entropic", **kw)}
    machine = describe(torch.get_num_threads())
    tok = llms["fcfs"].tokenizer
    rng = random.Random(args.seed)
    reqs, t = [], 0.0
    limit = args.kv_blocks * 16 - args.max_tokens
    for rec in load_sharegpt_prompts():
        ids = tok.apply_chat_template([{"role": "user", "content": rec["prompt"]}])
        n = max(8, min(args.max_tokens, len(tok.encode(rec["reference"]))))
        if len(ids) + n > min(limit, 1024):
            continue
        reqs.append((t, ids, n))
        t += rng.expovariate(args.rate)
        if len(reqs) == args.requests:
            break
    for llm in llms.values():  # warm-up
        llm.generate([reqs[0][1]], SamplingParams(max_tokens=4))
    runs: dict[str, list[dict]] = {k: [] for k in llms}
    for rep in range(args.repeats):
        for name, llm in llms.items():
            runs[name].append(run(llm, reqs))
            print(f"  repeat {rep} {name}: {runs[name][-1]['makespan']:.1f}s", file=sys.stderr,
                  flush=True)
    cols = ["ttft_mean", "ttft_p50", "ttft_p99", "tpot_mean", "tpot_p50", "tpot_p99",
            "e2e_mean", "e2e_p50", "e2e_p99", "output_tok_s", "preemptions", "pauses",
            "recomputes", "linear_tflop", "tau_per_tflop", "tau_per_s"]
    table = {name: {c: statistics.median(r[c] for r in rs) for c in cols}
             for name, rs in runs.items()}
    spread = {name: {c: [r[c] for r in rs] for c in cols} for name, rs in runs.items()}
    print("\n" + header(machine))
    print(f"{len(reqs)} requests, Poisson {args.rate}/s, max_num_seqs {args.max_num_seqs}, "
          f"{args.kv_blocks} KV blocks, medians of {args.repeats} (seconds; tok/s)\n")
    print("| policy | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, r in table.items():
        print(f"| {name} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |")
    ratio = {c: table["entropic"][c] / table["fcfs"][c] if table["fcfs"][c] else float("nan")
             for c in cols}
    print("| entropic/fcfs | " + " | ".join(f"{ratio[c]:.3f}" for c in cols) + " |")
    pred = predictor_check([h for rs in runs.values() for h in rs[0]["_entropies"]])
    print(f"\nE[dH] predictors on {pred.pop('_n')} steps (realised next dH+):\n")
    print("| predictor | MAE (nats) | Spearman |\n|---|---|---|")
    for name, r in pred.items():
        print(f"| {name} | {r['mae']:.4f} | {r['spearman']:.3f} |")
    meta = {k: v for k, v in vars(args).items()}
    meta["machine"] = machine
    meta["command"] = " ".join(sys.argv)
    meta["threads"] = torch.get_num_threads()
    write_json(Path(args.out) / "scheduling.json",
               {"meta": meta, "median": table, "runs": spread, "ratio": ratio,
                "predictors": pred})


if __name__ == "__main__":
    main()
