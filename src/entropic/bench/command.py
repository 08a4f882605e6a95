"""`entropic bench ablation`: argument parsing and the run, for the main CLI."""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace


def add_parsers(sub) -> None:
    """Add `ablation` to the `entropic bench` subparsers."""
    a = sub.add_parser("ablation", help="baseline, each control layer, each pair, all three "
                       "(design section 6); writes DIR/ablation.json, ablation.md and PNG plots",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a.add_argument("--quick", action="store_true",
                   help="small workload, 1 repeat (about 2 minutes on 2 cores)")
    a.add_argument("--regime", default="mixed", choices=("mixed", "long", "interactive"),
                   help="workload and engine limits: (a) mixed saturated, (b) long documents "
                   "under KV-memory pressure, (c) interactive, unsaturated arrivals")
    a.add_argument("--out", default="results/ablation", help="output directory")
    a.add_argument("--configs", nargs="+", default=None,
                   help="subset, baseline first (e.g. baseline sched thermo sched+thermo); "
                   "default: all 8")
    a.add_argument("--repeats", type=int, default=None, help="default 2, or 1 with --quick")
    a.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second")
    a.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples")
    a.add_argument("--temperature", type=float, default=0.7,
                   help="baseline's fixed temperature and the thermostat's T_0")
    a.add_argument("--target-entropy", type=float, default=1.0, help="thermostat H* (nats)")
    a.add_argument("--model", default=None,
                   help="GGUF file or HF directory; None: the embedded model")
    a.add_argument("--dtype", default="auto",
                   help="auto: bfloat16 on CPUs with bf16 arithmetic, else float32 (as LLM()); "
                   "bfloat16 or float32 force one")
    a.add_argument("--no-aa", dest="aa_control", action="store_false",
                   help="skip the A/A control (the baseline run twice: the noise floor)")
    a.add_argument("--no-progress", dest="progress", action="store_false")
    a.add_argument("--report-only", action="store_true",
                   help="recompute statistics, tables and plots from the files already in "
                   "--out (no model run)")
    a.set_defaults(func=cmd_ablation)


def cmd_ablation(args) -> int:
    from entropic.bench import report
    from entropic.bench.ablation import AblationOptions, run_ablation
    from entropic.bench.ablation_stats import summarise
    from entropic.bench.workloads import REGIMES

    regime = REGIMES[args.regime]
    spec = regime.quick if args.quick else regime.full
    if args.rate is not None:
        spec = replace(spec, rate=args.rate)
    opts = AblationOptions(quick=args.quick, regime=args.regime, configs=args.configs,
                           repeats=args.repeats,
                           workload=spec, temperature=args.temperature,
                           target_entropy=args.target_entropy, threads=args.threads,
                           seed=args.seed, n_boot=args.bootstrap, progress=args.progress,
                           aa_control=args.aa_control,
                           model=args.model, dtype=args.dtype)
    opts.resolved()  # bad options fail here, before any model is loaded
    t0 = time.perf_counter()
    if args.report_only:
        raw = report.load_raw(args.out)
    else:
        raw = run_ablation(opts)
        raw["command"] = "entropic " + " ".join(sys.argv[1:])
    summary = summarise(raw, n_boot=args.bootstrap, seed=args.seed)
    paths = report.write(raw, summary, args.out)
    print(paths["md"].read_text())
    print(f"wall time {time.perf_counter() - t0:.0f} s; wrote "
          + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0
