"""Two engines' N-concurrent throughput, measured in alternation: a ratio that the machine's
drift does not decide.

    python3 benchmarks/peers_alternating.py --vllm-python /tmp/vllmenv/bin/python \
        --vllm-model /tmp/smollm2_hf --peers ours,vllm --rounds 6 --concurrency 64

benchmarks/peers.py measures each peer in its own child, one after the other; on a shared
machine whose speed drifts by 10-20 % over minutes, the ratio of two such figures moves with
the drift. Here both peers are loaded once, each in its own process group, and take turns:
in every round each serves the same N requests (ShareGPT first turns, chat-templated, greedy,
EOS ignored, --new-tokens each, the workload of peers.py) while the other is frozen with
SIGSTOP, so that an idle peer's polling threads take no CPU from the one measured. Prints
each round's total tok/s (with --decode-only at --concurrency 1: the decode tok/s of one
request, prefill left out, as peers.py's batch-1 figure), the per-round ratio first/second
and its median; writes JSON.
Peers are those of peers.py (same classes, same settings); a child that dies stops the run.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import peers  # (benchmarks/peers.py: the peer classes and the workload)
from entropic.bench.machine import add_common_args, describe, header

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]


def child(a) -> None:
    """Load one peer, say "ready", then serve one batch per line read (N) and print tok/s."""
    peer = peers.CHILD[a.child](argparse.Namespace(model=a.model, threads=a.threads,
                                                   n_ctx=a.n_ctx,
                                                   no_extra_bufts=a.no_extra_bufts))
    work = json.loads(Path(a.work).read_text())
    peer.batch(work["prompts"][:2], 4)  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        if a.decode_only:  # peers.py's batch-1 decode figure: the tokens after the first
            print(peer.decode(work["prompts"][0], a.new_tokens), flush=True)
        else:
            print(peer.batch(work["prompts"][:int(line)], a.new_tokens), flush=True)


def spawn(name: str, a, work_file: str) -> subprocess.Popen:
    python, model, env = peers.child_setup(name, a)  # peers.py's interpreter, model, env
    cmd = [python, str(HERE), "--child", name, "--work", work_file, "--threads", str(a.threads),
           "--new-tokens", str(a.new_tokens), "--n-ctx", str(a.n_ctx), "--model", str(model)]
    if a.no_extra_bufts:
        cmd.append("--no-extra-bufts")
    if a.decode_only:
        cmd.append("--decode-only")
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)  # its own group: frozen and killed whole


def read_line(name: str, p: subprocess.Popen) -> str:
    line = p.stdout.readline()
    if not line:
        raise SystemExit(f"{name}: the child exited (run it alone, e.g. benchmarks/peers.py "
                         f"--peers {name}, to see why)")
    return line.strip()


def read_number(name: str, p: subprocess.Popen) -> float:
    """The child's next figure, skipping what else it printed (vLLM's engine core logs to
    stdout, e.g. a warning when it was frozen for a minute)."""
    while True:
        line = read_line(name, p)
        try:
            return float(line)
        except ValueError:
            print(f"{name}: {line[:160]}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="ours,vllm", help="two (or more) of " + ",".join(peers.PEERS))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--vllm-model", default=None)
    add_common_args(ap, threads=2, threads_choices=(1, 2),
                    out=str(ROOT / "results" / "peers_alternating.json"),
                    model="GGUF path (default: the embedded model)", quick=None)
    ap.add_argument("--emulate-isa", choices=sorted(peers.EMULATE_ISA),
                    help="as in benchmarks/peers.py: every library capped at this ISA")
    ap.add_argument("--no-extra-bufts", action="store_true",
                    help="as in benchmarks/peers.py: llama.cpp without its extra buffer types")
    ap.add_argument("--decode-only", action="store_true",
                    help="with --concurrency 1: time each peer's decode alone (tokens after "
                         "the first over their time, as benchmarks/peers.py's batch-1 "
                         "figure), not the whole request")
    ap.add_argument("--child", choices=peers.PEERS, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.out = Path(a.out)
    if a.child is None:
        a.peers = [p.strip() for p in a.peers.split(",") if p.strip()]
        bad = [p for p in a.peers if p not in peers.PEERS]
        if bad or len(a.peers) < 2:
            ap.error(f"--peers: two or more of {', '.join(peers.PEERS)}; got {a.peers}")
        if any(p.startswith("vllm") for p in a.peers) and not (a.vllm_python and a.vllm_model):
            ap.error("--peers vllm needs --vllm-python and --vllm-model (see benchmarks/peers.py)")
        if a.decode_only and a.concurrency != 1:
            ap.error("--decode-only times one request: it needs --concurrency 1")
        for name in ("rounds", "concurrency", "new_tokens"):
            if getattr(a, name) < 1:
                ap.error(f"--{name.replace('_', '-')} must be >= 1")
        if a.emulate_isa:  # before anything imports torch; the children inherit it
            os.environ.update(peers.EMULATE_ISA[a.emulate_isa])
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.child:
        child(a)
        return
    from entropic.model.loader import default_model_path

    a.model = a.model or default_model_path()
    work = peers.build_workload(a.model, argparse.Namespace(
        batch_sizes=[a.concurrency], max_prompt_tokens=a.max_prompt_tokens, prefill_tokens=2048))
    work_file = str(a.out.with_suffix(".work.json"))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    Path(work_file).write_text(json.dumps(work))
    procs = {name: spawn(name, a, work_file) for name in a.peers}

    def freeze(name: str, stop: bool) -> None:
        os.killpg(procs[name].pid, signal.SIGSTOP if stop else signal.SIGCONT)

    try:
        for name, p in procs.items():
            while read_line(name, p) != "ready":
                pass
            freeze(name, True)
            print(f"{name}: loaded", file=sys.stderr, flush=True)
        load = [os.getloadavg()[0]]
        res: dict[str, list[float]] = {name: [] for name in procs}
        for r in range(a.rounds):
            for name, p in procs.items():
                freeze(name, False)
                time.sleep(2)  # let the woken process settle
                p.stdin.write(f"{a.concurrency}\n")
                p.stdin.flush()
                res[name].append(read_number(name, p))
                freeze(name, True)
            print(f"round {r + 1}: " + "  ".join(f"{k} {v[-1]:.1f}" for k, v in res.items()),
                  flush=True)
        load.append(os.getloadavg()[0])
    finally:
        for name, p in procs.items():
            try:
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    first = a.peers[0]
    summary = {k: {"median_tok_s": statistics.median(v), "samples": v} for k, v in res.items()}
    for other in a.peers[1:]:
        ratios = [x / y for x, y in zip(res[first], res[other])]
        summary[f"{first}/{other}"] = {"median_ratio": statistics.median(ratios), "per_round": ratios}
    machine = describe(a.threads)
    meta = {"machine": machine, "concurrency": a.concurrency, "new_tokens": a.new_tokens, "threads": a.threads,
            "measure": "decode tok/s" if a.decode_only else "total tok/s",
            "rounds": a.rounds, "load_average": load,
            "emulated_isa": ({"isa": a.emulate_isa, "env": peers.EMULATE_ISA[a.emulate_isa]}
                             if a.emulate_isa else None),
            "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(["python3"] + sys.argv)}
    a.out.write_text(json.dumps({"meta": meta, "results": summary}, indent=2))
    print("\n" + header(machine))
    print(f"{a.concurrency} concurrent, {a.new_tokens} new tokens, {a.rounds} alternating rounds, "
          f"{meta['measure']}")
    for k, v in summary.items():
        if "median_tok_s" in v:
            print(f"  {k}: median {v['median_tok_s']:.1f} tok/s  {[round(x, 1) for x in v['samples']]}")
        else:
            print(f"  {k}: median ratio {v['median_ratio']:.3f}  per round "
                  f"{[round(x, 3) for x in v['per_round']]}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
