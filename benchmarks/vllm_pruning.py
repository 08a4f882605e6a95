"""Decode time with entropic's block pruning inside vLLM against dense, in one engine.

    VENV/bin/python benchmarks/vllm_pruning.py HF_DIR [--context 3500] [--rows 2]
        [--tokens 32] [--rounds 3]

One `vllm.LLM` with `PruningLogitsProcessor` (fp32, eager, one core: set
VLLM_CPU_OMP_THREADS_BIND=0), prefix caching on, so that after a warm-up each run's prompt
is a cache hit and its time is decode (plus one recomputed token). `rows` greedy requests of
`context` prompt tokens (repository docs, each from its own offset), `tokens` new tokens,
in configurations taken in rotated order within each round: dense (no opt-in), fixed
fractions of the live blocks (gate off) and the default config (entropy law and no-regret
gate). Reported per configuration: median wall time, decode ms per step, the ratio to
dense within each round, the blocks attended (backend counters) and the greedy tokens
equal to dense before the first difference. Writes JSON, with the machine, to --out
(default: stdout, where vLLM's own log lines also go).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

CONFIGS = {
    "dense": None,
    "fixed 0.5": {"adaptive": False, "min_keep_fraction": 0.5, "min_attention_share": 0.0},
    "fixed 0.25": {"adaptive": False, "min_keep_fraction": 0.25, "min_attention_share": 0.0},
    "default": {},
}
DOCS = ("docs/performance.md", "docs/entropy.md", "docs/pruning.md", "docs/scaling.md")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("--context", type=int, default=3500)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from entropic_vllm.pruning import PruningLogitsProcessor
    from entropic_vllm.traces import EXTENSION, fetch_pruning_stats

    fp32_token = 2 * 30 * 3 * 64 * 4
    llm = LLM(model=a.hf_dir, dtype="float32", enforce_eager=True, seed=0, max_num_seqs=a.rows,
              max_model_len=a.context + a.tokens + 128, enable_prefix_caching=True,
              kv_cache_memory_bytes=(a.rows + 1) * (a.context + a.tokens + 256) * fp32_token,
              logits_processors=[PruningLogitsProcessor], worker_extension_cls=EXTENSION)
    tok = llm.get_tokenizer()
    root = Path(__file__).resolve().parents[1]
    text = "\n\n".join((root / p).read_text() for p in DOCS)
    ids = tok.encode(text)
    prompts = [TokensPrompt(prompt_token_ids=ids[i * 500:i * 500 + a.context])
               for i in range(a.rows)]
    assert all(len(p["prompt_token_ids"]) == a.context for p in prompts)

    def run(cfg: dict | None) -> tuple[float, list[list[int]], dict]:
        ps = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True,
                            extra_args=None if cfg is None else {"pruning": cfg})
        fetch_pruning_stats(llm)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, [ps] * a.rows, use_tqdm=False)
        wall = time.perf_counter() - t0
        return wall, [list(o.outputs[0].token_ids) for o in outs], fetch_pruning_stats(llm)

    names = list(CONFIGS)
    for n in names:  # warm-up: the prompts into the prefix cache, each path once
        run(CONFIGS[n])
    walls: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, list[list[int]]] = {}
    stats: dict[str, dict] = {}
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        got = {}
        for n in order:
            got[n], tokens[n], stats[n] = run(CONFIGS[n])
            walls[n].append(got[n])
        for n in names:
            ratios[n].append(got[n] / got["dense"])

    def agree(n: str) -> list[int]:
        return [next((i for i, (x, y) in enumerate(zip(d, p)) if x != y), len(d))
                for d, p in zip(tokens["dense"], tokens[n])]

    from entropic.bench.machine import describe
    steps = a.tokens - 1
    report = {"machine": describe(), "context": a.context, "rows": a.rows, "tokens": a.tokens,
              "rounds": a.rounds, "configs": {}}
    for n in names:
        st = stats[n]
        report["configs"][n] = {
            "median_s": statistics.median(walls[n]),
            "ms_per_step": statistics.median(walls[n]) / steps * 1e3,
            "x_dense_median": statistics.median(ratios[n]),
            "x_dense_range": [min(ratios[n]), max(ratios[n])],
            "blocks_attended": (st["blocks_attended"] / st["blocks_live"]
                                if st.get("blocks_live") else 1.0),
            "pruned_decodes": st.get("pruned_decodes", 0), "decodes": st.get("decodes", 0),
            "equal_to_dense_before_first_difference": agree(n)}
    text = json.dumps(report, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
