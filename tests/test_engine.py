"""End-to-end engine behaviour on the real default model."""
import pytest

from entropic import LLM, SamplingParams

pytestmark = pytest.mark.model

CHAT = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


def _no_blocks_held(llm):
    eng = llm.engine
    return eng.pool.num_free == eng.num_blocks and eng.kv.num_tracked == 0


def test_generate_and_chat_outputs_are_complete(llm_bf16):
    (o,) = llm_bf16.chat(CHAT, SamplingParams(max_tokens=24, temperature=0, logprobs=3))
    assert o.finished and o.finish_reason in ("stop", "length")
    assert len(o.token_ids) == len(o.entropies) == len(o.logprobs) <= 24
    assert o.text and o.text == llm_bf16.tokenizer.decode(o.token_ids)
    assert all(h >= 0 for h in o.entropies)
    for lp, tok in zip(o.logprobs, o.token_ids):
        assert lp.token_id == tok and len(lp.top) == 3 and lp.logprob <= 0
        assert max(lp.top.values()) >= lp.logprob  # greedy: the chosen token is the top one
    m = o.metrics
    assert m.ttft > 0 and len(m.token_times) == len(o.token_ids) and m.e2e >= m.ttft
    raw = llm_bf16.generate(["The capital of France is", [1, 2, 3]],
                            SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert [len(r.token_ids) for r in raw] == [5, 5] and raw[1].prompt_token_ids == [1, 2, 3]
    assert _no_blocks_held(llm_bf16)


@pytest.mark.parametrize("prompt, err, field", [
    ("", ValueError, "prompt"),
    ([], ValueError, "prompt"),
    ([5] * 9000, ValueError, "context length"),
    ([10**6], ValueError, "token id"),
    (3.5, TypeError, "prompt"),
])
def test_bad_prompts_rejected_and_engine_keeps_serving(llm_bf16, prompt, err, field):
    eng = llm_bf16.engine
    eng.add_request("good", "Tell me a joke.", SamplingParams(max_tokens=8, temperature=0,
                                                               ignore_eos=True))
    eng.step()
    with pytest.raises(err, match=field):
        eng.add_request("bad", prompt, SamplingParams(max_tokens=8))
    with pytest.raises(err, match=field):
        llm_bf16.generate([prompt], SamplingParams(max_tokens=8))
    finals = eng.run_until_done()
    assert [o.request_id for o in finals] == ["good"] and finals[0].token_ids
    assert _no_blocks_held(llm_bf16)


def test_prompt_plus_max_tokens_over_context(llm_bf16):
    with pytest.raises(ValueError, match="max_tokens"):
        llm_bf16.generate([[7] * 8000], SamplingParams(max_tokens=500))
    assert _no_blocks_held(llm_bf16)


def test_sampling_param_errors_name_the_field():
    for kw, field in [({"max_tokens": 0}, "max_tokens"), ({"top_p": 0}, "top_p"),
                      ({"top_p": 1.01}, "top_p"), ({"temperature": -1}, "temperature")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)


def test_unknown_model_path_and_corrupt_gguf(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        LLM(model=str(tmp_path / "nope.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 40)
    with pytest.raises(ValueError, match="bad.gguf"):
        LLM(model=str(bad))


def test_stop_strings_and_stop_token_ids(llm_bf16):
    base = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    (ref,) = llm_bf16.chat(CHAT, base)
    words = ref.text.split()
    stop = " ".join(words[3:5])
    (o,) = llm_bf16.chat(CHAT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                              stop=[stop, "zzzz-never"]))
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == ref.text[:ref.text.index(stop)]
    (o,) = llm_bf16.chat(CHAT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                              stop=[stop], include_stop_str_in_output=True))
    assert o.text.endswith(stop)
    tok = ref.token_ids[6]
    (o,) = llm_bf16.chat(CHAT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                              stop_token_ids=[tok]))
    first = ref.token_ids.index(tok)
    assert o.token_ids == ref.token_ids[:first + 1] and o.stop_reason == tok
    assert _no_blocks_held(llm_bf16)


def test_seed_reproducible_whatever_the_batch(llm_bf16):
    p = SamplingParams(max_tokens=20, temperature=1.0, seed=42)
    (alone,) = llm_bf16.chat(CHAT, p)
    others = [[{"role": "user", "content": f"Count to {i}."}] for i in range(6)]
    mixed = llm_bf16.chat(others[:3] + [CHAT] + others[3:],
                          [SamplingParams(max_tokens=20, temperature=1.0)] * 3 + [p] +
                          [SamplingParams(max_tokens=20, temperature=1.0)] * 3)
    assert mixed[3].token_ids == alone.token_ids
    (other_seed,) = llm_bf16.chat(CHAT, SamplingParams(max_tokens=20, temperature=1.0, seed=7))
    assert other_seed.token_ids != alone.token_ids


def test_streaming_deltas_and_early_close_frees_blocks(llm_bf16):
    ids = llm_bf16.tokenizer.apply_chat_template(CHAT)
    params = SamplingParams(max_tokens=30, temperature=0)
    outs = list(llm_bf16.stream(ids, params))
    assert outs[-1].finished and "".join(o.text_delta for o in outs) == outs[-1].text
    assert sum(len(o.new_token_ids) for o in outs) == len(outs[-1].token_ids)
    gen = llm_bf16.stream(ids, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    for _, _ in zip(range(3), gen):
        pass
    assert llm_bf16.engine.num_unfinished == 1
    gen.close()  # the client went away: the request is aborted
    assert llm_bf16.engine.num_unfinished == 0 and _no_blocks_held(llm_bf16)


def test_abort_any_time_others_finish(llm_bf16):
    eng = llm_bf16.engine
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for i in range(4):
        eng.add_request(f"a{i}", "Name three colours.", p)
    eng.abort_request("a3")  # while waiting
    eng.step()
    eng.step()
    out = eng.abort_request("a1")  # while running
    assert out.finish_reason == "abort"
    assert eng.abort_request("a1") is None  # twice is harmless
    finals = eng.run_until_done()
    assert sorted(o.request_id for o in finals) == ["a0", "a2"]
    assert all(len(o.token_ids) == 12 for o in finals)
    assert _no_blocks_held(llm_bf16)


def test_preemption_by_recompute_keeps_greedy_tokens(llm_fp32, chat_prompts):
    """A cache too small for all requests at once forces preemptions; greedy tokens must not
    change (fp32, so recomputed KV equals the original to float precision)."""
    prompts = sorted(chat_prompts, key=len)[:4]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    roomy = llm_fp32.generate(prompts, params)
    need = -(-(len(prompts[-1]) + 16) // 16)  # blocks for the largest request alone
    small = LLM(dtype="float32", num_kv_blocks=need + 2, max_num_batched_tokens=64)
    tight = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert _no_blocks_held(small)


def test_cost_tau_and_thermostat_on_outputs(llm_bf16):
    from entropic import ThermostatParams
    from entropic.control.clock import entropic_time

    eng = llm_bf16.engine
    before = eng.stats.cost.flops
    th = ThermostatParams(target_entropy=1.5, t_min=0.3, t_max=1.5)
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    (ref,) = llm_bf16.chat(CHAT, plain)
    outs = llm_bf16.chat([CHAT, CHAT], [plain, SamplingParams(
        max_tokens=16, temperature=1.0, seed=3, ignore_eos=True, thermostat=th)])
    assert outs[0].token_ids == ref.token_ids  # a thermostat row leaves the others alone
    assert outs[0].temperatures == [0.0] * 16
    assert all(0.3 - 1e-6 <= t <= 1.5 + 1e-6 for t in outs[1].temperatures)
    assert outs[1].temperatures[0] == pytest.approx(1.0)
    for o in outs:
        assert o.entropic.tau == pytest.approx(entropic_time(o.entropies), abs=1e-9)
        assert o.cost.flops_linear > 0 and o.cost.flops_attention > 0 and o.cost.seconds > 0
    spent = eng.stats.cost.flops - before
    assert spent == pytest.approx(ref.cost.flops + sum(o.cost.flops for o in outs), rel=1e-9)
    assert eng.stats.tau > 0 and eng.stats.tau_per_tflop > 0


class _FailOn:
    """A sampler-chain element that raises whenever the batch holds a request whose
    max_tokens is `marker` and which has `after` output tokens (a bug in one request)."""

    def __init__(self, marker: int, after: int) -> None:
        self.marker, self.after = marker, after

    def apply(self, logits, temperatures, batch):
        for p, n in zip(batch.params, batch.num_output_tokens):
            if p.max_tokens == self.marker and n == self.after:
                raise FloatingPointError("injected fault")
        return logits, temperatures

    def accept(self, token_ids, batch):
        pass

    def release(self, request_ids):
        pass


def test_a_request_that_fails_fails_alone(llm_bf16):
    """A fault in one request's work finishes that request with finish_reason "error" and
    frees its blocks; the requests batched with it get the tokens they get without it."""
    convs = [[{"role": "user", "content": f"Name {i} animals."}] for i in range(1, 4)]
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm_bf16.chat(convs, plain)
    procs = llm_bf16.engine.runner.sampler.processors
    procs.append(_FailOn(marker=11, after=3))
    failed_before = llm_bf16.engine.stats.failed
    try:
        victim = SamplingParams(max_tokens=11, temperature=0, ignore_eos=True)
        outs = llm_bf16.chat(convs[:1] + [CHAT] + convs[1:], [plain, victim, plain, plain])
    finally:
        procs.pop()
    bad = outs[1]
    assert bad.finish_reason == "error" and "injected fault" in bad.error
    assert len(bad.token_ids) == 3
    assert [o.token_ids for o in outs[:1] + outs[2:]] == [o.token_ids for o in alone]
    assert all(o.finish_reason == "length" for o in outs[:1] + outs[2:])
    assert llm_bf16.engine.stats.failed == failed_before + 1
    assert _no_blocks_held(llm_bf16)


def test_finished_requests_are_released_at_once(llm_fp32):
    """One release path: the sampler's per-request state (a seeded generator) goes when the
    request finishes, with no further step."""
    sampler = llm_fp32.engine.runner.sampler
    out = llm_fp32.generate("Hello", SamplingParams(max_tokens=3, temperature=0.8, seed=5))
    assert out[0].finished and out[0].request_id not in sampler._generators
