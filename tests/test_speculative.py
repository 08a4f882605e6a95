"""Speculative decoding: drafting, the entropy gate, and exactness against plain decoding.

Exactness is checked on the real model (bf16, native kernels): greedy and seeded sampled
token ids identical with speculation on and off, alone and in mixed batches, with the
thermostat, stops inside an accepted run, and KV rollback under random acceptance lengths.
The sampler's acceptance rule is checked on tiny vocabularies against the exact
distributions (chi-square).
"""
from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from entropic import SamplingParams
from entropic.config import EngineConfig
from entropic.control.clock import EntropicClock
from entropic.control.thermostat import Thermostat
from entropic.engine.engine import LLMEngine
from entropic.sampling.sampler import Sampler, SamplingBatch
from entropic.sampling_params import ThermostatParams
from entropic.speculative import SpeculativeConfig, Speculator
from entropic.speculative.gate import (AcceptanceModel, Candidate, RowCost, StepTimes, entropy_bin,
                                       plan)
from entropic.speculative.ngram import NgramProposer
from entropic.speculative.speculator import _Regret

# prompts that repeat themselves (drafts get accepted) and one that does not
REPEATS = [
    "Repeat this sentence three times: the cat sat on the mat and looked at the door.",
    "Copy this list exactly: apples, pears, plums, cherries, apples, pears, plums, grapes.",
    "Rewrite with the same words: def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"
    "    return a - b",
    "Name four animals.",
]


def _engine(llm, spec: SpeculativeConfig | None, proposer=None, **config) -> LLMEngine:
    """An engine on the session model's weights, with its own KV cache and hooks."""
    cfg = dict(max_num_batched_tokens=256, kv_cache_gib=0.25)
    cfg.update(config)
    speculator = Speculator(spec, proposer) if spec is not None else None
    return LLMEngine(llm.engine.model, llm.tokenizer, EngineConfig(**cfg),
                     processors=[Thermostat()], observer=EntropicClock(),
                     speculator=speculator)


