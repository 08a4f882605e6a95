"""The ablation harness: metrics on hand-made examples, and a tiny real run end to end."""
import json
import random

import numpy as np
import pytest

from entropic.bench import metrics as M
from entropic.bench.ablation import AblationConfig, all_configs
from entropic.bench.loadgen import poisson_offsets


# ---- metrics on known values ------------------------------------------------------------
def test_rouge_identical_is_one_and_disjoint_is_zero():
    r = M.rouge_f(["the cat sat on the mat", "alpha beta"], ["the cat sat on the mat", "gamma"])
    for k in M.ROUGE_KEYS:
        assert r[k][0] == pytest.approx(1.0)
        assert r[k][1] == pytest.approx(0.0)


def test_rouge1_by_hand():
    # hyp "a b c d", ref "a b x": 2 overlapping unigrams; P = 2/4, R = 2/3, F = 4/7
    r = M.rouge_f(["a b c d"], ["a b x"])
    assert r["rouge1"][0] == pytest.approx(4 / 7)


def test_bleu_from_summed_stats_equals_sacrebleu_corpus_bleu():
    hyps = ["the quick brown fox jumps over the lazy dog", "a b c d e f", "hello there world"]
    refs = ["the quick brown fox jumped over the lazy dog", "a b c d e g", "hello world"]
    st = M.bleu_stats(hyps, refs)
    assert st.shape == (3, 10)
    assert M.bleu_from_stats(st) == pytest.approx(M.corpus_bleu(hyps, refs))
    assert M.bleu_from_stats(st[[0, 2]]) == pytest.approx(
        M.corpus_bleu([hyps[0], hyps[2]], [refs[0], refs[2]]))
    assert M.bleu_from_stats(M.bleu_stats(hyps, hyps)) == pytest.approx(100.0)


def test_parse_yes_no():
    assert M.parse_yes_no("Yes, because ...") == "yes"
    assert M.parse_yes_no("I think the answer is no.") == "no"
    assert M.parse_yes_no("Nobody knows; yesterday") is None
    assert M.parse_yes_no("") is None


def test_bootstrap_ci_contains_mean():
    rng = np.random.default_rng(1)
    xs = rng.normal(3.0, 1.0, size=200)
    point, lo, hi = M.bootstrap_ci(xs, n_boot=500)
    assert point == pytest.approx(xs.mean())
    assert lo < point < hi
    assert hi - lo < 0.5  # ~ 4 standard errors of 1/sqrt(200)


def test_paired_bootstrap_is_paired():
    # b = a + 1 on every item: the paired difference is exactly 1 in every resample,
    # although each mean alone varies.
    a = np.arange(50, dtype=float)
    out = M.paired_bootstrap({"a": {"x": a}, "b": {"x": a + 1}},
                             {"mean": lambda f: float(np.mean(f["x"]))}, 50, n_boot=200)
    d = out["b"]["mean"] - out["a"]["mean"]
    assert np.allclose(d, 1.0)
    assert out["a"]["mean"].std() > 0.5


def test_superadditivity_arithmetic():
    # gains +10 %, +5 %, +2 % alone; +20 % together: 20 - 17 = +3 points super-additive
    assert float(M.superadditivity(0.20, [0.10, 0.05, 0.02])) == pytest.approx(0.03)
    assert float(M.superadditivity(0.10, [0.10, 0.05, 0.02])) == pytest.approx(-0.07)
    s = M.superadditivity(np.array([0.2, 0.3]), [np.array([0.1, 0.1]), np.array([0.0, 0.1])])
    assert np.allclose(s, [0.1, 0.1])


def test_relative_change():
    assert float(M.relative_change(90.0, 100.0)) == pytest.approx(-0.1)
    assert np.isnan(float(M.relative_change(1.0, 0.0)))


def test_configs_are_the_papers_eight_then_spec_and_parse_round_trips():
    cfgs = all_configs()
    assert len(cfgs) == 10 and len(set(cfgs)) == 10
    assert cfgs[0] == AblationConfig() and cfgs[0].name == "baseline"
    assert cfgs[7].name == "sched+prune+thermo"
    assert [c.name for c in cfgs[8:]] == ["spec", "sched+prune+thermo+spec"]
    for c in cfgs:
        assert AblationConfig.parse(c.name) == c
    with pytest.raises(ValueError):
        AblationConfig.parse("sched+warp")


def test_poisson_offsets():
    off = poisson_offsets(2000, 4.0, random.Random(0))
    assert off[0] == 0 and all(b >= a for a, b in zip(off, off[1:]))
    assert np.mean(np.diff(off)) == pytest.approx(0.25, rel=0.1)
    with pytest.raises(ValueError):
        poisson_offsets(3, 0.0, random.Random(0))


