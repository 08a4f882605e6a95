"""What a request returns: text, tokens, per-token logprobs and entropies, timings."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Cost:
    """Resources one request (or the engine) consumed (engine/cost.py computes them)."""

    flops_linear: float = 0.0
    flops_attention: float = 0.0
    kv_bytes_read: float = 0.0
    seconds: float = 0.0

    @property
    def flops(self) -> float:
        return self.flops_linear + self.flops_attention

    def add(self, other: "Cost") -> None:
        self.flops_linear += other.flops_linear
        self.flops_attention += other.flops_attention
        self.kv_bytes_read += other.kv_bytes_read
        self.seconds += other.seconds


@dataclass
class TokenLogprob:
    """Log-probability of the chosen token and the top alternatives at one step."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.perf_counter) of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        n = len(self.token_times)
        if n < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (n - 1)


@dataclass
class EntropicReading:
    """Entropic time of one request (or the engine) against its cost (design section 2)."""

    tau: float  # sum of positive entropy drops, nats
    mean_entropy: float
    tflops: float
    seconds: float

    @property
    def tau_per_tflop(self) -> float:
        return self.tau / self.tflops if self.tflops else 0.0

    @property
    def tau_per_second(self) -> float:
        return self.tau / self.seconds if self.seconds else 0.0

    @classmethod
    def of(cls, tau: float, mean_entropy: float, cost: Cost) -> "EntropicReading":
        return cls(tau, mean_entropy, cost.flops / 1e12, cost.seconds)


@dataclass
class SpeculationReading:
    """One request's speculation so far."""

    decode_steps: int = 0  # forward passes that committed tokens after the prompt
    drafts: int = 0  # of those, the ones that verified a draft
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    committed_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verified draft (the accepted ones plus the target's own)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.committed_tokens / self.decode_steps if self.decode_steps else 0.0


@dataclass
class RequestOutput:
    """The state of one request: complete when `finished` is True.

    `text_delta` and `new_token_ids` hold what this step added (for streaming).
    `entropies[i]` is the exact entropy (nats) of the model's temperature-1 next-token
    distribution from which `token_ids[i]` was drawn; `temperatures[i]` the temperature it
    was sampled at (0 for greedy); `tempered_entropies[i]` H^T, the entropy of the tempered
    distribution softmax(logits / T) it was drawn from, before top-k/top-p/min-p (what the
    thermostat steers): equal to `entropies[i]` at T = 1, 0 for greedy, the thermostat's own
    measurement under it, and None where it was not measured (a fixed temperature other
    than 0 and 1 without `SamplingParams.tempered_entropy`). `cost` is what the request
    consumed so far; `entropic` its entropic time reading, when the engine runs a clock.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    tempered_entropies: list[float | None] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # [None, score of token 1, ...]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: str | int | None = None
    finished: bool = False
    text_delta: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    cost: Cost | None = None
    entropic: EntropicReading | None = None
    error: str | None = None  # why the engine failed this request (finish_reason "error")
    speculation: SpeculationReading | None = None  # when the engine speculates
