"""Batched sampler: entropy, logprobs, temperature, top-k, top-p, min-p, seeded sampling.

Order of operations on one step's logits [S, V] (fp32):
1. the model distribution p = softmax(logits) (temperature 1, before any truncation) gives
   each row's exact entropy and the returned logprobs;
2. processors (a chain of `LogitsProcessor`s, e.g. the thermostat) may rewrite logits and
   per-row temperatures; they see the full distribution, before any truncation;
3. each row's tempered entropy H^T, of softmax(logits / T) at the temperature the row is
   sampled at, before truncation (see `SamplerOutput.tempered_entropies`);
4. temperature, then top-k, top-p, min-p truncate the tempered distribution;
5. a token is drawn by inversion: the first token whose cumulative probability (fp64)
   exceeds u times the row's total, u ~ U[0, 1), one uniform per row (a token of
   probability 0 is never drawn). An exponential race argmax(p / E) needs one Exp(1)
   draw per token of the vocabulary: 17.5 ms for 16 rows of 49,152 here, against 0.4 ms
   for the cumulative sums. A seeded request's u at output position i comes from a
   generator keyed by (seed, i), so the draw depends only on the seed and the position,
   never on the batch or on how many positions one step computes (speculative verify
   rows).
Greedy rows (temperature 0, or below GREEDY_BELOW) take argmax of the raw logits.

Several rows of one request (a speculative verify) are consecutive, in position order;
`SamplingBatch.draft_next` says which drafted token each must produce, and `kept` which
rows count: every row up to and including the first whose token differs from its draft.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from entropic.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling inputs for one step, built by the runner."""

    request_ids: list[str]
    params: list[SamplingParams]
    num_output_tokens: list[int]
    # [S] model entropy, set by the sampler (exact); a processor may replace it by an
    # estimate (a new tensor), which is then what the sampler reports
    entropies: torch.Tensor | None = None
    # [S] row maxima of `stats_of` (the raw logits), set when the native statistics ran
    row_max: torch.Tensor | None = None
    stats_of: torch.Tensor | None = None
    # per row, the drafted token the next row of the same request assumes (None: the
    # request's last row in this batch); None: no verify rows in the batch
    draft_next: list[int | None] | None = None
    # set by the sampler before processors accept: rows whose tokens are committed
    kept: list[bool] | None = None
    # [S] H^T per row, NaN where not measured; the sampler sets it to NaN before the
    # processors run, and a processor that measures a row's tempered entropy (at the
    # temperature it returns for that row) writes it here, so it is not measured twice
    tempered_entropies: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S] long
    entropies: torch.Tensor  # [S] fp32, nats, of the temperature-1 model distribution
    # (exact, unless a processor replaced a row's by an estimate)
    logprobs: torch.Tensor  # [S] logprob of the chosen token (temperature-1 distribution)
    top_ids: torch.Tensor | None  # [S, n]
    top_logprobs: torch.Tensor | None  # [S, n]
    temperatures: torch.Tensor  # [S] temperature each row was sampled at (0 = greedy)
    # [S] fp32, nats: H^T, the entropy of softmax(logits / T) at the row's temperature T,
    # before top-k/top-p/min-p: the distribution the token was drawn from, before
    # truncation. Rows at T = 1 (logits not rewritten) have H^T = the exact H (even where an
    # estimator replaced the reported H); greedy rows 0 (argmax
    # draws from a point mass); a row a processor measured has the processor's value; other
    # rows are measured (one more pass over the row) only when their SamplingParams ask
    # (`tempered_entropy`), and are NaN otherwise.
    tempered_entropies: torch.Tensor | None = None


