"""The entropy gate: draft where the model is sure, as far as the drafts pay.

Two online estimates (docs/speculative.md states the law and its constants):
- acceptance a_j(c, h, m): the chance that drafted token j is accepted given that tokens
  1..j-1 were, per sampling class c (greedy or sampled), bin h of the entropy of the
  distribution the last committed token was drawn from, bin m of the suffix-match length
  that produced the draft, and position j (1, 2, 3, 4+). Beta priors (weight PRIOR_WEIGHT):
  for j = 1 centred on PRIOR_MATCH * exp(-h) (the most likely token of a distribution with
  entropy h has probability at least exp(-h)), for later positions at least PRIOR_LATER;
  every verify updates the positions it tested. Drafted token j then adds
  g_j = a_1 * ... * a_j expected tokens;
- step time t(R) of a decode step that computes R rows, from the engine's own pure decode
  steps (drafting, sampling and emitting included; all-greedy steps apart from sampling
  ones), fitted online per batch-size bucket as t = a + b R + e ceil(R / TILE_ROWS) + c V
  + d K, where V is the KV positions the verify rows attend and K those the decode rows
  attend (summed over rows): least squares with exponential forgetting (FORGET per step), so
  one more verify row of a request at context L costs b + c L, plus e where it starts a new
  tile of TILE_ROWS rows, and c(k) = t(R + k) / t(R). One fit over all the steps of a
  bucket, not a time per R: a width drafted rarely gets its time from the whole line, not
  from its own few noisy steps taken at whatever context they happened at. The tile term
  is the matmuls' row blocking: on AMX the 17th row of a step costs ~15 % of the step (a
  second pass of 16-row tiles), the 2nd to 16th ~1 % each; where a CPU has no such steps
  the fit finds e near 0.
The rule: with E the tokens a step commits without drafts (one per decoding request) and R
its rows, order the drafted tokens of all requests by their expected gain g (each step
takes the candidate with the highest next g), then draft the first n of that order, for
the n that maximises the expected tokens per second (E + g_1 + ... + g_n) / t(R + n); n = 0
where no draft pays. With a cost linear in the rows this is the marginal rule "add while
g > (E + G) (t(R + 1) / t(R) - 1)"; over a tile step it drafts a whole tile's worth of
rows where together they pay, and none where only the first would be bought.
Exploration: a bin whose first position has been tested fewer than EXPLORE_TRIES times
drafts one token whatever the bar says, so that a pessimistic prior cannot keep a bin shut
for good (bounded cost: EXPLORE_TRIES one-row drafts per bin over the engine's life), but
only where that row costs at most EXPLORE_MAX_TOKENS of the step's tokens (E (t(R + 1) /
t(R) - 1)): never a new tile at batch 16.
The gate is open for a request when its first drafted token is in the plan. As the batch
grows, E grows, and speculation switches itself off where rows stop being free.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np

# Entropy bin edges (nats) of the last committed token's distribution.
ENTROPY_EDGES = (0.05, 0.25, 0.5, 1.0, 2.0, 4.0)
PRIOR_WEIGHT = 4.0  # pseudo-observations behind the exp(-h) prior
POSITION_BINS = 4  # draft positions 1, 2, 3 and 4+ are estimated apart
PRIOR_LATER = 0.7  # prior a_j for j > 1: a lookup that was right so far stays right often
PRIOR_MATCH = 0.6  # the prior's share for a prompt-lookup match (the draft may be wrong
#                    even where the model is sure)
EXPLORE_TRIES = 8  # first-position tests per bin before the bar alone decides
EXPLORE_MAX_TOKENS = 0.5  # an exploring row may cost at most this many of a step's tokens
TILE_ROWS = 16  # rows per matmul tile (AMX's tile height); the fit's e prices a new tile
EMA = 0.2  # weight of a new step-time measurement (StepTimes)
FORGET = 0.99  # RowCost: weight left to a step after each later one (~100 steps' memory)
MIN_FIT_STEPS = 8  # RowCost: steps measured in a bucket before its fit replaces the prior
RIDGE = 1e-3  # RowCost: pull of b, c, d and e towards 0, relative to the intercept's scale
MAX_ROWS_TRACKED = 256
# Before a step with more rows has been measured: one more row costs this share of a row
# measured so far (a weight-streaming-bound decode step is nearly free to widen).
PRIOR_ROW_COST = 0.05


def entropy_bin(h: float) -> int:
    return bisect.bisect_right(ENTROPY_EDGES, h)


def bin_label(b: int) -> str:
    lo = ENTROPY_EDGES[b - 1] if b > 0 else 0.0
    hi = ENTROPY_EDGES[b] if b < len(ENTROPY_EDGES) else math.inf
    return f"[{lo:g}, {hi:g})"


@dataclass
class _Counts:
    tries: float = 0.0  # drafted tokens that were tested (up to and including a rejection)
    accepted: float = 0.0


@dataclass
class StepTimes:
    """EMA seconds of pure decode steps by number of rows."""

    seconds: dict[int, float] = field(default_factory=dict)
    # sorted rows measured and their non-decreasing times, rebuilt after a record (the
    # gate asks for many times per step, the engine records one per step)
    _known: list[int] = field(default_factory=list, repr=False)
    _mono: list[float] = field(default_factory=list, repr=False)

    def record(self, rows: int, seconds: float) -> None:
        if not 0 < rows <= MAX_ROWS_TRACKED or not seconds > 0:
            return
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else (1 - EMA) * old + EMA * seconds
        self._known, self._mono = sorted(self.seconds), []
        run = 0.0
        for r in self._known:
            run = max(run, self.seconds[r])
            self._mono.append(run)

    def time(self, rows: int) -> float | None:
        """t(rows): measured (made non-decreasing), interpolated or extrapolated; None
        before any measurement."""
        if not self.seconds:
            return None
        known, mono = self._known, self._mono
        i = bisect.bisect_left(known, rows)
        if i < len(known) and known[i] == rows:
            return mono[i]
        if i == 0:
            return mono[0]
        if i < len(known):  # between two measurements
            r0, r1 = known[i - 1], known[i]
            w = (rows - r0) / (r1 - r0)
            return mono[i - 1] + w * (mono[i] - mono[i - 1])
        # beyond the largest: the slope of the last two points, or a prior one per row
        slope = ((mono[-1] - mono[-2]) / (known[-1] - known[-2]) if len(known) > 1
                 else PRIOR_ROW_COST * mono[-1] / known[-1])
        return mono[-1] + max(slope, 0.0) * (rows - known[-1])

    def ratio(self, rows: int, more: int = 1) -> float:
        """t(rows + more) / t(rows)."""
        base = self.time(rows)
        if base is None:
            return 1.0 + PRIOR_ROW_COST * more / rows
        return self.time(rows + more) / base


def batch_bucket(requests: int) -> int:
    """1, 2-3, 4-7, 8-15, ... decoding requests."""
    return max(requests, 1).bit_length()


def tiles(rows: int) -> int:
    """Matmul row tiles a step of `rows` rows takes: ceil(rows / TILE_ROWS)."""
    return -(-rows // TILE_ROWS)


Coef = tuple[float, float, float, float, float]  # a, b, c, d, e


@dataclass
class _LineFit:
    """Weighted least squares of t = a + b R + c V + d K + e ceil(R / TILE_ROWS) with
    exponential forgetting (R rows, V the positions the verify rows attend and K those the
    requests' own decode rows attend, in thousands): the decayed sums X'X and X't. V and K
    are apart because the two are not priced alike: a request's first row reads its KV from
    memory, its verify rows find much of it in cache."""

    xx: np.ndarray = field(default_factory=lambda: np.zeros((5, 5)))
    xt: np.ndarray = field(default_factory=lambda: np.zeros(5))
    steps: int = 0
    coef: Coef | None = None

    def add(self, rows: int, verify_kilo: float, base_kilo: float, seconds: float) -> None:
        x = np.array((1.0, float(rows), verify_kilo, base_kilo, float(tiles(rows))))
        self.xx = FORGET * self.xx + np.outer(x, x)
        self.xt = FORGET * self.xt + x * seconds
        self.steps += 1
        self.coef = self._solve() if self.steps >= MIN_FIT_STEPS else None

    def _solve(self) -> Coef | None:
        """Least squares with every coefficient >= 0 (more work never costs less, and a
        step never costs less than nothing): where the free solution has a negative one,
        the most negative is fixed at 0 and the rest solved again. Clamping it after the
        solve instead leaves the others fitted to compensate for it (a fit at batch 16
        read a = 237 ms against steps of 60-80 ms, with d < 0 clamped: its rows looked
        free)."""
        xx = self.xx + RIDGE * max(self.xx[0, 0], 1e-12) * np.diag((0.0, 1.0, 1.0, 1.0, 1.0))
        free = list(range(len(self.xt)))
        while True:
            try:
                sol = np.linalg.solve(xx[np.ix_(free, free)], self.xt[free])
            except np.linalg.LinAlgError:
                return None
            worst = min(range(len(free)), key=lambda i: sol[i], default=None)
            if worst is None or sol[worst] >= 0:
                break
            del free[worst]
        coef = np.zeros(len(self.xt))
        coef[free] = sol
        return tuple(coef.tolist())


class RowCost:
    """What one more verify row costs: per batch-size bucket, the line
    t = a + b R + c V + d K + e ceil(R / TILE_ROWS) fitted to the bucket's pure decode
    steps (module docstring)."""

    def __init__(self) -> None:
        self._fits: dict[int, _LineFit] = {}

    def record(self, requests: int, rows: int, verify_attended: float, attended: int,
               seconds: float) -> None:
        """A pure decode step: `requests` decode rows attending `attended` positions, and
        rows - requests verify rows attending `verify_attended`."""
        if requests > 0 and rows >= requests and seconds > 0:
            self._fits.setdefault(batch_bucket(requests), _LineFit()).add(
                rows, verify_attended / 1000.0, attended / 1000.0, seconds)

    def line(self, requests: int) -> Coef | None:
        """(a, b, c, d, e) of the bucket of `requests` (seconds; c and d per thousand
        positions); None before MIN_FIT_STEPS steps."""
        fit = self._fits.get(batch_bucket(requests))
        return None if fit is None else fit.coef

    def view(self, requests: int, attended: int) -> "StepCost":
        """The step about to run: `requests` decode rows attending `attended` positions."""
        return StepCost(self.line(requests), requests, attended)


@dataclass
class StepCost:
    """t(R + more) / t(R) for one step; each verify row attends the step's mean context."""

    coef: Coef | None
    requests: int
    attended: int

    def ratio(self, rows: int, more: int = 1) -> float:
        if self.coef is None:
            return 1.0 + PRIOR_ROW_COST * more / rows
        a, b, c, d, e = self.coef
        kilo = self.attended / 1000.0
        per_row = b + c * kilo / max(self.requests, 1)
        base = (a + b * rows + c * kilo * (rows - self.requests) / max(self.requests, 1)
                + d * kilo + e * tiles(rows))
        if base <= 0:  # a line that does not describe this step: the prior
            return 1.0 + PRIOR_ROW_COST * more / rows
        return 1.0 + (per_row * more + e * (tiles(rows + more) - tiles(rows))) / base


class AcceptanceModel:
    """Online acceptance estimates by (greedy?, entropy bin, match-length bin) and draft
    position: a_j, the chance that drafted token j is accepted given that tokens 1..j-1
    were (a lookup that was right so far tends to stay right, so a_j grows with j)."""

    def __init__(self, max_match: int, positions: int = POSITION_BINS) -> None:
        self.max_match = max_match
        self.positions = positions
        self._counts: dict[tuple[bool, int, int, int], _Counts] = {}

    def key(self, greedy: bool, entropy: float, match: int) -> tuple[bool, int, int]:
        return greedy, entropy_bin(entropy), min(match, self.max_match)

    def prior(self, key: tuple[bool, int, int], position: int) -> float:
        greedy, hb, _ = key
        edges = (0.0, *ENTROPY_EDGES)
        h_mid = (edges[hb] + edges[hb + 1]) / 2 if hb + 1 < len(edges) else edges[hb]
        first = PRIOR_MATCH * math.exp(-h_mid) * (1.0 if greedy else 0.8)
        return first if position == 1 else max(first, PRIOR_LATER)

    def rates(self, key: tuple[bool, int, int], k: int) -> list[float]:
        """[a_1, ..., a_k]."""
        out = []
        for j in range(1, k + 1):
            c = self._counts.get((*key, min(j, self.positions)))
            p = self.prior(key, j)
            out.append(p if c is None else (c.accepted + PRIOR_WEIGHT * p)
                       / (c.tries + PRIOR_WEIGHT))
        return out

    def tries(self, key: tuple[bool, int, int], position: int = 1) -> float:
        """How often draft position `position` of this bin has been tested."""
        c = self._counts.get((*key, min(position, self.positions)))
        return 0.0 if c is None else c.tries

    def rate(self, key: tuple[bool, int, int]) -> float:
        return self.rates(key, 1)[0]

    def observe(self, key: tuple[bool, int, int], drafted: int, accepted: int) -> None:
        """Tokens 1..accepted were accepted; token accepted + 1 (if drafted) was not."""
        for j in range(1, min(accepted + 1, drafted) + 1):
            c = self._counts.setdefault((*key, min(j, self.positions)), _Counts())
            c.tries += 1
            c.accepted += j <= accepted


@dataclass
class Candidate:
    """One request that could draft this step."""

    request_id: str
    key: tuple[bool, int, int]
    max_tokens: int  # draft tokens available and allowed
    explore: bool = False  # its bin is still being explored: draft at least one token


def plan(candidates: list[Candidate], rates: dict[str, list[float]],
         times: StepTimes | StepCost, base_rows: int, base_tokens: int) -> dict[str, int]:
    """Draft length per request by the rule of the module docstring; rates[id] = [a_1,
    a_2, ...], the conditional acceptance of each draft position; `times` prices rows
    (its ratio(rows, more) = t(rows + more) / t(rows))."""
    k = {c.request_id: 0 for c in candidates}
    if base_rows <= 0:
        return k
    limit = {c.request_id: min(c.max_tokens, len(rates[c.request_id])) for c in candidates}
    reach = {c.request_id: 1.0 for c in candidates}  # P(all drafted so far accepted)
    rows, tokens = base_rows, float(base_tokens)
    for c in candidates:
        rid = c.request_id
        if (c.explore and limit[rid] > 0
                and tokens * (times.ratio(rows) - 1.0) <= EXPLORE_MAX_TOKENS):
            k[rid] = 1
            reach[rid] = rates[rid][0]
            rows += 1
            tokens += reach[rid]
    # the remaining drafted tokens, best expected gain first
    order: list[tuple[str, float]] = []
    kk, r = dict(k), dict(reach)
    while True:
        best, best_gain = None, 0.0
        for rid, n in kk.items():
            if n < limit[rid]:
                g = r[rid] * rates[rid][n]
                if g > best_gain:
                    best, best_gain = rid, g
        if best is None:
            break
        order.append((best, best_gain))
        kk[best] += 1
        r[best] = best_gain
    # the prefix of that order with the most expected tokens per unit of step time
    best_n, best_rate, gained = 0, tokens, tokens
    for n, (_, g) in enumerate(order, start=1):
        gained += g
        rate = gained / times.ratio(rows, n)
        if rate > best_rate:
            best_n, best_rate = n, rate
    for rid, _ in order[:best_n]:
        k[rid] += 1
    return k
