"""The ablation (design section 6): baseline, each layer alone, each pair, all three, and
speculation alone and with all three.

Layers: macro = entropic scheduling (`LLM(scheduling="entropic")`), meso = KV-block pruning
(`LLM(pruning=PruningConfig())`), micro = the thermostat (`SamplingParams(thermostat=...)`),
and a fourth beside the paper's three, spec = entropy-gated prompt-lookup speculation
(`LLM(speculative_config=SpeculativeConfig())`, docs/speculative.md).
The baseline is FCFS, dense attention, a fixed temperature and no speculation. Every configuration serves
the same workload (workloads.py): same prompts, same arrival times, same per-request seeds,
in each repeat; repeats draw new arrivals and seeds and rotate the configuration order so
that drift in machine load is spread over all of them. An A/A control ("baseline-again": a
second engine with the baseline's configuration, run in the same rotation) measures the
run-to-run noise that the per-request bootstrap intervals do not cover.

`run_ablation` returns the raw per-request records; `ablation_stats.summarise` turns them
into metrics with bootstrap intervals, `report` writes JSON, Markdown and plots.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from itertools import combinations

import torch

from entropic.bench.loadgen import TimedRequest, replay
from entropic.bench.probes import TemperedEntropyProbe
from entropic.bench.workloads import (KINDS, REGIMES, WorkItem, WorkloadSpec, build_items,
                                      prompt_format, timed)

PAPER_LAYERS = ("sched", "prune", "thermo")  # macro, meso, micro
LAYERS = (*PAPER_LAYERS, "spec")
SPEC_COUNTERS = ("drafted_tokens", "accepted_tokens", "decode_steps", "committed_tokens")
AA_NAME = "baseline-again"  # a second, independent engine with the baseline's configuration


@dataclass(frozen=True)
class AblationConfig:
    """Which control layers are on."""

    sched: bool = False
    prune: bool = False
    thermo: bool = False
    spec: bool = False

    @property
    def name(self) -> str:
        on = [k for k in LAYERS if getattr(self, k)]
        return "+".join(on) if on else "baseline"

    @classmethod
    def parse(cls, name: str) -> "AblationConfig":
        if name == "baseline":
            return cls()
        parts = name.split("+")
        bad = [p for p in parts if p not in LAYERS]
        if bad or not parts:
            raise ValueError(f"unknown configuration {name!r}: use 'baseline' or layers "
                             f"joined by '+' from {LAYERS}")
        return cls(**{p: True for p in parts})


def all_configs() -> list[AblationConfig]:
    """The 10 configurations: the paper's 8 (baseline, singles, pairs, all three), then
    spec alone and spec with all three."""
    out = []
    for k in range(len(PAPER_LAYERS) + 1):
        for on in combinations(PAPER_LAYERS, k):
            out.append(AblationConfig(**{p: True for p in on}))
    out.append(AblationConfig(spec=True))
    out.append(AblationConfig(**{p: True for p in LAYERS}))
    return out


@dataclass
class AblationOptions:
    """What to run. `regime` picks the workload and engine limits (workloads.REGIMES);
    `quick` its small workload and one repeat. Limits left None come from the regime."""

    quick: bool = False
    regime: str = "mixed"
    configs: list[str] | None = None  # names; None = all 10
    repeats: int | None = None  # default 2 (full) or 1 (quick)
    workload: WorkloadSpec | None = None
    temperature: float = 0.7  # the baseline's fixed temperature, the thermostat's T_0
    target_entropy: float = 1.0  # H* of the thermostat, also the stability reference
    eta: float = 0.2
    t_min: float = 0.2
    t_max: float = 2.0
    max_num_seqs: int | None = None
    num_kv_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    threads: int | None = 1
    seed: int = 0
    n_boot: int = 1000
    aa_control: bool = True  # run the baseline twice per repeat: the run-to-run noise floor
    progress: bool = True
    model: str | None = None
    dtype: str = "auto"  # as LLM(): bf16 where the CPU has bf16 arithmetic, else fp32

    def resolved(self) -> "AblationOptions":
        """Defaults filled in and every option checked (ValueError naming the option)."""
        o = AblationOptions(**asdict(self))
        if self.regime not in REGIMES:
            raise ValueError(f"--regime must be one of {sorted(REGIMES)}, got {self.regime!r}")
        regime = REGIMES[self.regime]
        o.workload = self.workload or (regime.quick if self.quick else regime.full)
        for k in ("max_num_seqs", "num_kv_blocks", "max_num_batched_tokens"):
            if getattr(o, k) is None:
                setattr(o, k, getattr(regime, k))
        if isinstance(o.workload, dict):
            o.workload = WorkloadSpec(**o.workload)
        o.repeats = self.repeats if self.repeats is not None else (1 if self.quick else 2)
        checks = [("repeats", o.repeats >= 1, "at least 1"),
                  ("rate", o.workload.rate > 0, "> 0 requests per second"),
                  ("threads", o.threads is None or o.threads >= 1, "at least 1"),
                  ("bootstrap", o.n_boot >= 1, "at least 1 resample"),
                  ("temperature", o.temperature > 0, "> 0 (it is also the thermostat's T_0)"),
                  ("target-entropy", o.target_entropy >= 0, ">= 0 nats")]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"--{name} must be {want}")
        for n in o.configs or ():
            AblationConfig.parse(n)
        return o


def build_llm(cfg: AblationConfig, opts: AblationOptions, probe: TemperedEntropyProbe):
    """An LLM with the configuration's engine-side layers (scheduling, pruning,
    speculation)."""
    from entropic import LLM
    from entropic.control.pruning import PruningConfig
    from entropic.speculative import SpeculativeConfig

    # quantization=None: float weights in every regime and on every CPU (quantization="auto"
    # could pick int4 for a small max_num_seqs), as in every run recorded so far
    return LLM(model=opts.model, dtype=opts.dtype, quantization=None,
               max_num_seqs=opts.max_num_seqs, num_kv_blocks=opts.num_kv_blocks,
               max_num_batched_tokens=opts.max_num_batched_tokens, processors=[probe],
               scheduling="entropic" if cfg.sched else "fcfs",
               pruning=PruningConfig() if cfg.prune else None,
               speculative_config=SpeculativeConfig() if cfg.spec else None,
               # repeats replay the same prompts: a prefix cache would serve repeat 2 on
               # from repeat 1's KV (its counters still land in the engine stats)
               enable_prefix_caching=False)


def sampling_params(item: WorkItem, cfg: AblationConfig, opts: AblationOptions, seed: int):
    from entropic import SamplingParams, ThermostatParams

    thermo = None
    if cfg.thermo:
        thermo = ThermostatParams(target_entropy=opts.target_entropy, eta=opts.eta,
                                  t_min=opts.t_min, t_max=opts.t_max)
    return SamplingParams(max_tokens=item.max_tokens, temperature=opts.temperature, seed=seed,
                          ignore_eos=item.ignore_eos, thermostat=thermo)


def _record(item: WorkItem, out, h_tempered: list[float]) -> dict:
    """What the statistics need of one finished request (JSON-friendly)."""
    m, c, e = out.metrics, out.cost, out.entropic
    return {"key": item.key, "kind": item.kind, "text": out.text,
            "n_tokens": len(out.token_ids), "finish_reason": out.finish_reason,
            "ttft": m.ttft, "tpot": m.tpot, "e2e": m.e2e, "preemptions": m.num_preemptions,
            "seconds": c.seconds, "flops_linear": c.flops_linear,
            "flops_attention": c.flops_attention, "kv_bytes_read": c.kv_bytes_read,
            "tau": e.tau if e else 0.0, "entropies": list(out.entropies),
            "temperatures": list(out.temperatures), "h_tempered": h_tempered,
            "reference": item.reference, "answer": item.answer}


def run_ablation(opts: AblationOptions) -> dict:
    """Serve the workload under every configuration; return raw records and run facts.

    Result: {"options", "configs" (names run), "items" (n),
    "runs": {config: [ {"repeat", "makespan", "engine", "steps", "records": [...] } ]},
    "wall_seconds"}.  Record i of every run of every configuration is the same request.
    """
    opts = opts.resolved()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    names = opts.configs or [c.name for c in all_configs()]
    cfgs = [AblationConfig.parse(n) for n in names]
    if cfgs[0] != AblationConfig():
        raise ValueError(f"the first configuration must be the baseline, got {names[0]!r}")
    t_start = time.perf_counter()
    engines = {}
    named = [(c.name, c) for c in cfgs]
    if opts.aa_control:
        named.insert(1, (AA_NAME, AblationConfig()))
    for name, cfg in named:
        probe = TemperedEntropyProbe()
        engines[name] = (cfg, build_llm(cfg, opts, probe), probe)
    tokenizer = next(iter(engines.values()))[1].tokenizer
    items = build_items(tokenizer, opts.workload)
    if not items:
        raise ValueError("the workload is empty")
    # Warm-up: the shortest and the longest prompt together, so that first-call costs
    # (kernel selection for each shape, allocator growth) stay out of the timings.
    warm = [min(items, key=lambda i: len(i.prompt_ids)).prompt_ids,
            max(items, key=lambda i: len(i.prompt_ids)).prompt_ids]
    for _, llm, probe in engines.values():
        llm.generate(warm, sampling_params(WorkItem("warm", "chat", [], 8, True),
                                           AblationConfig(), opts, 0))
        probe.h.clear()

    bar = None
    if opts.progress:
        from tqdm import tqdm
        bar = tqdm(total=opts.repeats * len(engines) * len(items), unit="req",
                   desc="ablation", file=sys.stderr)
    runs: dict[str, list[dict]] = {n: [] for n in engines}
    order = list(engines)
    for rep in range(opts.repeats):
        load = timed(items, opts.workload.rate, seed=opts.seed + rep)
        rot = order[rep % len(order):] + order[:rep % len(order)]
        for name in rot:
            cfg, llm, probe = engines[name]
            reqs = [TimedRequest(f"r{rep}|{it.key}", it.prompt_ids,
                                 sampling_params(it, cfg, opts, seed=opts.seed * 7919 + rep *
                                                 100_003 + j), off)
                    for j, (off, it) in enumerate(load)]
            if bar is not None:
                bar.set_postfix_str(f"repeat {rep + 1}/{opts.repeats} {name}")
            spec = llm.engine.speculator
            spec_before = spec.stats.as_dict() if spec is not None else None
            res = replay(llm.engine, reqs, on_finish=(lambda _o: bar.update(1)) if bar else None)
            if spec is not None:  # this run's drafts (the gate keeps learning across runs)
                after = spec.stats.as_dict()
                res.stats.update({f"spec_{k}": after[k] - spec_before[k]
                                  for k in SPEC_COUNTERS})
            recs = []
            for it in items:  # record order = item order, the same in every run
                out = res.outputs[f"r{rep}|{it.key}"]
                recs.append(_record(it, out, probe.pop(out.request_id, len(out.token_ids))))
            runs[name].append({"repeat": rep, "makespan": res.makespan, "engine": res.stats,
                               "steps": [[round(t, 4), round(d, 5), n] for t, d, n in res.steps],
                               "records": recs})
    if bar is not None:
        bar.close()
    meta = asdict(opts)
    meta["workload"] = asdict(opts.workload)
    meta["threads"] = torch.get_num_threads()
    meta["dtype_reason"] = next(iter(engines.values()))[1].dtype_reason  # what "auto" chose
    return {"options": meta, "configs": list(engines),
            "items": len(items), "kinds": {k: sum(i.kind == k for i in items)
                                           for k in KINDS if any(i.kind == k for i in items)},
            "prompt_tokens": sum(len(i.prompt_ids) for i in items),
            "prompt_format": prompt_format(tokenizer),
            "runs": runs, "wall_seconds": time.perf_counter() - t_start}
