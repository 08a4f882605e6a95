"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping to SamplingParams.

Types are checked strictly (a string where a number belongs is a 400, not a silent
coercion); ranges are checked once, by SamplingParams and ThermostatParams, whose errors
name the field and its limit. Unknown fields are ignored, as OpenAI-compatible servers do,
so that clients sending fields we do not model still work.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat,
                      StrictInt, StrictStr)

from entropic.sampling_params import SamplingParams, ThermostatParams



def _encodable(s: str) -> str:
    """JSON's \\uD800-style escapes can carry lone UTF-16 surrogates, which are not text: no
    tokenizer (nor UTF-8) can encode them. Reject them here, where the field is known."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"a lone UTF-16 surrogate (U+{ord(s[e.start]):04X}) at character "
                         f"{e.start} is not valid text") from None
    return s


Text = Annotated[StrictStr, AfterValidator(_encodable)]
TokenIds = list[StrictInt]


class ThermostatOptions(BaseModel):
    """The `entropic.thermostat` object: fields of ThermostatParams (unknown keys: 400)."""

    model_config = ConfigDict(extra="forbid")

    target_entropy: StrictFloat = 2.0
    eta: StrictFloat = 0.2
    t_min: StrictFloat = 0.2
    t_max: StrictFloat = 2.0
    h_min: StrictFloat = 0.0
    mode: Literal["stabilize", "follow"] = "stabilize"


class EntropicOptions(BaseModel):
    """The `entropic` extension object of a request body.

    `entropy`: return per-token entropy (and temperature, and the request's entropic time
    tau) even without logprobs. `thermostat`: sample under the entropy-stabilising
    temperature controller; the request's `temperature` is its starting value T_0."""

    model_config = ConfigDict(extra="forbid")

    entropy: StrictBool = False
    thermostat: ThermostatOptions | None = None


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints (OpenAI's, then vLLM-style extensions)."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stop: Text | list[Text] | None = None
    seed: StrictInt | None = None
    n: StrictInt | None = None
    stream: StrictBool = False
    stream_options: "StreamOptions | None" = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    user: Text | None = None
    # extensions (vLLM names)
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    entropic: EntropicOptions | None = None

    @property
    def wants_entropy(self) -> bool:
        return self.entropic is not None and (self.entropic.entropy
                                              or self.entropic.thermostat is not None)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for a value this server does not implement, else None."""
        if self.n is not None and self.n != 1:
            return "n", f"n: only n=1 is supported, got {self.n}; send n separate requests"
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if v not in (None, 0, 0.0):
                return name, f"{name}: not supported by this server (only 0), got {v}"
        if self.logit_bias:
            return "logit_bias", "logit_bias: not supported by this server"
        return None

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Build SamplingParams; raises ValueError/TypeError naming the field and limit.
        Where the response carries the `entropic` block (entropy asked for, or logprobs),
        every token's H^T is measured for it (`tempered_entropy`)."""
        th = self.entropic.thermostat if self.entropic is not None else None
        kw = dict(max_tokens=max_tokens, logprobs=logprobs, ignore_eos=self.ignore_eos,
                  tempered_entropy=self.wants_entropy or logprobs is not None,
                  include_stop_str_in_output=self.include_stop_str_in_output,
                  skip_special_tokens=self.skip_special_tokens, seed=self.seed,
                  stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
                  thermostat=ThermostatParams(**th.model_dump()) if th is not None else None)
        if prompt_logprobs is not None:
            kw["prompt_logprobs"] = prompt_logprobs
        for name in ("temperature", "top_p", "top_k", "min_p"):
            v = getattr(self, name)
            if v is not None:
                kw[name] = v
        return SamplingParams(**kw)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. One prompt per request: text, or a list of token ids (a
    one-element list of either is accepted too)."""

    prompt: Union[Text, TokenIds, list[Text], list[TokenIds]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: Text | None = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt, or ValueError for a batch (not supported: one per request)."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError(f"prompt: batches of prompts are not supported (got {len(p)}); "
                                 "send one prompt per request")
            return p[0]
        return p

    def unsupported(self) -> tuple[str, str] | None:
        if self.best_of not in (None, 1):
            return "best_of", f"best_of: only 1 is supported, got {self.best_of}"
        if self.suffix:
            return "suffix", "suffix: not supported by this server"
        return super().unsupported()


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Text
    content: Text | list[ContentPart] | None = None

    def as_template_dict(self) -> dict:
        c = self.content
        if isinstance(c, list):
            c = "".join(p.text for p in c)
        return {"role": self.role, "content": c or ""}


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. `max_tokens` (or `max_completion_tokens`) defaults to the
    rest of the context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs: requires logprobs=true"
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            return "top_logprobs", f"top_logprobs: must be in [0, 20], got {self.top_logprobs}"
        return super().unsupported()


class TokenizeRequest(BaseModel):
    """POST /tokenize: a text `prompt` (BOS as the model's tokenizer adds it, unless
    add_special_tokens is false), or chat `messages` rendered with the model's chat template."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
    # vLLM's fields: BOS etc. for a text prompt (default on, as the model's tokenizer adds
    # them); a chat template writes its own, so `messages` ignore it. `return_token_strs`:
    # also the vocabulary string of each token.
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids back to text."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    tokens: TokenIds


_SamplingFields.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """An OpenAI-style error object. A message quoting bad input may hold lone surrogates,
    which no JSON encoder writes as UTF-8: they are shown as escapes."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
