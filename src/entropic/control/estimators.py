"""Entropy estimators behind one batched interface (design section 3).

All take logits [S, V] and return entropies [S] in nats, of the temperature-1 distribution.
- exact: H = -sum_x p(x) log p(x) over the whole vocabulary;
- top-k: the same sum over the k most likely tokens only (a lower bound on H);
- top-k with tail correction: adds the tail mass r = 1 - sum_topk p spread evenly over the
  other |V| - k tokens, -r log(r / (|V| - k)); the uniform spread maximises the tail's
  entropy, so this bounds the tail's contribution from above.
Control laws use the floored value H_hat = max(H_est, H_min) (`floor_entropy`), which
protects them from over-confident, badly calibrated distributions.

Which one the engine uses: `choose_estimator` (from measured cost), overridden by
`LLM(entropy_estimator=...)` or per request by `SamplingParams.entropy_estimator`;
`EntropyEstimate` puts the choice into the sampler chain.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Protocol

import torch


class EntropyEstimator(Protocol):
    name: str

    def __call__(self, logits: torch.Tensor) -> torch.Tensor: ...


class ExactEntropy:
    """O(|V|): log-softmax, then -sum p log p with 0 log 0 = 0."""

    name = "exact"

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits.float(), dim=-1)
        return torch.special.entr(logp.exp()).sum(-1)


class TopKEntropy:
    """-sum over the k largest probabilities of p log p (true, not renormalised, p)."""

    def __init__(self, k: int) -> None:
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        self.k = k
        self.name = f"top{k}"

    def _top(self, logits: torch.Tensor) -> torch.Tensor:
        x = logits.float()
        k = min(self.k, x.shape[-1])
        top = x.topk(k, dim=-1).values
        return top - torch.logsumexp(x, dim=-1, keepdim=True)  # log p of the top k

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.special.entr(self._top(logits).exp()).sum(-1)


class TopKTailEntropy(TopKEntropy):
    """Top-k plus the tail mass spread uniformly over the remaining |V| - k tokens."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.name = f"top{k}+tail"

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        logp = self._top(logits)
        p = logp.exp()
        head = torch.special.entr(p).sum(-1)
        rest = logits.shape[-1] - logp.shape[-1]
        if rest == 0:
            return head
        r = (1.0 - p.sum(-1)).clamp_min(0.0)
        # -r log(r / rest) = entr(r) + r log(rest); entr handles r = 0
        return head + torch.special.entr(r) + r * torch.log(torch.tensor(float(rest)))


def make_estimator(name: str) -> EntropyEstimator:
    """'exact', 'topK' or 'topK+tail' (e.g. 'top32+tail')."""
    if name == "exact":
        return ExactEntropy()
    if name.startswith("top"):
        body, tail = (name[3:-5], True) if name.endswith("+tail") else (name[3:], False)
        if body.isdigit():
            return TopKTailEntropy(int(body)) if tail else TopKEntropy(int(body))
    raise ValueError(f"entropy estimator: unknown {name!r}; use exact, topK or topK+tail")


def floor_entropy(h: torch.Tensor, h_min: float | torch.Tensor) -> torch.Tensor:
    """H_hat = max(H_est, H_min)."""
    return torch.maximum(h, torch.as_tensor(h_min, dtype=h.dtype, device=h.device))


# ---- which estimator the engine uses --------------------------------------------------------
# An estimator replaces the exact entropy only where it is clearly cheaper than the exact
# entropy it replaces: under half its measured cost (timings on a loaded machine vary by tens
# of percent; a closer call would flip from run to run).
SWITCH_BELOW = 0.5
CANDIDATES = ("top32+tail", "top128+tail")  # bounded bias (upper bounds); plain top-k is not


def _median_seconds(fns: dict[str, Callable[[], object]], rounds: int = 5) -> dict[str, float]:
    """Median seconds per call of each fn, the fns alternating within each round."""
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {n: [] for n in fns}
    names = list(fns)
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(v) for n, v in times.items()}


def choose_estimator(vocab_size: int, native_stats: bool, rows: int = 64,
                     device: str = "cpu") -> tuple[str, str]:
    """(estimator name, why) for an engine whose sampler works on `vocab_size` logits per
    row, `rows` rows per decode step.

    With the native row statistics the sampler gets the exact entropy in the pass that
    computes the log-normaliser it needs anyway for logprobs (one multiply-add per logit):
    an estimator would be a call on top of that pass, never instead of it, so exact is
    chosen without timing. On the torch path the exact entropy is an exp-multiply-sum
    over the log-probabilities the sampler already has; it is timed against the candidate
    estimators on logits of this vocabulary, and a candidate is chosen only when it costs
    under SWITCH_BELOW of it (docs/entropy.md has the measurements)."""
    if native_stats:
        return "exact", ("exact: the sampler's native row statistics compute it in the pass "
                         "that finds the log-normaliser (an estimator could only add a call)")
    from entropic.sampling.sampler import entropy_from_logprobs
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(rows, vocab_size, generator=g) * 3).to(device)
    logp = torch.log_softmax(x, dim=-1)
    fns: dict[str, Callable[[], object]] = {"exact": lambda: entropy_from_logprobs(logp)}
    for name in CANDIDATES:
        fns[name] = (lambda e=make_estimator(name): e(x))
    t = _median_seconds(fns)
    best = min(CANDIDATES, key=t.__getitem__)
    ms = ", ".join(f"{n} {v * 1e3:.2f} ms" for n, v in t.items())
    if t[best] < SWITCH_BELOW * t["exact"]:
        return best, f"{best}: measured on {rows} x {vocab_size} logits ({ms})"
    return "exact", f"exact: no estimator under {SWITCH_BELOW:g}x its cost ({rows} x {vocab_size} logits: {ms})"


class EntropyEstimate:
    """Sampler-chain element (first in the chain): where a row's estimator is not exact,
    replaces the sampler's exact entropy by the estimate, so that the control laws, the
    clock and the outputs read the estimate. A request's `SamplingParams.entropy_estimator`
    overrides the engine's `default`. Rows on the exact estimator are not touched."""

    def __init__(self, default: str = "exact") -> None:
        self.default = default
        self._made: dict[str, EntropyEstimator] = {}
        self.estimator(default)  # validates the name

    def estimator(self, name: str | None) -> EntropyEstimator | None:
        """The estimator `name` (None: the default) stands for; None for exact."""
        name = name or self.default
        if name == "exact":
            return None
        est = self._made.get(name)
        if est is None:
            est = self._made[name] = make_estimator(name)
        return est

    def apply(self, logits: torch.Tensor, temperatures: torch.Tensor, batch
              ) -> tuple[torch.Tensor, torch.Tensor]:
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(batch.params):
            name = p.entropy_estimator or self.default
            if name != "exact":
                groups.setdefault(name, []).append(i)
        if groups:
            h = batch.entropies.clone()
            for name, rows in groups.items():
                idx = torch.tensor(rows, device=logits.device)
                h[idx] = self.estimator(name)(logits[idx]).to(h.dtype)
            batch.entropies = h
        return logits, temperatures

    def accept(self, token_ids: torch.Tensor, batch) -> None:
        pass

    def release(self, request_ids) -> None:
        pass
