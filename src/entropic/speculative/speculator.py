"""The engine's speculation hook: drafts per step, and what came of them.

The scheduler asks `propose` once per step for the requests that decode (with how many
tokens each may draft); the model runner verifies every draft in the same pass as the
other rows; the scheduler reports each verify back through `commit`. Counters follow vLLM's
definitions: a draft is one request's drafted run in one step, acceptance rate is accepted
over drafted tokens, mean acceptance length is 1 + accepted / drafts, and a step where the
gate stays shut drafts nothing and counts as no rejection.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from entropic.engine.request import Request
from entropic.outputs import SpeculationReading
from entropic.speculative.config import SpeculativeConfig
from entropic.speculative.gate import (EXPLORE_TRIES, AcceptanceModel, Candidate, RowCost,
                                       StepTimes, batch_bucket, bin_label, plan)
from entropic.speculative.ngram import NgramProposer


# The no-regret check (docs/speculative.md): per (sampling, batch-size bucket), drafted
# steps must deliver at least the committed tokens per second that a plain step with as
# many requests delivers (its measured time), or the gate shuts; a step runs plain to
# measure that time again when PROBE_EVERY steps have passed without one (steps where no
# request found a draft count: at batch 1 they are common, and a forced plain step there
# costs a whole step's drafted tokens), and a shut bucket's drafting probes come ever more
# rarely (interval doubling up to MAX_PROBE_EVERY) while they keep losing.
YIELD_EMA = 0.1
MIN_ARM_STEPS = 4
PROBE_EVERY = 16
MAX_PROBE_EVERY = 256


class Proposer(Protocol):
    def propose(self, request_id: str, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to k drafted tokens after `tokens`, and the match length behind them."""
        ...

    def release(self, request_id: str) -> None: ...


@dataclass
class SpeculationStats(SpeculationReading):
    """Engine-wide counters, with the gate's view."""

    gate_checks: int = 0  # request-steps where a draft was possible (steps the no-regret
    #                       check keeps plain are not looked up, so not counted)
    gate_open: int = 0  # of those, the ones that drafted
    rows_computed: int = 0  # decode and verify rows
    # per entropy bin: [drafted tokens, accepted tokens]
    by_entropy: dict[str, list[int]] = field(default_factory=dict)
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def gate_open_rate(self) -> float:
        return self.gate_open / self.gate_checks if self.gate_checks else 0.0

    @property
    def wasted_fraction(self) -> float:
        """Share of decode rows whose work was thrown away (rejected drafted tokens)."""
        rejected = self.drafted_tokens - self.accepted_tokens
        return rejected / self.rows_computed if self.rows_computed else 0.0

    def as_dict(self) -> dict:
        return {
            "decode_steps": self.decode_steps, "drafts": self.drafts,
            "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
            "committed_tokens": self.committed_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "tokens_per_forward": self.tokens_per_forward,
            "gate_checks": self.gate_checks, "gate_open": self.gate_open,
            "gate_open_rate": self.gate_open_rate, "wasted_fraction": self.wasted_fraction,
            "by_entropy": {k: {"drafted": d, "accepted": a, "rate": a / d if d else 0.0}
                           for k, (d, a) in sorted(self.by_entropy.items())},
            "accepted_per_position": list(self.accepted_per_position),
        }


@dataclass
class _Gain:
    """EMA of the measured gain of drafted steps: committed tokens per second of the step
    over what a plain step with the same requests delivers (tokens / t_plain(requests))."""

    rate: float = 0.0
    n: int = 0

    def record(self, gain: float) -> None:
        self.rate = gain if self.n == 0 else (1 - YIELD_EMA) * self.rate + YIELD_EMA * gain
        self.n += 1


@dataclass
class _Regret:
    """The no-regret check of one (sampling, batch-size bucket)."""

    plain_steps: int = 0
    spec: _Gain = field(default_factory=_Gain)
    steps: int = 0
    last_plain: int = 0  # `steps` when the latest plain step was measured
    # a shut bucket drafts once per `interval` steps; each such probe that finds it still
    # losing doubles the interval (the regret of probing grows with log(steps), not steps)
    interval: int = PROBE_EVERY
    since_probe: int = 0

    def decide(self) -> str | None:
        """'plain': draft nothing this step; 'spec': draft as planned even if it loses;
        None: as planned."""
        self.steps += 1
        if self.plain_steps < MIN_ARM_STEPS or self.steps - self.last_plain >= PROBE_EVERY:
            return "plain"  # keep measuring what the step costs without drafts
        if self.spec.n < MIN_ARM_STEPS:
            return "spec"
        if self.spec.rate >= 1.0:
            self.interval, self.since_probe = PROBE_EVERY, 0
            return None
        self.since_probe += 1
        if self.since_probe < self.interval:
            return "plain"
        self.since_probe = 0
        self.interval = min(2 * self.interval, MAX_PROBE_EVERY)
        return "spec"

    def plain_measured(self) -> None:
        """This step drafted nothing (kept plain, or no request found a draft): its time
        is a plain step's."""
        self.plain_steps += 1
        self.last_plain = self.steps


