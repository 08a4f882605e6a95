"""Open-loop load: replay timed arrivals against an engine's step loop.

Requests are added when their scheduled arrival time has passed (their latency is measured
from that scheduled time, so queueing shows in TTFT and E2E); the loop sleeps only when the
engine is idle. Shared by benchmarks/scheduling.py and the ablation.
"""
from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from entropic.outputs import RequestOutput
from entropic.sampling_params import SamplingParams


@dataclass
class TimedRequest:
    """One request of a load: token ids, sampling parameters, arrival offset in seconds."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    offset: float


@dataclass
class ReplayResult:
    """Finished outputs by request id, the makespan, the engine counters it moved, and each
    engine step's start (s from the replay's start), duration (s) and the requests running
    after it."""

    outputs: dict[str, RequestOutput]
    makespan: float
    stats: dict[str, float]
    steps: list[tuple[float, float, int]] = dataclasses.field(default_factory=list)


def poisson_offsets(n: int, rate: float, rng: random.Random) -> list[float]:
    """Arrival offsets of a Poisson process of `rate` per second, the first at 0."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def engine_counters(stats) -> dict[str, float]:
    """Numeric fields of EngineStats, nested dataclasses flattened (`cost.flops_linear`).

    Read generically so counters added later (pruning's attended/skipped blocks) appear
    without changes here."""
    out: dict[str, float] = {}
    for f in dataclasses.fields(stats):
        v = getattr(stats, f.name)
        if dataclasses.is_dataclass(v):
            for k, x in engine_counters(v).items():
                out[f"{f.name}.{k}"] = x
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f.name] = float(v)
    return out


def replay(engine, requests: Sequence[TimedRequest],
           on_finish: Callable[[RequestOutput], None] | None = None) -> ReplayResult:
    """Run `requests` (sorted by offset) through `engine` as an open-loop load."""
    before = engine_counters(engine.stats)
    pending = sorted(requests, key=lambda r: r.offset)
    t0 = time.perf_counter()
    i, finals, steps = 0, {}, []
    while i < len(pending) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while i < len(pending) and t0 + pending[i].offset <= now:
            r = pending[i]
            engine.add_request(r.request_id, r.prompt_ids, r.params, arrival_time=t0 + r.offset)
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, t0 + pending[i].offset - time.perf_counter()))
            continue
        start = time.perf_counter()
        outs = engine.step()
        steps.append((start - t0, time.perf_counter() - start,
                      len(engine.scheduler.running)))
        for out in outs:
            if out.finished:
                finals[out.request_id] = out
                if on_finish is not None:
                    on_finish(out)
    makespan = time.perf_counter() - t0
    after = engine_counters(engine.stats)
    return ReplayResult(finals, makespan, {k: after[k] - before.get(k, 0.0) for k in after},
                        steps)
