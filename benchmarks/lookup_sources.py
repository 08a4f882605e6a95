"""Would drafts from other requests' text add to prompt lookup? An offline count.

    python benchmarks/lookup_sources.py [--n 16] [--max-tokens 128] [--out FILE]

Generates greedy outputs for the five workloads of benchmarks/speculative.py (n prompts
each, interleaved: xsum, aclsum, code, quote, chat, xsum, ...), then replays each output
token by token as a drafter would see it, without the model:
- own: prompt lookup over the request's own prompt and output (entropic's NgramProposer,
  n = 1..5, k = 8 tokens);
- own + shared: where the request's own lookup finds nothing, the latest continuation of
  its longest suffix (n = 2..5, or 3..5) in the prompts and outputs of the requests that
  finished before it (a cross-request n-gram table, as llama.cpp's dynamic lookup cache).
A drafted token counts as accepted while it equals the greedy output; each step commits the
accepted tokens plus one. Prints tokens per forward pass (steps are forward passes),
drafted and accepted tokens, and the shared table's share; writes a JSON file. No timing:
the count says how many more tokens a step could commit, the upper bound of the gain.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import speculative as spec  # the speculation benchmark's workloads and engine (same folder)
import torch

from entropic import LLM
from entropic.bench.machine import add_common_args, describe, write_json
from entropic.speculative.ngram import NgramProposer

K = 8
SHARED_MAX = 5


def replay(prompts: list[list[int]], outs: list[list[int]], shared_min: int | None) -> dict:
    own = NgramProposer(1, 5)
    table: dict[tuple[int, ...], list[int]] = {}
    steps = tokens = drafted = accepted = shared_drafted = shared_accepted = 0
    for i, (p, o) in enumerate(zip(prompts, outs)):
        t = 0
        while t < len(o):
            seq = p + o[:t]
            draft, _ = own.propose(f"r{i}", seq, K)
            shared = False
            if not draft and shared_min is not None:
                for n in range(SHARED_MAX, shared_min - 1, -1):
                    nxt = table.get(tuple(seq[-n:]))
                    if nxt:
                        draft, shared = nxt[:K], True
                        break
            a = 0
            while a < len(draft) and t + a < len(o) and draft[a] == o[t + a]:
                a += 1
            committed = min(a + 1, len(o) - t)
            steps += 1
            tokens += committed
            drafted += len(draft)
            accepted += a
            if shared:
                shared_drafted += len(draft)
                shared_accepted += a
            t += committed
        if shared_min is not None:
            full = p + o
            for end in range(1, len(full)):
                for n in range(shared_min, SHARED_MAX + 1):
                    if end >= n:
                        table[tuple(full[end - n:end])] = full[end:end + K]
    return {"tokens_per_forward": tokens / steps, "steps": steps, "drafted": drafted,
            "accepted": accepted, "shared_drafted": shared_drafted,
            "shared_accepted": shared_accepted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, out=str(Path(__file__).resolve().parent / "results"
                                / "lookup_sources.json"), quick=None)
    ap.add_argument("--n", type=int, default=16, help="prompts per workload (at most 16)")
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    llm = LLM(model=a.model, enable_prefix_caching=False)
    sets = spec.workloads(llm.tokenizer, a.n)
    names = [k for k in sets if k != "mixed"]
    prompts = [sets[names[i % len(names)]][i // len(names)] for i in range(a.n * len(names))]
    engine = spec.make_engine(llm, "off", 8, K)
    outs = spec.run_set(engine, prompts, 0.0, a.max_tokens)["ids"]
    result = {"machine": describe(a.threads), "workloads": names, "n": a.n,
              "max_tokens": a.max_tokens, "k": K,
              "own": replay(prompts, outs, None),
              "own+shared(2..5)": replay(prompts, outs, 2),
              "own+shared(3..5)": replay(prompts, outs, 3)}
    for name in ("own", "own+shared(2..5)", "own+shared(3..5)"):
        r = result[name]
        print(f"{name:18} tokens/forward {r['tokens_per_forward']:.3f}  drafted {r['drafted']:6d}"
              f"  accepted {r['accepted']:5d}  from the shared table: {r['shared_drafted']:5d}"
              f" drafted, {r['shared_accepted']:4d} accepted")
    write_json(a.out, result)


if __name__ == "__main__":
    main()
