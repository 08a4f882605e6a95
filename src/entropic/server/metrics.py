"""Prometheus metrics of the server: load, KV cache, latency histograms, entropic gauges.

Counters and histograms are fed on the engine thread after each step (prometheus-client is
thread-safe); gauges that describe the present (requests, KV usage, windowed entropy and
tau rate) are set when /metrics is scraped. Each app has its own registry, so several
servers can live in one process (tests).
"""
from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from entropic.engine.engine import LLMEngine
from entropic.outputs import RequestOutput
from entropic.server.async_engine import EngineSnapshot

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TOKEN_WINDOW = 512  # recent sampled tokens behind the mean-entropy / temperature gauges
TAU_WINDOW_S = 30.0  # seconds behind the tau-rate gauge
# speculative decoding, counted as vLLM counts it (cumulative since start)
SPEC_GAUGES = (
    ("num_drafts", "drafts", "Verified drafts (one request's drafted run in one step)"),
    ("num_draft_tokens", "drafted_tokens", "Drafted tokens verified"),
    ("num_accepted_tokens", "accepted_tokens", "Drafted tokens accepted"),
    ("acceptance_rate", "acceptance_rate", "Accepted over drafted tokens"),
    ("mean_acceptance_length", "mean_acceptance_length",
     "Tokens committed per verified draft"),
    ("tokens_per_forward", "tokens_per_forward", "Tokens committed per decode forward pass"),
    ("gate_open_rate", "gate_open_rate",
     "Share of request-steps with a possible draft where the entropy gate drafted"),
    ("wasted_fraction", "wasted_fraction", "Share of decode rows spent on rejected drafts"),
)


def pruned_block_fraction(stats) -> float | None:
    """Share of the live KV blocks that decode steps skipped (EngineStats.pruned_fraction,
    cumulative since start; 0 with dense attention); None for an engine without it."""
    return getattr(stats, "pruned_fraction", None)


