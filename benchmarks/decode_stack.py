"""A decode step's layers in one native call (`entropic.decode_layers_`) against the Python
layer loop, on the same int4 model, side by side.

    python benchmarks/decode_stack.py [--rounds 5] [--new-tokens 128] [--batch 1] [--threads 2]

The default model with `quantization="int4"` (the CLI's default at batch 1), native kernels,
prefix caching off; --batch ShareGPT first turns (chat-templated), greedy, EOS ignored. Each
round runs the same requests twice, once with `model.fused_decode` on and once off, in
alternating order; the figure is decode tok/s per request (tokens after the first over their
time, as benchmarks/peers.py), averaged over the batch, with the median over rounds and the
median per-round ratio fused/loop. Both give the same tokens (tests/test_quantization.py
checks the bits); the run checks the token ids too.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from entropic import LLM, SamplingParams
from entropic.bench.datasets import chat_prompt_ids
from entropic.bench.machine import add_common_args, describe, header, write_json


def decode_tok_s(outs) -> float:
    """Mean over requests of (tokens after the first) / (their time)."""
    rates = []
    for o in outs:
        tt = o.metrics.token_times
        rates.append((len(tt) - 1) / (tt[-1] - tt[0]))
    return statistics.fmean(rates)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, help="requests at once")
    add_common_args(ap, out="results/decode_stack.json", quick=None)
    a = ap.parse_args(argv)
    for name in ("rounds", "new_tokens", "batch"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    torch.set_num_threads(a.threads)
    llm = LLM(model=a.model, quantization="int4", max_num_seqs=max(a.batch, 4),
              enable_prefix_caching=False)  # the same prompts every round
    model = llm.engine.model
    if not model.fused_decode:
        raise SystemExit("this model or CPU level has no fused decode stack (it needs "
                         "entropic's int4 linears on every projection)")
    prompts = chat_prompt_ids(llm.tokenizer, a.batch)
    params = SamplingParams(max_tokens=a.new_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    res: dict[str, list[float]] = {"fused": [], "loop": []}
    ids: dict[str, list] = {}
    for r in range(a.rounds):
        order = ("fused", "loop") if r % 2 == 0 else ("loop", "fused")
        for name in order:
            model.fused_decode = name == "fused"
            outs = llm.generate(prompts, params)
            res[name].append(decode_tok_s(outs))
            ids.setdefault(name, [o.token_ids for o in outs])
        print(f"round {r + 1}: fused {res['fused'][-1]:.1f}  loop {res['loop'][-1]:.1f} tok/s",
              flush=True)
    model.fused_decode = True
    ratios = [f / lp for f, lp in zip(res["fused"], res["loop"])]
    machine = describe(a.threads)
    summary = {"fused_tok_s": statistics.median(res["fused"]),
               "loop_tok_s": statistics.median(res["loop"]),
               "median_ratio": statistics.median(ratios), "per_round": ratios,
               "same_ids": ids["fused"] == ids["loop"]}
    print(header(machine))
    print(f"| batch | fused decode tok/s | loop decode tok/s | fused / loop (median of rounds) "
          f"| same ids |\n|---:|---:|---:|---:|---|\n| {a.batch} | {summary['fused_tok_s']:.1f} "
          f"| {summary['loop_tok_s']:.1f} | {summary['median_ratio']:.3f} "
          f"({', '.join(f'{x:.2f}' for x in ratios)}) | {summary['same_ids']} |")
    write_json(a.out, {"machine": machine, "options": vars(a) | {"model": str(a.model)},
                       "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "samples": res, "summary": summary})
    if not summary["same_ids"]:
        raise SystemExit("the fused and loop runs gave different tokens")


if __name__ == "__main__":
    main()
