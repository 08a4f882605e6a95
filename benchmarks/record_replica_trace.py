"""Record the trace that benchmarks/replicas.py simulates N replicas on.

    python benchmarks/record_replica_trace.py                 # 40 requests (the committed trace)
    python benchmarks/record_replica_trace.py --quick         # 8 short ones, for tests
    python benchmarks/record_replica_trace.py --calibrate benchmarks/traces/replica_trace.json

The real engine (the embedded SmolLM2-135M unless --model) runs ShareGPT first turns (chat
template), output length = the reference reply's length in tokens capped at --max-tokens,
greedy with ignore_eos (so the output length is a property of the request, not of the
schedule). Recorded per request: its arrival offset (a Poisson process at --rate, seeded),
prompt length, output length and the exact entropy H_t of every output token. Recorded per
engine step: the tokens computed, the rows sampled, the attention pairs (query token x KV
position) and the measured wall seconds of the model call. The simulation fits its
step-time law on these (entropic.bench.replicas.fit_step_time: seconds against the engine
cost model's linear and attention FLOPs, src/entropic/engine/cost.py). The requests run
offline, all admitted as slots allow, so the steps cover batches of every size from full to
one row. Writes JSON (small: rounded entropies, no token ids), so the simulation needs no
model.

On a loaded machine a step's time is mostly other people's load (the 2-core machine here
ran at load 6-12: 16-row decode steps took 0.18 to 11 s), which is why the fit is a low
quantile, not least squares. --calibrate adds timed steps of fixed shapes (decode batches
of 1..16 rows at contexts 128 and 768, single prefill chunks of 64..512 tokens, each run
--repeats times) to a recorded trace, so that the fit sees every batch size several times.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch

from entropic import LLM, SamplingParams
from entropic.bench.datasets import load_sharegpt_prompts
from entropic.bench.loadgen import poisson_offsets
from entropic.bench.machine import add_common_args, describe, header, write_json
from entropic.bench.replicas import fit_step_time

ROOT = Path(__file__).resolve().parents[1]


def record_steps(llm: LLM) -> list[list[float]]:
    """Wrap the engine's per-step accounting: [tokens, sampled rows, attention pairs,
    seconds] of every step (the seconds the engine itself measured around the model)."""
    engine = llm.engine
    steps: list[list[float]] = []
    account = engine._account

    def spy(sched, seconds):
        work = [engine._work(c) for c in sched.chunks]
        steps.append([sum(w.num_tokens for w in work), sum(int(w.sampled) for w in work),
                      sum(w.attended_pairs for w in work), round(seconds, 6)])
        account(sched, seconds)

    engine._account = spy
    return steps


def calibrate(llm: LLM, repeats: int) -> list[list[float]]:
    """The fastest of `repeats` runs of each fixed step shape, as [tokens, sampled rows,
    attention pairs, seconds] rows."""
    steps = record_steps(llm)
    best: dict[tuple, list[float]] = {}

    def run(prompts, max_tokens):
        for _ in range(repeats):
            steps.clear()
            llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                 ignore_eos=True))
            for row in steps:
                key = tuple(row[:3])
                if key not in best or row[3] < best[key][3]:
                    best[key] = row

    for ctx in (128, 768):
        for b in (1, 2, 4, 8, 16):
            run([[100 + i] * ctx for i in range(b)], 5)  # decode steps of b rows
    for n in (64, 256, 512):
        run([[7] * n], 1)  # one prefill chunk
    return sorted(best.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, out=str(ROOT / "benchmarks/traces/replica_trace.json"),
                    quick="8 requests of at most 16 tokens (the tests' trace)")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--rate", type=float, default=1.0,
                    help="Poisson arrivals per second of the recorded workload (the "
                         "simulation rescales it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calibrate", metavar="TRACE", default=None,
                    help="add timed steps of fixed shapes to TRACE (for the step-time fit)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per shape (--calibrate)")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.max_tokens = 8, 16
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=1024,
              enable_prefix_caching=False)  # timed steps must compute what they schedule
    if args.calibrate:
        path = Path(args.calibrate)
        trace = json.loads(path.read_text())
        llm.generate([[5] * 32], SamplingParams(max_tokens=4))  # warm-up
        t0 = time.perf_counter()
        rows = calibrate(llm, args.repeats)
        trace["calibration"] = {"command": " ".join(sys.argv), "machine": describe(args.threads),
                                "seconds": round(time.perf_counter() - t0, 2), "steps": rows}
        fit = fit_step_time(trace["cost"], trace["steps"] + rows)
        print(f"{len(rows)} step shapes; step time (trace and calibration) {fit}")
        write_json(path, trace)
        return
    tok = llm.tokenizer
    prompts = []
    for rec in load_sharegpt_prompts():
        ids = tok.apply_chat_template([{"role": "user", "content": rec["prompt"]}])
        n = max(8, min(args.max_tokens, len(tok.encode(rec["reference"]))))
        if len(ids) + n <= 1024:
            prompts.append((rec["id"], ids, n))
        if len(prompts) == args.requests:
            break
    llm.generate([prompts[0][1]], SamplingParams(max_tokens=4))  # warm-up, not recorded
    steps = record_steps(llm)
    t0 = time.perf_counter()
    outs = llm.generate([ids for _, ids, _ in prompts],
                        [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                         for _, _, n in prompts])
    wall = time.perf_counter() - t0
    offsets = poisson_offsets(len(prompts), args.rate, random.Random(args.seed))
    requests = [{"id": rid, "arrival": round(off, 6), "prompt_len": len(ids),
                 "output_len": len(o.token_ids), "entropies": [round(h, 4) for h in o.entropies]}
                for (rid, ids, _), off, o in zip(prompts, offsets, outs)]
    cost = llm.engine.cost_model
    info = describe(args.threads)
    trace = {
        "meta": {"command": " ".join(sys.argv), "machine": info, "model": args.model
                 or "embedded SmolLM2-135M", "seconds": round(wall, 2),
                 "max_num_seqs": args.max_num_seqs,
                 "max_num_batched_tokens": args.max_num_batched_tokens,
                 "block_size": llm.engine.config.block_size, "rate": args.rate,
                 "seed": args.seed},
        "model_config": dataclasses.asdict(llm.engine.model_config),
        "kv_element_bytes": torch.empty((), dtype=llm.engine.model.dtype).element_size(),
        "cost": {"linear_per_token": cost.linear_per_token,
                 "lm_head_per_row": cost.lm_head_per_row,
                 "attention_per_pair": cost.attention_per_pair},
        "steps": steps,
        "requests": requests,
    }
    fit = fit_step_time(trace["cost"], steps)
    print(header(info))
    print(f"{len(requests)} requests, {len(steps)} steps in {wall:.1f} s; step time "
          f"{fit}")
    write_json(args.out, trace)


if __name__ == "__main__":
    main()
