"""Engine-side state of one request."""
from __future__ import annotations

import enum
import itertools

from entropic.outputs import Cost, RequestMetrics, TokenLogprob
from entropic.sampling_params import SamplingParams

_seq = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the engine failed on this request alone (see Request.error)

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


class Request:
    """Token ids (prompt then output), how many of them have KV computed, and results.

    There are no prefill/decode phases: each step the scheduler grants
    `num_tokens - num_computed_tokens` (or fewer) tokens, and the request samples a new
    token whenever its computed tokens reach its total.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, prompt: str | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # of them, found in the prefix cache at its last admission
        self.status = RequestStatus.WAITING
        self.seq_no = next(_seq)  # tie-break for equal arrival times
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.entropies: list[float] = []
        self.temperatures: list[float] = []
        self.tempered_entropies: list[float | None] = []
        self.cost = Cost()
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        # entry i scores prompt token i given the tokens before it; token 0 has no score
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        # surprisal (-log p) of prompt token i given the tokens before it, for positions
        # 0.. as far as all are known (computed or found in the prefix cache); token 0 has
        # none. Kept only where the runner scores prompt tokens (prompt logprobs or a block
        # policy's prompt surprisal); published blocks carry it.
        self.prompt_surprisal: list[float | None] = [None]
        self.stop_reason: str | int | None = None
        self.error: str | None = None  # set with FINISHED_ERROR
        self.last_served_step = 0  # scheduler step that last granted it tokens (or added it)
        self.outputs_at_admission = 0  # output tokens it had when last admitted
        self.admitted_step = 0  # scheduler step of its last admission
        # requests that arrived after it and were admitted while it waited, since it last
        # started waiting (entropic scheduling's bounded bypass)
        self.times_bypassed = 0
        # steps, since it last started waiting, in which it was not served and its whole
        # context did not fit in the pool beside what the running requests still owe
        # (counted only for a policy that reads it: entropic scheduling's max_wait_total)
        self.memory_wait_steps = 0
        self.num_new_tokens = 0  # tokens the last scheduler update appended

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
