"""The thermostat (micro control law) on synthetic logit streams."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from entropic.control.estimators import ExactEntropy
from entropic.control.thermostat import Thermostat, next_temperature
from entropic.sampling.sampler import Sampler, SamplingBatch
from entropic.sampling_params import SamplingParams, ThermostatParams


def run_stream(logit_steps, params, rid="r"):
    """Feed one request's logits step by step; return (temperatures, tempered entropies)."""
    th = Thermostat()
    s = Sampler([th])
    temps, h_t = [], []
    for i, logits in enumerate(logit_steps):
        b = SamplingBatch([rid], [params], [i])
        out = s(logits[None].clone(), b)
        t = out.temperatures[0].item()
        temps.append(t)
        h_t.append(ExactEntropy()(logits[None] / t).item())
    return temps, h_t


@settings(max_examples=40, deadline=None)
@given(st.floats(0.01, 10.0), st.floats(0.0, 6.0), st.floats(0.05, 2.0),
       st.integers(0, 2**31 - 1), st.sampled_from(["stabilize", "follow"]))
def test_temperature_always_within_bounds(scale, target, eta, seed, mode):
    g = torch.Generator().manual_seed(seed)
    steps = [torch.randn(200, generator=g) * scale * (1 + (i % 5)) for i in range(30)]
    th = ThermostatParams(target_entropy=target, eta=eta, t_min=0.3, t_max=1.7, mode=mode)
    temps, _ = run_stream(steps, SamplingParams(temperature=1.0, seed=seed, thermostat=th))
    assert all(0.3 - 1e-6 <= t <= 1.7 + 1e-6 for t in temps)  # float32 rounding of the bounds


@pytest.mark.parametrize("target", [1.0, 2.0, 3.5])
def test_converges_to_reachable_target(target):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(1000, generator=g) * 3.0
    h = lambda t: ExactEntropy()(z[None] / t).item()
    assert h(0.1) < target < h(4.0)  # reachable inside [T_min, T_max]
    th = ThermostatParams(target_entropy=target, eta=0.3, t_min=0.1, t_max=4.0)
    temps, h_t = run_stream([z] * 60, SamplingParams(temperature=1.0, thermostat=th))
    # stated tolerance: within 0.05 nats after 40 steps and stays there
    assert all(abs(x - target) < 0.05 for x in h_t[40:]), h_t[35:]


def test_tracks_a_drifting_stream():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(500, generator=g)
    steps = [z * (1.0 + 2.0 * i / 80) for i in range(80)]  # the model grows more certain
    th = ThermostatParams(target_entropy=3.0, eta=0.5, t_min=0.1, t_max=5.0)
    temps, h_t = run_stream(steps, SamplingParams(temperature=1.0, thermostat=th))
    assert temps[-1] > temps[10]  # temperature rose to hold the entropy
    assert all(abs(x - 3.0) < 0.15 for x in h_t[30:])


def test_degenerate_rows():
    th = ThermostatParams(target_entropy=2.0, eta=0.5, t_min=0.2, t_max=3.0)
    one_hot = torch.full((50,), -math.inf)
    one_hot[7] = 0.0
    temps, h_t = run_stream([one_hot] * 20, SamplingParams(temperature=1.0, thermostat=th))
    assert temps[-1] == pytest.approx(3.0) and all(h == 0 for h in h_t)  # too certain: T up
    uniform = torch.zeros(50)
    temps, h_t = run_stream([uniform] * 20, SamplingParams(temperature=1.0, thermostat=th))
    assert temps[-1] == pytest.approx(0.2)  # log 50 > target whatever T: T down to T_min
    with pytest.raises(FloatingPointError):
        run_stream([torch.tensor([0.0, float("nan"), 1.0])],
                   SamplingParams(temperature=1.0, thermostat=th))


def test_follow_mode_matches_its_formula():
    g = torch.Generator().manual_seed(2)
    steps = [torch.randn(100, generator=g) * (0.5 + i / 10) for i in range(15)]
    th = ThermostatParams(target_entropy=2.5, eta=0.4, t_min=0.2, t_max=2.5, h_min=0.3,
                          mode="follow")
    temps, _ = run_stream(steps, SamplingParams(temperature=0.8, thermostat=th))
    expected, t = [], 0.8
    for z in steps:
        expected.append(t)
        h = max(ExactEntropy()(z[None]).item(), 0.3)
        t = min(2.5, max(0.2, t * math.exp(0.4 * (h - 2.5))))
    assert temps == pytest.approx(expected, abs=1e-6)
    assert next_temperature(1.0, 3.0, 2.0, 0.5, 0.1, 9.0, "follow") == pytest.approx(math.exp(0.5))
    assert next_temperature(1.0, 3.0, 2.0, 0.5, 0.1, 9.0, "stabilize") == pytest.approx(
        math.exp(-0.5))


