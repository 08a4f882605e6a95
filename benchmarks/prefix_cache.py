"""Prefix caching, on against off: time to first token and throughput.

    PYTHONPATH=src python3 benchmarks/prefix_cache.py                 # ~3-6 min on 2 cores
    PYTHONPATH=src python3 benchmarks/prefix_cache.py --quick         # smoke run

Two workloads on the default model (SmolLM2-135M-Instruct, default dtype):
- chat: --conversations multi-turn chats run side by side; each turn resends the whole
  conversation (chat template, greedy replies of at most --max-tokens tokens). The user
  turns are ShareGPT first turns (entropic.bench.datasets holds first turns only): the
  first cut to --first-chars characters, the follow-ups (other prompts) to --turn-chars,
  as a chat's follow-ups are usually shorter than its opening. TTFT per turn; turn 1 has
  nothing cached.
- system: --requests requests submitted at once, each a shared ~--system-tokens-token system
  prompt (ShareGPT text) plus its own ShareGPT question; TTFT and output tokens per second.

Cache on and off run in alternating rounds (on/off, then off/on, ...) in one process, each
run on a fresh engine over the same loaded model (an empty cache), so that load on a shared
machine falls on both alike; figures are medians over rounds, and ratios off/on. Greedy
outputs with and without the cache are compared token by token. The JSON goes to --out.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace

import torch

from entropic import LLM, SamplingParams
from entropic.bench.machine import add_common_args, describe, header, write_json
from entropic.bench.datasets import load_sharegpt_prompts
from entropic.bench.workloads import (add_prefix_workload_args, chat_conversations,
                                      shared_system_prompts)
from entropic.engine.engine import LLMEngine


def fresh_engine(llm: LLM, caching: bool) -> LLMEngine:
    e = llm.engine
    return LLMEngine(e.model, e.tokenizer, replace(e.config, enable_prefix_caching=caching))


def run_batch(eng: LLMEngine, prompts: list[list[int]], sp: SamplingParams, tag: str):
    """Submit all at once, run to the end; outputs in prompt order and the wall time."""
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", p, sp, arrival_time=t0)
    outs = {o.request_id: o for o in eng.run_until_done()}
    return [outs[f"{tag}-{i}"] for i in range(len(prompts))], time.perf_counter() - t0


def chat_run(llm: LLM, caching: bool, convs: list[list[str]], max_tokens: int) -> dict:
    eng = fresh_engine(llm, caching)
    tok = llm.tokenizer
    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    msgs = [[] for _ in convs]
    ttft = {}  # turn -> list of seconds
    tokens, prompt_tokens, wall = [], 0, 0.0
    for t in range(len(convs[0])):
        for m, c in zip(msgs, convs):
            m.append({"role": "user", "content": c[t]})
        prompts = [tok.apply_chat_template(m) for m in msgs]
        prompt_tokens += sum(map(len, prompts))
        outs, secs = run_batch(eng, prompts, sp, f"t{t}")
        wall += secs
        ttft[t + 1] = [o.metrics.ttft for o in outs]
        for m, o in zip(msgs, outs):
            m.append({"role": "assistant", "content": o.text})
        tokens += [o.token_ids for o in outs]
    gen = sum(map(len, tokens))
    return {"ttft": ttft, "tokens": tokens, "wall_s": wall, "prompt_tokens": prompt_tokens,
            "output_tok_s": gen / wall, "hits": eng.stats.prefix_cache_hits,
            "queries": eng.stats.prefix_cache_queries}


def system_run(llm: LLM, caching: bool, prompts: list[list[int]], max_tokens: int) -> dict:
    eng = fresh_engine(llm, caching)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs, wall = run_batch(eng, prompts, sp, "s")
    return {"ttft": [o.metrics.ttft for o in outs], "tokens": [o.token_ids for o in outs],
            "wall_s": wall, "output_tok_s": sum(len(o.token_ids) for o in outs) / wall,
            "hits": eng.stats.prefix_cache_hits, "queries": eng.stats.prefix_cache_queries}


def med(xs):
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_prefix_workload_args(ap)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--only", choices=("chat", "system"), default=None,
                    help="run one of the two workloads")
    add_common_args(ap, out="results/prefix_cache.json",
                    quick="1 round, 2 conversations of 2 turns, 16 requests")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.conversations, args.turns, args.requests = 1, 2, 2, 16
    torch.set_num_threads(args.threads)
    # the cache is switched per run (fresh_engine), on and off in turn
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_gib=0.5, enable_prefix_caching=True)
    machine = describe(args.threads)
    print(header(machine), flush=True)
    tok = llm.tokenizer
    recs = load_sharegpt_prompts(500)
    convs = chat_conversations(recs, args.conversations, args.turns, args.first_chars,
                               args.turn_chars)
    sys_prompts = shared_system_prompts(tok, recs, args.requests, args.system_tokens)

    # warm-up (first calls of kernels and allocators), so that round 0 is not charged it
    run_batch(fresh_engine(llm, False), sys_prompts[:2], SamplingParams(max_tokens=4), "warm")
    kinds = [args.only] if args.only else ["chat", "system"]
    runs = {k: {True: [], False: []} for k in kinds}
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        for caching in order:
            line = f"round {r} cache {'on ' if caching else 'off'}:"
            if "chat" in runs:
                c = chat_run(llm, caching, convs, args.max_tokens)
                runs["chat"][caching].append(c)
                later = med([x for t, v in c["ttft"].items() if t >= 2 for x in v])
                line += f" chat {c['wall_s']:.1f}s (turn>=2 ttft median {later:.3f}s)"
            if "system" in runs:
                s = system_run(llm, caching, sys_prompts, args.system_max_tokens)
                runs["system"][caching].append(s)
                line += f" system {s['wall_s']:.1f}s"
            print(line, flush=True)

    def summary(kind: str, caching: bool) -> dict:
        rs = runs[kind][caching]
        out = {"wall_s": med([x["wall_s"] for x in rs]),
               "output_tok_s": med([x["output_tok_s"] for x in rs]),
               "hit_rate": rs[0]["hits"] / rs[0]["queries"] if rs[0]["queries"] else 0.0}
        if kind == "chat":
            for t in rs[0]["ttft"]:
                out[f"ttft_turn{t}_s"] = med([med(x["ttft"][t]) for x in rs])
            out["ttft_turn2plus_s"] = med([med([v for t, vs in x["ttft"].items() if t >= 2
                                                for v in vs]) for x in rs])
        else:
            out["ttft_median_s"] = med([med(x["ttft"]) for x in rs])
            out["ttft_p90_s"] = med([sorted(x["ttft"])[int(0.9 * len(x["ttft"]))] for x in rs])
        return out

    result = {"machine": machine, "load_avg_end": os.getloadavg(), "dtype": llm.dtype_reason,
              "args": vars(args), "system_prompt_tokens": len(sys_prompts[0])}
    if "chat" in runs:
        result["prompt_tokens_chat_per_run"] = runs["chat"][True][0]["prompt_tokens"]
    for kind in kinds:
        on, off = summary(kind, True), summary(kind, False)
        ratios = {k: off[k] / on[k] for k in on if k.endswith("_s") and on[k]}
        same = sum(a == b for x, y in zip(runs[kind][True], runs[kind][False])
                   for a, b in zip(x["tokens"], y["tokens"]))
        total = sum(len(x["tokens"]) for x in runs[kind][True])
        result[kind] = {"on": on, "off": off, "off_over_on": ratios,
                        "identical_outputs": f"{same}/{total}"}
    write_json(args.out, result)
    for kind in kinds:
        d = result[kind]
        print(f"\n{kind}: outputs identical {d['identical_outputs']}, hit rate "
              f"{d['on']['hit_rate']:.1%}")
        for k in d["on"]:
            if k == "hit_rate":
                continue
            print(f"  {k:22s} on {d['on'][k]:8.3f}  off {d['off'][k]:8.3f}  "
                  f"off/on {d['off'][k] / d['on'][k]:6.2f}")


if __name__ == "__main__":
    main()
