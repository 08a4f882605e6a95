"""The thermostat as a vLLM V1 logits processor.

    vllm serve MODEL --logits-processors entropic_vllm:ThermostatLogitsProcessor
    LLM(MODEL, logits_processors=[ThermostatLogitsProcessor])

Per request (arguments: `entropic_vllm.params`), at the step that samples output token n:
1. vLLM has divided the row by the request's temperature T_req; the processor restores the
   temperature-1 logits z (times T_req) and returns z / T_n, so the row is sampled at T_n;
2. it reads the controlled entropy as entropic's engine does (stabilize: H of
   softmax(z / T_n); follow: H of softmax(z)), floored at h_min;
3. T_{n+1} = entropic.control.thermostat.next_temperature(T_n, H, ...), the engine's law.
T_0 is T_req clipped to [t_min, t_max]. vLLM runs this processor after its temperature and
min-p, before top-k and top-p: min-p truncates the T_req-tempered distribution (entropic's
engine truncates the T_n-tempered one); top-k and top-p act on z / T_n as in the engine.

Which token a step produced is read from the request's output list (vLLM passes a live
reference): T_{n+1} is committed only once output token n exists. A step whose token vLLM
throws away (a chunk of a prefill that is not the last) leaves the state where it was.
State is keyed by the request's SamplingParams object, which the worker keeps for the
request's whole life, through moves in the batch and through preemption (the request
leaves the batch and comes back with the same object); it is dropped when vLLM drops that
object. The processor is argmax-invariant: it only divides rows by a positive number.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from entropic.control.thermostat import next_temperature
from entropic.sampling.sampler import entropy_from_logits
from entropic_vllm.params import RequestThermostat, parse_thermostat, trace_key
from entropic_vllm.rows import update_rows

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

MAX_TRACES = 4096  # finished traces kept for fetching; the oldest go first


@dataclass
class Trace:
    """Per output token: the temperature it was sampled at, the model's entropy (temperature
    1) and the entropy the controller read. Index n is output token n."""

    temperatures: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    controlled_entropies: list[float] = field(default_factory=list)

    def record(self, n: int, t: float, h: float, h_ctrl: float) -> None:
        for values, v in ((self.temperatures, t), (self.entropies, h),
                          (self.controlled_entropies, h_ctrl)):
            del values[n:]  # a step redone (recompute after preemption) replaces its entry
            values.append(v)

    def as_dict(self) -> dict[str, list[float]]:
        return {"temperatures": list(self.temperatures), "entropies": list(self.entropies),
                "controlled_entropies": list(self.controlled_entropies)}


class _RequestState:
    def __init__(self, cfg: RequestThermostat, t_req: float, trace: Trace | None) -> None:
        self.cfg = cfg
        self.t_req = t_req
        self.t = cfg.t0  # the temperature of the next output token
        self.pending: tuple[int, float] | None = None  # (output index sampled, next T)
        self.outputs: list[int] = []
        self.trace = trace

    def temperature_now(self) -> tuple[int, float]:
        """(index of the token this step samples, its temperature)."""
        n = len(self.outputs)
        if self.pending is not None:
            done, t_next = self.pending
            if n > done:  # the pending step's token was kept
                self.t = t_next
            self.pending = None
        return n, self.t


class ThermostatLogitsProcessor(LogitsProcessor):
    """entropic's thermostat inside vLLM's sampler (see the module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params: "SamplingParams") -> None:
        parse_thermostat(sampling_params.extra_args, sampling_params.temperature)
        trace_key(sampling_params.extra_args)

    def __init__(self, vllm_config: "VllmConfig", device: torch.device,
                 is_pin_memory: bool) -> None:
        self._rows: dict[int, _RequestState] = {}  # batch index -> state
        self._states: dict[int, _RequestState] = {}  # id(SamplingParams) -> state
        self._traces: OrderedDict[str, Trace] = OrderedDict()

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        update_rows(self._rows, batch_update, self._state_of)

    def _state_of(self, params: "SamplingParams") -> _RequestState | None:
        key = id(params)
        st = self._states.get(key)
        if st is not None:
            return st  # a request back in the batch (moved out, preempted): its own state
        cfg = parse_thermostat(params.extra_args, params.temperature)
        if cfg is None:
            return None
        tkey = trace_key(params.extra_args)
        trace = None
        if tkey is not None:
            trace = self._traces[tkey] = Trace()
            while len(self._traces) > MAX_TRACES:
                self._traces.popitem(last=False)
        st = self._states[key] = _RequestState(cfg, float(params.temperature), trace)
        # the id is ours while the object lives; forget it when vLLM drops the request
        weakref.finalize(params, self._states.pop, key, None)
        return st

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        rows = sorted(self._rows)
        states = [self._rows[i] for i in rows]
        now = [st.temperature_now() for st in states]
        dev = logits.device
        idx = torch.tensor(rows, device=dev)
        t_req = torch.tensor([st.t_req for st in states], dtype=torch.float32, device=dev)
        t_now = torch.tensor([t for _, t in now], dtype=torch.float32, device=dev)
        z = logits[idx].float() * t_req[:, None]  # undo vLLM's division by T_req
        tempered = z / t_now[:, None]
        need_model = [st.cfg.params.mode == "follow" or st.trace is not None for st in states]
        h_t = entropy_from_logits(tempered).tolist()
        h_1 = entropy_from_logits(z).tolist() if any(need_model) else [None] * len(rows)
        for j, st in enumerate(states):
            p = st.cfg.params
            h = max(h_t[j] if p.mode == "stabilize" else h_1[j], p.h_min)
            n, t = now[j]
            st.pending = (n, next_temperature(t, h, p.target_entropy, p.eta, p.t_min, p.t_max,
                                              p.mode))
            if st.trace is not None:
                st.trace.record(n, t, h_1[j], h)
        logits[idx] = tempered.to(logits.dtype)
        return logits

    def pop_traces(self, keys: list[str]) -> dict[str, dict[str, list[float]]]:
        """The traces of these keys (those still held), forgotten once returned."""
        return {k: self._traces.pop(k).as_dict() for k in keys if k in self._traces}