def test_summary_on_hand_made_runs():
    """summarise() on two fake configurations with known per-request values."""
    from entropic.bench.ablation_stats import summarise

    def rec(i, kind, text, e2e, toks, secs, tau, h):
        return {"key": f"{kind}:{i}", "kind": kind, "text": text, "n_tokens": toks,
                "finish_reason": "stop", "ttft": e2e / 2, "tpot": 0.1, "e2e": e2e,
                "preemptions": 0, "seconds": secs, "flops_linear": 1e12,
                "flops_attention": 0.0, "kv_bytes_read": 1e9, "tau": tau,
                "entropies": h, "temperatures": [0.7] * len(h), "h_tempered": h,
                "reference": "a b c" if kind == "xsum" else None,
                "answer": "yes" if kind == "strategyqa" else None}

    base = [rec(0, "xsum", "a b c", 2.0, 4, 1.0, 1.0, [1.0, 1.0, 1.0, 1.0]),
            rec(1, "strategyqa", "Yes.", 4.0, 2, 1.0, 1.0, [0.0, 2.0])]
    fast = [rec(0, "xsum", "a b c", 1.0, 4, 0.5, 1.0, [1.0, 1.0, 1.0, 1.0]),
            rec(1, "strategyqa", "No.", 2.0, 2, 0.5, 1.0, [0.0, 2.0])]
    raw = {"options": {"target_entropy": 1.0},
           "runs": {"baseline": [{"repeat": 0, "makespan": 2.0, "engine": {}, "records": base}],
                    "sched": [{"repeat": 0, "makespan": 1.0, "engine": {}, "records": fast}]}}
    s = summarise(raw, n_boot=50)
    v = s["values"]
    assert v["baseline"]["e2e_mean"] == pytest.approx(3.0)
    assert v["sched"]["e2e_mean"] == pytest.approx(1.5)
    assert s["delta"]["sched"]["e2e_mean"]["rel"] == pytest.approx(-0.5)
    assert v["baseline"]["tok_s"] == pytest.approx(3.0)  # 6 tokens / 2 busy seconds
    assert v["sched"]["tok_s"] == pytest.approx(6.0)
    assert v["baseline"]["tau_per_tflop"] == pytest.approx(1.0)  # 2 nats / 2 TFLOPs
    assert v["baseline"]["rougeL_ref"] == pytest.approx(1.0)
    assert v["sched"]["rougeL_base"] == pytest.approx(1.0)  # xsum text identical to baseline
    assert v["baseline"]["accuracy"] == 1.0 and v["sched"]["accuracy"] == 0.0
    assert s["delta"]["sched"]["accuracy"]["abs"] == pytest.approx(-1.0)  # scores: absolute
    # H^T = [1, 1, 1, 1, 0, 2] against H* = 1: mean |err| = 2/6; mean 1, E[H^2] = 8/6, so
    # var = 1/3; one collapsed step (H^T < 0.05) of 6
    assert v["baseline"]["ht_abs_err"] == pytest.approx(2 / 6)
    assert v["baseline"]["ht_var"] == pytest.approx(1 / 3)
    assert v["baseline"]["collapse"] == pytest.approx(1 / 6)
    d = s["delta"]["sched"]["e2e_mean"]
    assert d["lo"] <= d["rel"] <= d["hi"]


def test_step_time_index_finds_the_run_the_host_slowed():
    """Three runs of the same step sizes, one of them 1.5x slower at every size and one
    with more large steps (more work, same speed): only the slow one stands out; a run
    without recorded steps gets None."""
    from entropic.bench.ablation_stats import step_time_index

    def steps(scale, sizes):
        return [[i * 0.1, scale * (0.02 + 0.003 * n), n] for i, n in enumerate(sizes)]
    usual = [1, 2, 4, 8, 16] * 10
    idx = step_time_index({"a": steps(1.0, usual), "b": steps(1.5, usual),
                           "c": steps(1.0, usual + [16] * 40), "d": []})
    assert idx["b"] == pytest.approx(1.5, rel=0.02)
    assert idx["a"] == pytest.approx(1.0, rel=0.02) and idx["c"] == pytest.approx(1.0, rel=0.02)
    assert idx["d"] is None


