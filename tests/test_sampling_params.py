import pytest

from entropic.sampling_params import SamplingParams


@pytest.mark.parametrize("kw, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": 1e39}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"top_k": -5}, "top_k"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw, field", [
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"seed": 1.0}, "seed"),
])
def test_wrong_types_name_the_field(kw, field):
    with pytest.raises(TypeError, match=field):
        SamplingParams(**kw)


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", top_k=-1, temperature=0)
    assert p.stop == ["###"] and p.top_k == 0 and p.greedy


def test_seed_range_is_what_the_generator_takes():
    import torch
    for seed in (-(2**63), -1, 0, 2**64 - 1):
        torch.Generator().manual_seed(SamplingParams(seed=seed).seed)


def test_tiny_temperatures_are_greedy():
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-39).greedy
    assert not SamplingParams(temperature=1e-4).greedy