class LogitsProcessor(Protocol):
    """A sampler-chain element. `apply` transforms logits and/or temperatures of the rows
    it manages, returning new tensors for what it changes (never writing into `logits`: the
    sampler reads the model's logprobs from them afterwards); `accept` observes the sampled
    tokens. It may keep per-request state."""

    def apply(self, logits: torch.Tensor, temperatures: torch.Tensor,
              batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]: ...

    def accept(self, token_ids: torch.Tensor, batch: SamplingBatch) -> None: ...

    def release(self, request_ids: Sequence[str]) -> None: ...


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Exact entropy H = -sum p log p (nats) of softmax(logits) per row; 0 * log 0 = 0."""
    return entropy_from_logprobs(torch.log_softmax(logits.float(), dim=-1))


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """H = -sum p log p per row from log-probabilities, as sum(p * log p) with the product
    written over p: `entr(p)` would take a log of every p again (~25x slower over a 49k
    vocabulary). A -inf log-probability makes 0 * -inf = NaN there; such batches take the
    `entr` path."""
    h = logp.exp().mul_(logp).sum(-1).neg_()
    if torch.isnan(h).any():
        h = torch.special.entr(logp.exp()).sum(-1)
    return h


def tempered_entropy(logits: torch.Tensor, rows: torch.Tensor, temps: torch.Tensor,
                     batch: SamplingBatch) -> torch.Tensor:
    """Entropy (nats) of softmax(logits[rows] / temps), per row: what a temperature
    controller measures. One native pass over each row, given the maxima the sampler's
    statistics already found (when they ran on these very logits); else the torch ops."""
    if batch.row_max is not None and logits is batch.stats_of:
        return torch.ops.entropic.tempered_entropy(logits, rows, batch.row_max,
                                                   temps.to(torch.float32))
    return entropy_from_logits(logits[rows] / temps[:, None])


@dataclass
class TokenScores:
    """Log-probabilities of given target tokens (teacher forcing), with top alternatives."""

    logprobs: torch.Tensor  # [N] logprob of each target under softmax(logits)
    top_ids: torch.Tensor | None  # [N, n]
    top_logprobs: torch.Tensor | None  # [N, n]


def score_tokens(logits: torch.Tensor, targets: torch.Tensor, n_top: int = 0,
                 rows_per_pass: int = 256) -> TokenScores:
    """log p(target) per row of `logits` [N, V] and the n_top most likely alternatives.

    Rows are taken `rows_per_pass` at a time so that a long prompt never materialises
    more than one slab of fp32 log-probabilities."""
    lps, tids, tlps = [], [], []
    for i in range(0, logits.shape[0], rows_per_pass):
        logp = torch.log_softmax(logits[i:i + rows_per_pass].float(), dim=-1)
        lps.append(logp.gather(1, targets[i:i + rows_per_pass, None]).squeeze(1))
        if n_top:
            v, ix = logp.topk(n_top, dim=-1)
            tlps.append(v)
            tids.append(ix)
    return TokenScores(torch.cat(lps), torch.cat(tids) if n_top else None,
                       torch.cat(tlps) if n_top else None)


def _check_logits(logits: torch.Tensor) -> None:
    """Raise on NaN anywhere or on a row with no finite value."""
    # One cheap pass: a row max is finite unless the row has a NaN, +inf, or only -inf;
    # only then run the exact (slower) test, since +inf beside finite values is allowed.
    if bool(torch.isfinite(logits.amax(dim=-1)).all()):
        return
    if not torch.isfinite(logits).any(dim=-1).all() or torch.isnan(logits).any():
        raise FloatingPointError("sampler: logits contain NaN or a row with no finite value")


def _kept_rows(tokens: list[int], request_ids: list[str],
               draft_next: list[int | None]) -> list[bool]:
    """Which rows count: a request's rows until (and with) the first that does not produce
    the drafted token its next row assumed."""
    kept, prev, alive = [], None, True
    for tok, rid, d in zip(tokens, request_ids, draft_next):
        if rid != prev:
            prev, alive = rid, True
        kept.append(alive)
        if d is not None and tok != d:
            alive = False
    return kept


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's output position (splitmix64 of both)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Sampler:
    """Samples one token per row. Holds the per-request generators of seeded requests.

    `native`: the row statistics (max, log-normaliser, entropy, argmax) come from one
    `entropic.logit_stats` call, two passes over each row, instead of a full log_softmax and
    five more ops over [S, V] (same numbers up to fp32 summation order; argmax identical);
    rows with a NaN or an infinite max take the torch path. Needs the native kernels loaded."""

    def __init__(self, processors: Sequence[LogitsProcessor] = (), native: bool = False) -> None:
        self.processors = list(processors)
        self.native = native
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_ids: Sequence[str]) -> None:
        """Forget the state of finished requests."""
        for rid in request_ids:
            self._generators.pop(rid, None)
        for p in self.processors:
            p.release(request_ids)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw = logits
        dev = logits.device
        stats = self._native_stats(logits)
        if stats is not None:
            mx, lse, entropies, argmax = stats
            batch.row_max, batch.stats_of = mx, raw
            logp = None
        else:
            _check_logits(logits)
            logp = torch.log_softmax(logits, dim=-1)
            entropies = entropy_from_logprobs(logp)
        batch.entropies = entropies
        params = batch.params
        temps = torch.tensor([0.0 if p.greedy else p.temperature for p in params],
                             dtype=torch.float32, device=dev)
        batch.tempered_entropies = torch.full_like(entropies, float("nan"))
        for proc in self.processors:
            logits, temps = proc.apply(logits, temps, batch)
        # the rows' temperatures as numbers: the decisions below are made in Python, one
        # read of the tensor instead of a few tensor ops per decision (at batch 1 those ops
        # were a tenth of the sampler's time, run with caches cold from the forward pass)
        temps_list = temps.tolist()
        tempered = self._tempered(logits, logits is raw, temps, temps_list, entropies, batch)

        # processors return new logits when they change them (never in place)
        tokens = argmax if stats is not None and logits is raw else logits.argmax(dim=-1)
        if any(t != 0 for t in temps_list):
            tokens = torch.where(temps == 0, tokens, self._sample(logits, temps, batch))
        if batch.draft_next is not None:
            batch.kept = _kept_rows(tokens.tolist(), batch.request_ids, batch.draft_next)
        for proc in self.processors:
            proc.accept(tokens, batch)

        # The chosen token's logprob always (its surprisal is a KV-block pruning signal);
        # the top alternatives only when a row asks.
        n_top = max((p.logprobs for p in params if p.logprobs is not None), default=0)
        top_ids = top_lp = None
        if logp is None:
            chosen = raw.gather(1, tokens[:, None]).squeeze(1).sub_(lse)
            if n_top > 0:
                top_lp, top_ids = raw.topk(n_top, dim=-1)
                top_lp = top_lp.sub_(lse[:, None])
        else:
            chosen = logp.gather(1, tokens[:, None]).squeeze(1)
            if n_top > 0:
                top_lp, top_ids = logp.topk(n_top, dim=-1)
        # a processor (an entropy estimator) may have replaced the model entropies
        return SamplerOutput(tokens, batch.entropies, chosen, top_ids, top_lp, temps, tempered)

    @staticmethod
    def _tempered(logits: torch.Tensor, unchanged: bool, temps: torch.Tensor,
                  temps_list: list[float], entropies: torch.Tensor,
                  batch: SamplingBatch) -> torch.Tensor:
        """H^T per row (see SamplerOutput.tempered_entropies): what processors measured,
        then what is known without a pass (T = 1 on unchanged logits: H; greedy: 0), then
        a pass over the rows that ask for it. `temps_list` is `temps` as numbers."""
        h = batch.tempered_entropies
        known = h.tolist()
        if not any(math.isnan(v) for v in known):
            return h
        model_h = None
        asks = []
        for i, v in enumerate(known):
            if not math.isnan(v):
                continue
            if temps_list[i] == 0:
                known[i] = 0.0
            elif unchanged and temps_list[i] == 1:
                model_h = entropies.tolist() if model_h is None else model_h
                known[i] = model_h[i]
            elif batch.params[i].tempered_entropy:
                asks.append(i)
        h = torch.tensor(known, dtype=h.dtype, device=h.device)
        if asks:
            rows = torch.tensor(asks, device=h.device)
            h = h.index_put((rows,), tempered_entropy(logits, rows, temps[rows], batch))
        return h

    def _native_stats(self, logits: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(max, logsumexp, entropy, argmax) per row from the native kernel, or None where it does
        not apply (not enabled, not CPU fp32 rows, or a row whose max is not finite: those
        take the checked torch path)."""
        if not (self.native and logits.device.type == "cpu" and logits.dtype == torch.float32
                and logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[1] > 0):
            return None
        mx, lse, ent, arg = torch.ops.entropic.logit_stats(logits)
        if not all(map(math.isfinite, mx.tolist())):
            return None
        return mx, lse, ent, arg

    def _sample(self, logits: torch.Tensor, temps: torch.Tensor,
                batch: SamplingBatch) -> torch.Tensor:
        params = batch.params
        safe_t = torch.where(temps > 0, temps, torch.ones_like(temps))
        x = logits / safe_t[:, None]
        top_ks = [p.top_k for p in params]
        if any(k > 0 for k in top_ks):
            V = x.shape[-1]
            ks = torch.tensor([k if 0 < k < V else V for k in top_ks], device=x.device)
            kth = x.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1)[:, None])
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        top_ps = [p.top_p for p in params]
        if any(tp < 1.0 for tp in top_ps):
            tp = torch.tensor(top_ps, dtype=probs.dtype, device=x.device)
            sorted_p, idx = probs.sort(dim=-1, descending=True)
            # drop a token when the mass strictly before it already reaches top_p
            drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= tp[:, None]
            drop_sorted[:, 0] = False  # the top token stays, however small top_p (fp32 0)
            drop = torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        min_ps = [p.min_p for p in params]
        if any(mp > 0 for mp in min_ps):
            mp = torch.tensor(min_ps, dtype=probs.dtype, device=x.device)
            probs = probs.masked_fill(probs < mp[:, None] * probs.amax(-1, keepdim=True), 0.0)
        return _draw(probs, self._uniforms(batch, probs.device))

    def _uniforms(self, batch: SamplingBatch, device: torch.device) -> torch.Tensor:
        """One u ~ U[0, 1) per row (fp64): a seeded row's from its (seed, position) stream."""
        u = torch.rand(len(batch.params), dtype=torch.float64, device=device)
        for i, p in enumerate(batch.params):
            if p.seed is None:
                continue
            rid = batch.request_ids[i]
            gen = self._generators.get(rid)
            if gen is None:
                gen = self._generators[rid] = torch.Generator(device=device)
            gen.manual_seed(position_seed(p.seed, batch.num_output_tokens[i]))
            u[i] = torch.rand(1, dtype=torch.float64, generator=gen, device=device)[0]
        return u


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds u * the row's total.

    The sums are fp64: over 49k terms rounding can move a token's share by at most ~1e-11
    of the total, where an fp32 running sum could drift by ~1e-3. A token of probability 0 adds
    nothing to the sum, so the strict comparison never lands on it."""
    cdf = probs.double().cumsum_(-1)
    target = (u * cdf[:, -1])[:, None]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # u < 1 keeps the target below the total, so no row runs off the end; a row with no
    # mass at all (not reachable: the top token always stays) would, and takes its argmax
    over = tokens >= probs.shape[-1]
    if bool(over.any()):
        tokens = torch.where(over, probs.argmax(-1), tokens)
    return tokens
