"""The entropic clock (design section 2): H_t, dH_t = H_{t-1} - H_t, tau = sum max(0, dH_t).

Entropic time advances only on irreversible uncertainty reduction. The clock is an engine
observer: it sees every sampled token's entropy and every request's cost, and reports
per-request readings (tau, dtau/dC) and engine-wide totals.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from entropic.outputs import Cost, EntropicReading


def entropic_time(entropies: Sequence[float]) -> float:
    """tau of one entropy trajectory."""
    return sum(max(0.0, a - b) for a, b in zip(entropies, entropies[1:]))


@dataclass
class _Track:
    last: float | None = None
    tau: float = 0.0
    n: int = 0
    sum_h: float = 0.0
    history: list[float] = field(default_factory=list)  # recent H, for predictors


class EntropicClock:
    """Per-request and engine-wide entropic time. `history` keeps the last `window` H."""

    def __init__(self, window: int = 16) -> None:
        self.window = window
        self._tracks: dict[str, _Track] = {}
        self.tau_total = 0.0
        self.tokens = 0
        self.sum_h = 0.0
        # least-squares fit of next-step dH+ on the previous H, over all requests
        self._sxy = 0.0
        self._sxx = 0.0

    def observe(self, request_id: str, entropy: float) -> float:
        """Record one step's entropy; return dH+ for it (0 for a first token)."""
        t = self._tracks.setdefault(request_id, _Track())
        gain = 0.0 if t.last is None else max(0.0, t.last - entropy)
        if t.last is not None:
            self._sxy += t.last * gain
            self._sxx += t.last * t.last
        t.last = entropy
        t.tau += gain
        t.n += 1
        t.sum_h += entropy
        t.history.append(entropy)
        if len(t.history) > self.window:
            del t.history[0]
        self.tau_total += gain
        self.tokens += 1
        self.sum_h += entropy
        return gain

    def drop_per_nat(self, default: float = 0.5) -> float:
        """kappa in E[dH+_{t+1}] ~ kappa * H_t, fitted on everything observed so far."""
        return self._sxy / self._sxx if self._sxx > 0 else default

    @property
    def mean_entropy(self) -> float | None:
        return self.sum_h / self.tokens if self.tokens else None

    def history(self, request_id: str) -> list[float]:
        t = self._tracks.get(request_id)
        return list(t.history) if t else []

    def reading(self, request_id: str, cost: Cost) -> EntropicReading | None:
        t = self._tracks.get(request_id)
        if t is None:
            return None
        return EntropicReading.of(t.tau, t.sum_h / t.n, cost)

    def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._tracks.pop(rid, None)
