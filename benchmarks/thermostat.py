"""The micro control law alone: fixed temperature against the thermostat, on ShareGPT prompts.

    python benchmarks/thermostat.py                 # 100 prompts x 96 tokens per configuration
    python benchmarks/thermostat.py --quick         # 16 prompts x 32 tokens

Configurations: fixed T = 0.7 and 1.0, and the thermostat (stabilize mode, T_0 = 1.0,
eta 0.2, T in [0.2, 2.0]) at several targets H*. All sample with a per-request seed, so each
configuration sees the same random stream.

Measured per configuration (over all generated tokens of all prompts):
- H^T: entropy of the tempered distribution each token was drawn from (before top-k/p,
  which are off here), read by a probe element placed after the thermostat in the sampler
  chain; mean |H^T - H*| (for fixed T against the same H* grid's middle value, to compare),
  its variance, and the fraction of collapsed steps (H^T < 0.05 nats);
- distinct-2 / distinct-3 (distinct n-grams / n-grams, per output, averaged) and the
  repetition rate (fraction of tokens that complete a 4-gram already seen in that output);
- output tokens/s of a separate timing pass without the probe (--timing-prompts requests at
  once), and the thermostat's overhead against fixed T = 1.0 (median of --repeats).
Writes results/thermostat.json, a Markdown table on stdout and results/thermostat_traces.png.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from entropic import LLM, SamplingParams, ThermostatParams
from entropic.bench.datasets import chat_prompt_ids
from entropic.bench.machine import add_common_args, describe, header, write_json
from entropic.bench.probes import TemperedEntropyProbe

ROOT = Path(__file__).resolve().parents[1]

COLLAPSE = 0.05


def distinct(tokens: list[int], n: int) -> float:
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def repetition_rate(tokens: list[int], n: int = 4) -> float:
    seen, rep = set(), 0
    for i in range(len(tokens) - n + 1):
        g = tuple(tokens[i:i + n])
        rep += g in seen
        seen.add(g)
    return rep / max(1, len(tokens) - n + 1)


def configs(targets: list[float]) -> dict[str, dict]:
    out = {"fixed T=0.7": {"temperature": 0.7}, "fixed T=1.0": {"temperature": 1.0}}
    for h in targets:
        out[f"thermostat H*={h}"] = {"temperature": 1.0, "thermostat": ThermostatParams(
            target_entropy=h, eta=0.2, t_min=0.2, t_max=2.0)}
    return out


def params_for(cfg: dict, n: int, max_tokens: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, seed=1000 + i, ignore_eos=True, **cfg)
            for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--targets", type=float, nargs="+", default=[1.0, 2.0, 3.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timing-prompts", type=int, default=32)
    add_common_args(ap, threads=None, out=str(ROOT / "results"),
                    out_help="folder for thermostat.json and thermostat_traces.png",
                    quick="16 prompts x 32 tokens, 1 repeat")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.max_tokens, args.repeats = 16, 32, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    probe = TemperedEntropyProbe()
    llm = LLM(model=args.model, processors=[probe], enable_prefix_caching=False)
    machine = describe(torch.get_num_threads())
    prompts = chat_prompt_ids(llm.tokenizer, args.prompts)
    cfgs = configs(args.targets)
    mid_target = statistics.median(args.targets)
    results, traces = {}, {}
    for name, cfg in cfgs.items():
        probe.h.clear()
        outs = llm.generate(prompts, params_for(cfg, len(prompts), args.max_tokens))
        target = cfg["thermostat"].target_entropy if "thermostat" in cfg else mid_target
        h_all = [h for o in outs for h in probe.h[o.request_id][:len(o.token_ids)]]
        results[name] = {
            "target": target,
            "mean_abs_err": statistics.fmean(abs(h - target) for h in h_all),
            "mean_HT": statistics.fmean(h_all),
            "var_HT": statistics.pvariance(h_all),
            "collapse_frac": sum(h < COLLAPSE for h in h_all) / len(h_all),
            "mean_T": statistics.fmean(t for o in outs for t in o.temperatures),
            "distinct2": statistics.fmean(distinct(o.token_ids, 2) for o in outs),
            "distinct3": statistics.fmean(distinct(o.token_ids, 3) for o in outs),
            "repetition": statistics.fmean(repetition_rate(o.token_ids) for o in outs),
            "tau_per_tflop": statistics.fmean(o.entropic.tau_per_tflop for o in outs),
        }
        traces[name] = [(probe.h[o.request_id][:len(o.token_ids)], o.temperatures)
                        for o in outs[:3]]
        print(f"  {name}: done", file=sys.stderr, flush=True)

    # timing pass without the probe, all configurations interleaved per repeat
    timer = LLM(model=args.model, enable_prefix_caching=False)  # repeats: the same prompts
    timing_prompts = prompts[:args.timing_prompts]
    tps: dict[str, list[float]] = {k: [] for k in cfgs}
    timer.generate(timing_prompts[:4], SamplingParams(max_tokens=4))  # warm-up
    for _ in range(args.repeats):
        for name, cfg in cfgs.items():
            t0 = time.perf_counter()
            outs = timer.generate(timing_prompts, params_for(cfg, len(timing_prompts),
                                                             args.max_tokens))
            tps[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    base = statistics.median(tps["fixed T=1.0"])
    for name in cfgs:
        results[name]["tokens_per_s"] = statistics.median(tps[name])
        results[name]["overhead_vs_T1"] = 1 - results[name]["tokens_per_s"] / base

    cols = ["target", "mean_abs_err", "var_HT", "collapse_frac", "mean_T", "distinct2",
            "distinct3", "repetition", "tau_per_tflop", "tokens_per_s", "overhead_vs_T1"]
    print("\n" + header(machine))
    print(f"{len(prompts)} ShareGPT prompts x {args.max_tokens} tokens; "
          f"H* for fixed-T rows = {mid_target}; timing: {len(timing_prompts)} at once, "
          f"median of {args.repeats}\n")
    print("| config | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, r in results.items():
        print(f"| {name} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |")
    meta = {"machine": machine, "prompts": len(prompts), "max_tokens": args.max_tokens, "repeats": args.repeats,
            "threads": torch.get_num_threads(), "command": " ".join(sys.argv)}
    write_json(out_dir / "thermostat.json", {"meta": meta, "results": results})
    plot(traces, out_dir / "thermostat_traces.png")


def plot(traces: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in traces if n in ("fixed T=1.0",) or n.startswith("thermostat")][:3]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7), sharex=True)
    for col in range(3):
        for name in names:
            h, t = traces[name][col]
            axes[0, col].plot(h, label=name, lw=1)
            axes[1, col].plot(t, label=name, lw=1)
        axes[0, col].set_title(f"prompt {col}: entropy sampled from (H^T, nats)")
        axes[1, col].set_title(f"prompt {col}: temperature")
        axes[1, col].set_xlabel("generated token")
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"plot: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
