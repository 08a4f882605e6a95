"""Per-request sampling parameters (vLLM-shaped), validated at construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# Ranges the engine can execute. A seed seeds torch's generator, which takes any value of
# 64 bits, signed or unsigned. Temperatures below GREEDY_BELOW make fp32 logits / T overflow
# long before they would change the answer, so they sample greedily. The thermostat's
# bounds keep every exp/log of its law finite (and its exponent is clipped as well).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
GREEDY_BELOW = 1e-5
TEMPERATURE_MAX = 1e4  # beyond it a distribution is uniform to fp32 precision (and 1e39 is inf)
THERMOSTAT_T_RANGE = (1e-3, 1e3)
THERMOSTAT_MAX_ETA = 1e3
THERMOSTAT_MAX_ENTROPY = 1e3  # nats; a vocabulary of |V| tokens has at most log |V| (~12)


@dataclass(frozen=True)
class ThermostatParams:
    """Options of the entropy-stabilising temperature controller (design section 4, micro).

    stabilize (default): T_{t+1} = clip(T_t exp(eta (H* - H_t^T)), t_min, t_max), where
    H_t^T is the entropy of the tempered distribution actually sampled from.
    follow: T_{t+1} = clip(T_t exp(eta (H_t - H*)), t_min, t_max), with H_t the model's
    temperature-1 entropy (raises T where the model is uncertain).
    Entropies enter floored, max(H, h_min). The request's `temperature` is T_0.
    """

    target_entropy: float = 2.0
    eta: float = 0.2
    t_min: float = 0.2
    t_max: float = 2.0
    h_min: float = 0.0
    mode: str = "stabilize"

    def __post_init__(self) -> None:
        for name in ("target_entropy", "eta", "t_min", "t_max", "h_min"):
            _check_num(f"thermostat.{name}", getattr(self, name))
        for name in ("target_entropy", "h_min"):
            v = getattr(self, name)
            if not 0 <= v <= THERMOSTAT_MAX_ENTROPY:
                raise ValueError(f"thermostat.{name} must be in [0, {THERMOSTAT_MAX_ENTROPY:g}] "
                                 f"nats, got {v}")
        if not 0 < self.eta <= THERMOSTAT_MAX_ETA:
            raise ValueError(f"thermostat.eta must be in (0, {THERMOSTAT_MAX_ETA:g}], "
                             f"got {self.eta}")
        lo, hi = THERMOSTAT_T_RANGE
        for name in ("t_min", "t_max"):
            v = getattr(self, name)
            if not lo <= v <= hi:
                raise ValueError(f"thermostat.{name} must be in [{lo:g}, {hi:g}], got {v}")
        if self.t_min > self.t_max:
            raise ValueError(f"thermostat.t_min: need t_min <= t_max, got t_min={self.t_min}, "
                             f"t_max={self.t_max}")
        if self.mode not in ("stabilize", "follow"):
            raise ValueError(f"thermostat.mode must be 'stabilize' or 'follow', got {self.mode!r}")


@dataclass
class SamplingParams:
    """How one request is decoded.

    temperature 0 means greedy; so does any temperature below GREEDY_BELOW (1e-5), where
    fp32 logits / T would overflow (the `greedy` property; `temperature` keeps the value
    given). top_k 0 (or -1) disables top-k; top_p 1 and min_p 0 disable
    those filters. `seed` makes sampling reproducible whatever else runs in the batch.
    `logprobs=n` returns the chosen token's log-probability and the n most likely
    alternatives at every step (under the model's temperature-1 distribution).
    `prompt_logprobs=n` does the same for the prompt: each prompt token after the first gets
    its log-probability given the tokens before it (what log-likelihood evaluation needs).
    `thermostat` replaces the fixed temperature by the entropy controller (see
    ThermostatParams); `temperature` is then its starting value.
    `tempered_entropy` measures H^T, the entropy of the tempered distribution each token
    was drawn from, for every token (`RequestOutput.tempered_entropies`). It is known
    without it at temperature 1 (H^T = H), greedy (0) and under the thermostat in
    stabilize mode (its own measurement); elsewhere it costs one more pass over the
    vocabulary per token, and without it those tokens report None.
    `entropy_estimator` ("exact", "topK" or "topK+tail", e.g. "top32+tail"; None: the
    engine's choice, `LLM(entropy_estimator=...)`) is how this request's entropy is
    measured for its outputs and for the control laws (docs/entropy.md).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    thermostat: ThermostatParams | None = None
    tempered_entropy: bool = False
    entropy_estimator: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_num("temperature", self.temperature)
        if not 0 <= self.temperature <= TEMPERATURE_MAX:
            raise ValueError(f"temperature must be in [0, {TEMPERATURE_MAX:g}] (0 = greedy), "
                             f"got {self.temperature}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        _check_num("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_num("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not SEED_MIN <= self.seed <= SEED_MAX:
                raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}] (64 bits, signed or "
                                 f"unsigned), got {self.seed}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t)
            if not 0 <= t < 2**63:
                raise ValueError(f"stop_token_ids must be in [0, 2**63), got {t}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= 20:
                raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs)
            if not 0 <= self.prompt_logprobs <= 20:
                raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")

        if not isinstance(self.tempered_entropy, bool):
            raise TypeError(f"tempered_entropy must be a bool, got "
                            f"{type(self.tempered_entropy).__name__} {self.tempered_entropy!r}")
        if self.entropy_estimator is not None:
            if not isinstance(self.entropy_estimator, str):
                raise TypeError(f"entropy_estimator must be a string or None, got "
                                f"{type(self.entropy_estimator).__name__}")
            from entropic.control.estimators import make_estimator
            make_estimator(self.entropy_estimator)  # raises ValueError naming the choices
        if self.thermostat is not None:
            if isinstance(self.thermostat, dict):
                self.thermostat = ThermostatParams(**self.thermostat)
            if not isinstance(self.thermostat, ThermostatParams):
                raise TypeError("thermostat must be ThermostatParams or a dict of its fields")
            if self.temperature == 0:
                raise ValueError("temperature: the thermostat needs temperature > 0 (its T_0)")

    @property
    def greedy(self) -> bool:
        """Sampled by argmax: temperature 0, or one too small to divide logits by."""
        return self.temperature < GREEDY_BELOW


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")


def _check_num(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