class Speculator:
    """Drafter + entropy gate + counters, for one engine."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.proposer: Proposer = proposer or NgramProposer(config.prompt_lookup_min,
                                                            config.prompt_lookup_max)
        self.acceptance = AcceptanceModel(config.prompt_lookup_max)
        # the cost of verify rows, apart for all-greedy steps and steps that sample (a
        # sampled row costs a softmax, the noise and any top-k/top-p sort on top of a
        # greedy row's argmax)
        self.times = {False: RowCost(), True: RowCost()}
        self.stats = SpeculationStats()
        self._requests: dict[str, SpeculationReading] = {}
        self._keys: dict[str, tuple[bool, int, int]] = {}  # the key of this step's draft
        self.regret: dict[tuple[bool, int], _Regret] = {}
        # times of steps without drafts, by requests decoding: the counterfactual of a
        # drafted step with as many requests
        self.plain_times = {False: StepTimes(), True: StepTimes()}
        # this step's (sampling, bucket), its requests and whether it drafted; the tokens
        # it committed
        self._step: tuple[tuple[bool, int], int, bool] | None = None
        self._step_tokens = 0
        # this step's decoding requests, the KV positions they attend, and the mean context
        # of the requests that drafted (each verify row attends its request's context)
        self._shape: tuple[int, int, float] = (0, 0, 0.0)

    def propose(self, requests: Sequence[tuple[Request, int]], base_rows: int
                ) -> dict[str, list[int]]:
        """Drafts for this step: `requests` are the decoding requests with the most tokens
        each may draft; `base_rows` the rows the step computes without drafts."""
        cfg = self.config
        self._keys = {}
        self._step, self._step_tokens = None, 0
        context = {req.request_id: req.num_tokens for req, _ in requests}
        self._shape = (base_rows, sum(context.values()), 0.0)
        if cfg.disable_by_batch_size is not None and base_rows >= cfg.disable_by_batch_size:
            return {}
        drafts, cands, rates = {}, [], {}
        sampling = any(not (r.params.greedy and r.params.thermostat is None)
                       for r, _ in requests)
        verdict = None
        if cfg.gate != "fixed":
            bucket = (sampling, batch_bucket(base_rows))
            verdict = self.regret.setdefault(bucket, _Regret()).decide()
            if verdict == "plain":  # no lookups either: the step runs as without drafting
                self._step = (bucket, base_rows, False)
                return {}
        for req, cap in requests:
            k = min(cap, cfg.num_speculative_tokens)
            if k <= 0 or not req.entropies:
                continue
            draft, match = self.proposer.propose(req.request_id, req.token_ids, k)
            if not draft:
                continue
            self.stats.gate_checks += 1
            greedy = req.params.greedy and req.params.thermostat is None
            key = self.acceptance.key(greedy, req.entropies[-1], match)
            self._keys[req.request_id] = key
            drafts[req.request_id] = draft
            cands.append(Candidate(req.request_id, key, len(draft),
                                   explore=self.acceptance.tries(key) < EXPLORE_TRIES))
            rates[req.request_id] = self.acceptance.rates(key, len(draft))
        if cfg.gate == "fixed":
            lengths = {c.request_id: c.max_tokens for c in cands}
        else:
            lengths = plan(cands, rates, self.times[sampling].view(base_rows, self._shape[1]),
                           base_rows, base_rows)
            if verdict == "spec" and not any(lengths.values()):
                lengths = {c.request_id: 1 for c in cands}  # probe with one token each
            self._step = (bucket, base_rows, any(n > 0 for n in lengths.values()))
        out = {rid: drafts[rid][:n] for rid, n in lengths.items() if n > 0}
        if out:
            self._shape = (*self._shape[:2], sum(context[r] * len(d) for r, d in out.items())
                           / sum(len(d) for d in out.values()))
        self.stats.gate_open += len(out)
        return out

    def commit(self, req: Request, drafted: int, accepted: int, committed: int) -> None:
        """A decode step of `req` verified `drafted` tokens, accepted `accepted` of them and
        committed `committed` tokens in all (fewer than accepted + 1 where a stop came)."""
        self._step_tokens += committed
        r = self._requests.setdefault(req.request_id, SpeculationReading())
        for s in (r, self.stats):
            s.decode_steps += 1
            s.committed_tokens += committed
            if drafted:
                s.drafts += 1
                s.drafted_tokens += drafted
                s.accepted_tokens += accepted
        self.stats.rows_computed += 1 + drafted
        if not drafted:
            return
        key = self._keys.get(req.request_id)
        if key is not None:
            self.acceptance.observe(key, drafted, accepted)
            d_a = self.stats.by_entropy.setdefault(bin_label(key[1]), [0, 0])
            d_a[0] += drafted
            d_a[1] += accepted
        pos = self.stats.accepted_per_position
        pos.extend([0] * (drafted - len(pos)))
        for j in range(accepted):
            pos[j] += 1

    def observe_step(self, rows: int, seconds: float, sampling: bool) -> None:
        """The wall time of a step that computed only decode and verify rows (`sampling`:
        some row was sampled, not greedy), after its tokens were committed."""
        requests, attended, drafted_context = self._shape
        if requests and rows >= requests:  # each verify row attends its request's context
            self.times[sampling].record(requests, rows, (rows - requests) * drafted_context,
                                        attended, seconds)
        if self._step is not None and seconds > 0 and self._step_tokens > 0:
            bucket, requests, drafted = self._step
            regret, plain = self.regret[bucket], self.plain_times[bucket[0]]
            if not drafted:
                plain.record(rows, seconds)
                regret.plain_measured()
            elif (t_plain := plain.time(requests)) is not None:
                regret.spec.record(self._step_tokens * t_plain / (requests * seconds))
        self._step, self._step_tokens = None, 0
        self._shape = (0, 0, 0.0)

    def reading(self, request_id: str) -> SpeculationReading | None:
        return self._requests.get(request_id)

    def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._requests.pop(rid, None)
            self._keys.pop(rid, None)
            self.proposer.release(rid)


