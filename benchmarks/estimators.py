"""Entropy estimators against exact, on real next-token distributions of the default model.

    python benchmarks/estimators.py            # 100 ShareGPT prompts x 32 greedy tokens
    python benchmarks/estimators.py --quick    # 16 prompts x 16 tokens

The logits are captured from the engine while it decodes (greedy, chat template), so they are
the distributions the control laws will see. For each estimator (exact, top-k and top-k with
tail correction, k in --ks) it reports the mean and max absolute error against exact (nats),
the mean signed error (bias), and the cost: median seconds per call on batches of 64 rows
(the decode batch width), and per row. Writes results/estimators.json and prints Markdown.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from entropic import LLM, SamplingParams  # noqa: E402
from entropic.bench.datasets import chat_prompt_ids  # noqa: E402
from entropic.control.estimators import ExactEntropy, TopKEntropy, TopKTailEntropy  # noqa: E402


class LogitsProbe:
    """Sampler-chain element that keeps a copy of every row's logits (changes nothing)."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []

    def apply(self, logits, temperatures, batch):
        self.rows.append(logits.detach().clone())
        return logits, temperatures

    def accept(self, token_ids, batch):
        pass

    def release(self, request_ids):
        pass


def time_call(fn, x: torch.Tensor, repeats: int) -> float:
    fn(x)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ks", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.max_tokens, args.repeats = 16, 16, 5
    probe = LogitsProbe()
    llm = LLM(processors=[probe])
    prompts = chat_prompt_ids(llm.tokenizer, args.prompts)
    llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0))
    logits = torch.cat(probe.rows)
    exact_fn = ExactEntropy()
    exact = exact_fn(logits)
    estimators = [exact_fn] + [cls(k) for k in args.ks for cls in (TopKEntropy, TopKTailEntropy)]
    batch = logits[:64]
    t_exact = time_call(exact_fn, batch, args.repeats)
    results = {}
    for est in estimators:
        err = est(logits) - exact
        t = time_call(est, batch, args.repeats)
        results[est.name] = {
            "mean_abs_err": err.abs().mean().item(), "max_abs_err": err.abs().max().item(),
            "mean_err": err.mean().item(), "ms_per_64_rows": t * 1e3,
            "us_per_row": t / batch.shape[0] * 1e6, "cost_vs_exact": t / t_exact,
        }
    print(f"\n{logits.shape[0]} next-token distributions (vocab {logits.shape[1]}) from "
          f"{len(prompts)} ShareGPT prompts x {args.max_tokens} greedy tokens; exact H: mean "
          f"{exact.mean():.3f}, median {exact.median():.3f} nats; torch threads "
          f"{torch.get_num_threads()}\n")
    cols = ["mean_abs_err", "max_abs_err", "mean_err", "ms_per_64_rows", "us_per_row",
            "cost_vs_exact"]
    print("| estimator | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, r in results.items():
        print(f"| {name} | " + " | ".join(f"{r[c]:.4f}" for c in cols) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"rows": logits.shape[0], "prompts": len(prompts), "max_tokens": args.max_tokens,
            "exact_mean": exact.mean().item(), "command": " ".join(sys.argv)}
    (out / "estimators.json").write_text(json.dumps({"meta": meta, "results": results},
                                                    indent=2))


if __name__ == "__main__":
    main()