# ---- the harness on the real model ------------------------------------------------------
@pytest.mark.model
def test_tiny_ablation_run_writes_all_metric_keys(tmp_path):
    from entropic.bench import report
    from entropic.bench.ablation import AblationOptions, run_ablation
    from entropic.bench.ablation_stats import metric_table, summarise
    from entropic.bench.workloads import WorkloadSpec

    spec = WorkloadSpec(chat=1, chat_max_tokens=8, xsum=1, xsum_max_tokens=8, aclsum=0,
                        strategyqa=1, strategyqa_max_tokens=8, rate=100.0)
    raw = run_ablation(AblationOptions(configs=["baseline", "thermo", "spec"], repeats=1,
                                       workload=spec, threads=2, progress=False,
                                       aa_control=False,
                                       num_kv_blocks=64))
    assert raw["configs"] == ["baseline", "thermo", "spec"] and raw["items"] == 3
    assert raw["prompt_format"] == "chat"  # the default model has a chat template
    s = summarise(raw, n_boot=20)
    paths = report.write(raw, s, tmp_path)
    data = json.loads(paths["json"].read_text())
    names = {m.name for m in metric_table(1)}
    for c in ("baseline", "thermo", "spec"):
        assert set(data["values"][c]) == names
        assert set(data["delta"][c]) == names
    assert data["values"]["baseline"]["rougeL_base"] == pytest.approx(1.0)
    assert data["delta"]["baseline"]["e2e_mean"]["rel"] == 0.0
    assert data["meta"]["options"]["threads"] == 2
    # dtype "auto", as LLM() chooses it on this CPU (bf16 only where it is hardware's)
    from entropic.config import choose_dtype
    assert data["meta"]["options"]["dtype"] == "auto"
    assert data["meta"]["options"]["dtype_reason"] == choose_dtype("auto", "cpu", None)[1]
    assert all(r["n_tokens"] >= 1 for rs in raw["runs"].values() for run in rs
               for r in run["records"])
    thermo_t = [t for run in raw["runs"]["thermo"] for r in run["records"]
                for t in r["temperatures"]]
    assert all(0.2 - 1e-6 <= t <= 2.0 + 1e-6 for t in thermo_t)
    # speculation changes the speed, never the seeded text; its counters are the run's
    base, spec_run = raw["runs"]["baseline"][0], raw["runs"]["spec"][0]
    assert [r["text"] for r in spec_run["records"]] == [r["text"] for r in base["records"]]
    committed = spec_run["engine"]["spec_committed_tokens"]
    assert 0 < committed <= sum(r["n_tokens"] for r in spec_run["records"])
    assert "spec_drafted_tokens" not in base["engine"]
    assert "| baseline |" in paths["md"].read_text()
    assert paths["plot_deltas"].stat().st_size > 1000
    # each engine step's start, duration and running requests, in order, within the run
    for c, runs in data["runs"].items():
        for run in runs:
            steps = run["steps"]
            assert len(steps) == run["engine"]["steps"]
            assert all(d > 0 and n >= 0 for _, d, n in steps) and max(n for *_, n in steps) >= 1
            assert [t for t, _, _ in steps] == sorted(t for t, _, _ in steps)
            assert steps[-1][0] + steps[-1][1] <= run["makespan"] + 1e-3


@pytest.mark.parametrize("kw, flag", [({"repeats": 0}, "--repeats"), ({"threads": 0}, "--threads"),
                                      ({"n_boot": 0}, "--bootstrap"),
                                      ({"temperature": 0.0}, "--temperature"),
                                      ({"target_entropy": -1.0}, "--target-entropy"),
                                      ({"configs": ["baseline", "bogus"]}, "bogus"),
                                      ({"regime": "steady"}, "--regime")])
def test_bad_options_are_refused_before_any_run(kw, flag):
    from entropic.bench.ablation import AblationOptions
    with pytest.raises(ValueError, match=flag):
        AblationOptions(quick=True, **kw).resolved()


def test_regimes_set_the_workload_and_the_engine_limits():
    from entropic.bench.ablation import AblationOptions
    from entropic.bench.workloads import REGIMES
    long = AblationOptions(regime="long").resolved()
    assert long.workload == REGIMES["long"].full and long.workload.longdoc == 8
    assert (long.num_kv_blocks, long.max_num_seqs) == (1024, 8)
    quick = AblationOptions(regime="interactive", quick=True).resolved()
    assert quick.workload.rate < AblationOptions(quick=True).resolved().workload.rate
    # explicit limits win over the regime's
    assert AblationOptions(regime="long", num_kv_blocks=77).resolved().num_kv_blocks == 77
    assert AblationOptions().resolved().num_kv_blocks == 400  # (a), as before


@pytest.mark.model
def test_long_regime_items_are_long_documents_with_equal_output_work(llm_fp32):
    from entropic.bench.workloads import REGIMES, build_items
    items = build_items(llm_fp32.tokenizer, REGIMES["long"].full)
    assert [i.kind for i in items] == ["longdoc"] * 8
    lengths = [len(i.prompt_ids) for i in items]
    assert 4096 < min(lengths) and max(lengths) < 8192 - 128
    assert all(i.ignore_eos and i.max_tokens == 128 for i in items)
    assert sum(i.reference is not None for i in items) == 4  # papers: their abstracts
    # a KV pool too small for all of them at once
    blocks = sum(-(-(n + 128) // 16) for n in lengths)
    assert blocks > 2 * REGIMES["long"].num_kv_blocks
