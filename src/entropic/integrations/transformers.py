"""The thermostat as a Hugging Face transformers `LogitsProcessor`, for users of `generate()`.

    from entropic import ThermostatParams
    from entropic.integrations.transformers import ThermostatLogitsProcessor
    proc = ThermostatLogitsProcessor(ThermostatParams(target_entropy=2.0), temperature=1.0)
    out = model.generate(ids, do_sample=True, temperature=1.0, logits_processor=[proc])
    temps, entropies = proc.trace()          # [rows, steps] each

The control law is `entropic.control.thermostat.next_temperature`, the engine's own; this
class only carries its state through `generate()`. Per row at step t:
1. the row's scores are divided by its T_t (the processor returns the tempered scores, so
   `generate()`'s own temperature must stay 1: `temperature=1.0`, which adds no warper);
2. the controlled entropy is measured as the engine does: stabilize, H_t^T of
   softmax(scores / T_t); follow, H_t of softmax(scores); both floored at h_min;
3. T_{t+1} = next_temperature(T_t, H, ...). T_0 is `temperature` clipped to [t_min, t_max].
transformers applies its top-k / top-p / min-p warpers after user processors, so they
truncate the tempered distribution, as in the engine. The entropy is of the scores this
processor receives: processors placed before it (a repetition penalty) change them.

Per-sequence state: every call, each row is matched to the row of the previous call whose
tokens it extends by one, so rows that beam search reorders or duplicates keep their own
temperature. A call whose rows extend none of the previous ones starts a new generation
(T_0 for every row); one where only some do is an error, since no row's state can be
trusted then.
"""
from __future__ import annotations

import torch
from transformers import LogitsProcessor

from entropic.control.thermostat import next_temperature
from entropic.sampling.sampler import entropy_from_logits
from entropic.sampling_params import SamplingParams, ThermostatParams


class ThermostatLogitsProcessor(LogitsProcessor):
    """Entropy-stabilising temperature control inside `generate()` (see the module docstring)."""

    def __init__(self, params: ThermostatParams | None = None, temperature: float = 1.0) -> None:
        self.params = params if params is not None else ThermostatParams()
        # the engine's validation of the pair (T_0 > 0, parameter ranges), same messages
        SamplingParams(temperature=temperature, thermostat=self.params)
        self.t0 = min(self.params.t_max, max(self.params.t_min, float(temperature)))
        self.reset()

    def reset(self) -> None:
        """Forget every row: the next call starts a new generation."""
        self._prev: torch.Tensor | None = None  # the last call's input_ids
        self._temps: list[float] = []  # per current row, the temperature of its next step
        # per step: (parent row of each row in the previous step, T used, controlled H)
        self._steps: list[tuple[list[int], list[float], list[float]]] = []

    def _parents(self, input_ids: torch.Tensor) -> list[int] | None:
        """For each row, the previous call's row it extends by one token; None when no row
        extends any (a new generation)."""
        prev = self._prev
        if prev is None or input_ids.shape[1] != prev.shape[1] + 1:
            return None
        head = input_ids[:, :-1]
        if head.shape == prev.shape and torch.equal(head, prev):
            return list(range(head.shape[0]))
        same = (head[:, None, :] == prev[None, :, :]).all(-1)  # [rows, previous rows]
        found = same.any(1)
        if not bool(found.any()):
            return None
        if not bool(found.all()):
            missing = (~found).nonzero().flatten().tolist()
            raise ValueError(f"ThermostatLogitsProcessor: rows {missing} extend no row of the "
                             f"previous step while others do; call reset() between "
                             f"generations")
        return same.float().argmax(1).tolist()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] != scores.shape[0]:
            raise ValueError(f"ThermostatLogitsProcessor: {input_ids.shape[0]} rows of ids, "
                             f"{scores.shape[0]} of scores")
        parents = self._parents(input_ids)
        if parents is None:
            self._steps = []
            parents = [-1] * input_ids.shape[0]
            temps = [self.t0] * input_ids.shape[0]
        else:
            temps = [self._temps[j] for j in parents]
        p = self.params
        t_vec = torch.tensor(temps, dtype=torch.float32, device=scores.device)
        tempered = scores.float() / t_vec[:, None]
        h = entropy_from_logits(tempered if p.mode == "stabilize" else scores)
        h = h.clamp_min(p.h_min).tolist()
        self._temps = [next_temperature(t, hi, p.target_entropy, p.eta, p.t_min, p.t_max,
                                        p.mode) for t, hi in zip(temps, h)]
        self._steps.append((parents, temps, h))
        self._prev = input_ids.clone()
        return tempered.to(scores.dtype)

    def trace(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(temperatures, controlled entropies), each [rows, steps]: for every row of the
        last call, the temperature each of its tokens was sampled at and the entropy the
        controller read then, following the row's ancestry through beam reordering."""
        if not self._steps:
            return torch.empty(0, 0), torch.empty(0, 0)
        n_rows, n_steps = len(self._steps[-1][0]), len(self._steps)
        temps = torch.empty(n_rows, n_steps)
        ents = torch.empty(n_rows, n_steps)
        rows = list(range(n_rows))
        for s in range(n_steps - 1, -1, -1):
            parents, t, h = self._steps[s]
            temps[:, s] = torch.tensor([t[r] for r in rows])
            ents[:, s] = torch.tensor([h[r] for r in rows])
            rows = [parents[r] for r in rows]
        return temps, ents
