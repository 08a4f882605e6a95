"""How long one large request stalls the server's other clients.

    python benchmarks/serve_stall.py                       # spawns the servers (~1-2 min)
    python benchmarks/serve_stall.py --repeats 5 --body-mb 5
    python benchmarks/serve_stall.py --base-url http://127.0.0.1:8000 \\
        --default-base-url http://127.0.0.1:8001          # servers already running

While one client streams a greedy chat completion (ignore_eos, --stream-tokens tokens) and
another polls GET /health every --health-interval s, a third sends one large body:
  tokenize     a --body-mb MB /tokenize prompt (server with --max-body-bytes raised);
  completion   the same text as a /v1/completions prompt (a 400: it exceeds the context);
  over_limit   the same /tokenize body to a server with the default body limit (a 413).
For each case and repeat: the largest gap between two stream chunks and the largest /health
latency while the large request is in flight, against a baseline window of the same stream
with no large request (--baseline-s, just before). The stall is the excess of the first
over the second. Medians over --repeats; the target is a stall under 0.2 s.

A spawned large-limit server gets `--max-body-bytes` (--max-body-mb MiB) when `entropic
serve` has that option; without it the large cases get 413 too, and the report says so.
Prints a Markdown table (with the CPU model) and writes --out (JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from entropic.bench.machine import add_common_args, describe, header, write_json

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 0.2
CASES = ("tokenize", "completion", "over_limit")


# ---- servers ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_has_option(option: str) -> bool:
    out = subprocess.run([sys.executable, "-m", "entropic.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=120)
    return option in out.stdout


class Server:
    """A spawned `entropic serve` (or, with `base`, one already running)."""

    def __init__(self, args, extra: list[str], base: str | None = None) -> None:
        self.proc: subprocess.Popen | None = None
        self.log = None
        if base is not None:
            self.base = base.rstrip("/")
            return
        port = _free_port()
        self.base = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "entropic.cli", "serve", "--port", str(port),
               "--dtype", args.dtype, "--log-level", "warning", *extra]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if args.model:
            cmd += ["--model", args.model]
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 240.0) -> None:
        deadline = time.time() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited {self.proc.returncode}:\n"
                                   f"{self.log.read()[-3000:]}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"{self.base} not healthy after {timeout:.0f} s")
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---- the clients --------------------------------------------------------------------------
class HealthPoller(threading.Thread):
    """GET /health every `interval` s on one keep-alive connection; records (sent, latency).
    A poll that takes longer delays the next one (its latency is what is measured)."""

    def __init__(self, base: str, interval: float, headers: dict) -> None:
        super().__init__(daemon=True)
        self.base, self.interval, self.headers = base, interval, headers
        self.samples: list[tuple[float, float]] = []
        self.errors = 0
        self._halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=60, headers=self.headers) as http:
            nxt = time.perf_counter()
            while not self._halt.is_set():
                t0 = time.perf_counter()
                try:
                    http.get(self.base + "/health")
                except httpx.HTTPError:
                    self.errors += 1
                self.samples.append((t0, time.perf_counter() - t0))
                nxt = max(nxt + self.interval, time.perf_counter())
                self._halt.wait(max(0.0, nxt - time.perf_counter()))

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


class Streamer(threading.Thread):
    """One streamed chat completion; records the arrival time of every chunk."""

    def __init__(self, base: str, model: str, tokens: int, headers: dict) -> None:
        super().__init__(daemon=True)
        self.base, self.headers = base, headers
        self.body = {"model": model, "stream": True, "max_tokens": tokens, "ignore_eos": True,
                     "temperature": 0, "messages": [{"role": "user", "content":
                                                     "Tell me a long story about a lighthouse."}]}
        self.arrivals: list[float] = []
        self.done_at: float | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            with httpx.Client(timeout=120, headers=self.headers) as http, \
                    http.stream("POST", self.base + "/v1/chat/completions",
                                json=self.body) as r:
                if r.status_code != 200:
                    self.error = f"stream answered {r.status_code}"
                    return
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.arrivals.append(time.perf_counter())
        except httpx.HTTPError as e:
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.done_at = time.perf_counter()

    def wait_chunks(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.perf_counter() + timeout
        while len(self.arrivals) < n:
            if self.done_at is not None or time.perf_counter() > deadline:
                raise RuntimeError(f"stream stalled before {n} chunks: {self.error}")
            time.sleep(0.005)


def max_gap(arrivals: list[float], t0: float, t1: float) -> float | None:
    """The largest gap between consecutive chunks whose interval overlaps [t0, t1]."""
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= t0 and a <= t1]
    return max(gaps) if gaps else None


def max_latency(samples: list[tuple[float, float]], t0: float, t1: float) -> float | None:
    """The largest /health latency among polls in flight at some time in [t0, t1]."""
    lat = [d for s, d in samples if s <= t1 and s + d >= t0]
    return max(lat) if lat else None


# ---- one measurement ---------------------------------------------------------------------
@dataclass
class Trial:
    case: str
    repeat: int
    status: int = 0
    request_s: float = 0.0
    baseline_gap_s: float | None = None
    gap_s: float | None = None
    baseline_health_s: float | None = None
    health_s: float | None = None
    stream_covered: bool = True  # the stream ran through the whole large request
    note: str = ""


def big_text(n_bytes: int, seed: int = 0) -> str:
    """Prose-like text (a few thousand distinct words) of about n_bytes characters."""
    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = ["".join(rng.choice(letters[:rng.randint(6, 26)]) for _ in range(rng.randint(2, 9)))
             for _ in range(4000)]
    out, size = [], 0
    while size < n_bytes:
        w = rng.choice(words) + (". " if rng.random() < 0.08 else " ")
        out.append(w)
        size += len(w)
    return "".join(out)[:n_bytes]


def trial(case: str, repeat: int, base: str, model: str, payload: bytes, path: str,
          args, headers: dict) -> Trial:
    t = Trial(case, repeat)
    poller = HealthPoller(base, args.health_interval, headers)
    stream = Streamer(base, model, args.stream_tokens, headers)
    poller.start()
    stream.start()
    try:
        stream.wait_chunks(8)  # past the prefill: steady decode
        b0 = time.perf_counter()
        time.sleep(args.baseline_s)
        b1 = time.perf_counter()
        with httpx.Client(timeout=300, headers=headers) as http:
            r0 = time.perf_counter()
            resp = http.post(base + path, content=payload,
                             headers={"Content-Type": "application/json"})
            _ = resp.content  # read whole, never parsed here (the client's GIL stays free)
            r1 = time.perf_counter()
        t.status, t.request_s = resp.status_code, r1 - r0
        stream.join(120)
        poller.stop()
        w1 = max(r1, r0 + 3 * args.health_interval)  # a 413 is quicker than one poll
        t.baseline_gap_s = max_gap(stream.arrivals, b0, b1)
        t.gap_s = max_gap(stream.arrivals, r0, w1)
        t.baseline_health_s = max_latency(poller.samples, b0, b1)
        t.health_s = max_latency(poller.samples, r0, w1)
        t.stream_covered = bool(stream.arrivals) and stream.arrivals[-1] >= r1
        if stream.error:
            t.note = stream.error
        elif not t.stream_covered:
            t.note = "the stream ended before the large request did (raise --stream-tokens)"
    finally:
        poller.stop()
        stream.join(120)
    return t


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(trials: list[Trial]) -> list[dict]:
    rows = []
    for case in CASES:
        ts = [t for t in trials if t.case == case]
        if not ts:
            continue
        row = {"case": case, "repeats": len(ts),
               "status": sorted({t.status for t in ts}),
               "request_s": _median([t.request_s for t in ts]),
               "baseline_gap_s": _median([t.baseline_gap_s for t in ts]),
               "gap_s": _median([t.gap_s for t in ts]),
               "baseline_health_s": _median([t.baseline_health_s for t in ts]),
               "health_s": _median([t.health_s for t in ts]),
               "stream_covered": all(t.stream_covered for t in ts)}
        row["stream_stall_s"] = _excess(row["gap_s"], row["baseline_gap_s"])
        row["health_stall_s"] = _excess(row["health_s"], row["baseline_health_s"])
        stalls = [s for s in (row["stream_stall_s"], row["health_stall_s"]) if s is not None]
        row["target_met"] = bool(stalls) and max(stalls) <= TARGET_S
        rows.append(row)
    return rows


def _excess(x, base):
    return None if x is None or base is None else max(0.0, x - base)


def _f(x, digits=3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"CPU: {meta['cpu']} ({meta['cpus']} logical CPUs); body {meta['body_bytes']:,} "
             f"bytes; stream {meta['stream_tokens']} tokens; /health every "
             f"{meta['health_interval_s'] * 1000:.0f} ms; medians of {meta['repeats']} repeats"
             + ("" if meta["max_body_bytes_supported"] else
                "; NOTE: this `entropic serve` has no --max-body-bytes, so every large case "
                "hit the default limit"),
             "",
             "| case | status | request s | max chunk gap s (baseline -> during) | stream stall s "
             "| max /health s (baseline -> during) | /health stall s | <= 0.2 s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['case']} | {','.join(map(str, r['status']))} | {_f(r['request_s'], 2)} | "
            f"{_f(r['baseline_gap_s'])} -> {_f(r['gap_s'])} | {_f(r['stream_stall_s'])} | "
            f"{_f(r['baseline_health_s'])} -> {_f(r['health_s'])} | "
            f"{_f(r['health_stall_s'])} | {'yes' if r['target_met'] else 'NO'}"
            + ("" if r["stream_covered"] else " (stream ended early)") + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default=None,
                    help="a running server with a body limit above --body-mb (default: spawn)")
    ap.add_argument("--default-base-url", default=None,
                    help="a running server with the default body limit, for over_limit "
                         "(default: spawn)")
    ap.add_argument("--api-key", default=os.environ.get("ENTROPIC_API_KEY"))
    ap.add_argument("--body-mb", type=float, default=5.0, help="size of the large bodies (MB)")
    ap.add_argument("--max-body-mb", type=float, default=8.0,
                    help="--max-body-bytes of the spawned large-limit server (MiB)")
    ap.add_argument("--stream-tokens", type=int, default=128)
    ap.add_argument("--health-interval", type=float, default=0.02)
    ap.add_argument("--baseline-s", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--dtype", default="float32")
    # --threads and --model: the spawned servers'
    add_common_args(ap, threads=1, out=str(ROOT / "results" / "serve_stall.json"), quick=None)
    args = ap.parse_args()

    cases = [c for c in args.cases.split(",") if c]
    bad = set(cases) - set(CASES)
    if bad:
        ap.error(f"--cases: unknown {sorted(bad)}; choose from {', '.join(CASES)}")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    supported = True
    servers: list[Server] = []
    try:
        if args.base_url is None:
            supported = serve_has_option("--max-body-bytes")
            extra = ["--max-num-seqs", "8"]
            if supported:
                extra += ["--max-body-bytes", str(int(args.max_body_mb * (1 << 20)))]
            else:
                print("note: `entropic serve` has no --max-body-bytes; the large cases will "
                      "meet the default limit", file=sys.stderr)
            big = Server(args, extra)
            servers.append(big)
        else:
            big = Server(args, [], base=args.base_url)
        small = None
        if "over_limit" in cases:
            small = (Server(args, [], base=args.default_base_url) if args.default_base_url
                     else Server(args, ["--max-num-seqs", "8"]))
            if small.proc is not None:
                servers.append(small)
        for s in (big, small):
            if s is not None:
                s.wait_healthy()
        model = httpx.get(big.base + "/v1/models", headers=headers,
                          timeout=10).json()["data"][0]["id"]
        small_model = (httpx.get(small.base + "/v1/models", headers=headers, timeout=10)
                       .json()["data"][0]["id"] if small is not None else None)

        text = big_text(int(args.body_mb * 1e6))
        payloads = {  # serialized before any measurement
            "tokenize": ("/tokenize", json.dumps({"prompt": text}).encode()),
            "completion": ("/v1/completions", json.dumps(
                {"model": model, "prompt": text, "max_tokens": 1}).encode()),
            "over_limit": ("/tokenize", json.dumps({"prompt": text}).encode()),
        }
        trials = []
        for rep in range(args.repeats):
            for case in cases:
                srv, name = (small, small_model) if case == "over_limit" else (big, model)
                path, payload = payloads[case]
                t = trial(case, rep, srv.base, name, payload, path, args, headers)
                print(f"  {case:<11} repeat {rep}: {t.status} in {t.request_s:.2f} s, gap "
                      f"{_f(t.baseline_gap_s)} -> {_f(t.gap_s)} s, /health "
                      f"{_f(t.baseline_health_s)} -> {_f(t.health_s)} s {t.note}",
                      file=sys.stderr, flush=True)
                trials.append(t)
    finally:
        for s in servers:
            s.stop()

    rows = summarize(trials)
    machine = describe(args.threads)
    meta = {"machine": machine, "cpu": machine["cpu"], "cpus": os.cpu_count(), "body_bytes": len(payloads["tokenize"][1]),
            "stream_tokens": args.stream_tokens, "health_interval_s": args.health_interval,
            "baseline_s": args.baseline_s, "repeats": args.repeats,
            "max_body_bytes_supported": supported, "target_s": TARGET_S,
            "spawned": args.base_url is None, "python": platform.python_version()}
    print(header(machine))
    print(markdown(rows, meta))
    write_json(args.out, {"meta": meta, "summary": rows, "trials": [asdict(t) for t in trials]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
