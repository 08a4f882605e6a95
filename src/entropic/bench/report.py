"""Ablation outputs: ablation.json, ablation.md (Markdown tables) and PNG plots."""
from __future__ import annotations

import json
import math
from pathlib import Path

VALUE_COLS = ["e2e_mean", "e2e_p50", "e2e_p99", "ttft_mean", "ttft_p50", "ttft_p99",
              "tpot_mean", "tpot_p50", "tpot_p99", "tokens", "tok_s", "tau", "tau_per_tflop",
              "tau_per_s", "tflops_linear", "tflops_attention", "kv_gb_read"]
QUALITY_COLS = ["rouge1_ref", "rouge2_ref", "rougeL_ref", "bleu_ref", "rouge1_base",
                "rouge2_base", "rougeL_base", "bleu_base", "accuracy", "ht_abs_err", "ht_var",
                "collapse", "mean_h", "mean_t"]
DELTA_COLS = ["e2e_mean", "e2e_p99", "ttft_mean", "ttft_p99", "tpot_mean", "tokens", "tok_s",
              "tau_per_tflop", "tau_per_s", "tflops_attention", "kv_gb_read", "rougeL_ref",
              "bleu_ref", "rougeL_base", "accuracy", "ht_abs_err", "collapse"]
PLOT_COLS = ["e2e_mean", "e2e_p99", "tok_s", "tau_per_tflop", "tflops_attention", "rougeL_ref",
             "accuracy", "ht_abs_err"]