class ServerMetrics:
    """The metric families, and the two feeds: `on_step` (engine thread) and `render`."""

    def __init__(self, model_name: str, engine: LLMEngine) -> None:
        self.registry = r = CollectorRegistry()
        self.engine = engine
        p = "entropic_"
        self.running = Gauge(p + "requests_running", "Requests in the engine's running batch",
                             registry=r)
        self.waiting = Gauge(p + "requests_waiting", "Requests waiting in the engine's queue",
                             registry=r)
        self.in_flight = Gauge(p + "requests_in_flight",
                               "Requests held by the server (running, waiting, on their way in)",
                               registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "Fraction of KV blocks in use",
                              registry=r)
        self.kv_used = Gauge(p + "kv_blocks_used", "KV blocks in use", registry=r)
        self.kv_total = Gauge(p + "kv_blocks_total", "KV blocks in the cache", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds",
                              "Mean time per output token after the first, per request",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=E2E_BUCKETS, registry=r)
        self.generated = Counter(p + "generation_tokens", "Generated tokens", registry=r)
        self.prompt = Counter(p + "prompt_tokens", "Prompt tokens of finished requests",
                              registry=r)
        # vLLM's prefix-cache counters, in tokens (our prefix): hit rate = hits / queries
        self.cache_queries = Counter(p + "prefix_cache_queries", "Prompt tokens looked up in "
                                     "the prefix cache (requests admitted)", registry=r)
        self.cache_hits = Counter(p + "prefix_cache_hits", "Tokens found in the prefix cache "
                                  "(their KV shared, not computed)", registry=r)
        self._cache_seen = (0, 0)  # the engine's (queries, hits) at the last step
        self.finished = Counter(p + "requests_finished", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.aborted = Gauge(p + "requests_aborted", "Requests aborted (client gone) since start",
                             registry=r)
        self.rejected = Counter(p + "requests_rejected", "Requests refused, by reason",
                                ["reason"], registry=r)
        self.tau_total = Gauge(p + "tau_nats", "Engine-wide entropic time tau since start",
                               registry=r)
        self.tau_rate = Gauge(p + "tau_rate_nats_per_second",
                              f"Entropic time gained per wall second over {TAU_WINDOW_S:.0f}s",
                              registry=r)
        self.tau_per_tflop = Gauge(p + "tau_per_tflop", "Engine tau per TFLOP computed",
                                   registry=r)
        self.mean_entropy = Gauge(p + "mean_entropy_nats",
                                  f"Mean entropy of the last {TOKEN_WINDOW} sampled tokens",
                                  registry=r)
        self.mean_temperature = Gauge(p + "mean_temperature",
                                      f"Mean temperature of the last {TOKEN_WINDOW} sampled "
                                      "tokens (0 = greedy)", registry=r)
        self.pruned_fraction = self.evicted = self.blocks_live = self.blocks_attended = None
        self.prefill_dense = self.prefill_attended = None
        if pruned_block_fraction(engine.stats) is not None:
            self.pruned_fraction = Gauge(p + "pruned_block_fraction",
                                         "Share of live KV blocks that decode attention skipped "
                                         "(entropic pruning; 0 when dense), since start",
                                         registry=r)
        if hasattr(engine.stats, "decode_blocks_live"):
            # the two counts behind that share, so a reader (the entropy lens) can take
            # their rates over a window of its own; both stay 0 without a block policy
            self.blocks_live = Gauge(p + "decode_blocks_live", "KV blocks decode steps could "
                                     "attend (under a block policy), since start", registry=r)
            self.blocks_attended = Gauge(p + "decode_blocks_attended", "KV blocks decode steps "
                                         "attended (under a block policy), since start",
                                         registry=r)
        if hasattr(engine.stats, "prefill_pairs_dense"):
            self.prefill_dense = Gauge(p + "prefill_pairs_dense", "(query position, key) pairs "
                                       "block-sparse prefill chunks would attend densely, per "
                                       "layer and KV head, since start", registry=r)
            self.prefill_attended = Gauge(p + "prefill_pairs_attended", "(query position, key) "
                                          "pairs block-sparse prefill chunks attended, per "
                                          "layer and KV head, since start", registry=r)
        if hasattr(engine.stats, "blocks_evicted"):
            self.evicted = Gauge(p + "kv_blocks_evicted", "KV blocks evicted for good by the "
                                 "pruner under memory pressure, since start", registry=r)
        self.spec = None
        if getattr(engine, "speculator", None) is not None:
            # gauge name -> (key of SpeculationStats.as_dict(), help)
            self.spec = {name: (key, Gauge(p + "spec_decode_" + name, text, registry=r))
                         for name, key, text in SPEC_GAUGES}
            self.spec_by_entropy = Gauge(p + "spec_decode_acceptance_by_entropy",
                                         "Acceptance rate of drafted tokens by entropy bin "
                                         "(nats) of the last committed token", ["bin"],
                                         registry=r)
        info = Gauge(p + "model_info", "The served model", ["model"], registry=r)
        info.labels(model=model_name).set(1)
        self._lock = threading.Lock()  # guards the two windows below
        self._tokens: deque[tuple[float, float]] = deque(maxlen=TOKEN_WINDOW)
        self._tau: deque[tuple[float, float]] = deque()

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """Engine thread, after each step: each output carries its new tokens (several
        where a speculative draft was accepted)."""
        now = time.perf_counter()
        self.generated.inc(sum(len(o.new_token_ids) for o in outputs))
        q = getattr(engine.stats, "prefix_cache_queries", 0)
        h = getattr(engine.stats, "prefix_cache_hits", 0)
        self.cache_queries.inc(q - self._cache_seen[0])
        self.cache_hits.inc(h - self._cache_seen[1])
        self._cache_seen = (q, h)
        with self._lock:
            for o in outputs:
                n = len(o.new_token_ids)
                if n and o.entropies:
                    self._tokens.extend(zip(o.entropies[-n:], o.temperatures[-n:]))
            self._tau.append((now, engine.stats.tau))
            while self._tau and self._tau[0][0] < now - TAU_WINDOW_S:
                self._tau.popleft()
        for o in outputs:
            if not o.finished:
                continue
            self.finished.labels(finish_reason=o.finish_reason).inc()
            self.prompt.inc(len(o.prompt_token_ids))
            m = o.metrics
            for hist, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.e2e, m.e2e)):
                if value is not None:
                    hist.observe(value)

    def render(self, snap: EngineSnapshot, in_flight: int) -> bytes:
        """Set the present-state gauges, then the exposition text."""
        self.running.set(snap.running)
        self.waiting.set(snap.waiting)
        self.in_flight.set(in_flight)
        self.kv_used.set(snap.kv_blocks_used)
        self.kv_total.set(snap.kv_blocks_total)
        self.kv_usage.set(snap.kv_usage)
        stats = self.engine.stats
        self.aborted.set(stats.aborted)
        self.tau_total.set(stats.tau)
        self.tau_per_tflop.set(stats.tau_per_tflop)
        now = time.perf_counter()
        with self._lock:
            toks = list(self._tokens)
            taus = [x for x in self._tau if x[0] >= now - TAU_WINDOW_S]
        if toks:
            self.mean_entropy.set(sum(h for h, _ in toks) / len(toks))
            self.mean_temperature.set(sum(t for _, t in toks) / len(toks))
        # Rate over the window: tau gained since the oldest step in it, per second up to now
        # (so the gauge falls back toward 0 when the engine goes idle).
        rate = 0.0
        if len(taus) >= 2 and now > taus[0][0]:
            rate = (taus[-1][1] - taus[0][1]) / (now - taus[0][0])
        self.tau_rate.set(rate)
        if self.pruned_fraction is not None:
            self.pruned_fraction.set(pruned_block_fraction(stats))
        if self.evicted is not None:
            self.evicted.set(stats.blocks_evicted)
        if self.blocks_live is not None:
            self.blocks_live.set(stats.decode_blocks_live)
            self.blocks_attended.set(stats.decode_blocks_attended)
        if self.prefill_dense is not None:
            self.prefill_dense.set(stats.prefill_pairs_dense)
            self.prefill_attended.set(stats.prefill_pairs_attended)
        if self.spec is not None:
            d = self.engine.speculator.stats.as_dict()
            for key, gauge in self.spec.values():
                gauge.set(d[key])
            for label, row in d["by_entropy"].items():
                self.spec_by_entropy.labels(bin=label).set(row["rate"])
        return generate_latest(self.registry)
