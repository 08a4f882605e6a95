"""Batch-1 decode speed at long contexts: one request continuing a long document.

    python benchmarks/long_decode.py [--contexts 1024 4096 7936] [--new-tokens 64] [--repeats 3]
                                     [--quantization int4] [--threads 2]

The default model (int4 by default: the CLI's choice at batch 1), one ACLSum paper body cut
to each context length, greedy, EOS ignored. The prompt is computed once and then read from
the prefix cache, so each timed request is its decode: the figure is tokens after the first
over their time (as benchmarks/peers.py's batch-1 figure), the median over repeats. At these
lengths the step is mostly decode attention (docs/performance.md). To compare two builds,
run this in turn with each (a copy of `src` on PYTHONPATH).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from entropic import LLM, SamplingParams
from entropic.bench.datasets import load_longdocs
from entropic.bench.machine import add_common_args, describe, header, write_json


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096, 7936])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantization", choices=("int4", "int8", "none"), default="int4",
                    help="none: LLM()'s floats")
    add_common_args(ap, out="results/long_decode.json", quick=None)
    a = ap.parse_args(argv)
    for name in ("new_tokens", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    torch.set_num_threads(a.threads)
    llm = LLM(model=a.model, quantization=None if a.quantization == "none" else a.quantization,
              enable_prefix_caching=True)  # the prompt once, then from the cache
    limit = llm.engine.max_model_len - a.new_tokens - 1
    if any(not 1 <= L <= limit for L in a.contexts):
        ap.error(f"--contexts must be in 1..{limit} (the context length less the new tokens)")
    doc = max(load_longdocs("paper"), key=lambda d: len(d["text"]))
    ids = llm.tokenizer.encode(doc["text"])
    if len(ids) < max(a.contexts):
        ap.error(f"the longest document has {len(ids)} tokens, fewer than {max(a.contexts)}")
    params = SamplingParams(max_tokens=a.new_tokens + 1, temperature=0, ignore_eos=True)
    rows = []
    for L in a.contexts:
        prompt = ids[:L]
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        rates = []
        for _ in range(a.repeats):
            (out,) = llm.generate([prompt], params)
            tt = out.metrics.token_times
            rates.append((len(tt) - 1) / (tt[-1] - tt[0]))
        rows.append({"context": L, "decode_tok_s": statistics.median(rates), "repeats": rates})
        print(f"context {L}: {rows[-1]['decode_tok_s']:.1f} tok/s "
              f"({', '.join(f'{r:.1f}' for r in rates)})", flush=True)
    machine = describe(a.threads)
    print(header(machine))
    print("| context | decode tok/s (median) | repeats |\n|---:|---:|---|")
    for r in rows:
        print(f"| {r['context']} | {r['decode_tok_s']:.1f} | "
              f"{', '.join(f'{x:.1f}' for x in r['repeats'])} |")
    write_json(a.out, {"machine": machine, "options": vars(a) | {"model": str(a.model)},
                       "document": doc["id"], "rows": rows})


if __name__ == "__main__":
    main()
