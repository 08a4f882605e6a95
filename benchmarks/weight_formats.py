"""What each weight format costs in fidelity: bf16, int8 and int4 against fp32, same sequences.

    python3 benchmarks/weight_formats.py            # 32 prompts, 64 greedy tokens each
    python3 benchmarks/weight_formats.py --quick    # 6 prompts, 24 tokens

For each ShareGPT first turn (chat template, <= --max-prompt-tokens tokens):
1. fp32 (the reference: it matches transformers' fp32 logits to ~1e-3, tests/test_parity.py)
   decodes --max-tokens greedy tokens, EOS ignored.
2. Every format scores the same sequence (prompt + fp32's continuation) in one teacher-forced
   forward (`entropic.bench.parity.sequence_logits`); per position, against fp32: top-1
   agreement, KL(fp32 || format), |H_format - H_fp32| (the entropy our control laws read),
   and the largest logit difference. Positions: every prompt position after the first, and
   every continuation position.
3. Every format also decodes greedily on its own (free running, through the engine, batch of
   all prompts): the share of sequences identical to fp32's, and the mean length of the
   prefix shared with fp32's before the first different token.
Formats: `LLM(dtype="bfloat16")` (the default), `LLM(quantization="int8")`,
`LLM(quantization="int4")` (the GGUF's Q4_1 codes as they are); on request (--formats)
bf16-torchops and int4-torchops, the same with `kernels="torch"`. Writes results/weight_formats.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from entropic.bench.machine import add_common_args, describe, header, write_json

ROOT = Path(__file__).resolve().parents[1]
FORMATS = {"fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"},
           "int8": {"dtype": "bfloat16", "quantization": "int8"},
           "int4": {"dtype": "bfloat16", "quantization": "int4"},
           # the same formats on plain torch ops instead of entropic's native kernels
           "bf16-torchops": {"dtype": "bfloat16", "kernels": "torch"},
           "int4-torchops": {"dtype": "bfloat16", "quantization": "int4", "kernels": "torch"}}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, out=str(ROOT / "results" / "weight_formats.json"),
                    quick="6 prompts x 24 tokens")
    ap.add_argument("--prompts", type=int, default=None, help="default 32 (6 with --quick)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 64 (24 with --quick)")
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--formats", default="bf16,int8,int4",
                    help="compared against fp32; subset of "
                    + ",".join(f for f in FORMATS if f != "fp32"))
    a = ap.parse_args(argv)
    a.prompts = a.prompts if a.prompts is not None else (6 if a.quick else 32)
    a.max_tokens = a.max_tokens if a.max_tokens is not None else (24 if a.quick else 64)
    a.formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    bad = [f for f in a.formats if f not in FORMATS or f == "fp32"]
    if bad:
        ap.error(f"--formats: unknown {bad}; choose from "
                 f"{', '.join(f for f in FORMATS if f != 'fp32')}")
    for name in ("prompts", "max_tokens", "max_prompt_tokens", "threads"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    from entropic import LLM, SamplingParams
    from entropic.bench.datasets import chat_prompt_ids
    from entropic.bench.parity import Divergence, common_prefix, sequence_logits

    greedy = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    ref = LLM(a.model, enable_prefix_caching=False, **FORMATS["fp32"])
    prompts = chat_prompt_ids(ref.tokenizer, a.prompts, a.max_prompt_tokens)
    t0 = time.perf_counter()
    ref_out = [o.token_ids for o in ref.generate(prompts, greedy)]
    seqs = [p + o for p, o in zip(prompts, ref_out)]
    ref_logits = [sequence_logits(ref.engine.model, s) for s in seqs]
    ref_seconds = time.perf_counter() - t0
    del ref
    results = {}
    for fmt in a.formats:
        llm = LLM(a.model, enable_prefix_caching=False, **FORMATS[fmt])
        div = Divergence()
        for s, rl in zip(seqs, ref_logits):
            div.add(rl[:-1], sequence_logits(llm.engine.model, s)[:-1])
        outs = [o.token_ids for o in llm.generate(prompts, greedy)]
        prefixes = [common_prefix(o, r) for o, r in zip(outs, ref_out)]
        results[fmt] = {**div.summary(),
                        "greedy_identical": sum(p == a.max_tokens for p in prefixes) / len(prefixes),
                        "greedy_mean_common_prefix": statistics.mean(prefixes),
                        "load_seconds": llm.load_seconds}
        print(f"{fmt}: done", file=sys.stderr, flush=True)
        del llm
    machine = describe(a.threads)
    meta = {"machine": machine, "prompts": len(prompts), "max_tokens": a.max_tokens,
            "prompt_tokens": [len(p) for p in prompts], "threads": a.threads,
            "reference": "fp32", "reference_seconds": ref_seconds,
            "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(["python3"] + sys.argv)}
    write_json(a.out, {"meta": meta, "formats": results})
    print("\n" + header(machine))
    print(f"{len(prompts)} prompts, {a.max_tokens} greedy tokens each, against fp32 "
          f"({results[a.formats[0]]['positions']} teacher-forced positions)\n")
    print("| format | top-1 agreement | mean KL (nats) | mean abs entropy diff (nats) "
          "| max abs logit diff | greedy identical | mean common prefix |")
    print("|---|---|---|---|---|---|---|")
    for fmt, r in results.items():
        print(f"| {fmt} | {r['top1_agreement']:.4f} | {r['mean_kl']:.5f} | "
              f"{r['mean_abs_entropy_diff']:.4f} | {r['max_logit_diff']:.3f} | "
              f"{r['greedy_identical']:.2f} | {r['greedy_mean_common_prefix']:.1f} / {a.max_tokens} |")


if __name__ == "__main__":
    main()
