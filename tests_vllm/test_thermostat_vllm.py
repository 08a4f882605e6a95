"""The thermostat processor inside vLLM (offline `vllm.LLM`, CPU build), against entropic.

Tokens cannot match entropic's engine token for token: they draw differently (vLLM: an
exponential race with one generator per request, advanced each step; entropic: by inversion,
one uniform per token from a generator keyed by (seed, position)). What must match is the
law: replaying vLLM's own tokens through entropic's thermostat on the same weights gives the
same temperature at every token, up to fp32 differences between the two forward passes
(vLLM's CPU kernels against transformers').
"""
import pytest

RTOL = 1e-3  # temperatures: the law compounds fp32 logit noise (~1e-5) over the steps
ATOL_H = 2e-3  # nats


def check_against_entropic(row, reference):
    trace = row["trace"]
    assert trace is not None, "no trace came back from the worker"
    n = len(row["token_ids"])
    assert len(trace["temperatures"]) == len(trace["entropies"]) == n
    temps, ents = reference(row["prompt_token_ids"], row["token_ids"], row["thermostat"],
                            row["temperature"])
    assert trace["temperatures"] == pytest.approx(temps, rel=RTOL)
    assert trace["entropies"] == pytest.approx(ents, abs=ATOL_H)
    th = row["thermostat"]
    assert all(th["t_min"] - 1e-9 <= t <= th["t_max"] + 1e-9 for t in trace["temperatures"])
    assert len({round(t, 3) for t in trace["temperatures"]}) > n // 3  # the law moved T


def test_greedy_output_unchanged_with_the_plugin_loaded(run_scenario):
    """The same greedy requests, without the plugin and with it (in one batch with thermostat
    requests, whose rows it rewrites): identical token ids."""
    base, plug = run_scenario("baseline"), run_scenario("plugin")
    assert len(base["greedy"]) == len(plug["greedy"]) == 4
    for b, p in zip(base["greedy"], plug["greedy"]):
        assert len(b["token_ids"]) == 24
        assert p["token_ids"] == b["token_ids"]
    assert all(r["trace"] for r in plug["thermostat"])  # the processor was active beside them


@pytest.mark.parametrize("which", [0, 1], ids=["stabilize", "follow"])
def test_temperatures_match_entropic_thermostat(run_scenario, reference, which):
    check_against_entropic(run_scenario("plugin")["thermostat"][which], reference)


def test_bad_thermostat_arguments_are_refused_offline(run_scenario):
    err = run_scenario("plugin")["bad_params_error"]
    assert err is not None and "thermostat.eta must be in (0, 1000]" in err


def test_state_survives_preemption(run_scenario, reference):
    """A KV cache too small for the batch: vLLM preempts requests and recomputes them later.
    Every request's temperatures still follow the law over its whole output, as if it had
    never left the batch (a state reset at resumption would restart at T_0 = 1.7)."""
    res = run_scenario("preempt")
    assert res["preemptions"] >= 1, "the tiny KV cache did not force a preemption"
    for row in res["thermostat"]:
        assert len(row["token_ids"]) == 160
        check_against_entropic(row, reference)
