"""Load generator for the OpenAI-compatible server, with vLLM `bench serve` metrics.

    python benchmarks/serve_load.py --quick                    # spawns a server, 32 requests
    python benchmarks/serve_load.py --num-prompts 200 --request-rate 4
    python benchmarks/serve_load.py --base-url http://127.0.0.1:8000 --api-key KEY
    python benchmarks/serve_load.py --max-concurrency 16 --request-rate inf

Workload: ShareGPT first turns (the packaged subset) sent to /v1/chat/completions with
stream=true; each request's output length is its ShareGPT reference reply's length in
tokens, capped at --max-tokens, with ignore_eos so that the work is fixed (as vLLM's
benchmark does); greedy unless --temperature. Arrivals are a Poisson process at
--request-rate requests/s (inf: all at once); --max-concurrency caps requests in flight.

Metrics, as vLLM's `bench serve` defines them:
- TTFT: request sent -> first streamed token chunk.
- TPOT: per request, (E2E - TTFT) / (output tokens - 1), requests with > 1 output token.
- ITL: gaps between successive token chunks of a request, pooled over all requests.
- E2E: request sent -> last chunk.
- request throughput = completed requests / benchmark duration; output token throughput =
  output tokens / duration (duration: first request sent -> last request done).
Mean, median (p50) and p99 (numpy's linear percentiles). Prints Markdown and writes
results/serve_load.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from entropic.bench.datasets import load_sharegpt_prompts
from entropic.bench.loadgen import poisson_offsets
from entropic.bench.machine import add_common_args, describe, header, write_json

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Result:
    """One request as the client saw it."""

    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


# ---- the server -------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_server(args) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "entropic.cli", "serve", "--port", str(port), "--log-level",
           "warning", "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
           "--scheduling", args.scheduling, "--max-waiting", "100000"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.model:
        cmd += ["--model", args.model]
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read()[-3000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise SystemExit("server did not become healthy in 300 s")
        time.sleep(0.3)


# ---- workload ---------------------------------------------------------------------------
def build_workload(http: httpx.Client, base: str, n: int, max_tokens: int,
                   max_prompt_tokens: int) -> list[tuple[str, int, int]]:
    """(prompt text, prompt tokens, output tokens) for the first n usable ShareGPT turns."""
    out = []
    for rec in load_sharegpt_prompts():
        msgs = [{"role": "user", "content": rec["prompt"]}]
        p = http.post(base + "/tokenize", json={"messages": msgs}).json()["count"]
        if p > max_prompt_tokens:
            continue
        ref = http.post(base + "/tokenize", json={"prompt": rec["reference"]}).json()["count"]
        out.append((rec["prompt"], p, max(2, min(ref, max_tokens))))
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} ShareGPT prompts fit {max_prompt_tokens} tokens")


async def one_request(http: httpx.AsyncClient, base: str, model: str, prompt: str,
                      n_prompt: int, n_out: int, temperature: float) -> Result:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": n_out, "ignore_eos": True, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    res = Result(ok=False, prompt_tokens=n_prompt)
    st = last = time.perf_counter()
    try:
        async with http.stream("POST", base + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                data = json.loads(line[6:])
                if "error" in data:
                    res.error = data["error"]["message"]
                    return res
                if data.get("usage"):
                    res.output_tokens = data["usage"]["completion_tokens"]
                if not data["choices"]:
                    continue
                if res.ttft == 0.0:
                    res.ttft = now - st
                else:
                    res.itl.append(now - last)
                last = now
        res.e2e = last - st
        res.ok = res.ttft > 0
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(base: str, api_key: str | None, model: str,
                   work: list[tuple[str, int, int]], offsets: list[float],
                   max_concurrency: int | None, temperature: float
                   ) -> tuple[list[Result], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(len(work), 1) + 4)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def timed(http, t0, off, item):
        await asyncio.sleep(max(0.0, t0 + off - time.perf_counter()))
        if gate is None:
            return await one_request(http, base, model, *item, temperature)
        async with gate:
            return await one_request(http, base, model, *item, temperature)

    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(600.0),
                                 limits=limits) as http:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(timed(http, t0, off, item)
                                         for off, item in zip(offsets, work)))
        return list(results), time.perf_counter() - t0


# ---- report -----------------------------------------------------------------------------
def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    summary = {"completed": len(ok), "failed": len(results) - len(ok),
               "duration_s": duration, "input_tokens": sum(r.prompt_tokens for r in ok),
               "output_tokens": out_tokens, "request_throughput": len(ok) / duration,
               "output_throughput": out_tokens / duration,
               "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok))
               / duration}
    series = {"ttft": [r.ttft for r in ok],
              "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok
                       if r.output_tokens > 1],
              "itl": [x for r in ok for x in r.itl],
              "e2e": [r.e2e for r in ok]}
    for name, xs in series.items():
        a = np.array(xs, dtype=float) * 1000.0  # ms
        for stat, fn in (("mean", np.mean), ("p50", np.median),
                         ("p99", lambda v: np.percentile(v, 99))):
            summary[f"{name}_{stat}_ms"] = float(fn(a)) if a.size else float("nan")
    return summary


def markdown(s: dict) -> str:
    rows = ["| metric | mean | p50 | p99 |", "|---|---:|---:|---:|"]
    for name, label in (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), ("itl", "ITL (ms)"),
                        ("e2e", "E2E latency (ms)")):
        rows.append(f"| {label} | {s[f'{name}_mean_ms']:.1f} | {s[f'{name}_p50_ms']:.1f} | "
                    f"{s[f'{name}_p99_ms']:.1f} |")
    rows += ["", "| throughput | value |", "|---|---:|",
             f"| completed / failed requests | {s['completed']} / {s['failed']} |",
             f"| benchmark duration (s) | {s['duration_s']:.2f} |",
             f"| request throughput (req/s) | {s['request_throughput']:.3f} |",
             f"| output token throughput (tok/s) | {s['output_throughput']:.1f} |",
             f"| total token throughput (tok/s) | {s['total_token_throughput']:.1f} |",
             f"| input / output tokens | {s['input_tokens']} / {s['output_tokens']} |"]
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default=None, help="a running server (default: spawn one)")
    ap.add_argument("--api-key", default=os.environ.get("ENTROPIC_API_KEY"))
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--request-rate", type=float, default=4.0,
                    help="Poisson arrival rate, requests/s ('inf': all at once)")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=256, help="cap on output tokens")
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    # --threads and --model: the spawned server only
    add_common_args(ap, threads=None, out=str(ROOT / "results" / "serve_load.json"),
                    quick="32 prompts, rate 2/s, at most 64 output tokens")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--scheduling", default="fcfs", choices=("fcfs", "entropic"))
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.request_rate = 32, 2.0
        args.max_tokens = min(args.max_tokens, 64)
    for name in ("num_prompts", "max_tokens", "max_prompt_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.request_rate > 0:
        ap.error("--request-rate must be > 0 (or inf)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        ap.error("--max-concurrency must be at least 1")
    proc = None
    base = args.base_url
    if base is None:
        proc, base = spawn_server(args)
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        with httpx.Client(headers=headers, timeout=60) as http:
            model = http.get(base + "/v1/models").json()["data"][0]["id"]
            work = build_workload(http, base, args.num_prompts, args.max_tokens,
                                  args.max_prompt_tokens)
        rng = random.Random(args.seed)
        offsets = ([0.0] * len(work) if args.request_rate == float("inf")
                   else poisson_offsets(len(work), args.request_rate, rng))
        results, duration = asyncio.run(run_load(base, args.api_key, model, work, offsets,
                                                 args.max_concurrency, args.temperature))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
    summary = summarize(results, duration)
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    machine = describe(args.threads)
    print("\n" + header(machine))
    print(f"serve_load: {len(work)} ShareGPT chat requests, rate {args.request_rate}/s, "
          f"max concurrency {args.max_concurrency}, model {model}\n")
    print(markdown(summary))
    for r in results:
        if not r.ok:
            print(f"failed: {r.error}", file=sys.stderr)
    write_json(args.out, {"machine": machine, "config": config, "summary": summary,
                          "requests": [asdict(r) for r in results]})
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
