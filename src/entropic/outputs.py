"""What a request returns: text, tokens, per-token logprobs and entropies, timings."""
from __future__ import annotations

from dataclasses import dataclass, field


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
class RequestOutput:
    """The state of one request: complete when `finished` is True.

    `text_delta` and `new_token_ids` hold what this step added (for streaming).
    `entropies[i]` is the exact entropy (nats) of the model's temperature-1 next-token
    distribution from which `token_ids[i]` was drawn.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: str | int | None = None
    finished: bool = False
    text_delta: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    metrics: RequestMetrics | None = None
