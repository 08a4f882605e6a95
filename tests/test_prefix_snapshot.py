"""Cached prefix blocks moved between engines (`LLMEngine.export_prefix` / `import_prefix`),
and the prompt surprisal that published blocks carry (docs/prefix_caching.md)."""
from dataclasses import replace

import pytest

from entropic.engine.block_pool import BlockPool
from entropic.engine.scheduler import PromptScores
from entropic.sampling_params import SamplingParams
from fakes import make_scheduler
from test_prefix_cache import req

# ---- no model -------------------------------------------------------------------------


def test_scores_travel_with_the_hash_and_fill_in_once():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.publish(a, "h") and pool.scores(a) is None
    assert not pool.publish(b, "h", (None, 1.0))  # same content: fills in the cached one's
    assert pool.scores(a) == (None, 1.0)
    assert not pool.publish(b, "h", (None, 2.0))  # known already: kept
    assert pool.scores(a) == (None, 1.0)
    pool.free([a, b])
    pool.allocate(2)  # evicts the cached block: its scores go with its hash
    assert pool.lookup("h") is None and pool.scores(a) is None


class SurprisalPolicy:
    """A block policy that wants prompt surprisal and records every observation."""

    wants_prompt_surprisal = True
    wants_key_bounds = False

    def __init__(self):
        self.seen: dict[str, dict[int, float]] = {}

    def bind(self, cost):
        pass

    def prefill_sparsity(self, req, start, num_tokens):
        return None

    def select(self, req, live, num_blocks, decode_rows):
        from entropic.engine.block_policy import BlockSelection
        return BlockSelection(None)

    def observe(self, req, positions, surprisal, attended, mass):
        got = self.seen.setdefault(req.request_id, {})
        for p, s in zip(positions, surprisal):
            assert p not in got, f"position {p} observed twice"
            got[p] = s

    def evict(self, candidates, need):
        return []

    def release(self, ids):
        pass


def _score(tokens_before: list[int], token: int) -> float:
    """A fake log p(token | tokens before): depends on the whole prefix."""
    return -((hash(tuple(tokens_before)) * 31 + token) % 1000) / 100.0


def _run_scored(sched, runner, policy):
    """Step the scheduler as the engine does for a block policy: prompt scores from the
    (fake) runner, observed with the cached surprisal of a hit's first chunk."""
    chunks_seen = []
    while sched.num_unfinished:
        out = sched.schedule()
        sampled = runner.execute(out)
        scores = {}
        for c in out.chunks:
            chunks_seen.append((c.request_id, c.start_pos, c.num_tokens))
            toks = sched.requests[c.request_id].token_ids
            if c.score_targets is not None:
                scores[c.request_id] = PromptScores(
                    [_score(toks[:c.start_pos + j + 1], t)
                     for j, t in enumerate(c.score_targets)])
        reqs = {c.request_id: sched.requests[c.request_id] for c in out.chunks}
        sched.update(out, sampled, 0.0, scores)
        for c in out.chunks:
            pos, sur = [], []
            if c.cached_surprisal:
                pos += range(1, c.start_pos + 1)
                sur += c.cached_surprisal
            if c.request_id in scores:
                pos += range(c.start_pos + 1, c.start_pos + 1 + len(c.score_targets))
                sur += [-lp for lp in scores[c.request_id].logprobs]
            policy.observe(reqs[c.request_id], pos, sur, None, None)
    return chunks_seen


def test_scored_hit_gives_the_surprisal_of_every_prompt_position():
    """A surprisal-ranking request starts on cached blocks only where they carry their
    positions' surprisal, one block short of the scored chain (the first computed
    position's score comes from the cache), and is told exactly the scores it would have
    computed; blocks published without scores are not used."""
    policy = SurprisalPolicy()
    sched, pool, runner = make_scheduler(num_blocks=40, budget=64, prefix_caching=True,
                                         block_policy=policy)
    prompt = [(5 * i + 1) % 37 for i in range(19)]  # 4 full blocks of 4, and 3 tokens
    sched.add(req("a", prompt, 2))
    assert ("a", 0, 19) in _run_scored(sched, runner, policy)
    truth = {p: -_score(prompt[:p], prompt[p]) for p in range(1, 19)}
    assert {p: s for p, s in policy.seen["a"].items() if p < 19} == truth
    sched.add(req("b", prompt, 2))
    chunks = _run_scored(sched, runner, policy)
    # 4 scored blocks cached: a hit of 3 (block 3's scores give position 12's)
    assert chunks[0] == ("b", 12, 7)
    assert {p: s for p, s in policy.seen["b"].items() if p < 19} == truth
    assert pool.num_free == 40

    # blocks published by a request that did not score its prompt carry no surprisal
    plain, _, runner2 = make_scheduler(num_blocks=40, budget=64, prefix_caching=True)
    plain.add(req("a", prompt, 2))
    _run_scored(plain, runner2, policy)
    plain.block_policy = policy2 = SurprisalPolicy()
    plain.add(req("b", prompt, 2))
    assert _run_scored(plain, runner2, policy2)[0] == ("b", 0, 19)
    # ... but b scored them, which filled in the cached blocks' surprisal: c hits
    plain.add(req("c", prompt, 2))
    assert _run_scored(plain, runner2, policy2)[0] == ("c", 12, 7)
    assert {p: s for p, s in policy2.seen["c"].items() if p < 19} == truth