def _run(engine: LLMEngine, prompts, params) -> list:
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    outs = {o.request_id: o for o in engine.run_until_done()}
    assert engine.pool.num_used == 0, "blocks leaked"
    return [outs[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def prompts(llm_bf16):
    tok = llm_bf16.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": t}]) for t in REPEATS]


# ---- drafting and the gate ------------------------------------------------------------
def test_ngram_drafts_follow_the_latest_longest_match():
    p = NgramProposer(1, 3)
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix (2, 3) last seen followed by 7: continue from there
    assert p.propose("a", toks, 3) == ([7, 8, 5], 2)
    toks += [7]  # suffix (2, 3, 7) now matches at length 3
    assert p.propose("a", toks, 2) == ([8, 5], 3)
    assert p.propose("b", [4, 5, 6], 4) == ([], 0)
    assert NgramProposer(2, 2).propose("c", [5, 5, 5], 4) == ([5], 2)  # run up to the end


def test_gate_drafts_where_rows_pay_and_stops_where_they_do_not():
    times = StepTimes()
    for rows, t in ((1, 10.0), (2, 10.2), (3, 10.4), (4, 10.6), (9, 11.6)):
        times.record(rows, t)
    sure = Candidate("a", (True, 0, 5), 8)
    k = plan([sure], {"a": [0.9] * 8}, times, base_rows=1, base_tokens=1)
    assert k["a"] == 8  # 0.9^8 = 0.43 beats the ~2 % a row costs
    assert plan([sure], {"a": [0.01] * 8}, times, 1, 1)["a"] == 0  # an unsure draft never pays
    assert plan([sure], {"a": [0.9, 0.9, 0.01] + [0.9] * 5}, times, 1, 1)["a"] == 2
    # at 64 rows each further row costs what it buys: one 0.3 candidate among many shuts
    busy = StepTimes()
    for rows in range(60, 70):
        busy.record(rows, rows * 1.0)
    assert plan([Candidate("b", (True, 1, 2), 8)], {"b": [0.3] * 8}, busy, 64, 64)["b"] == 0
    assert entropy_bin(0.0) == 0 and entropy_bin(10.0) == 6


def test_row_cost_is_one_line_through_noisy_steps_not_a_time_per_width():
    """Verify rows are priced from one fit over all of a bucket's steps: a width drafted
    rarely, whose few steps happened to be slow or to run at a long context, does not set
    the price of every wider draft (a per-width table made monotone by a running maximum
    did, and drafted little at batch 1 though rows there cost ~1 %)."""
    import random
    rng = random.Random(0)
    a, b, c, d = 0.018, 0.0002, 0.0006, 0.003  # s; c, d per thousand positions
    from entropic.speculative.gate import PRIOR_ROW_COST
    cost = RowCost()
    assert cost.view(1, 500).ratio(1) == pytest.approx(1 + PRIOR_ROW_COST)  # before a fit
    widths = [1] * 60 + [2] * 20 + [5] * 10 + [9] * 3
    for rows in widths * 4:
        ctx = rng.choice([200, 800, 1600])
        t = a + b * rows + c * (rows - 1) * ctx / 1000 + d * ctx / 1000
        slow = 1.6 if rows == 9 and rng.random() < 0.3 else 1.0  # a rare width, unlucky
        cost.record(1, rows, (rows - 1) * ctx, ctx, t * slow * rng.uniform(0.9, 1.1))
    fa, fb, fc, fd, fe = cost.line(1)
    assert fa == pytest.approx(a, rel=0.1) and fd == pytest.approx(d, rel=0.25)
    true = 1 + (b + c * 0.5) / (a + b + d * 0.5)  # one more row at context 500
    assert cost.view(1, 500).ratio(1) == pytest.approx(true, abs=0.01)
    # a context four times as long prices a verify row higher, as its attention costs
    assert cost.view(1, 2000).ratio(1, 4) > cost.view(1, 500).ratio(1, 4)
    # buckets apart: a batch of 16 has its own line, the prior until it has steps
    assert cost.line(16) is None
    assert cost.view(16, 8000).ratio(16) == pytest.approx(1 + PRIOR_ROW_COST / 16)


def test_a_new_tile_of_rows_is_drafted_only_where_the_whole_tile_pays():
    """On AMX a step's 17th row costs a second pass of 16-row tiles (~15 % of the step),
    the 2nd to 16th ~1 % each. The fit finds that step, and the plan, which maximises
    expected tokens per second over the whole order of drafts (not one row at a time),
    drafts a tile's worth of rows at batch 16 where together they pay, and nothing where
    one unsure request alone would buy the new tile; nor does exploration buy it."""
    import random
    from entropic.speculative.gate import TILE_ROWS, tiles
    rng = random.Random(1)
    a, b, d, e = 0.020, 0.0003, 0.0005, 0.004  # s; d per thousand positions
    cost = RowCost()
    for _ in range(200):
        rows = 16 + rng.choice([0, 0, 0, 1, 2, 4, 8, 16, 17, 24])
        ctx = 16 * rng.choice([200, 400])
        t = a + b * rows + d * ctx / 1000 + e * tiles(rows)
        cost.record(16, rows, 0, ctx, t * rng.uniform(0.97, 1.03))
    fit = cost.line(16)
    assert fit[4] == pytest.approx(e, rel=0.2) and fit[1] == pytest.approx(b, rel=0.3)
    view = cost.view(16, 16 * 300)
    step = a + 16 * b + d * 4.8 + e
    assert view.ratio(16) == pytest.approx(1 + (b + e) / step, rel=0.05)  # a new tile
    assert view.ratio(17) - 1 < (view.ratio(16) - 1) / 5  # within the tile: ~a row
    unsure = Candidate("u", (False, 3, 2), 8)
    assert plan([unsure], {"u": [0.5] * 8}, view, 16, 16)["u"] == 0
    assert plan([Candidate("u", (False, 3, 2), 8, explore=True)], {"u": [0.5] * 8}, view,
                16, 16)["u"] == 0  # exploring would buy the tile: not at this step
    sure = [Candidate(f"s{i}", (True, 0, 5), 8) for i in range(16)]
    k = plan(sure, {c.request_id: [0.9] * 8 for c in sure}, view, 16, 16)
    assert sum(k.values()) >= TILE_ROWS  # one row alone (0.9 tokens) buys no tile; 16 do


def test_row_cost_fit_keeps_every_cost_non_negative_by_solving_again():
    """Steps whose time falls as the attended context grows (the host slowed down while
    short requests ran, say): a free fit gives that term a negative cost. It is fixed at 0
    and the rest fitted again, so the line still describes the steps; clamping it after
    the solve left an intercept above every step measured and made rows look free."""
    import random
    rng = random.Random(2)
    cost = RowCost()
    times = []
    for _ in range(120):
        rows, kilo = 16 + rng.choice([0, 4, 8]), rng.uniform(10, 30)
        t = 0.08 + 0.001 * rows - 0.0015 * kilo
        times.append(t)
        cost.record(16, rows, 0, int(kilo * 1000), t)
    a, b, c, d, e = cost.line(16)
    assert min(b, c, d, e) >= 0 and d == 0
    assert a < max(times)
    mean_rows, mean_kilo = 20, 20
    predicted = a + b * mean_rows + e * 2 + d * mean_kilo
    assert predicted == pytest.approx(0.08 + 0.001 * mean_rows - 0.0015 * mean_kilo, rel=0.15)


def test_a_shut_bin_is_explored_a_bounded_number_of_times():
    from entropic.speculative.gate import EXPLORE_TRIES
    times = StepTimes()
    for rows, t in ((1, 10.0), (2, 10.2)):
        times.record(rows, t)
    model = AcceptanceModel(max_match=5)
    key = model.key(True, 5.0, 2)  # entropy 5 nats: the prior says a draft never pays
    rates = {"a": model.rates(key, 4)}
    assert plan([Candidate("a", key, 4)], rates, times, 1, 1)["a"] == 0
    explored = 0
    while model.tries(key) < EXPLORE_TRIES:
        c = Candidate("a", key, 4, explore=model.tries(key) < EXPLORE_TRIES)
        k = plan([c], {"a": model.rates(key, 4)}, times, 1, 1)["a"]
        # one row while the estimate is still the prior; more once acceptances are seen
        assert k == 1 if explored == 0 else k >= 1
        model.observe(key, k, 1)  # ... and it was accepted every time
        explored += 1
    assert explored == EXPLORE_TRIES
    # what it learned opens the bin without exploring
    assert plan([Candidate("a", key, 4)], {"a": model.rates(key, 4)}, times, 1, 1)["a"] >= 1


def _regret_verdicts(r: _Regret, gains) -> list:
    verdicts = []
    for gain in gains:
        v = r.decide()
        verdicts.append(v)
        if v == "plain":
            r.plain_measured()
        else:  # drafted steps deliver `gain` times a plain step's tokens per second
            r.spec.record(gain)
    return verdicts


@pytest.mark.parametrize("gain, shut", [(0.8, True), (1.2, False)])
def test_the_no_regret_check_shuts_drafting_that_loses(gain, shut):
    from entropic.speculative.speculator import MAX_PROBE_EVERY, MIN_ARM_STEPS, PROBE_EVERY
    r = _Regret()
    verdicts = _regret_verdicts(r, [gain] * 4000)
    assert verdicts[:MIN_ARM_STEPS] == ["plain"] * MIN_ARM_STEPS
    late = verdicts[2 * PROBE_EVERY:]
    if shut:  # only probes draft, ever more rarely: the gaps double up to the cap
        probes = [i for i, v in enumerate(late) if v == "spec"]
        gaps = [b - a for a, b in zip(probes, probes[1:])]
        assert None not in late and len(probes) >= 8
        assert gaps == sorted(gaps) and gaps[-1] >= MAX_PROBE_EVERY
        assert max(gaps) <= MAX_PROBE_EVERY + MAX_PROBE_EVERY // PROBE_EVERY + 1
    else:  # the gate decides, save the plain probes (every PROBE_EVERY-th step)
        plain = late.count("plain")
        assert abs(plain - len(late) / PROBE_EVERY) <= 1 and late.count(None) == len(late) - plain


def test_steps_without_drafts_stand_in_for_the_forced_plain_ones():
    """Where requests often find no draft (batch 1), those steps measure the plain time, and
    no step that could draft is kept plain; without them one step in PROBE_EVERY is."""
    from entropic.speculative.speculator import MIN_ARM_STEPS, PROBE_EVERY
    r = _Regret()
    verdicts = []
    for i in range(40 * PROBE_EVERY):
        v = r.decide()
        verdicts.append(v)
        if v == "plain" or i % (PROBE_EVERY // 2) == 0:  # nothing drafted this step
            r.plain_measured()
        else:
            r.spec.record(1.5)
    late = verdicts[MIN_ARM_STEPS + 2 * PROBE_EVERY:]
    assert late.count("plain") == 0 and late.count(None) == len(late)
    # every PROBE_EVERY + 1 steps without a plain one: the forced ones come back
    r2 = _Regret()
    late2 = _regret_verdicts(r2, [1.5] * (40 * PROBE_EVERY))[2 * PROBE_EVERY:]
    assert abs(late2.count("plain") - len(late2) / PROBE_EVERY) <= 1


def test_the_no_regret_check_reopens_when_drafting_pays_again():
    from entropic.speculative.speculator import MAX_PROBE_EVERY, PROBE_EVERY
    r = _Regret()
    _regret_verdicts(r, [0.5] * 3000)  # shut, probing at the longest interval
    assert r.interval == MAX_PROBE_EVERY
    # the workload changes: drafts pay now; within a few long intervals the gate reopens
    # (the EMA has to climb past 1), and then a shut would probe at the short interval again
    verdicts = _regret_verdicts(r, [3.0] * (4 * MAX_PROBE_EVERY))
    assert verdicts[-PROBE_EVERY:].count(None) >= PROBE_EVERY - 1
    assert r.interval == PROBE_EVERY


def test_the_no_regret_gain_compares_with_a_plain_step_of_as_many_requests():
    spec = Speculator(SpeculativeConfig())
    bucket = (False, 4)  # 8-15 requests, greedy
    spec.regret[bucket] = regret = _Regret()
    for requests, seconds in ((8, 0.08), (12, 0.09)):  # plain steps: 8 and 12 requests
        spec._step, spec._step_tokens = (bucket, requests, False), requests
        spec.observe_step(requests, seconds, False)
    assert regret.plain_steps == 2
    # 8 requests drafted, 12 tokens committed in 0.10 s: a plain 8-request step gives
    # 8 tokens in 0.08 s, so the gain is (12 / 0.10) / (8 / 0.08) = 1.2, though a plain
    # 12-request step (133 tokens/s) beats it
    spec._step, spec._step_tokens = (bucket, 8, True), 12
    spec.observe_step(20, 0.10, False)
    assert regret.spec.n == 1 and regret.spec.rate == pytest.approx(1.2)


def test_acceptance_is_learned_per_position():
    model = AcceptanceModel(max_match=5)
    key = model.key(True, 0.1, 3)
    for _ in range(200):  # the first drafted token is right half the time; then all are
        model.observe(key, 6, 6)
        model.observe(key, 6, 0)
    a = model.rates(key, 6)
    assert a[0] == pytest.approx(0.5, abs=0.02) and min(a[1:]) > 0.97


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="model="):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="eagle")


# ---- the acceptance rule on tiny vocabularies ---------------------------------------------
def _verify_draws(logits: torch.Tensor, draft: int, params: SamplingParams, trials: int):
    """Each trial: one request verifying one drafted token over two rows (logits[0] at the
    pending position, logits[1] after the draft). Returns the committed tokens per trial."""
    rows = logits.repeat(trials, 1)
    batch = SamplingBatch([f"t{i // 2}" for i in range(2 * trials)], [params] * (2 * trials),
                          [i % 2 for i in range(2 * trials)],
                          draft_next=[draft if i % 2 == 0 else None for i in range(2 * trials)])
    toks = Sampler()(rows, batch).token_ids.view(trials, 2).tolist()
    kept = torch.tensor(batch.kept).view(trials, 2)
    assert kept[:, 0].all()
    return toks, kept[:, 1].tolist()


def _check(counts: list[int], probs: torch.Tensor) -> None:
    n = sum(counts)
    support = [i for i, p in enumerate(probs.tolist()) if p > 0]
    assert all(counts[i] == 0 for i in range(len(counts)) if i not in support)
    if len(support) > 1:
        mass = sum(float(probs[i]) for i in support)
        _, pval = chisquare([counts[i] for i in support],
                            [n * float(probs[i]) / mass for i in support])
        assert pval > 1e-4, (counts, probs)


@pytest.mark.parametrize("case", ["plain", "top_p_removes_draft", "draft_prob_zero", "greedy"])
def test_committed_tokens_follow_the_target_distribution(case):
    torch.manual_seed(0)
    l0 = torch.tensor([[1.0, 0.2, -0.5, 0.7, -2.0]])
    l1 = torch.tensor([[-1.0, 0.5, 0.5, 0.0, 1.2]])
    params, draft = SamplingParams(temperature=0.8), 3
    p0 = torch.softmax(l0[0] / 0.8, -1)
    if case == "top_p_removes_draft":
        params = SamplingParams(temperature=1.0, top_p=0.6)
        p0 = torch.softmax(l0[0], -1)
        order = p0.argsort(descending=True)
        mass_before = torch.cumsum(p0[order], 0) - p0[order]
        keep = torch.zeros(5, dtype=torch.bool)
        keep[order[mass_before < 0.6]] = True
        draft = int(order[-1])  # the least likely token: removed by top-p
        assert not keep[draft]
        p0 = torch.where(keep, p0, 0.0) / p0[keep].sum()
    elif case == "draft_prob_zero":
        l0 = l0.clone()
        l0[0, 3] = float("-inf")
        p0 = torch.softmax(l0[0] / 0.8, -1)
    elif case == "greedy":
        params = SamplingParams(temperature=0.0)
        draft = 0
        p0 = torch.nn.functional.one_hot(l0[0].argmax(), 5).float()
    logits = torch.cat([l0, l1])
    toks, second_kept = _verify_draws(logits, draft, params, 100_000)
    first = [t[0] for t in toks]
    _check([first.count(v) for v in range(5)], p0)
    # the second row counts exactly when the first produced the draft ...
    assert second_kept == [f == draft for f in first]
    # ... and then follows the second distribution
    seconds = [t[1] for t, k in zip(toks, second_kept) if k]
    if case in ("top_p_removes_draft", "draft_prob_zero"):
        assert not seconds  # a draft the target cannot produce is never accepted
    else:
        p1 = (torch.softmax(l1[0] / params.temperature, -1) if params.temperature
              else torch.nn.functional.one_hot(l1[0].argmax(), 5).float())
        _check([seconds.count(v) for v in range(5)], p1)


# ---- exactness on the real model ----------------------------------------------------------
FIXED = SpeculativeConfig(gate="fixed", num_speculative_tokens=6, prompt_lookup_min=1)
GATED = SpeculativeConfig()


@pytest.mark.parametrize("spec", [FIXED, GATED], ids=["fixed", "gated"])
def test_greedy_ids_identical_alone_and_mixed(llm_bf16, prompts, spec):
    greedy = SamplingParams(temperature=0, max_tokens=48)
    plain = _engine(llm_bf16, None)
    refs = [_run(plain, [p], greedy)[0] for p in prompts]
    fast = _engine(llm_bf16, spec)
    for p, ref in zip(prompts, refs):
        assert _run(fast, [p], greedy)[0].token_ids == ref.token_ids
    # mixed: all at once, a sampled request among them, a small budget mixing prefill in
    mixed = _engine(llm_bf16, spec, max_num_batched_tokens=40)
    params = [greedy] * len(prompts) + [SamplingParams(temperature=1.0, max_tokens=20)]
    outs = _run(mixed, prompts + [prompts[0]], params)
    assert [o.token_ids for o in outs[:-1]] == [r.token_ids for r in refs]
    st = fast.speculator.stats
    assert st.accepted_tokens > 0 and st.committed_tokens > st.decode_steps
    assert outs[0].speculation is not None and outs[0].speculation.decode_steps > 0


def test_seeded_sampling_and_thermostat_identical(llm_bf16, prompts):
    th = ThermostatParams(target_entropy=1.0, t_min=0.3, t_max=1.5)
    params = [SamplingParams(temperature=0.8, seed=11, max_tokens=40, tempered_entropy=True),
              SamplingParams(temperature=0.8, seed=12, max_tokens=40, top_p=0.9),
              SamplingParams(temperature=1.0, seed=13, max_tokens=40, thermostat=th),
              SamplingParams(temperature=0.8, seed=14, max_tokens=40, top_k=5,
                             tempered_entropy=True)]
    ref = _run(_engine(llm_bf16, None), prompts, params)
    fast = _engine(llm_bf16, FIXED)
    got = _run(fast, prompts, params)
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids
        assert g.temperatures == r.temperatures  # the thermostat stepped per position
        assert g.entropies == pytest.approx(r.entropies, abs=1e-4)
        assert g.entropic.tau == pytest.approx(r.entropic.tau, abs=1e-3)
        # H^T of the committed tokens only, one per token, as without speculation (the
        # rejected rows' measurements are dropped): measured, or None where not asked
        assert len(g.tempered_entropies) == len(g.token_ids)
        if r is ref[1]:
            assert g.tempered_entropies == r.tempered_entropies == [None] * len(r.token_ids)
        else:
            assert g.tempered_entropies == pytest.approx(r.tempered_entropies, abs=1e-4)
    assert fast.speculator.stats.accepted_tokens > 0


def test_stops_inside_an_accepted_run(llm_bf16, prompts):
    """max_tokens, a stop token and a stop string that fall inside a run of accepted drafted
    tokens end the request exactly where plain decoding ends it."""
    p = prompts[1]
    (ref,) = _run(_engine(llm_bf16, None), [p], SamplingParams(temperature=0, max_tokens=40))
    text = ref.text
    word = text.split()[len(text.split()) // 2]
    stop_tok = ref.token_ids[len(ref.token_ids) // 2]
    cases = [SamplingParams(temperature=0, max_tokens=n) for n in (3, 7, 13)]
    cases += [SamplingParams(temperature=0, max_tokens=40, stop=[word]),
              SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_tok]),
              SamplingParams(temperature=0, max_tokens=40, stop=[word], logprobs=2,
                             include_stop_str_in_output=True)]
    plain = _run(_engine(llm_bf16, None), [p] * len(cases), cases)
    fast = _run(_engine(llm_bf16, FIXED), [p] * len(cases), cases)
    for a, b in zip(plain, fast):
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == \
            (a.token_ids, a.text, a.finish_reason, a.stop_reason)
        assert len(b.entropies) == len(b.token_ids) == len(b.metrics.token_times)
        if a.logprobs is not None:
            assert [x.token_id for x in b.logprobs] == [x.token_id for x in a.logprobs]


class _Oracle:
    """Drafts the true greedy continuation, corrupted at random places: random acceptance
    lengths, from 0 to the whole draft."""

    def __init__(self, refs: dict[tuple, list[int]], seed: int) -> None:
        self.refs = refs
        self.rng = random.Random(seed)

    def propose(self, request_id, tokens, k):
        for prompt, full in self.refs.items():
            n = len(prompt)
            if tuple(tokens[:n]) == prompt and full[:len(tokens)] == tokens:
                draft = full[len(tokens):len(tokens) + self.rng.randint(1, k)]
                if draft and self.rng.random() < 0.6:
                    draft[self.rng.randrange(len(draft))] = self.rng.randrange(100, 30000)
                return draft, 3
        return [], 0

    def release(self, request_id):
        pass


def test_kv_rollback_fuzz_no_leaked_or_stale_blocks(llm_bf16, prompts):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = _run(_engine(llm_bf16, None), prompts, greedy)
    refs = {tuple(p): p + o.token_ids for p, o in zip(prompts, plain)}
    for seed in range(3):
        eng = _engine(llm_bf16, FIXED, _Oracle(refs, seed), num_kv_blocks=40)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, greedy)
        finals = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    finals[o.request_id] = o
            held = 0
            for req in eng.scheduler.requests.values():
                table = eng.kv.block_table(req.request_id)
                assert len(table) <= eng.kv.blocks_needed(req.num_tokens), "stale blocks"
                held += len(table)
            assert eng.pool.num_used == held, "leaked blocks"
        assert eng.pool.num_used == 0
        assert [finals[f"r{i}"].token_ids for i in range(len(prompts))] == \
            [o.token_ids for o in plain]
        st = eng.speculator.stats
        assert 0 < st.accepted_tokens < st.drafted_tokens