def _num(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    a = abs(x)
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def _change(x: float, lo: float, hi: float, relative: bool) -> str:
    """'+12.3% [+1.0, +20.0]' (relative) or '+0.012 [-0.004, +0.030]' (absolute)."""
    if any(v is None or math.isnan(v) for v in (x, lo, hi)):
        return "n/a"
    if relative:
        return f"{100 * x:+.1f}% [{100 * lo:+.1f}, {100 * hi:+.1f}]"
    return f"{x:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def _delta(d: dict, relative: bool) -> str:
    return _change(d["rel" if relative else "abs"], d["lo"], d["hi"], relative)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def markdown(raw: dict, summary: dict) -> str:
    """The three tables: values, changes vs baseline (95 % CI), super-additivity."""
    o, labels = raw["options"], summary["metrics"]
    configs = list(summary["values"])
    w = o["workload"]
    kinds = ", ".join(f"{v} {k}" for k, v in raw["kinds"].items())
    parts = [
        f"Regime: {o.get('regime', 'mixed')}. "
        f"Workload: {raw['items']} requests per run ({kinds}), "
        f"{raw['prompt_tokens']:,} prompt tokens, Poisson arrivals at {w['rate']}/s; "
        f"{o['repeats']} repeat(s), {summary['n_requests']} request pairs in the bootstrap "
        f"({summary['n_boot']} resamples); max_num_seqs {o['max_num_seqs']}, "
        f"{o['num_kv_blocks']} KV blocks, budget {o['max_num_batched_tokens']} tokens/step; "
        f"T = {o['temperature']} (thermostat: T_0 = {o['temperature']}, H* = "
        f"{o['target_entropy']}, eta {o['eta']}, T in [{o['t_min']}, {o['t_max']}]); "
        f"{o['threads']} torch thread(s); wall time {raw['wall_seconds']:.0f} s.",
    ]
    if "baseline-again" in configs:
        parts.append("`baseline-again` is an A/A control: a second engine with the baseline's "
                     "configuration, run in the same rotation. Its differences from the baseline "
                     "are run-to-run noise (machine load, batch timing), which the per-request "
                     "bootstrap intervals do not include: treat a layer's change as real only "
                     "if it is clearly larger than baseline-again's.")
    parts.append("### Values\n\n" + _table(
        ["config"] + [labels[c]["label"] for c in VALUE_COLS],
        [[c] + [_num(summary["values"][c][m]) for m in VALUE_COLS] for c in configs]))
    parts.append(_table(
        ["config"] + [labels[c]["label"] for c in QUALITY_COLS],
        [[c] + [_num(summary["values"][c][m]) for m in QUALITY_COLS] for c in configs]))
    parts.append("### Change against the baseline (95 % paired-bootstrap interval)\n\n"
                 "Relative (%) for latency, throughput and cost; absolute difference for "
                 "quality and stability scores.\n\n" + _table(
                     ["config"] + [labels[c]["label"] for c in DELTA_COLS],
                     [[c] + [_delta(summary["delta"][c][m], labels[m]["relative"])
                             for m in DELTA_COLS] for c in configs[1:]]))
    sup = summary["superadditivity"]
    full = [c for c in sup if len(c.split("+")) >= 3] or list(sup)  # all three+, else pairs
    aa = summary["delta"].get("baseline-again")
    rows = []
    for c in full:
        for m in DELTA_COLS:
            if m in sup[c]:
                s, rel = sup[c][m], labels[m]["relative"]
                fmt = (lambda x: f"{100 * x:+.1f}%") if rel else (lambda x: f"{x:+.3f}")
                # S combines four runs against the baseline: its run-to-run noise is about
                # twice an A/A difference, so the interval must clear that margin too.
                margin = 2 * abs(aa[m]["rel" if rel else "abs"]) if aa else 0.0
                ok = "yes" if s["lo"] > margin else ("no: sub-additive" if s["hi"] < -margin
                                                     else "not distinguishable")
                rows.append([c, labels[m]["label"], fmt(s["gain"]), fmt(s["sum_single"]),
                             _change(s["s"], s["lo"], s["hi"], rel),
                             fmt(margin) if aa else "-", ok])
    if rows:
        parts.append("### Super-additivity: the combined gain against the sum of the single "
                     "layers' gains\n\nGains signed so that + is better; the pairs are in "
                     "ablation.json. Verdict: the interval must clear zero by the A/A margin "
                     "(2 x |baseline-again's change|), since the difference combines four runs' "
                     "timing noise.\n\n" + _table(
                         ["config", "metric", "its gain", "sum of single-layer gains",
                          "difference [95 % CI]", "A/A margin", "super-additive?"], rows))
    run_rows = []
    for c, rs in summary["runs"].items():
        for r in rs:
            e = r["engine"]
            extra = ", ".join(f"{k} {v:,.0f}" for k, v in e.items()
                              if "block" in k or "prun" in k or "evict" in k
                              or k.startswith("spec_"))
            speed = r.get("step_time_index")
            run_rows.append([c, str(r["repeat"]), f"{r['makespan']:.1f}",
                             f"{r['output_tok_s_makespan']:.1f}",
                             "-" if speed is None else f"{speed:.2f}",
                             f"{e.get('preemptions', float('nan')):.0f}", extra or "-"])
    parts.append("### Runs\n\nStep-time index: the run's median step time per batch size "
                 "over all runs' at that size (geometric mean over sizes); well above 1 at "
                 "equal work, the host ran slow during that run.\n\n"
                 + _table(["config", "repeat", "makespan (s)", "output tok/s over makespan",
                           "step-time index", "preemptions",
                           "pruning and speculation counters"], run_rows))
    return "\n\n".join(parts) + "\n"


def write(raw: dict, summary: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write ablation.json (summary + run facts), ablation_outputs.jsonl (every request's
    text and traces), ablation.md and the plots; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "ablation.json", "md": out / "ablation.md",
             "outputs": out / "ablation_outputs.jsonl"}
    meta = {k: v for k, v in raw.items() if k != "runs"}
    (paths["json"]).write_text(json.dumps({"meta": meta, **summary}, indent=1, default=float))
    with open(paths["outputs"], "w", encoding="utf-8") as f:
        for c, rs in raw["runs"].items():
            for r in rs:
                for rec in r["records"]:
                    f.write(json.dumps({"config": c, "repeat": r["repeat"], **rec},
                                       ensure_ascii=False) + "\n")
    paths["md"].write_text(markdown(raw, summary))
    paths.update(plot(raw, summary, out))
    return paths


def load_raw(out_dir: str | Path) -> dict:
    """Rebuild a run's raw result from its ablation.json and ablation_outputs.jsonl, so that
    statistics and report can be recomputed without serving the workload again."""
    out = Path(out_dir)
    saved = json.loads((out / "ablation.json").read_text())
    raw = dict(saved["meta"])
    runs = {c: [{"repeat": r["repeat"], "makespan": r["makespan"], "engine": r["engine"],
                 "steps": r.get("steps", []), "records": []} for r in rs]
            for c, rs in saved["runs"].items()}
    with open(out / "ablation_outputs.jsonl", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            c, rep = rec.pop("config"), rec.pop("repeat")
            next(r for r in runs[c] if r["repeat"] == rep)["records"].append(rec)
    raw["runs"] = runs
    return raw


def plot(raw: dict, summary: dict, out: Path) -> dict[str, Path]:
    """ablation_deltas.png (change vs baseline with 95 % CI, per metric) and
    ablation_latency.png (E2E latency CDF per configuration)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(summary["values"])[1:]
    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    for ax, m in zip(axes.flat, PLOT_COLS):
        rel = summary["metrics"][m]["relative"]
        k, scale = ("rel", 100) if rel else ("abs", 1)
        d = [summary["delta"][c][m] for c in configs]
        y = [scale * x[k] for x in d]
        err = [[max(0.0, scale * (x[k] - x["lo"])) for x in d],
               [max(0.0, scale * (x["hi"] - x[k])) for x in d]]
        ax.bar(range(len(configs)), y, yerr=err, capsize=3, color="tab:blue")
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xticks(range(len(configs)), configs, rotation=45, ha="right", fontsize=8)
        unit = "% vs baseline" if rel else "minus baseline"
        ax.set_title(f"{summary['metrics'][m]['label']} ({unit})", fontsize=9)
    fig.tight_layout()
    p1 = out / "ablation_deltas.png"
    fig.savefig(p1, dpi=80)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c, rs in raw["runs"].items():
        xs = sorted(rec["e2e"] for r in rs for rec in r["records"])
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=c, lw=1.2)
    ax.set_xlabel("end-to-end latency (s)")
    ax.set_ylabel("fraction of requests")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p2 = out / "ablation_latency.png"
    fig.savefig(p2, dpi=80)
    plt.close(fig)
    return {"plot_deltas": p1, "plot_latency": p2}