# ---- the real model -----------------------------------------------------------------------


def _engine(llm, block_policy=None, **config):
    from entropic.engine.engine import LLMEngine
    e = llm.engine
    return LLMEngine(e.model, e.tokenizer, replace(e.config, **config),
                     block_policy=block_policy)


def _first_logits(engine):
    """Keep the logits of the first sampled row of every step (the runner's test switch)."""
    engine.runner.keep_logits = True
    run_chunks, got = engine.runner.execute, []

    def execute(sched):
        res = run_chunks(sched)
        got.append((sched.chunks[0].start_pos, res.logits[0].clone()))
        return res
    engine.runner.execute = execute
    return got


@pytest.fixture(scope="module")
def prompt(llm_fp32):
    tok = llm_fp32.tokenizer
    return tok.apply_chat_template(
        [{"role": "user", "content": "Describe the tides of the North Sea. " * 6}])


@pytest.mark.model
def test_export_import_round_trip_gives_the_computed_prompts_tokens_and_logits(llm_fp32,
                                                                                prompt):
    sp = SamplingParams(max_tokens=8, temperature=0)
    source = _engine(llm_fp32)
    source.add_request("a", prompt, sp)
    source.run_until_done()
    snap = source.export_prefix(prompt + [1, 2, 3])  # past the cached blocks: ignored
    n = len(prompt) // 16
    assert snap.num_blocks == n and snap.num_tokens == n * 16 and len(prompt) % 16
    assert snap.surprisal == (None,) * n  # a plain request does not score its prompt

    fresh = _engine(llm_fp32, enable_prefix_caching=False)
    fresh_logits = _first_logits(fresh)
    fresh.add_request("x", prompt, sp)
    (want,) = fresh.run_until_done()

    target = _engine(llm_fp32)
    free = target.pool.num_free
    assert target.import_prefix(snap) == n
    assert target.pool.num_free == free and target.pool.num_cached == n  # cached, free
    assert target.import_prefix(snap) == 0  # cached already: nothing written
    logits = _first_logits(target)
    target.add_request("x", prompt, sp)
    (got,) = target.run_until_done()
    assert target.stats.prefix_cache_hits == n * 16
    assert logits[0][0] == n * 16  # the first step computed only the prompt's tail
    assert got.token_ids == want.token_ids
    diff = (logits[0][1] - fresh_logits[0][1]).abs().max().item()
    print(f"first-token logits, imported prefix vs computed: max |diff| {diff:.3g}")
    assert diff < 1e-3
    assert target.pool.num_free == target.num_blocks and target.pool.num_used == 0


