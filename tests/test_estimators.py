import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from entropic.control.estimators import (ExactEntropy, TopKEntropy, TopKTailEntropy,
                                         floor_entropy, make_estimator)


def test_exact_on_known_distributions():
    p = torch.tensor([[0.5, 0.25, 0.25, 0.0]])
    h = ExactEntropy()(p.log())
    assert h.item() == pytest.approx(1.5 * math.log(2), abs=1e-6)
    assert ExactEntropy()(torch.zeros(2, 10)).tolist() == pytest.approx([math.log(10)] * 2)


def test_topk_and_tail_values_by_hand():
    p = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.1])
    top2 = TopKEntropy(2)(p.log()[None]).item()
    assert top2 == pytest.approx(-(0.4 * math.log(0.4) + 0.3 * math.log(0.3)), abs=1e-6)
    tail = TopKTailEntropy(2)(p.log()[None]).item()
    assert tail == pytest.approx(top2 - 0.3 * math.log(0.3 / 3), abs=1e-6)
    # tail mass spread uniformly here, so the correction is exact
    assert tail == pytest.approx(ExactEntropy()(p.log()[None]).item(), abs=1e-6)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 60), st.floats(0.1, 8.0), st.integers(0, 2**31 - 1))
def test_bounds_topk_below_exact_below_tail(k, scale, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 64, generator=g) * scale
    exact = ExactEntropy()(logits)
    tol = 1e-4  # float32: the tail mass 1 - sum(top p) carries ~1e-6 absolute error
    assert (TopKEntropy(k)(logits) <= exact + tol).all()
    assert (TopKTailEntropy(k)(logits) >= exact - tol).all()


def test_k_at_least_vocab_is_exact():
    logits = torch.randn(3, 16)
    assert torch.allclose(TopKTailEntropy(16)(logits), ExactEntropy()(logits), atol=1e-6)
    assert torch.allclose(TopKEntropy(99)(logits), ExactEntropy()(logits), atol=1e-6)


def test_factory_and_floor():
    assert make_estimator("top32+tail").name == "top32+tail"
    assert make_estimator("top8").k == 8
    with pytest.raises(ValueError, match="estimator"):
        make_estimator("topx")
    h = torch.tensor([0.0, 0.5, 2.0])
    assert floor_entropy(h, 0.3).tolist() == pytest.approx([0.3, 0.5, 2.0])


# ---- the engine's choice and its place in the sampler chain ---------------------------------
def test_choice_exact_with_native_statistics_without_timing(monkeypatch):
    from entropic.control import estimators
    monkeypatch.setattr(estimators, "_median_seconds", lambda fns: pytest.fail("timed"))
    name, why = estimators.choose_estimator(262144, native_stats=True)
    assert name == "exact" and "native row statistics" in why


@pytest.mark.parametrize("ratio, want", [(0.3, "top32+tail"), (0.7, "exact")])
def test_choice_on_the_torch_path_follows_measured_cost(monkeypatch, ratio, want):
    """A candidate replaces exact only under SWITCH_BELOW (0.5) of exact's measured cost."""
    from entropic.control import estimators
    seen = {}

    def fake(fns):
        seen.update(fns)
        return {"exact": 1e-3, "top32+tail": ratio * 1e-3, "top128+tail": 0.9e-3}
    monkeypatch.setattr(estimators, "_median_seconds", fake)
    name, why = estimators.choose_estimator(1000, native_stats=False, rows=4)
    assert name == want and set(seen) == {"exact", *estimators.CANDIDATES}
    assert "top32+tail 0.30 ms" in why or "top32+tail 0.70 ms" in why


def test_choice_on_the_torch_path_really_times():
    from entropic.control.estimators import choose_estimator
    name, why = choose_estimator(5000, native_stats=False, rows=4)
    assert name in ("exact", "top32+tail", "top128+tail") and "ms" in why


def test_estimate_replaces_the_entropy_per_row_and_the_thermostat_reads_it():
    """The engine default and a request's override: rows on an estimator report (and
    control with) its value, exact rows keep the sampler's exact entropy; in stabilize
    mode the thermostat's H^T is the estimator's on the tempered logits."""
    from entropic.control.estimators import EntropyEstimate
    from entropic.control.thermostat import Thermostat, next_temperature
    from entropic.sampling.sampler import Sampler, SamplingBatch
    from entropic.sampling_params import SamplingParams, ThermostatParams
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 500, generator=g) * 2
    est = EntropyEstimate("top8")
    th = Thermostat(est)
    tp = ThermostatParams(target_entropy=3.0, eta=0.5, t_min=0.5, t_max=2.0)
    params = [SamplingParams(temperature=0.7),                                 # default: top8
              SamplingParams(temperature=0.7, entropy_estimator="exact"),
              SamplingParams(temperature=0.7, entropy_estimator="top16+tail"),
              SamplingParams(temperature=0.8, entropy_estimator="top16+tail", thermostat=tp)]
    out = Sampler([est, th])(logits.clone(), SamplingBatch(list("abcd"), params, [0] * 4))
    h = out.entropies.tolist()
    assert h[0] == pytest.approx(TopKEntropy(8)(logits[0:1]).item(), abs=1e-6)
    assert h[1] == pytest.approx(ExactEntropy()(logits[1:2]).item(), abs=1e-5)
    assert h[2] == pytest.approx(TopKTailEntropy(16)(logits[2:3]).item(), abs=1e-6)
    ht = TopKTailEntropy(16)(logits[3:4] / 0.8).item()
    assert out.tempered_entropies[3].item() == pytest.approx(ht, abs=1e-6)
    assert th.temperature("d") == pytest.approx(
        next_temperature(0.8, ht, 3.0, 0.5, 0.5, 2.0, "stabilize"), rel=1e-6)
    assert ht != pytest.approx(ExactEntropy()(logits[3:4] / 0.8).item(), abs=1e-3)


def test_estimator_names_are_checked():
    from entropic.sampling_params import SamplingParams
    with pytest.raises(ValueError, match="entropy estimator: unknown 'top'"):
        SamplingParams(entropy_estimator="top")
    with pytest.raises(TypeError, match="entropy_estimator must be a string"):
        SamplingParams(entropy_estimator=32)


@pytest.mark.model
def test_engine_chooses_exact_and_a_request_can_ask_for_an_estimate(llm_fp32):
    from entropic.sampling_params import SamplingParams
    assert llm_fp32.entropy_estimator_reason.startswith("exact")
    prompt = "The three primary colours are"
    exact, = llm_fp32.generate(prompt, SamplingParams(max_tokens=8, temperature=0))
    low, = llm_fp32.generate(prompt, SamplingParams(max_tokens=8, temperature=0,
                                                     entropy_estimator="top8"))
    assert low.token_ids == exact.token_ids  # greedy: the estimate changes no token
    # top-k is a lower bound, and on this model's long tails a strict one
    assert all(a <= b + 1e-4 for a, b in zip(low.entropies, exact.entropies))
    assert sum(low.entropies) < sum(exact.entropies) - 0.1
