"""Block-sparse prefill (pruning's `prefill_delta`): quality and prefill time on long documents.

    python benchmarks/sparse_prefill.py [--contexts 2048 4096 8000] [--deltas 3] [--rounds 3]
                                        [--docs 4] [--threads 2] [--quick]

The default model (`LLM()`'s dtype for this CPU), the long documents of the pruning benchmark
(ACLSum paper bodies and Shakespeare acts, alternating), prefix caching off. Per document and
context L:
- quality: the first L + 128 tokens as one prompt, scored by teacher forcing
  (`prompt_logprobs=1`), once densely (`PruningConfig(prefill_delta=None)`) and once per
  delta (`PruningConfig(prefill_delta=delta)`, everything else the defaults); over the last
  128 positions: the perplexity of the document's own tokens, and the share of positions
  whose most likely token is the dense run's (top-1 agreement). Every position of the prompt
  is prefilled block-sparsely past the no-regret gate, the scored ones included: a stricter
  test than a decode after a sparse prompt.
- time: the first L tokens as a prompt, one new token (so the wall time is the prefill),
  dense and each delta in turn within a round (the order reversed every other round), over
  `--rounds` rounds; the figure is the median over rounds and documents of dense time /
  sparse time, and the share of (query, key) pairs the sparse prefill attended.
Prints Markdown tables and writes JSON.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from entropic import LLM, SamplingParams
from entropic.bench.datasets import load_longdocs
from entropic.bench.machine import add_common_args, describe, header, write_json
from entropic.control.pruning import PruningConfig

SCORED = 128


def engine_for(model: str | None, delta: float | None) -> LLM:
    return LLM(model=model, pruning=PruningConfig(prefill_delta=delta),
               enable_prefix_caching=False)


def scored(llm: LLM, ids: list[int]) -> tuple[list[float], list[int]]:
    """Log-probabilities of the last SCORED prompt tokens, and each position's top-1 id."""
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    lps, tops = [], []
    for j in range(len(ids) - SCORED, len(ids)):
        entry = out.prompt_logprobs[j]  # the score of token j given the tokens before it
        lps.append(entry.logprob)
        tops.append(max(entry.top, key=entry.top.get))
    return lps, tops


def timed(llm: LLM, ids: list[int]) -> tuple[float, int, int]:
    """Wall time of a prefill of `ids` (one new token), and the prefill pairs attended and
    dense (0, 0 when the prefill ran densely)."""
    st = llm.engine.stats
    a0, d0 = st.prefill_pairs_attended, st.prefill_pairs_dense
    t = time.perf_counter()
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return time.perf_counter() - t, st.prefill_pairs_attended - a0, st.prefill_pairs_dense - d0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", nargs="+", type=int, default=[2048, 4096, 8000])
    ap.add_argument("--deltas", nargs="+", type=float, default=[3.0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--docs", type=int, default=4, help="documents (papers and plays in turn)")
    add_common_args(ap, out="results/sparse_prefill.json",
                    quick="2 documents, contexts 2048 and 4096, 1 round")
    a = ap.parse_args(argv)
    if a.quick:
        a.contexts, a.docs, a.rounds = [2048, 4096], 2, 1
    if a.rounds < 1 or a.docs < 1 or any(d < 0 for d in a.deltas):
        ap.error("--rounds and --docs must be >= 1, --deltas >= 0")
    torch.set_num_threads(a.threads)
    papers, plays = load_longdocs("paper"), load_longdocs("play")
    docs = [d for pair in zip(papers, plays) for d in pair][:a.docs]
    engines = {"dense": engine_for(a.model, None)}
    for delta in a.deltas:
        engines[f"delta {delta:g}"] = engine_for(a.model, delta)
    tok = engines["dense"].tokenizer
    info = describe(a.threads)
    print(header(info))
    names = list(engines)
    quality, timing = [], []
    for L in a.contexts:
        for doc in docs:
            ids = tok.encode(doc["text"])
            if len(ids) < L + SCORED:
                raise SystemExit(f"{doc['id']} has {len(ids)} tokens, fewer than {L + SCORED}")
            ref_lp, ref_top = scored(engines["dense"], ids[:L + SCORED])
            row = {"context": L, "doc": doc["id"], "kind": doc["kind"],
                   "ppl": {"dense": math.exp(-statistics.fmean(ref_lp))}, "top1": {}}
            for name in names[1:]:
                lp, top = scored(engines[name], ids[:L + SCORED])
                row["ppl"][name] = math.exp(-statistics.fmean(lp))
                row["top1"][name] = sum(x == y for x, y in zip(top, ref_top)) / SCORED
            quality.append(row)
            print(L, doc["id"], {k: round(v, 3) for k, v in row["ppl"].items()}, row["top1"],
                  flush=True)
    for r in range(a.rounds):
        for L in a.contexts:
            for doc in docs:
                ids = tok.encode(doc["text"])[:L]
                order = names if r % 2 == 0 else names[::-1]
                res = {name: timed(engines[name], ids) for name in order}
                timing.append({"round": r, "context": L, "doc": doc["id"],
                               "seconds": {n: v[0] for n, v in res.items()},
                               "pairs": {n: [v[1], v[2]] for n, v in res.items()}})
                print("round", r, L, doc["id"],
                      {n: round(v[0], 2) for n, v in res.items()}, flush=True)
    print("\n| context | config | ppl change (mean over docs) | top-1 agreement | pairs attended | "
          "prefill time, dense / this (median) |")
    print("|---|---|---|---|---|---|")
    summary = []
    for L in a.contexts:
        q = [row for row in quality if row["context"] == L]
        t = [row for row in timing if row["context"] == L]
        for name in names[1:]:
            dppl = statistics.fmean(row["ppl"][name] / row["ppl"]["dense"] - 1 for row in q)
            top1 = statistics.fmean(row["top1"][name] for row in q)
            # of all the prompt's pairs: the chunks the gate kept dense attended all theirs
            full = len(t) * L * (L + 1) // 2
            den = sum(row["pairs"][name][1] for row in t)
            share = (sum(row["pairs"][name][0] for row in t) + full - den) / full
            speed = statistics.median(row["seconds"]["dense"] / row["seconds"][name] for row in t)
            summary.append({"context": L, "config": name, "ppl_change": dppl, "top1": top1,
                            "pairs_attended": share, "speedup": speed})
            print(f"| {L} | {name} | {dppl:+.2%} | {top1:.3f} | {share:.2f} | {speed:.2f}x |")
    write_json(a.out, {"machine": info, "args": vars(a), "quality": quality, "timing": timing,
                       "summary": summary})


if __name__ == "__main__":
    main()
