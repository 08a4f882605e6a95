"""Entropic KV-block pruning on long documents: speed, FLOPs and KV bytes, quality.

    python benchmarks/pruning.py [--quick] [--threads 1] [--out results/pruning.json]

Three parts, all greedy, on SmolLM2-135M-Instruct bf16:
1. Teacher-forced continuation (ACLSum paper bodies, Shakespeare acts; contexts of 1k, 2k,
   4k, 8k tokens): the first L tokens of a document are the prompt, the next C are forced.
   Per configuration: decode tokens/s (1 / median inter-token time, batch 1), attention
   FLOPs and KV bytes read by the decode steps, the share of live blocks skipped, the
   perplexity of the held-back continuation, and the mean KL(dense || pruned) of the
   next-token distributions. The dense prefill runs once per document and context; its KV
   blocks go into each configuration's prefix cache (entropic.bench.forking), where the
   request finds them: each engine computes only the prompt's tail, densely, so only
   decode steps differ.
2. Summaries: each paper excerpt (L tokens) summarised in chat form, 96 tokens; ROUGE-L of
   the pruned summary against the dense one (and of both against the paper's abstract).
3. Eviction under a fixed KV budget: chat summaries of N paper excerpts at once with the
   cache holding ~half of what they need; dense (preemption by recompute), pruned, and
   pruned with eviction. Peak and mean concurrency, preemptions, evicted blocks, wall
   time, output tokens/s, ROUGE-L against unconstrained dense outputs.
Prints Markdown tables and writes JSON.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from rouge_score import rouge_scorer

from entropic import LLM, SamplingParams
from entropic.bench.datasets import load_longdocs
from entropic.bench.forking import PrefilledPrompt, TeacherForcer
from entropic.bench.machine import add_common_args, describe, header, write_json
from entropic.control.pruning import EntropicBlockPruner, PruningConfig
from entropic.engine.engine import LLMEngine

BLOCK = 16


def _ungated(**kw) -> PruningConfig:
    """A configuration with the no-regret gate off: the mechanism itself, at every context
    (decodes only: the prompt's tail is prefilled densely, so only decode steps differ)."""
    return PruningConfig(min_attention_share=0.0, prefill_delta=None, **kw)


CONFIGS = {
    "dense": None,
    "mass rho=0.5": _ungated(score="mass", min_keep_fraction=0.5),
    "mass rho=0.25": _ungated(score="mass", min_keep_fraction=0.25),
    "mass rho=0.125": _ungated(score="mass", min_keep_fraction=0.125),
    "surprisal rho=0.25": _ungated(score="surprisal", min_keep_fraction=0.25),
    "hybrid rho=0.25": _ungated(score="hybrid", min_keep_fraction=0.25),
    # entropy-blind controls: the same budget at every step
    "mass fixed 0.75": _ungated(score="mass", min_keep_fraction=0.75, adaptive=False),
    "mass fixed 0.5": _ungated(score="mass", min_keep_fraction=0.5, adaptive=False),
    # query-aware: blocks chosen per layer and KV head inside attention by their key bound
    "bound rho=0.25": _ungated(score="bound", min_keep_fraction=0.25),
    "bound fixed 0.5": _ungated(score="bound", min_keep_fraction=0.5, adaptive=False),
    "bound fixed 0.35": _ungated(score="bound", min_keep_fraction=0.35, adaptive=False),
    "bound fixed 0.25": _ungated(score="bound", min_keep_fraction=0.25, adaptive=False),
    "bound fixed 0.125": _ungated(score="bound", min_keep_fraction=0.125, adaptive=False),
    # the defaults, no-regret gate included
    "default": PruningConfig(),
}
DEFAULT_CONFIGS = ("dense", "mass rho=0.25", "mass fixed 0.5", "surprisal rho=0.25",
                   "bound rho=0.25", "bound fixed 0.5", "bound fixed 0.25", "default")
QUICK_CONFIGS = ("dense", "mass rho=0.25", "bound rho=0.25", "default")


def engine_for(llm: LLM, cfg: PruningConfig | None, processors=(), **limits) -> LLMEngine:
    """A fresh engine over the loaded weights with this pruning configuration."""
    from dataclasses import replace
    config = replace(llm.engine.config, **limits)
    pruner = EntropicBlockPruner(cfg, BLOCK) if cfg is not None else None
    return LLMEngine(llm.engine.model, llm.tokenizer, config, processors=processors,
                     block_policy=pruner)


def median_gap(times: list[float]) -> float:
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def decode_from(pre: PrefilledPrompt, eng: LLMEngine, params: SamplingParams) -> dict:
    """Decode a prefilled prompt to the end on `eng`; decode-only counters (the first step
    computes the prompt's tail and samples the first token, the same in every
    configuration: not counted)."""
    pre.start_in(eng, "x", params)
    outs = []
    while not outs:
        outs = eng.step()
    st = eng.stats
    attn, kv = st.cost.flops_attention, st.cost.kv_bytes_read
    live, kept = st.decode_blocks_live, st.decode_blocks_attended
    (out,) = [o for o in outs if o.finished] or eng.run_until_done()
    live, kept = st.decode_blocks_live - live, st.decode_blocks_attended - kept
    return {"out": out, "tok_s": 1.0 / median_gap(out.metrics.token_times),
            "attn_gflop": (st.cost.flops_attention - attn) / 1e9,
            "kv_gb": (st.cost.kv_bytes_read - kv) / 1e9,
            "pruned": 1.0 - kept / live if live else 0.0}


# ---- part 1: teacher-forced continuation ------------------------------------------------
def forced(llm: LLM, docs: list[dict], contexts: list[int], cont: int, configs: list[str],
           log) -> list[dict]:
    rows = []
    for doc in docs:
        ids = llm.tokenizer.encode(doc["text"])
        for L in contexts:
            if len(ids) < L + cont:
                continue
            prompt, target = ids[:L], ids[L:L + cont]
            need = -(-(L + cont) // BLOCK) + 1
            forcer = TeacherForcer(keep_distributions=True)
            forcer.targets = {"prefill": target, "x": target}
            sp = SamplingParams(max_tokens=cont, temperature=0, ignore_eos=True, logprobs=0)
            pre_eng = engine_for(llm, None, [forcer], num_kv_blocks=need)
            pre = PrefilledPrompt.run(pre_eng, prompt, SamplingParams(
                max_tokens=cont, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0))
            del pre_eng
            dense_logp = None
            for name in configs:
                forcer.logps = {}
                eng = engine_for(llm, CONFIGS[name], [forcer], num_kv_blocks=need)
                r = decode_from(pre, eng, sp)
                # steps 1..cont-1: step 0 (the first token, from the prompt's last row) is
                # computed densely in every configuration
                logp = torch.stack(forcer.logps["x"][1:])
                nll = [-lp.logprob for lp in r["out"].logprobs[1:]]
                kl = 0.0
                if name == "dense":
                    dense_logp = logp
                else:
                    kl = float((dense_logp.exp() * (dense_logp - logp)).sum(-1).mean())
                row = {"doc": doc["id"], "kind": doc["kind"], "context": L, "config": name,
                       "tok_s": r["tok_s"], "attn_gflop": r["attn_gflop"], "kv_gb": r["kv_gb"],
                       "pruned": r["pruned"], "ppl": math.exp(sum(nll) / len(nll)), "kl": kl}
                rows.append(row)
                log(f"  {doc['id']:>20} L={L:5d} {name:>20}: {r['tok_s']:6.1f} tok/s "
                    f"pruned {r['pruned']:.2f} ppl {row['ppl']:7.2f} kl {kl:.4f}")
                del eng
    return rows


# ---- part 5: decode speed in alternating rounds -------------------------------------------
def speed(llm: LLM, docs: list[dict], contexts: list[int], batches: list[int], steps: int,
          rounds: int, configs: list[str], log) -> list[dict]:
    """Greedy decode of `batch` prefilled documents at once, each configuration in turn,
    rounds rotating the order: per round and configuration, decode tokens/s (batch / the
    median step time); the ratio to dense is taken within each round, then the median."""
    sp = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    rows = []
    for L in contexts:
        for batch in batches:
            prompts = [llm.tokenizer.encode(d["text"])[:L] for d in docs[:batch]]
            need = batch * (-(-(L + steps) // BLOCK) + 1)
            # prompt scores too: a surprisal-ranking configuration starts on the prefilled
            # blocks only where they carry their positions' surprisal
            pres = [PrefilledPrompt.run(engine_for(llm, None, num_kv_blocks=need), p,
                                        SamplingParams(max_tokens=steps, temperature=0,
                                                       prompt_logprobs=0))
                    for p in prompts]
            engines = {n: engine_for(llm, CONFIGS[n], num_kv_blocks=need,
                                     max_num_seqs=max(batch, 1)) for n in configs}
            per_round = []
            for r in range(rounds):
                order = configs[r % len(configs):] + configs[:r % len(configs)]
                got = {}
                for name in order:
                    eng = engines[name]
                    before = eng.stats.decode_blocks_live, eng.stats.decode_blocks_attended
                    for i, pre in enumerate(pres):
                        pre.start_in(eng, f"s{r}-{i}", sp)
                    outs = eng.run_until_done()
                    gap = statistics.median(median_gap(o.metrics.token_times) for o in outs)
                    live = eng.stats.decode_blocks_live - before[0]
                    kept = eng.stats.decode_blocks_attended - before[1]
                    got[name] = (batch / gap, 1 - kept / live if live else 0.0)
                per_round.append(got)
            for name in configs:
                tok = [g[name][0] for g in per_round]
                ratio = [g[name][0] / g["dense"][0] for g in per_round]
                row = {"context": L, "batch": batch, "config": name,
                       "tok_s": statistics.median(tok), "x_dense": statistics.median(ratio),
                       "ratio_min": min(ratio), "ratio_max": max(ratio),
                       "pruned": per_round[-1][name][1], "rounds": rounds}
                rows.append(row)
                log(f"  L={L:5d} batch {batch:2d} {name:>18}: {row['tok_s']:6.1f} tok/s "
                    f"{row['x_dense']:.2f}x dense [{row['ratio_min']:.2f}, "
                    f"{row['ratio_max']:.2f}] pruned {row['pruned']:.2f}")
            del engines, pres
    return rows


def speed_table(rows: list[dict]) -> str:
    out = ["| context | batch | config | decode tok/s | x dense (median, [min, max] over rounds) "
           "| blocks skipped |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['context']} | {r['batch']} | {r['config']} | {r['tok_s']:.1f} | "
                   f"{r['x_dense']:.2f}x [{r['ratio_min']:.2f}, {r['ratio_max']:.2f}] | "
                   f"{r['pruned']:.2f} |")
    return "\n".join(out)


# ---- part 2: summaries ------------------------------------------------------------------
def summary_prompt(llm: LLM, text: str, L: int) -> list[int]:
    body = llm.tokenizer.decode(llm.tokenizer.encode(text)[:L])
    msg = "Summarize the main contribution of this paper in three sentences.\n\n" + body
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": msg}])


def summaries(llm: LLM, papers: list[dict], contexts: list[int], max_tokens: int,
              configs: list[str], log) -> list[dict]:
    rouge = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    rows = []
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0)
    for doc in papers:
        for L in contexts:
            prompt = summary_prompt(llm, doc["text"], L)
            need = -(-(len(prompt) + max_tokens) // BLOCK) + 1
            pre = PrefilledPrompt.run(engine_for(llm, None, num_kv_blocks=need), prompt,
                                      SamplingParams(max_tokens=max_tokens, temperature=0,
                                                     logprobs=0, prompt_logprobs=0))
            dense_text = None
            for name in configs:
                r = decode_from(pre, engine_for(llm, CONFIGS[name], num_kv_blocks=need), sp)
                text = llm.tokenizer.decode(r["out"].token_ids)
                if name == "dense":
                    dense_text = text
                row = {"doc": doc["id"], "context": L, "config": name, "tok_s": r["tok_s"],
                       "pruned": r["pruned"],
                       "rougeL_vs_dense": rouge.score(dense_text, text)["rougeL"].fmeasure,
                       "rougeL_vs_abstract": rouge.score(doc["reference"], text)["rougeL"].fmeasure,
                       "text": text}
                rows.append(row)
                log(f"  {doc['id']:>20} L={L:5d} {name:>20}: rougeL vs dense "
                    f"{row['rougeL_vs_dense']:.3f}")
    return rows


# ---- part 3: eviction -------------------------------------------------------------------
def eviction(llm: LLM, papers: list[dict], n: int, L: int, max_tokens: int, log) -> list[dict]:
    rouge = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    prompts = [summary_prompt(llm, papers[i % len(papers)]["text"][(i // len(papers)) * 500:], L)
               for i in range(n)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    full = sum(-(-(len(p) + max_tokens) // BLOCK) for p in prompts)
    tight = full // 2
    runs = [("dense, unconstrained", None, full + n), ("dense", None, tight),
            ("mass rho=0.25", CONFIGS["mass rho=0.25"], tight),
            ("mass rho=0.25 + evict",
             _ungated(score="mass", min_keep_fraction=0.25, evict=True), tight)]
    rows, ref = [], None
    for name, cfg, blocks in runs:
        eng = engine_for(llm, cfg, num_kv_blocks=blocks, max_num_seqs=n)
        for i, p in enumerate(prompts):
            eng.add_request(f"e{i}", p, sp)
        conc, outs = [], {}
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o
            conc.append(len(eng.scheduler.running))
        wall = time.perf_counter() - t0
        texts = [llm.tokenizer.decode(outs[f"e{i}"].token_ids) for i in range(n)]
        if ref is None:
            ref = texts
        rl = statistics.mean(rouge.score(a, b)["rougeL"].fmeasure for a, b in zip(ref, texts))
        st = eng.stats
        row = {"config": name, "kv_blocks": blocks, "wall_s": wall,
               "out_tok_s": n * max_tokens / wall, "peak_running": max(conc),
               "mean_running": statistics.mean(conc), "preemptions": st.preemptions,
               "evicted_blocks": st.blocks_evicted, "pruned": st.pruned_fraction,
               "rougeL_vs_unconstrained": rl}
        rows.append(row)
        log(f"  {name:>24}: {wall:6.1f} s, peak {row['peak_running']} running, "
            f"{st.preemptions} preemptions, {st.blocks_evicted} evicted, rougeL {rl:.3f}")
    return rows


# ---- part 4: what scoring the prompt costs (surprisal and hybrid need it) ---------------
def scoring_cost(llm: LLM, doc: dict, contexts: list[int], repeats: int, log) -> list[dict]:
    """Prefill time with and without teacher-forced prompt scoring, interleaved."""
    rows = []
    ids = llm.tokenizer.encode(doc["text"])
    for L in contexts:
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):
            for scored in (False, True):
                eng = engine_for(llm, None, num_kv_blocks=-(-L // BLOCK) + 2)
                sp = SamplingParams(max_tokens=1, temperature=0,
                                    prompt_logprobs=0 if scored else None)
                t = time.perf_counter()
                eng.add_request("p", ids[:L], sp)
                eng.run_until_done()
                times[scored].append(time.perf_counter() - t)
        plain, scored = statistics.median(times[False]), statistics.median(times[True])
        rows.append({"context": L, "prefill_s": plain, "prefill_scored_s": scored,
                     "ratio": scored / plain})
        log(f"  L={L}: prefill {plain:.2f} s, with prompt scoring {scored:.2f} s "
            f"({scored / plain:.2f}x)")
    return rows


# ---- report -----------------------------------------------------------------------------
def forced_table(rows: list[dict], configs: list[str]) -> str:
    out = ["| context | config | decode tok/s (x dense) | attention GFLOP (x dense) | "
           "KV GB read (x dense) | blocks skipped | perplexity (dense) | KL vs dense |",
           "|---|---|---|---|---|---|---|---|"]
    for L in sorted({r["context"] for r in rows}):
        at = [r for r in rows if r["context"] == L]
        base = {r["doc"]: r for r in at if r["config"] == "dense"}
        for name in configs:
            rs = [r for r in at if r["config"] == name]
            if not rs:
                continue
            med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
            ratio = lambda k: statistics.median(r[k] / base[r["doc"]][k] for r in rs)  # noqa: E731
            out.append(f"| {L} | {name} | {med('tok_s'):.1f} ({ratio('tok_s'):.2f}x) | "
                       f"{med('attn_gflop'):.2f} ({ratio('attn_gflop'):.2f}x) | "
                       f"{med('kv_gb'):.2f} ({ratio('kv_gb'):.2f}x) | {med('pruned'):.2f} | "
                       f"{med('ppl'):.2f} ({statistics.median(base[r['doc']]['ppl'] for r in rs):.2f})"
                       f" | {med('kl'):.4f} |")
    return "\n".join(out)


def summary_table(rows: list[dict], configs: list[str]) -> str:
    out = ["| context | config | ROUGE-L vs dense | ROUGE-L vs abstract | blocks skipped |",
           "|---|---|---|---|---|"]
    for L in sorted({r["context"] for r in rows}):
        for name in configs:
            rs = [r for r in rows if r["context"] == L and r["config"] == name]
            if rs:
                out.append(f"| {L} | {name} | "
                           f"{statistics.mean(r['rougeL_vs_dense'] for r in rs):.3f} | "
                           f"{statistics.mean(r['rougeL_vs_abstract'] for r in rs):.3f} | "
                           f"{statistics.mean(r['pruned'] for r in rs):.2f} |")
    return "\n".join(out)


def eviction_table(rows: list[dict]) -> str:
    out = ["| config | KV blocks | wall s | output tok/s | peak / mean running | preemptions | "
           "evicted blocks | ROUGE-L vs unconstrained |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['config']} | {r['kv_blocks']} | {r['wall_s']:.1f} | "
                   f"{r['out_tok_s']:.1f} | {r['peak_running']} / {r['mean_running']:.1f} | "
                   f"{r['preemptions']} | {r['evicted_blocks']} | "
                   f"{r['rougeL_vs_unconstrained']:.3f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, threads=1, out="results/pruning.json",
                    quick="1k/2k contexts, 3 configs (~5 min)")
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=None,
                    help="configurations (dense first); default: all but the fixed controls")
    ap.add_argument("--contexts", nargs="+", type=int, default=None)
    ap.add_argument("--parts", nargs="+", default=["forced", "summaries", "eviction", "scoring"],
                    choices=["forced", "summaries", "eviction", "scoring", "speed"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4],
                    help="speed part: decode rows at once")
    ap.add_argument("--rounds", type=int, default=3, help="speed part: alternating rounds")
    ap.add_argument("--steps", type=int, default=32, help="speed part: tokens decoded")
    ap.add_argument("--quantization", choices=("int4", "int8"), default=None,
                    help="weight-only quantized projections (default: the model's dtype)")
    args = ap.parse_args()
    if args.threads < 1:
        ap.error("--threads must be at least 1")
    torch.set_num_threads(args.threads)
    log = lambda s: print(s, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    # on: each configuration finds the dense prefill's blocks in its cache (the docstring)
    llm = LLM(model=args.model, quantization=args.quantization, max_num_batched_tokens=2048,
              num_kv_blocks=16, enable_prefix_caching=True)
    machine = describe(args.threads)
    log(header(machine))
    papers, plays = load_longdocs("paper"), load_longdocs("play")
    if args.quick:
        configs, contexts, cont = list(QUICK_CONFIGS), [1024, 2048], 24
        docs, sum_papers, sum_ctx, ev = [papers[0], plays[0]], papers[:1], [1024], (4, 600, 48)
    else:
        configs, contexts, cont = list(DEFAULT_CONFIGS), [1024, 2048, 4096, 8000], 48
        docs, sum_papers, sum_ctx, ev = (papers[:2] + plays[:2], papers, [2048, 4096],
                                         (8, 1200, 96))
    if args.configs:
        if args.configs[0] != "dense":
            ap.error("--configs: the first configuration must be dense (the reference)")
        configs = args.configs
    contexts = args.contexts or contexts
    limit = llm.engine.max_model_len - cont
    if any(not 0 < L <= limit for L in contexts):
        ap.error(f"--contexts must be in 1..{limit} (the context length less {cont} "
                 f"continuation tokens), got {contexts}")
    forced_rows = sum_rows = ev_rows = sc_rows = speed_rows = []
    tables = []
    if "forced" in args.parts:
        log("## part 1: teacher-forced continuation")
        forced_rows = forced(llm, docs, contexts, cont, configs, log)
        tables.append(forced_table(forced_rows, configs))
    if "summaries" in args.parts:
        log("## part 2: summaries")
        sum_rows = summaries(llm, sum_papers, sum_ctx, 96, configs, log)
        tables.append(summary_table(sum_rows, configs))
    if "eviction" in args.parts:
        log("## part 3: eviction under a fixed KV budget")
        ev_rows = eviction(llm, papers, *ev, log)
        tables.append(eviction_table(ev_rows))
    if "scoring" in args.parts:
        log("## part 4: prompt scoring cost")
        sc_rows = scoring_cost(llm, plays[0], contexts, 1 if args.quick else 3, log)
        tables.append("| context | prefill s | with prompt scoring s | ratio |\n|---|---|---|---|\n"
                      + "\n".join(f"| {r['context']} | {r['prefill_s']:.2f} | "
                                  f"{r['prefill_scored_s']:.2f} | {r['ratio']:.2f}x |"
                                  for r in sc_rows))
    if "speed" in args.parts:
        log("## part 5: decode speed, configurations in alternating rounds")
        speed_rows = speed(llm, papers + plays, contexts, args.batches, args.steps, args.rounds,
                           configs, log)
        tables.append(speed_table(speed_rows))
    report = "\n\n".join(tables)
    print("\n" + header(machine) + "\n\n" + report)
    meta = {"machine": machine, "threads": args.threads, "quick": args.quick,
            "quantization": args.quantization, "continuation_tokens": cont,
            "wall_s": time.perf_counter() - t0, "configs": {k: repr(CONFIGS[k]) for k in configs}}
    write_json(args.out, {"meta": meta, "forced": forced_rows, "summaries": sum_rows,
                          "eviction": ev_rows, "scoring": sc_rows, "speed": speed_rows,
                          "report": report})
    log(f"{meta['wall_s']:.0f} s in all")


if __name__ == "__main__":
    main()
