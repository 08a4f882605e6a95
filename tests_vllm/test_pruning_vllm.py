"""KV-block pruning inside vLLM (offline `vllm.LLM`, CPU build): the pruning processor and
its attention backend against plain vLLM (the baseline scenario, no plugin).

Two long requests (880-token prompts: 7 of vLLM's 128-token blocks, 8 by the end) opt in,
beside the four short greedy requests that do not. The baseline runs the same batch without
the plugin ("mixed"). Greedy decoding, fp32, one core.
"""
from vllm_runs import LONG_TOKENS, PROMPTS

LAYERS = 30


def agreement(dense: list[int], pruned: list[int]) -> tuple[int, float]:
    """(tokens before the first difference, share of equal positions)."""
    prefix = next((i for i, (a, b) in enumerate(zip(dense, pruned)) if a != b), len(dense))
    return prefix, sum(a == b for a, b in zip(dense, pruned)) / len(dense)


def check_untouched(base: dict, phase: dict) -> None:
    """The requests that did not opt in: plain vLLM's tokens, in a batch that pruned."""
    assert len(phase["greedy"]) == len(PROMPTS)
    for b, p in zip(base["mixed"]["greedy"], phase["greedy"]):
        assert p["token_ids"] == b["token_ids"]


def test_pruning_that_never_binds_gives_plain_vllm_tokens(run_scenario):
    """A budget above every context (min_blocks 64): the backend and the processor run, no
    row prunes, and every token equals vLLM's without the plugin."""
    base, run = run_scenario("baseline"), run_scenario("pruning")
    ph = run["never_binds"]
    assert ph["stats"]["decodes"] == 2 * (LONG_TOKENS - 1)  # the first token is prefill's
    assert ph["stats"]["pruned_decodes"] == 0 and ph["stats"]["layer_rows"] == 0
    for b, p in zip(base["mixed"]["long"], ph["long"]):
        assert len(b["token_ids"]) == LONG_TOKENS
        assert p["prompt_token_ids"] == b["prompt_token_ids"]
        assert p["token_ids"] == b["token_ids"]
    check_untouched(base, ph)


def test_pruned_attention_skips_blocks_and_leaves_other_requests_alone(run_scenario):
    """A fixed quarter budget: every decode of the long requests attends max(4, ceil(7 or 8 /
    4)) = 4 blocks (sink, 2 recent, 1 by bound) in each of the 30 layers, of 7-8 live; the
    short requests in the same batches keep plain vLLM's tokens. Agreement with dense is
    measured and printed, not required to be total."""
    base, run = run_scenario("baseline"), run_scenario("pruning")
    ph = run["fixed"]
    st = ph["stats"]
    assert st["decodes"] == st["pruned_decodes"] == 2 * (LONG_TOKENS - 1)
    assert st["layer_rows"] == LAYERS * st["pruned_decodes"]
    assert st["blocks_attended"] == 4 * st["layer_rows"]
    assert 7 * st["layer_rows"] <= st["blocks_live"] <= 8 * st["layer_rows"]
    check_untouched(base, ph)
    for b, p in zip(base["mixed"]["long"], ph["long"]):
        assert p["token_ids"][0] == b["token_ids"][0]  # sampled after the (dense) prefill
        prefix, share = agreement(b["token_ids"], p["token_ids"])
        print(f"fixed quarter: {st['blocks_attended'] / st['blocks_live']:.2f} of the blocks "
              f"attended; greedy tokens equal to dense before the first difference: "
              f"{prefix}/{LONG_TOKENS}, positionwise {share:.2f}")
        assert len(set(p["token_ids"])) > 5  # not a degenerate loop of one token


def test_entropy_law_and_the_no_regret_gate(run_scenario):
    """The entropy law (default rho(H)) prunes some decodes and keeps at least as much as the
    fixed quarter; the default no-regret gate (min_attention_share 0.2) keeps these short
    contexts dense (by entropic's cost model, attention is ~14 % of a decode's bytes at 900 fp32
    tokens with two rows decoding)."""
    base, run = run_scenario("baseline"), run_scenario("pruning")
    ad = run["adaptive"]["stats"]
    assert ad["decodes"] == 2 * (LONG_TOKENS - 1)
    assert ad["blocks_attended"] >= 4 * ad["layer_rows"]
    check_untouched(base, run["adaptive"])
    for b, p in zip(base["mixed"]["long"], run["adaptive"]["long"]):
        prefix, share = agreement(b["token_ids"], p["token_ids"])
        frac = ad["blocks_attended"] / ad["blocks_live"] if ad["blocks_live"] else 1.0
        print(f"entropy law: {ad['pruned_decodes']}/{ad['decodes']} decodes pruned, {frac:.2f} "
              f"of their blocks attended; equal to dense: {prefix}/{LONG_TOKENS}, "
              f"positionwise {share:.2f}")
    gate = run["gate"]["stats"]
    assert gate["decodes"] == 2 * (LONG_TOKENS - 1) and gate["pruned_decodes"] == 0


def test_bad_pruning_arguments_are_refused_offline(run_scenario):
    err = run_scenario("pruning")["bad_params_error"]
    assert err is not None and "pruning.score: only 'bound' on vLLM" in err