@pytest.mark.model
def test_surprisal_pruner_on_an_imported_prefix_gets_the_scores_it_would_compute(llm_fp32,
                                                                                 prompt):
    from entropic.bench.forking import PrefilledPrompt
    from entropic.control.pruning import EntropicBlockPruner, PruningConfig
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    seen = {}

    def pruner(name):
        p = EntropicBlockPruner(PruningConfig(score="surprisal", min_keep_fraction=0.5,
                                              min_attention_share=0.0), 16)
        observe = p.observe

        def record(req, positions, surprisal, attended, mass):
            got = seen.setdefault(name, {})
            got.update(zip(positions, surprisal))
            return observe(req, positions, surprisal, attended, mass)
        p.observe = record
        return p

    alone = _engine(llm_fp32, pruner("computed"), enable_prefix_caching=False)
    alone.add_request("x", prompt, sp)
    (want,) = alone.run_until_done()

    pre = PrefilledPrompt.run(_engine(llm_fp32), prompt,
                              SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    assert all(s is not None for s in pre.snapshot.surprisal)
    target = _engine(llm_fp32, pruner("imported"))
    pre.start_in(target, "x", sp)
    (got,) = target.run_until_done()
    n = len(prompt) // 16
    assert target.stats.prefix_cache_hits == (n - 1) * 16  # one block short: see the docs
    a, b = seen["computed"], seen["imported"]
    # every prompt position and the first token's (a finished request's last token is not
    # observed: the policy has released it)
    assert sorted(a) == sorted(b) and set(range(1, len(prompt) + 1)) <= set(a)
    cached = range(1, (n - 1) * 16 + 1)
    assert [a[p] for p in cached] == [b[p] for p in cached]  # the prefill's own numbers
    diff = max(abs(a[p] - b[p]) for p in a)
    print(f"prompt surprisal, imported prefix vs computed: max |diff| {diff:.3g}")
    assert diff < 1e-3
    assert got.token_ids == want.token_ids
    assert target.pool.num_free == target.num_blocks


@pytest.mark.model
def test_import_refuses_a_mismatch_and_changes_nothing(llm_fp32, prompt):
    from entropic.engine.prefix_snapshot import PrefixSnapshot
    source = _engine(llm_fp32)
    source.add_request("a", prompt, SamplingParams(max_tokens=1, temperature=0))
    source.run_until_done()
    snap = source.export_prefix(prompt)
    assert snap.num_blocks >= 3
    target = _engine(llm_fp32)
    before = (target.pool.num_free, target.pool.num_cached)
    for field, value in (("dtype", "bfloat16"), ("kernels", "other"),
                         ("weights", "0" * 32), ("model", "another config")):
        bad = replace(snap, identity=replace(snap.identity, **{field: value}))
        with pytest.raises(ValueError, match=field):
            target.import_prefix(bad)
    with pytest.raises(ValueError, match="block size is 16, this engine's 32"):
        _engine(llm_fp32, block_size=32).import_prefix(snap)
    with pytest.raises(ValueError, match="keys"):
        target.import_prefix(replace(snap, token_ids=(7,) + snap.token_ids[1:]))
    with pytest.raises(ValueError, match="KV is"):
        target.import_prefix(replace(snap, kv=snap.kv[:, :-1]))
    with pytest.raises(TypeError):
        target.import_prefix(snap.kv)
    with pytest.raises(ValueError, match="prefix caching is off"):
        _engine(llm_fp32, enable_prefix_caching=False).import_prefix(snap)
    assert (target.pool.num_free, target.pool.num_cached) == before
    assert isinstance(snap, PrefixSnapshot)

    # too few free blocks: a request holds most of a small pool
    small = _engine(llm_fp32, num_kv_blocks=snap.num_blocks + 1)
    small.add_request("hold", list(range(100, 100 + 16 * (snap.num_blocks - 1))),
                      SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    small.step()
    free = small.pool.num_free
    with pytest.raises(RuntimeError, match="free KV blocks"):
        small.import_prefix(snap)
    assert small.pool.num_free == free and small.pool.num_cached == snap.num_blocks - 1
    small.abort_request("hold")
    assert small.import_prefix(snap) == snap.num_blocks  # evicts the aborted one's blocks
    assert small.pool.num_free == small.num_blocks


@pytest.mark.model
def test_prefilled_prompt_keeps_the_pruning_benchmarks_semantics(llm_bf16):
    """bf16, as the benchmark runs: every configuration samples the same first token from
    the same numbers (they start on the same blocks and compute the same tail), and a
    surprisal-ranking pruner sees the prefill's own scores on the cached positions (the
    tail's recomputed ones within rounding; measured identical at 1k-2k tokens)."""
    from entropic.bench.datasets import load_longdocs
    from entropic.bench.forking import PrefilledPrompt
    from entropic.control.pruning import EntropicBlockPruner, PruningConfig
    tok = llm_bf16.tokenizer
    prompt = tok.encode(load_longdocs("paper")[0]["text"])[:300]
    pre_eng = _engine(llm_bf16)
    pre_eng.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0,
                                                    prompt_logprobs=0))
    (prefill,) = pre_eng.run_until_done()
    today = [-lp.logprob for lp in prefill.prompt_logprobs[1:]]  # positions 1..L-1
    pre = PrefilledPrompt(list(prompt), pre_eng.export_prefix(prompt))
    assert pre.num_cached_blocks == len(prompt) // 16 - 1  # the snapshot's blocks, less one
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=0)
    firsts, scores = {}, {}
    for score in (None, "mass", "surprisal", "hybrid", "bound"):
        pruner = (EntropicBlockPruner(PruningConfig(score=score, min_keep_fraction=0.25,
                                                    min_attention_share=0.0,
                                                    prefill_delta=None), 16)
                  if score else None)
        if score in ("surprisal", "hybrid"):
            seen = scores[score] = {}
            observe = pruner.observe

            def record(req, positions, surprisal, attended, mass, seen=seen, observe=observe):
                seen.update(zip(positions, surprisal))
                return observe(req, positions, surprisal, attended, mass)
            pruner.observe = record
        eng = _engine(llm_bf16, pruner)
        pre.start_in(eng, "x", sp)
        (out,) = eng.run_until_done()
        assert eng.stats.prefix_cache_hits == pre.num_cached_blocks * 16
        firsts[score] = (out.token_ids[0], out.logprobs[0].logprob, out.entropies[0])
        assert eng.pool.num_free == eng.num_blocks
    assert len(set(firsts.values())) == 1, firsts
    cached = pre.num_cached_blocks * 16
    for seen in scores.values():
        got = [seen[p] for p in range(1, len(prompt))]
        assert got[:cached] == today[:cached]
        diff = max(abs(a - b) for a, b in zip(got, today))
        print(f"prompt surprisal on the PrefilledPrompt path vs the prefill's: max |diff| "
              f"{diff:.3g} (tail {cached + 1}..{len(prompt) - 1})")
        assert diff < 0.05