# ---- visible in the server -----------------------------------------------------------------
def test_server_speculates_and_reports_it(llm_bf16, prompts):
    """`entropic serve --speculative-method ngram`: the same greedy ids as the engine without
    speculation (streamed and not), the request's speculation in the `entropic` block, and
    the spec_decode gauges in /metrics."""
    import json

    import httpx

    from serving import ServerProcess

    (ref,) = _run(_engine(llm_bf16, None), [prompts[1]],
                  SamplingParams(temperature=0, max_tokens=40))
    body = {"model": "m", "prompt": prompts[1], "max_tokens": 40, "temperature": 0,
            "entropic": {"entropy": True}}
    with ServerProcess("--threads", "2", "--speculative-method", "ngram",
                       "--speculative-gate", "fixed", "--served-model-name", "m",
                       "--log-level", "warning") as srv:
        r = httpx.post(srv.base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == ref.text
        spec = choice["entropic"]["speculation"]
        assert spec["accepted_tokens"] > 0 and spec["tokens_per_forward"] > 1
        text = ""
        with httpx.stream("POST", srv.base + "/v1/completions", json={**body, "stream": True},
                          timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert text == ref.text
        metrics = httpx.get(srv.base + "/metrics", timeout=10).text
        accepted = [ln for ln in metrics.splitlines()
                    if ln.startswith("entropic_spec_decode_num_accepted_tokens ")]
        assert accepted and float(accepted[0].split()[1]) >= 2 * spec["accepted_tokens"]
        assert "entropic_spec_decode_acceptance_by_entropy{" in metrics


def test_draft_model_drafts_exactly(llm_bf16, prompts):
    """The local model's int4 weights draft for its bf16 self (the only smaller model with
    the same tokenizer at hand): same greedy ids, most drafts accepted; a draft model whose
    tokenizer differs is refused."""
    from entropic.model.loader import default_model_path
    from entropic.speculative.draft_model import make_proposer

    spec = SpeculativeConfig(method="draft_model", model=default_model_path(),
                             draft_quantization="int4", num_speculative_tokens=4, gate="fixed")
    proposer = make_proposer(spec, llm_bf16.tokenizer)
    greedy = SamplingParams(temperature=0, max_tokens=24)
    ref = _run(_engine(llm_bf16, None), prompts[1:3], greedy)
    eng = _engine(llm_bf16, spec, proposer)
    got = _run(eng, prompts[1:3], greedy)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    st = eng.speculator.stats
    assert st.acceptance_rate > 0.5, st.as_dict()
    assert proposer.kv.pool.num_used == 0  # finished requests' draft KV is released

    class OtherTokenizer:
        def encode(self, text):
            return [len(text)]

    with pytest.raises(ValueError, match="tokenizer does not match"):
        make_proposer(spec, OtherTokenizer())
