"""The thermostat: entropy-stabilising temperature control (design section 4, micro scale).

A sampler-chain element (see `entropic.sampling.sampler.LogitsProcessor`) with per-request
state T_t. At each step, for every row whose request set `SamplingParams.thermostat`:
1. the row is sampled at T_t (the controller sets the row's temperature);
2. the controller measures the entropy that drives it:
   - stabilize: H_t^T, the entropy of softmax(logits / T_t), the full tempered distribution
     before top-k/top-p/min-p (which then truncate it as usual), in one native pass over the
     row when the sampler's native statistics ran (it reuses their row max);
   - follow: H_t, the model's temperature-1 entropy;
   floored at h_min (H_hat = max(H, H_min)); in stabilize mode the unfloored H_t^T is
   also handed to the sampler, which reports it per token (`SamplerOutput.tempered_entropies`);
3. after sampling (`accept`) it moves to
   stabilize: T_{t+1} = clip(T_t * exp(eta * (H* - H_hat_t^T)), T_min, T_max)
   follow:    T_{t+1} = clip(T_t * exp(eta * (H_hat_t - H*)), T_min, T_max).
In stabilize mode a too-certain distribution (H^T < H*) raises T and an uncertain one lowers
it, so the sampled entropy is held near H* wherever T_min..T_max can reach it.
Rows without a thermostat are not touched: their outputs are bit-identical to the plain
sampler's.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from entropic.control.estimators import EntropyEstimate, ExactEntropy
from entropic.sampling.sampler import SamplingBatch, tempered_entropy

_exact = ExactEntropy()


# |eta * err| beyond this moves T by more than e^30 in one step: clipping the exponent there
# changes nothing a [T_min, T_max] clip would not, and keeps exp() finite for any input.
MAX_EXPONENT = 30.0


def next_temperature(t: float, h: float, target: float, eta: float, t_min: float,
                     t_max: float, mode: str) -> float:
    """One step of the control law (h already floored)."""
    err = (target - h) if mode == "stabilize" else (h - target)
    x = eta * err
    if not -MAX_EXPONENT <= x <= MAX_EXPONENT:  # also catches NaN (an inf * 0 product)
        x = MAX_EXPONENT if x > 0 else -MAX_EXPONENT if x < 0 else 0.0
    return min(t_max, max(t_min, t * math.exp(x)))


class Thermostat:
    """Per-request temperature controller; state is released when a request finishes."""

    def __init__(self, estimates: EntropyEstimate | None = None) -> None:
        # where a request's entropy estimator is not exact, H^T is that estimator's value
        # on the tempered logits (follow mode reads the sampler's H_t, already estimated)
        self.estimates = estimates
        self._temps: dict[str, float] = {}
        self._pending: dict[int, tuple[str, float, float]] = {}  # row -> (id, next T, H)
        self.last_controlled_entropy: dict[str, float] = {}

    def temperature(self, request_id: str) -> float | None:
        """The temperature the request's next row will be sampled at (None: not controlled)."""
        return self._temps.get(request_id)

    def apply(self, logits: torch.Tensor, temperatures: torch.Tensor,
              batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [i for i, p in enumerate(batch.params) if p.thermostat is not None]
        self._pending = {}
        if not rows:
            return logits, temperatures
        temps = temperatures.clone()
        # A request's rows (a speculative verify: consecutive positions) are taken in
        # waves: its row j is sampled at the temperature its row j - 1 leads to, as if
        # the positions were decoded one after another.
        waves: list[list[int]] = []
        rank: dict[str, int] = {}
        current: dict[str, float] = {}
        for i in rows:
            p, rid = batch.params[i], batch.request_ids[i]
            j = rank.get(rid, 0)
            rank[rid] = j + 1
            if j == len(waves):
                waves.append([])
            waves[j].append(i)
            if j == 0:
                t = self._temps.get(rid)
                current[rid] = min(p.thermostat.t_max, max(p.thermostat.t_min, p.temperature)) \
                    if t is None else t
        h_model = batch.entropies.tolist() if batch.entropies is not None else None
        for wave in waves:
            t_now = [current[batch.request_ids[i]] for i in wave]
            idx = torch.tensor(wave, device=logits.device)
            t_vec = torch.tensor(t_now, dtype=logits.dtype, device=logits.device)
            temps[idx] = t_vec
            stab = [batch.params[i].thermostat.mode == "stabilize" for i in wave]
            if any(stab):
                measured = tempered_entropy(logits, idx, t_vec, batch)
                if self.estimates is not None:
                    measured = self._estimated(measured, logits, wave, t_vec, batch)
                if batch.tempered_entropies is not None:  # reported per token (H^T_t)
                    batch.tempered_entropies[idx] = measured.to(batch.tempered_entropies.dtype)
                h_tempered = measured.tolist()
            if h_model is None and not all(stab):
                h_model = _exact(logits).tolist()
            for j, i in enumerate(wave):
                th, rid = batch.params[i].thermostat, batch.request_ids[i]
                h = max(h_tempered[j] if stab[j] else h_model[i], th.h_min)
                nxt = next_temperature(t_now[j], h, th.target_entropy, th.eta, th.t_min,
                                       th.t_max, th.mode)
                current[rid] = nxt
                self._pending[i] = (rid, nxt, h)
        return logits, temps

    def _estimated(self, measured: torch.Tensor, logits: torch.Tensor, wave: list[int],
                   t_vec: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """`measured` with the rows whose request uses an estimator re-measured by it."""
        out = measured
        for j, i in enumerate(wave):
            est = self.estimates.estimator(batch.params[i].entropy_estimator)
            if est is not None:
                if out is measured:
                    out = measured.clone()
                out[j] = est(logits[i:i + 1] / t_vec[j]).to(out.dtype)[0]
        return out

    def accept(self, token_ids: torch.Tensor, batch: SamplingBatch) -> None:
        """Move each request to the temperature after its last committed row."""
        kept = batch.kept
        for i in sorted(self._pending):
            if kept is None or kept[i]:
                rid, t, h = self._pending[i]
                self._temps[rid] = t
                self.last_controlled_entropy[rid] = h
        self._pending = {}

    def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._temps.pop(rid, None)
            self.last_controlled_entropy.pop(rid, None)
