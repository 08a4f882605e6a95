"""What the thermostat costs in decode throughput: fixed T = 1.0 against the thermostat
measuring H^T by one native pass (the default), and against the same thermostat measuring
H^T with the torch ops (log_softmax of logits / T), the path before the native pass.

    python benchmarks/thermostat_cost.py            # 16 rows, 96 tokens, 5 alternating rounds
    python benchmarks/thermostat_cost.py --quick    # 3 rounds of 48 tokens

Every round runs the three configurations one after the other on the same 16 ShareGPT
prompts (ignore_eos, seeded), so the machine's drift hits them alike; the table reports
median decode tok/s (output tokens after the first, over the time after the first token)
and each thermostat's overhead against fixed T. Writes results/thermostat_cost.json.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import entropic.control.thermostat as thermostat_module
from entropic.bench.machine import add_common_args, describe, header, write_json
from entropic import LLM, SamplingParams, ThermostatParams
from entropic.bench.datasets import chat_prompt_ids
from entropic.sampling.sampler import entropy_from_logits, tempered_entropy

ROOT = Path(__file__).resolve().parents[1]


def torch_tempered_entropy(logits, rows, temps, batch):
    """H^T with the torch ops, as the thermostat computed it before the native pass."""
    return entropy_from_logits(logits[rows] / temps[:, None])


def decode_rate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    first = max(o.metrics.first_token_time for o in outs)
    end = max(o.metrics.finished_time for o in outs)
    tokens = sum(len(o.token_ids) - 1 for o in outs)
    assert end > first > t0 - 1
    return tokens / (end - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    add_common_args(ap, out=str(ROOT / "results" / "thermostat_cost.json"),
                    quick="3 rounds of 48 tokens")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.max_tokens = 3, 48
    torch.set_num_threads(args.threads)
    # rounds send the same prompts: no prefix cache, every round computes its prefills
    llm = LLM(model=args.model, max_num_batched_tokens=2048, enable_prefix_caching=False)
    prompts = chat_prompt_ids(llm.tokenizer, args.rows, max_tokens=256)
    th = ThermostatParams(target_entropy=2.0, eta=0.2, t_min=0.2, t_max=2.0)
    configs = {
        "fixed T=1.0": (None, tempered_entropy),
        "thermostat, native H^T": (th, tempered_entropy),
        "thermostat, torch H^T": (th, torch_tempered_entropy),
    }
    rates: dict[str, list[float]] = {k: [] for k in configs}
    decode_rate(llm, prompts[:2], [SamplingParams(max_tokens=8)] * 2)  # warm-up
    for _ in range(args.rounds):
        for name, (thermo, fn) in configs.items():
            thermostat_module.tempered_entropy = fn
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i,
                                     ignore_eos=True, thermostat=thermo)
                      for i in range(len(prompts))]
            rates[name].append(decode_rate(llm, prompts, params))
    thermostat_module.tempered_entropy = tempered_entropy
    base = statistics.median(rates["fixed T=1.0"])
    rows = []
    for name, r in rates.items():
        med = statistics.median(r)
        # per-round ratios against the same round's fixed-T run, then their median
        ratio = statistics.median(a / b for a, b in zip(r, rates["fixed T=1.0"]))
        rows.append({"config": name, "median_tok_s": med, "per_round": r,
                     "overhead_vs_fixed": 1 - ratio})
    machine = describe(args.threads)
    print(header(machine))
    print(f"{len(prompts)} rows x {args.max_tokens} "
          f"tokens, {args.rounds} alternating rounds (default LLM(): {llm.engine.model.dtype})")
    print("| config | decode tok/s (median) | overhead vs fixed T (median of rounds) |")
    print("|---|---:|---:|")
    for row in rows:
        print(f"| {row['config']} | {row['median_tok_s']:.1f} | "
              f"{100 * row['overhead_vs_fixed']:+.1f} % |")
    write_json(args.out, {"machine": machine, "cpu": machine["cpu"], "threads": args.threads,
                          "rows": len(prompts), "max_tokens": args.max_tokens,
                          "rounds": args.rounds, "baseline_tok_s": base, "results": rows})


if __name__ == "__main__":
    main()
