"""Metrics of the ablation with paired-bootstrap intervals, and super-additivity.

Every metric is a function of per-request arrays (`fields`), so it can be recomputed on
bootstrap resamples of the requests. Requests are pooled over repeats: item (repeat r,
request i) of one configuration is paired with the same item of every other configuration
(same prompt, arrival time and seed), which makes the differences paired. The intervals
cover the variation from which requests were drawn and, with repeats, run-to-run noise;
they do not cover a change of machine load between configurations beyond what the
rotating order of the repeats spreads out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from entropic.bench.metrics import (bleu_from_stats, bleu_stats, interval, paired_bootstrap,
                                    parse_yes_no, relative_change, rouge_f, superadditivity)

COLLAPSE_NATS = 0.05  # H^T below this is a collapsed step (as in benchmarks/thermostat.py)
TEXT_KINDS = ("chat", "xsum", "aclsum", "longdoc")
REF_KINDS = ("xsum", "aclsum", "longdoc")  # those of them with a reference (plays have none)


MIN_STEPS_AT_SIZE = 3  # steps a run needs at a batch size for it to enter the index


def step_time_index(steps: dict) -> dict:
    """Per run, how slow its steps were against all runs' steps of the same size: the
    geometric mean over batch sizes n (running requests) of the run's median step time at
    n over the median of every run's steps at n, weighted by the run's steps at n. Steps of
    one size do the same kind of work in every configuration (mostly decodes, whose cost is
    set by n), so an index well above 1 at equal work says the host ran slow during that
    run, not that the configuration did more. `steps`: run key -> [[start, seconds, n],
    ...] as the ablation records them; runs without steps get None."""
    pooled: dict[int, list[float]] = {}
    for st in steps.values():
        for _, sec, n in st:
            pooled.setdefault(n, []).append(sec)
    median = {n: float(np.median(v)) for n, v in pooled.items()}
    out: dict = {}
    for key, st in steps.items():
        mine: dict[int, list[float]] = {}
        for _, sec, n in st:
            mine.setdefault(n, []).append(sec)
        logs, weight = 0.0, 0
        for n, v in mine.items():
            if len(v) >= MIN_STEPS_AT_SIZE and median[n] > 0:
                logs += len(v) * np.log(float(np.median(v)) / median[n])
                weight += len(v)
        out[key] = float(np.exp(logs / weight)) if weight else None
    return out


@dataclass(frozen=True)
class Metric:
    """A named function of per-request fields; `better` is +1 (higher), -1 (lower) or 0.

    `relative`: differences against the baseline are relative (performance and cost), or
    absolute (quality and stability scores, whose baseline can be near zero: a BLEU of 0.9
    against 2.6 is "+190 %" but 1.7 points)."""

    name: str
    fn: Callable[[dict], float]
    better: int
    label: str
    relative: bool = True


def _ratio(a, b) -> float:
    b = float(np.sum(b))
    return float(np.sum(a)) / b if b else float("nan")


def _masked_mean(x, m) -> float:
    return _ratio(np.asarray(x) * m, m)


def _nan_stat(x, q=None) -> float:
    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x)]
    if not x.size:
        return float("nan")
    return float(np.mean(x)) if q is None else float(np.percentile(x, q))


def metric_table(repeats: int) -> list[Metric]:
    """All metrics, in report order. Totals (tau, FLOPs, bytes) are per run (/ repeats)."""
    ms = []
    for lat in ("e2e", "ttft", "tpot"):
        ms += [Metric(f"{lat}_mean", lambda f, k=lat: _nan_stat(f[k]), -1, f"{lat} mean (s)"),
               Metric(f"{lat}_p50", lambda f, k=lat: _nan_stat(f[k], 50), -1, f"{lat} p50 (s)"),
               Metric(f"{lat}_p99", lambda f, k=lat: _nan_stat(f[k], 99), -1, f"{lat} p99 (s)")]
    ms += [
        Metric("tokens", lambda f: float(np.sum(f["tokens"])) / repeats, 0,
               "output tokens per run"),
        Metric("tok_s", lambda f: _ratio(f["tokens"], f["seconds"]), +1, "output tok/s"),
        Metric("tau", lambda f: float(np.sum(f["tau"])) / repeats, 0, "tau per run (nats)"),
        Metric("tau_per_tflop", lambda f: _ratio(f["tau"], (f["flops_linear"] +
                                                             f["flops_attention"]) / 1e12),
               +1, "tau / TFLOP"),
        Metric("tau_per_s", lambda f: _ratio(f["tau"], f["seconds"]), +1, "tau / s"),
        Metric("tflops_linear", lambda f: float(np.sum(f["flops_linear"])) / 1e12 / repeats, -1,
               "linear TFLOPs per run"),
        Metric("tflops_attention", lambda f: float(np.sum(f["flops_attention"])) / 1e12 /
               repeats, -1, "attention TFLOPs per run"),
        Metric("kv_gb_read", lambda f: float(np.sum(f["kv_bytes_read"])) / 1e9 / repeats, -1,
               "KV GB read per run"),
    ]
    for src in ("ref", "base"):
        # Overlap with references is quality (+1); overlap with the baseline's own output
        # only says how far a layer moves the text (0: no direction, no super-additivity).
        mask, better = ("m_ref", +1) if src == "ref" else ("m_text", 0)
        for r in ("rouge1", "rouge2", "rougeL"):
            ms.append(Metric(f"{r}_{src}", lambda f, k=f"{r}_{src}", m=mask:
                             _masked_mean(f[k], f[m]), better, f"{r} vs {src}", False))
        ms.append(Metric(f"bleu_{src}", lambda f, k=f"bleu_{src}": bleu_from_stats(f[k]),
                         better, f"BLEU vs {src}", False))
    ms += [
        Metric("accuracy", lambda f: _masked_mean(f["correct"], f["m_sqa"]), +1,
               "strategyqa accuracy", False),
        Metric("ht_abs_err", lambda f: _ratio(f["ht_abs"], f["ht_n"]), -1, "mean abs(H^T - H*)",
               False),
        Metric("ht_var", lambda f: _ratio(f["ht_sq"], f["ht_n"]) - _ratio(f["ht"], f["ht_n"])
               ** 2, -1, "var H^T", False),
        Metric("collapse", lambda f: _ratio(f["ht_collapse"], f["ht_n"]), -1, "collapse rate",
               False),
        Metric("mean_h", lambda f: _ratio(f["h"], f["ht_n"]), 0, "mean model H", False),
        Metric("mean_t", lambda f: _ratio(f["t"], f["ht_n"]), 0, "mean temperature", False),
    ]
    return ms


def fields_of(runs: dict, baseline: str, target: float) -> dict[str, dict[str, np.ndarray]]:
    """Per-request arrays per configuration, items pooled over repeats in a fixed order."""
    base_recs = [r for run in runs[baseline] for r in run["records"]]
    out = {}
    for name, rs in runs.items():
        recs = [r for run in rs for r in run["records"]]
        if [r["key"] for r in recs] != [r["key"] for r in base_recs]:
            raise ValueError(f"{name}: requests do not line up with the baseline's")
        f = {k: np.array([float(r[k]) if r[k] is not None else np.nan for r in recs])
             for k in ("e2e", "ttft", "tpot", "seconds", "flops_linear", "flops_attention",
                       "kv_bytes_read", "tau")}
        f["tokens"] = np.array([r["n_tokens"] for r in recs], dtype=float)
        kinds = [r["kind"] for r in recs]
        f["m_ref"] = np.array([k in REF_KINDS and bool(r["reference"])
                               for r, k in zip(recs, kinds)], dtype=float)
        f["m_text"] = np.array([k in TEXT_KINDS for k in kinds], dtype=float)
        f["m_sqa"] = np.array([k == "strategyqa" for k in kinds], dtype=float)
        hyps = [r["text"] for r in recs]
        refs = [r["reference"] or "" if k in REF_KINDS else "" for r, k in zip(recs, kinds)]
        bases = [b["text"] if k in TEXT_KINDS else "" for b, k in zip(base_recs, kinds)]
        for src, other, mask in (("ref", refs, f["m_ref"]), ("base", bases, f["m_text"])):
            rouge = rouge_f(hyps, other)
            for k, v in rouge.items():
                f[f"{k}_{src}"] = v * mask
            f[f"bleu_{src}"] = bleu_stats(hyps, other) * mask[:, None]
        f["correct"] = np.array([float(parse_yes_no(r["text"]) == r["answer"])
                                 if r["kind"] == "strategyqa" else 0.0 for r in recs])
        ht = [np.asarray(r["h_tempered"], dtype=float) for r in recs]
        f["ht_n"] = np.array([len(h) for h in ht], dtype=float)
        f["ht"] = np.array([h.sum() for h in ht])
        f["ht_sq"] = np.array([(h ** 2).sum() for h in ht])
        f["ht_abs"] = np.array([np.abs(h - target).sum() for h in ht])
        f["ht_collapse"] = np.array([(h < COLLAPSE_NATS).sum() for h in ht], dtype=float)
        f["h"] = np.array([sum(r["entropies"][:len(h)]) for r, h in zip(recs, ht)])
        f["t"] = np.array([sum(r["temperatures"][:len(h)]) for r, h in zip(recs, ht)])
        out[name] = f
    return out


def summarise(raw: dict, n_boot: int = 1000, seed: int = 0) -> dict:
    """Point values, changes against the baseline with 95 % intervals, super-additivity.

    Result: {"metrics": {name: {"label", "better"}}, "values": {config: {metric: x}},
    "delta": {config: {metric: {"rel" or "abs", "lo", "hi"}}} (change vs baseline: relative
    for performance and cost, absolute for quality and stability scores),
    "superadditivity": {config: {metric: {"s", "lo", "hi", "gain", "sum_single"}}} for
    each multi-layer configuration whose single layers all ran, "runs": run-level facts}.
    """
    runs = raw["runs"]
    names = list(runs)
    base = names[0]
    repeats = len(runs[base])
    fields = fields_of(runs, base, raw["options"]["target_entropy"])
    metrics = metric_table(repeats)
    n = len(next(iter(fields.values()))["tokens"])
    values = {c: {m.name: m.fn(f) for m in metrics} for c, f in fields.items()}
    boot = paired_bootstrap(fields, {m.name: m.fn for m in metrics}, n, n_boot, seed)
    def change(m: Metric, cfg: str, boot_: bool = False):
        """Config minus baseline: relative or absolute (see Metric), on points or samples."""
        src = boot if boot_ else values
        v, b = src[cfg][m.name], src[base][m.name]
        if m.relative:
            return relative_change(v, b)
        return np.asarray(v, dtype=float) - np.asarray(b, dtype=float)

    delta: dict = {}
    for c in names:
        delta[c] = {}
        for m in metrics:
            lo, hi = interval(change(m, c, True))
            delta[c][m.name] = {"rel" if m.relative else "abs": float(change(m, c)),
                                "lo": lo, "hi": hi}
    sup: dict = {}
    for c in names:
        layers = c.split("+")
        if len(layers) < 2 or not all(x in runs for x in layers):
            continue
        sup[c] = {}
        for m in metrics:
            if not m.better:
                continue
            s_point = float(superadditivity(m.better * change(m, c),
                                            [m.better * change(m, x) for x in layers]))
            lo, hi = interval(superadditivity(m.better * change(m, c, True),
                                              [m.better * change(m, x, True) for x in layers]))
            sup[c][m.name] = {"s": s_point, "lo": lo, "hi": hi,
                              "gain": float(m.better * change(m, c)),
                              "sum_single": float(sum(m.better * change(m, x) for x in layers))}
    speeds = step_time_index({(c, r["repeat"]): r.get("steps", []) for c, rs in runs.items()
                              for r in rs})
    run_facts = {c: [{"repeat": r["repeat"], "makespan": r["makespan"],
                      "output_tok_s_makespan": sum(x["n_tokens"] for x in r["records"]) /
                      r["makespan"], "engine": r["engine"],
                      "step_time_index": speeds.get((c, r["repeat"])),
                      "steps": r.get("steps", [])} for r in rs]
                 for c, rs in runs.items()}
    return {"metrics": {m.name: {"label": m.label, "better": m.better, "relative": m.relative}
                        for m in metrics},
            "values": values, "delta": delta, "superadditivity": sup, "runs": run_facts,
            "n_requests": n, "n_boot": n_boot}