def test_off_is_bit_identical_and_seeded_runs_reproduce():
    g = torch.Generator().manual_seed(3)
    logits = [torch.randn(4, 300, generator=g) for _ in range(10)]
    plain = [SamplingParams(temperature=0.9, top_p=0.9, seed=s) for s in range(4)]

    def draw(sampler, params):
        toks = []
        for i, x in enumerate(logits):
            b = SamplingBatch([f"r{j}" for j in range(4)], params, [i] * 4)
            toks.append(sampler(x.clone(), b).token_ids.tolist())
        return toks

    assert draw(Sampler(), plain) == draw(Sampler([Thermostat()]), plain)
    th = ThermostatParams(target_entropy=2.0)
    mixed = plain[:2] + [SamplingParams(temperature=1.0, seed=9, thermostat=th)] * 2
    a, b = draw(Sampler([Thermostat()]), mixed), draw(Sampler([Thermostat()]), mixed)
    assert a == b
    assert [r[:2] for r in a] == [r[:2] for r in draw(Sampler(), plain)]  # others untouched


def test_params_validation():
    for kw, field in [({"eta": 0}, "eta"), ({"t_min": 0}, "t_min"),
                      ({"t_min": 2, "t_max": 1}, "t_max"), ({"mode": "x"}, "mode"),
                      ({"h_min": -1}, "h_min"), ({"target_entropy": -1}, "target_entropy"),
                      ({"eta": 1e308}, "eta"), ({"target_entropy": 1e300}, "target_entropy"),
                      ({"mode": "follow", "h_min": 1e300}, "h_min"), ({"t_min": 1e-39}, "t_min"),
                      ({"t_max": 1e9}, "t_max")]:
        with pytest.raises(ValueError, match=field):
            ThermostatParams(**kw)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0, thermostat=ThermostatParams())
    assert SamplingParams(thermostat={"target_entropy": 1.0}).thermostat.target_entropy == 1.0


@settings(max_examples=200, deadline=None)
@given(st.floats(1e-3, 1e3), st.floats(0.0, 1e300), st.floats(0.0, 1e3), st.floats(1e-300, 1e308),
       st.sampled_from(["stabilize", "follow"]))
def test_law_never_overflows(t, h, target, eta, mode):
    """Whatever the inputs, one step of the law is a finite temperature within its bounds
    (its exponent is clipped; math.exp would otherwise overflow)."""
    t_next = next_temperature(t, h, target, eta, 1e-3, 1e3, mode)
    assert math.isfinite(t_next) and 1e-3 <= t_next <= 1e3


@pytest.mark.parametrize("mode", ["stabilize", "follow"])
def test_sampler_reports_the_tempered_entropy_the_law_used(mode):
    """The sampler's per-row H^T is the thermostat's measurement: in stabilize mode the law
    T_{t+1} = clip(T_t exp(eta (H* - max(H^T_t, h_min)))) holds with the reported value,
    which is the entropy of softmax(logits / T_t); in follow mode (where the law reads H_t)
    it is measured only when the request asks."""
    g = torch.Generator().manual_seed(4)
    steps = [torch.randn(400, generator=g) * (0.5 + 0.3 * i) for i in range(12)]
    th_p = ThermostatParams(target_entropy=2.5, eta=0.4, t_min=0.3, t_max=3.0, h_min=0.5,
                            mode=mode)
    for ask in (False, True):
        th = Thermostat()
        s = Sampler([th])
        params = SamplingParams(temperature=1.3, thermostat=th_p, tempered_entropy=ask)
        temps, reported = [], []
        for i, z in enumerate(steps):
            out = s(z[None].clone(), SamplingBatch(["r"], [params], [i]))
            temps.append(out.temperatures[0].item())
            reported.append(out.tempered_entropies[0].item())
            if mode == "stabilize":  # the floored value the law used, unfloored here
                assert th.last_controlled_entropy["r"] == max(reported[-1], 0.5)
        if mode == "follow" and not ask:
            assert all(math.isnan(h) for h in reported)
            continue
        for z, t, h in zip(steps, temps, reported):
            assert h == pytest.approx(ExactEntropy()(z[None] / t).item(), abs=1e-5)
        if mode == "stabilize":
            for i in range(len(steps) - 1):
                want = next_temperature(temps[i], max(reported[i], 0.5), 2.5, 0.4, 0.3, 3.0,
                                        mode)
                assert temps[i + 1] == pytest.approx(want, rel=1e-6)
