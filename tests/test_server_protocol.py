"""The server's request models and error mapping, without a model or a server process."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from pydantic import ValidationError  # noqa: E402

from entropic.sampling_params import ThermostatParams  # noqa: E402
from entropic.server.errors import _describe, bad_request  # noqa: E402
from entropic.server.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402


def test_sampling_params_mapping_with_thermostat():
    req = CompletionRequest.model_validate({
        "prompt": "hi", "temperature": 0.8, "top_p": 0.9, "stop": "\n", "seed": 4,
        "top_k": 5, "entropic": {"entropy": True,
                                 "thermostat": {"target_entropy": 1.5, "mode": "follow"}}})
    p = req.sampling_params(7, logprobs=2, prompt_logprobs=2)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (7, 0.8, 0.9, 5, 4)
    assert p.stop == ["\n"] and p.logprobs == 2 and p.prompt_logprobs == 2
    assert p.thermostat == ThermostatParams(target_entropy=1.5, mode="follow")
    assert req.wants_entropy


def test_defaults_leave_sampling_params_defaults():
    p = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}]}).sampling_params(3, None)
    assert (p.temperature, p.top_p, p.top_k, p.thermostat, p.logprobs) == (1.0, 1.0, 0, None,
                                                                           None)


@pytest.mark.parametrize("prompt, want", [("abc", "abc"), ([1, 2], [1, 2]), (["abc"], "abc"),
                                          ([[3, 4]], [3, 4])])
def test_single_prompt_forms(prompt, want):
    assert CompletionRequest(prompt=prompt).single_prompt() == want


def test_prompt_batches_are_refused_clearly():
    with pytest.raises(ValueError, match="one prompt per request"):
        CompletionRequest(prompt=["a", "b"]).single_prompt()


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "seed": 1.5}, "seed"),
    ({"prompt": "x", "entropic": {"thermostat": {"eta": "fast"}}}, "entropic"),
])
def test_types_are_strict(body, param):
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate(body)
    msg, got = _describe(e.value.errors()[0])
    assert got == param and msg.startswith(param)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": 3}, "n"), ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x", "logit_bias": {"1": 2.0}}, "logit_bias"),
])
def test_unsupported_values_are_named(body, param):
    assert CompletionRequest.model_validate(body).unsupported()[0] == param


def test_engine_messages_name_their_param():
    assert bad_request(ValueError("max_tokens: prompt (5 tokens) + ...")).param == "max_tokens"
    assert bad_request(ValueError("thermostat.eta must be > 0, got -1")).param == "thermostat.eta"
    assert bad_request(TypeError("temperature must be a number")).status == 400
